"""The GGUF export read back with the gguf package (the reader of llama.cpp's own gguf-py): every tensor under the
name llama.cpp loads it by, with the drafter's shape and values, and the metadata that sizes the draft. The export
runs llama.cpp's converter, which `make peers` unpacks (CI runs it first); without it these tests skip."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.base import load_base
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.eagle3 import Eagle3
from specdec.export import export, gguf

try:
    gguf.converter()
    MISSING = None
except FileNotFoundError as err:
    MISSING = str(err)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=f"no GGUF converter: {MISSING}")]

HEADS, KV_HEADS = 4, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama (4 layers, untied head) with SmolLM2's tokenizer: the converter needs a tokenizer it
    knows (the tiny test base's byte-level one it cannot read), and EAGLE-3's conversion reads the base's own
    directory (--target-model-dir), so the base is loaded from one."""
    tokenizer = load_base(device="cpu").tokenizer
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=len(tokenizer), max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("base")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return load_base(str(d), device="cpu")


def randomized(d, seed: int = 0):
    """Every parameter redrawn: an export of the base's layers (a copy init) or of another drafter's would differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return d.eval()


def rotary_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows [heads · head_dim, ...] from HF's rotate-half layout to GGML's interleaved pairs, as llama.cpp's
    converter writes them (LlamaModel.permute in convert_hf_to_gguf / conversion/llama.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def layer_tensors(prefix: str, layer) -> dict[str, torch.Tensor]:
    """A Llama decoder layer's tensors under llama.cpp's names blk.<i>.* (`prefix`)."""
    a, m = layer.self_attn, layer.mlp
    return {f"{prefix}.attn_norm.weight": layer.input_layernorm.weight,
            f"{prefix}.attn_q.weight": rotary_order(a.q_proj.weight, HEADS),
            f"{prefix}.attn_k.weight": rotary_order(a.k_proj.weight, KV_HEADS),
            f"{prefix}.attn_v.weight": a.v_proj.weight, f"{prefix}.attn_output.weight": a.o_proj.weight,
            f"{prefix}.ffn_norm.weight": layer.post_attention_layernorm.weight,
            f"{prefix}.ffn_gate.weight": m.gate_proj.weight, f"{prefix}.ffn_up.weight": m.up_proj.weight,
            f"{prefix}.ffn_down.weight": m.down_proj.weight}


def read_back(out) -> tuple[dict[str, torch.Tensor], dict]:
    reader = GGUFReader(out / gguf.FILE)
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("tokenizer.", "GGUF."))}
    return tensors, fields


def assert_same(tensors: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(tensors) == set(want)
    for name, w in want.items():
        assert tensors[name].shape == w.shape and torch.equal(tensors[name], w.detach()), name


def test_draft_model_reads_back_as_llama_cpp_loads_it(base, tmp_path):
    d = randomized(DraftModel(base, num_layers=2))  # (a copy init would be the base's layers 0 and 3)
    tensors, fields = read_back(export(d, "gguf", tmp_path / "dm"))
    want = {"token_embd.weight": base.embed_tokens.weight, "output.weight": base.lm_head.weight,
            "output_norm.weight": d.lm.model.norm.weight}
    for i, layer in enumerate(d.lm.model.layers):
        want |= layer_tensors(f"blk.{i}", layer)
    assert_same(tensors, want)
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    assert (fields["llama.embedding_length"], fields["llama.feed_forward_length"]) == (32, 64)
    assert (fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]) == (HEADS, KV_HEADS)
    assert fields["llama.vocab_size"] == base.vocab_size


def test_eagle3_reads_back_as_llama_cpp_loads_it(base, tmp_path):
    d = randomized(Eagle3(base, ttt_steps=2, draft_vocab_size=500, aux_layers=[1, 2, 3]))
    d.set_draft_vocab(torch.randperm(base.vocab_size, generator=torch.Generator().manual_seed(1))[:500])
    tensors, fields = read_back(export(d, "gguf", tmp_path / "e3"))
    layer = d.layers[0]
    want = {"token_embd.weight": base.embed_tokens.weight, "fc.weight": d.fc.weight, "output.weight": d.lm_head.weight,
            "output_norm.weight": d.norm.weight, "blk.0.attn_norm_2.weight": layer.hidden_norm.weight,
            # the base id of each draft index (the converter turns speculators' offsets into ids; t2d it drops)
            "d2t": d.draft_vocab.tokens}
    assert_same(tensors, want | layer_tensors("blk.0", layer))
    assert tensors["blk.0.attn_q.weight"].shape == (32, 64)  # the layer reads [embedding; hidden]: 2H wide
    assert fields["general.architecture"] == "eagle3" and fields["eagle3.block_count"] == 1
    assert fields["eagle3.target_layers"] == [1, 2, 3] and fields["eagle3.target_hidden_size"] == 32
    assert fields["eagle3.norm_before_residual"] is False and fields["eagle3.vocab_size"] == base.vocab_size
