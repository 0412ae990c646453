"""Bases specdec cannot drive, and data that is not there, fail at load in one line; bases of the Llama layout
(whatever their class) load with the default settings and decode. Tiny random models, saved as model directories
with the tiny base's byte-level tokenizer: nothing is downloaded."""

import pytest
import torch
import transformers as T
from hydra.utils import instantiate

from conftest import auto_engine, compose_train
from specdec.base import Base, layout_problems, load_base, tiny_base
from specdec.data.sources import chat, text
from specdec.sampling.decode import SamplerConfig, generate

TOKENIZER = tiny_base().tokenizer
V = len(TOKENIZER)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=V)

# one tiny model per architecture, all of the layout Base drives (model.model.{layers, rotary_emb, norm}, lm_head)
SUPPORTED = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=1)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=1)),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=16)),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, num_key_value_heads=1, pad_token_id=0)),
    "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**SMALL, num_key_value_heads=1, pad_token_id=0)),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, num_key_value_heads=1, head_dim=16)),
}
UNSUPPORTED = {  # (the model, the class named in the refusal, where its decoder layers live)
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V)),
             "GPT2LMHeadModel", "transformer.h"),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL)), "GPTNeoXForCausalLM", "gpt_neox.layers"),
}


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _save(make, d) -> str:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = make()
    model.save_pretrained(d)
    TOKENIZER.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("arch", UNSUPPORTED)
def test_unsupported_layout_refused_at_load(arch, tmp_path):
    make, cls, stack = UNSUPPORTED[arch]
    d = _save(make, tmp_path / arch)
    with pytest.raises(ValueError) as e:
        load_base(d, device="cpu")
    message = _one_line(e)
    assert message.startswith(f"base {d}: {cls} is not supported: specdec drives decoder stacks with a shared "
                              "rotary embedding (model.model.layers, model.model.rotary_emb")
    assert f"its decoder layers are at {stack}" in message
    assert message.endswith("supported layouts: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo2, Gemma2 and others of "
                            "that layout")


@pytest.mark.parametrize("arch", SUPPORTED)
def test_supported_layouts_pass_the_check(arch):
    # read off the modules, not the class name: every architecture of the layout is taken, and fingerprinted
    model = SUPPORTED[arch]()
    assert layout_problems(model) == []
    assert Base(model, TOKENIZER, arch).fingerprint()["architecture"] == type(model).__name__


def test_layout_check_names_what_is_missing():
    model = SUPPORTED["llama"]()
    del model.model.rotary_emb
    with pytest.raises(ValueError) as e:
        Base(model, TOKENIZER, "no-rope")
    assert "this model has no model.model.rotary_emb; supported layouts" in _one_line(e)


def _greedy_reference(base: Base, prompt: list[int], n: int) -> list[int]:
    """Greedy by full no-cache forwards of the HF model: argmax of base(ids), appended, n times."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(base(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch, attention", [("gemma2", "eager"), ("qwen3", "sdpa")])
def test_loads_from_a_directory_with_defaults_and_decodes(arch, attention, tmp_path):
    # base=hf base.name=<dir>, the config's own attn_implementation (sdpa): Gemma2, which HF refuses sdpa for,
    # loads eager without being told
    d = _save(SUPPORTED[arch], tmp_path / arch)
    cfg = compose_train(["base=hf", f"base.name={d}", "base.dtype=float32", "base.device=cpu"], tmp_path)
    assert cfg.base.attn_implementation == "sdpa"
    base = instantiate(cfg.base)
    assert type(base.model).__name__ == type(SUPPORTED[arch]()).__name__
    assert base.model.config._attn_implementation == attention
    want = _greedy_reference(base, [1, 2, 3], 4)
    for engine in ({}, {"engine": auto_engine()}):  # the reference engine, and the one evaluate.py runs on a CPU
        out = generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=4, eos_token_id=[]), **engine)
        assert out.tokens[0].tolist() == want


@pytest.mark.parametrize("source", [text, chat])
@pytest.mark.parametrize("pattern", ["/nonexistent/*.txt", "/nonexistent/*.jsonl", "/nonexistent/a.jsonl"])
def test_data_path_that_matches_no_file(source, pattern):
    with pytest.raises(FileNotFoundError) as e:
        source(pattern)
    assert pattern in _one_line(e)


def test_data_files_that_are_empty(tmp_path):
    for name in ("a.txt", "b.txt", "c.jsonl"):
        (tmp_path / name).write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    for path, says in [(f"{tmp_path}/*.txt", f"{tmp_path}/*.txt: the 2 files it matches are empty"),
                       (f"{tmp_path}/c.jsonl", f"{tmp_path}/c.jsonl is an empty file"),
                       (f"{tmp_path}/blank.jsonl", f"{tmp_path}/blank.jsonl: no JSON rows in the file")]:
        with pytest.raises(ValueError) as e:
            text(path)
        assert _one_line(e).startswith(says)
    with pytest.raises(ValueError) as e:
        text(str(tmp_path))
    assert _one_line(e) == f"{tmp_path} is a folder: name its files with a glob, e.g. {tmp_path}/*.txt"


def test_beyond_a_sliding_window_or_sampling_capped_logits_is_refused_in_one_line(tmp_path):
    """The sampler's mask sees the whole prefix and its lm_head gives uncapped logits: a decode longer than a base's
    sliding window, or sampling from soft-capped logits, would not be the base's, so it is refused before any work
    (greedy decoding of capped logits is the base's: the cap keeps their order)."""
    base = load_base(name=_save(SUPPORTED["gemma2"], tmp_path / "gemma2"), dtype="float32", device="cpu")
    base.config.sliding_window = 16
    with pytest.raises(ValueError) as e:
        generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=20, eos_token_id=[]))
    assert "beyond the base's sliding attention window of 16" in _one_line(e)
    with pytest.raises(ValueError) as e:
        generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=4, temperature=1.0, eos_token_id=[]))
    assert "final_logit_softcapping is not supported" in _one_line(e)
    assert generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=4, eos_token_id=[])).num_generated == [4]
