"""specdec.export for DFlash: both layouts written and read back to the same drafter (weights and logits); the
files' own forward, computed the serving engines' way (their layer ids, their vocab head), drafts what ours does;
the config keys and tensor names each loader reads (fixtures from their sources); what their loaders would compute
otherwise refused on export, and another base or a bad mask token refused on load, each in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import ByT5Tokenizer, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from specdec.base import CHATML, Base, tiny_base
from specdec.drafters.dflash import DFlash
from specdec.export import describe, detect, export, load
from specdec.export.common import SPECDEC, CheckpointError

T, AUX = 8, [1, 2, 3]


def tiny_qwen3(seed: int = 0, num_layers: int = 4) -> Base:
    """The tiny base's shapes as a Qwen3 (the decoder layer every DFlash loader builds), float64."""
    tok = ByT5Tokenizer(extra_ids=0)
    tok.chat_template = CHATML
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=len(tok), max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg).to(torch.float64)
    return Base(model, tok, f"tiny-qwen3-l{num_layers}-s{seed}")


@pytest.fixture(scope="module")
def base():
    return tiny_qwen3()


def drafter(base, vocab: int | None = None, own: bool = False, seed: int = 0, **kw) -> DFlash:
    """A DFlash with random weights (and a shuffled draft vocab of `vocab` tokens), in eval mode."""
    d = DFlash(base, num_layers=2, block_size=4, aux_layers=AUX, mask_token_id=5, draft_vocab_size=vocab,
               own_lm_head=own, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        if vocab is not None:
            d.set_draft_vocab(torch.randperm(base.vocab_size, generator=gen)[:vocab])
            for p in d.vocab_heads():
                p.weight.copy_(torch.randn(p.weight.shape, generator=gen, dtype=p.weight.dtype))
    return d.eval()


def ids_of(base, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, base.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def ours(d: DFlash, ids: torch.Tensor) -> torch.Tensor:
    """Our draft logits over the base's vocabulary, every anchor: [T, b − 1, V]."""
    with torch.no_grad():
        return d.full_vocab(d.forward_train(d.base.features(ids, layers=d.feature_layers), ids).logits)[0]


CASES = {"speculators": [dict(vocab=50), dict(vocab=50, own=True), dict(own=True), dict()], "sglang": [dict()]}


@pytest.mark.parametrize("fmt,case", [(f, c) for f, cs in CASES.items() for c in cs])
def test_round_trip_equal_weights_and_logits(base, tmp_path, fmt, case):
    d = drafter(base, **case)
    out = export(d, fmt, tmp_path / fmt)
    assert detect(out) == fmt and describe(out)["target"] == "specdec.drafters.dflash.DFlash"
    back = load(out, base)
    assert isinstance(back, DFlash)
    assert (back.aux_layers, back.block_size, back.mask_token_id, len(back.layers)) == (AUX, 4, 5, 2)
    assert (back.lm_head is not None) == case.get("own", False)
    mine, theirs = d.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = ids_of(base)
    torch.testing.assert_close(ours(back, ids), ours(d, ids), rtol=0, atol=0)


@torch.no_grad()
def their_block(out, base, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """The exported files' draft logits for the block anchored at `anchor`, computed as the serving engines do and
    from nothing of ours: the target's HF hidden_states picked by the layout's own ids (z-lab: hidden_states[id + 1];
    speculators: hidden_states[id]); Qwen3 layers whose queries are the block's, keys and values the context's
    (k_proj / v_proj of hidden_norm(fc(·)), no input norm) then the block's, all visible; the vocab head of the layout
    (z-lab: the target's lm_head; speculators: its lm_head, mapped to target ids by d2t, −inf elsewhere)
    -> [b − 1, V]."""
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(out / "model.safetensors")
    zlab = "dflash_config" in cfg
    lc = cfg if zlab else cfg["transformer_layer_config"]
    hs = base.model(ids, output_hidden_states=True).hidden_states
    picked = [hs[i + 1] for i in cfg["dflash_config"]["target_layer_ids"]] if zlab else \
        [hs[i] for i in cfg["aux_hidden_state_layer_ids"]]
    mask_id = cfg["dflash_config"]["mask_token_id"] if zlab else cfg["mask_token_id"]
    b, eps, hd = cfg["block_size"], lc["rms_norm_eps"], lc["head_dim"]
    nh, nkv = lc["num_attention_heads"], lc["num_key_value_heads"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    ctx = rms(torch.cat(picked, -1)[0, :anchor] @ t["fc.weight"].T, t["hidden_norm.weight"])  # [a, H]
    x = base.model.get_input_embeddings()(torch.tensor([ids[0, anchor].item()] + [mask_id] * (b - 1)))  # [b, H]
    cos, sin = Qwen3RotaryEmbedding(Qwen3Config(**lc))(x, torch.arange(anchor + b)[None])
    for i in range(lc["num_hidden_layers"]):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in t.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = rms((h @ w["self_attn.q_proj.weight"].T).view(b, nh, hd), w["self_attn.q_norm.weight"])
        src = torch.cat([ctx, h])  # [a + b, H]
        k = rms((src @ w["self_attn.k_proj.weight"].T).view(-1, nkv, hd), w["self_attn.k_norm.weight"])
        v = (src @ w["self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[:, anchor:], sin[:, anchor:])
        k, _ = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        k, v = k[0].repeat_interleave(nh // nkv, 0), v.transpose(0, 1).repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q[0] @ k.transpose(1, 2) / hd**0.5, -1) @ v  # [nh, b, hd]
        x = x + att.transpose(0, 1).reshape(b, -1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
        x = x + mlp @ w["mlp.down_proj.weight"].T
    x = rms(x, t["norm.weight"])[1:]
    if zlab:
        return x @ base.lm_head.weight.T
    logits = x @ t["lm_head.weight"].T
    if "d2t" not in t:
        return logits
    full = logits.new_full((b - 1, base.vocab_size), float("-inf"))
    full[:, torch.arange(len(t["d2t"])) + t["d2t"]] = logits
    return full


@pytest.mark.parametrize("fmt,case", [("speculators", dict(vocab=50)), ("speculators", dict(own=True)),
                                      ("sglang", dict())])
def test_their_forward_of_the_export_drafts_ours(base, tmp_path, fmt, case):
    """Equal logits at every anchor with context: the layer ids' off-by-one, the head and the d2t offsets hold."""
    d = drafter(base, **case)
    out = export(d, fmt, tmp_path / fmt)
    ids = ids_of(base, seed=2)
    mine = ours(d, ids)
    for anchor in range(1, T):  # (float64 but for the rotary tables, which HF computes in float32 either way)
        torch.testing.assert_close(their_block(out, base, ids, anchor), mine[anchor], rtol=1e-5, atol=1e-5)


def test_speculators_layout_is_what_speculators_and_vllm_read(base, tmp_path):
    """Fixture: speculators src/speculators/models/dflash/config.py (DFlashSpeculatorConfig: speculators_model_type,
    transformer_layer_config, draft_vocab_size, block_size, target_hidden_size, aux_hidden_state_layer_ids,
    mask_token_id, sliding_window_non_causal, sample_from_anchor), src/speculators/models/dflash/core.py (layers
    from transformer_layer_config.num_hidden_layers; fc, hidden_norm, norm) and src/speculators/model.py
    (DraftVocabMixin: lm_head [draft_vocab_size, H], embed_tokens, t2d bool [V] / d2t int64 [V_d] only when the
    draft vocab is smaller); src/speculators/convert/dflash/converter.py (aux id = z-lab id + 1); vLLM
    vllm/transformers_utils/configs/speculators/algos.py (update_dflash: aux_hidden_state_layer_ids and mask_token_id
    required, target_layer_ids = aux − 1, causal = not sliding_window_non_causal) and
    vllm/model_executor/models/qwen3_dflash.py (load_weights: d2t, lm_head, embed_tokens; q_norm / k_norm)."""
    d = drafter(base, vocab=50)
    out = export(d, "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert (cfg["draft_vocab_size"], cfg["block_size"], cfg["mask_token_id"]) == (50, 4, 5)
    assert cfg["aux_hidden_state_layer_ids"] == AUX and cfg["target_hidden_size"] == base.hidden_size
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is False
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 259
    assert layer["layer_types"] == ["full_attention"] * 2
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                           "accept_tolerance": 0.0}
    assert set(spec["verifier"]) == {"name_or_path", "architectures"}
    h, v = base.hidden_size, base.vocab_size
    t = load_file(out / "model.safetensors")
    per_layer = {f"layers.{i}.{n}.weight" for i in range(2) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")}
    assert set(t) == per_layer | {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
                                  "embed_tokens.weight", "d2t", "t2d"}
    assert t["fc.weight"].shape == (h, 3 * h) and t["lm_head.weight"].shape == (50, h)
    assert t["embed_tokens.weight"].shape == (v, h)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == 50
    assert torch.equal(t["d2t"] + torch.arange(50), d.draft_vocab.tokens)
    full = export(drafter(base), "speculators", tmp_path / "full")  # the whole vocabulary: no mapping at all
    assert json.loads((full / "config.json").read_text())["draft_vocab_size"] == v
    assert not {"d2t", "t2d"} & set(load_file(full / "model.safetensors"))


def test_zlab_layout_is_what_sglang_reads(base, tmp_path):
    """Fixture: sglang python/sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config:
    dflash_config.mask_token_id and target_layer_ids, each in [0, num_target_layers); block_size and
    num_target_layers at the top level; layer_types one per draft layer; SGLang captures the input of layer id + 1)
    and python/sglang/srt/models/dflash.py (DFlashDraftModel: layers.{i} with q/k/v/o_proj, q_norm, k_norm,
    gate/up/down_proj and both layernorms; fc, hidden_norm, norm; no embeddings or lm_head: the target's);
    z-lab/dflash dflash/model.py (extract_context_feature reads hidden_states[id + 1]; config.block_size)."""
    d = drafter(base)
    out = export(d, "sglang", tmp_path / "g")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "speculators_model_type" not in cfg
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 1, 2]}  # ours − 1
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"]) == (4, 4, 2)
    assert all(0 <= i < cfg["num_target_layers"] for i in cfg["dflash_config"]["target_layer_ids"])
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["hidden_act"] == "silu"
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (32, 8, 2)
    t = load_file(out / "model.safetensors")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.1.self_attn.k_norm.weight", "layers.1.mlp.gate_proj.weight"} <= set(t)
    assert all(k.split(".")[0] in ("layers", "fc", "hidden_norm", "norm") for k in t)


def test_what_their_loaders_compute_otherwise_is_refused_on_export(base, tmp_path):
    llama = tiny_base(num_layers=4)
    for fmt in ("speculators", "sglang"):
        with pytest.raises(CheckpointError, match=r"^a dflash drafter has no faithful \w+ form: .*Qwen3's, with "
                                                  r"per-head RMSNorm .* the base's LlamaDecoderLayer, which has none"):
            export(DFlash(llama, aux_layers=AUX), fmt, tmp_path / "llama")
        with pytest.raises(CheckpointError, match=r"fuses layer 4 \(the base's normed output\)"):
            export(DFlash(base, aux_layers=[2, 4]), fmt, tmp_path / "last")
    with pytest.raises(CheckpointError, match="SGLang's DFLASH scores with the target's whole lm_head and this "
                                              "drafter with a 50-token draft vocab: export --to speculators"):
        export(drafter(base, vocab=50), "sglang", tmp_path / "vocab")
    with pytest.raises(CheckpointError, match="with its own trained head"):
        export(drafter(base, own=True), "sglang", tmp_path / "own")
    assert not any(tmp_path.iterdir())  # nothing written that would serve other drafts


def spoiled(src, dst, config: dict | None = None, tensors: dict | None = None, drop: str | None = None):
    """A copy of the export `src` with config keys replaced (nested dicts merged), tensors replaced or dropped, and
    no specdec.json (a checkpoint from elsewhere: its declared sizes decide)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for k, v in (config or {}).items():
        cfg[k] = cfg[k] | v if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(src / "model.safetensors") | (tensors or {})
    save_file({k: v for k, v in t.items() if k != drop}, dst / "model.safetensors")
    return dst


def test_another_base_and_a_bad_mask_token_are_refused_on_load(base, tmp_path):
    spec = export(drafter(base, vocab=50), "speculators", tmp_path / "s")
    zlab = export(drafter(base), "sglang", tmp_path / "g")
    with pytest.raises(CheckpointError, match="exported from another base"):
        load(zlab, tiny_qwen3(seed=1))
    assert (spec / SPECDEC).exists()
    cases = [
        (spec, {"target_hidden_size": 64}, None, "reads hidden states of size 64, the base's are 32"),
        (spec, {"transformer_layer_config": {"vocab_size": 1000}}, None,
         "has a vocabulary of 1,000 tokens, the base 259"),
        (spec, {"aux_hidden_state_layer_ids": [1, 2, 9]}, None, r"reads base layers \[1, 2, 9\], the base has 4"),
        (spec, {"mask_token_id": 259}, None, r"mask_token_id 259 is outside the base's vocabulary \[0, 259\)"),
        (spec, {"mask_token_id": None}, None, "names no mask_token_id"),
        (spec, {"speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": []}}}, None,
         "drafts for verifier 'Qwen/Qwen3-8B'"),
        (spec, {"transformer_layer_config": {"num_hidden_layers": 5}}, None, r"num_layers must be in \[1, 4\], got 5"),
        (spec, {"transformer_layer_config": {"rms_norm_eps": 1e-5}}, None, "its draft layers have rms_norm_eps 1e-05"),
        (spec, {"sample_from_anchor": True}, None, "sample_from_anchor drafts from the anchor slot too"),
        (spec, None, {"d2t": -torch.arange(50)}, "d2t does not map 50 draft indices onto distinct base tokens"),
        (zlab, {"num_target_layers": 36}, None, "drafts for a 36-layer target, the base has 4"),
        (zlab, {"hidden_size": 4096}, None, "reads hidden states of size 4096"),
        (zlab, {"dflash_config": {"mask_token_id": 300}}, None, r"mask_token_id 300 is outside the base's vocabulary"),
        (zlab, {"block_size": 1}, None, "block_size must be >= 2"),
        (zlab, None, {"norm.weight": torch.ones(7)}, r"tensor norm.weight has shape \(7,\), expected \(32,\)"),
    ]
    for i, (src, config, tensors, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message) as e:
            load(spoiled(src, tmp_path / f"x{i}", config, tensors), base)
        assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="tensor fc.weight is missing"):
        load(spoiled(zlab, tmp_path / "nofc", drop="fc.weight"), base)
    # a Qwen3-layer checkpoint on a Llama base of the same sizes: its per-head norms have no place there
    with pytest.raises(CheckpointError, match="tensor layers.0.self_attn.k_norm.weight has no place in this base's "
                                              "LlamaDecoderLayer"):
        load(spoiled(zlab, tmp_path / "llama"), tiny_base(num_layers=4))


def test_a_zlab_checkpoint_without_layer_ids_reads_zlabs_default(base, tmp_path):
    """z-lab's default for a config without target_layer_ids (dflash/model.py build_target_layer_ids): the middle
    layer for one draft layer, else spread from 1 to L − 3; read as the inputs of the next layers."""
    from specdec.export.dflash import default_target_layers

    assert default_target_layers(36, 1) == [18] and default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    deep = tiny_qwen3(num_layers=8)
    out = export(DFlash(deep, num_layers=2, aux_layers=[2, 6]), "sglang", tmp_path / "g")
    bare = spoiled(out, tmp_path / "bare", {"dflash_config": {"mask_token_id": 5, "target_layer_ids": None}})
    assert load(bare, deep).aux_layers == [2, 6]  # (8 layers, 2 draft layers: outputs of 1 and 5)
