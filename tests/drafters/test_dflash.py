"""DFlash: what each block position reads (the context strictly before its anchor, the anchor token, nothing of
another block), the starting point, sampling == training inside `generate`, lossless drafting at T = 0 and T > 0,
and the one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import auto_engine
from sampling_stubs import micro_base
from specdec.base import Features, tiny_base
from specdec.checkpoint import load_drafter, save_drafter
from specdec.drafters.dflash import DFlash, default_mask_token
from specdec.sampling.decode import SamplerConfig, generate
from test_eagle3 import T, data, randomized  # random weights and T = 8 tokens with the base's features, any drafter
from test_sampling_mc import PROMPT, TOKENS, chi_square_pvalue, exact_joint

AUX = [1, 2, 4]


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=4, dtype="float64")


def test_shapes_offsets_and_what_is_saved(base):
    d = DFlash(base, num_layers=2, block_size=4, aux_layers=AUX, draft_vocab_size=64)
    ids, feats = data(base, d)
    assert d.forward_train(feats, ids).logits.shape == (2, T, 3, 64)
    assert d.target_offsets == [0, 1, 2] and d.head_names == ["pos1", "pos2", "pos3"] and d.max_depth == 3
    h = base.hidden_size
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert shapes["fc.weight"] == (h, 3 * h) and shapes["hidden_norm.weight"] == (h,)
    assert not any("embed" in k or "lm_head" in k for k in shapes)  # the base's, frozen, never saved


def test_mask_token(base):
    class Added:  # an added token of the tokenizer's vocabulary
        def __init__(self, special: bool):
            self.special = special

    class Tok:  # SmolLM2's: 0 eos/bos, 1-2 chat markers, 3-16 code-data markers (added, special); no mask token
        mask_token_id, bos_token_id, eos_token_id, pad_token_id, unk_token_id = None, 1, 2, None, 0
        all_special_ids = [1, 2, 0]  # the named ones only
        added_tokens_decoder = {i: Added(True) for i in range(17)} | {17: Added(False)}

    stub = type("B", (), {"tokenizer": Tok(), "vocab_size": 49152})()
    assert default_mask_token(stub) == 16
    Tok.mask_token_id = 3
    assert default_mask_token(stub) == 3
    assert DFlash(base, mask_token_id=7, aux_layers=AUX).mask_token_id == 7
    with pytest.raises(ValueError, match=r"mask_token_id 259 is outside the base.s vocabulary \[0, 259\)"):
        DFlash(base, mask_token_id=base.vocab_size, aux_layers=AUX)


def test_smollm2s_mask_token_is_its_last_special_token():
    """On the embedded base's own tokenizer: 16, <empty_output>, the configs' and exports' mask token."""
    from transformers import AutoTokenizer

    from specdec.base import _smollm2_cache

    tok = AutoTokenizer.from_pretrained(_smollm2_cache(Path("~/.cache/specdec").expanduser()))  # (load_base's)
    stub = type("B", (), {"tokenizer": tok, "vocab_size": len(tok)})()
    assert default_mask_token(stub) == 16 and tok.convert_ids_to_tokens(16) == "<empty_output>"


def test_each_position_reads_the_context_before_its_anchor_and_its_anchor_token(base):
    """Block index k at anchor t moves with the features of positions s < t (any fused layer) and with token t, and
    with nothing else: not the features at or after t, not another anchor's token (each block sees only its own)."""
    d = randomized(DFlash(base, num_layers=2, block_size=3, aux_layers=AUX, draft_vocab_size=None))
    ids, feats = data(base, d)
    ref = d.forward_train(feats, ids).logits  # [B, T, 2, V]
    t = torch.arange(T)[:, None].expand(-1, 2)
    for layer in AUX:
        for s in range(T):
            hidden = {k: v.clone() for k, v in feats.hidden.items()}
            hidden[layer][:, s] += 0.5
            moved = (d.forward_train(Features(hidden, None), ids).logits - ref).abs().amax(dim=(0, 3)) > 1e-9
            assert torch.equal(moved, s < t), f"layer {layer}, feature {s}"
    for s in range(T):
        changed = ids.clone()
        changed[:, s] = (ids[:, s] + 7) % base.vocab_size
        moved = (d.forward_train(feats, changed).logits - ref).abs().amax(dim=(0, 3)) > 1e-9
        assert torch.equal(moved, s == t), f"token {s}"


def test_a_fresh_drafter_reads_its_first_source_layers_own_keys(base):
    """With aux_layers [1, 2, 3] the highest fused layer is the input of base layer 3, the one-layer drafter's source:
    its context is that layer's input norm of it, so its context keys and values are the base layer's own."""
    d = DFlash(base, num_layers=1, aux_layers=[1, 2, 3])
    src = base.layers[3]
    assert torch.equal(d.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight)
    ids, feats = data(base, d)
    c = d.context(feats.hidden)
    torch.testing.assert_close(c, src.input_layernorm(feats.hidden[3]))


NEW = 20


def generated_blocks(base, d: DFlash, prompts, gamma: int):
    """Every block `generate` drafts for a row still decoding (a finished row rides along in the batch, its features
    no longer kept exact): (the committed prefix, the anchor, the block's logits [γ, V_d])."""
    calls = []

    class Recording(DFlash):
        def observe(self, state, ctx, feats, tokens, n_new, next_token):
            for b in range(tokens.shape[0]):
                self.committed[b] += tokens[b, : int(n_new[b])].tolist()
            super().observe(state, ctx, feats, tokens, n_new, next_token)

        def draft_block(self, state, ctx):
            logits = super().draft_block(state, ctx)
            for b in range(logits.shape[0]):
                if len(self.committed[b]) + 1 - len(prompts[b]) < NEW:  # (the anchor is an answer token)
                    calls.append((list(self.committed[b]), int(state["root"][b]), logits[b]))
            return logits

    rec = Recording(base, **d.hparams)
    rec.load_state_dict(d.state_dict())
    rec.committed = [[] for _ in prompts]
    cfg = SamplerConfig(max_new_tokens=NEW, eos_token_id=[], gamma=gamma)
    out = generate(base, prompts, rec, cfg, engine=auto_engine())
    return calls, out


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41]]


def fit_to_greedy(base, d, steps: int):
    """Adam steps on the base's own greedy continuations of PROMPTS (every entry against the base's token at its
    offset), so drafts get accepted (partly, ragged); d frozen after."""
    torch.manual_seed(0)
    ref = generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=40, eos_token_id=[]), engine=auto_engine())
    ids = torch.tensor([p[-2:] + t for p, t in zip(PROMPTS, ref.tokens.tolist())])
    feats = base.features(ids, layers=d.feature_layers)
    target = feats.logits.argmax(-1)  # [B, T]: the base's next token at each position
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = d.forward_train(feats, ids).logits
        loss = sum(torch.nn.functional.cross_entropy(logits[:, : ids.shape[1] - o, j].flatten(0, 1),
                                                     target[:, o:].flatten())
                   for j, o in enumerate(d.target_offsets))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.requires_grad_(False)


@pytest.fixture(scope="module")
def trained(base):
    """Blocks of 4 fitted to the base's greedy continuations."""
    torch.manual_seed(0)
    return fit_to_greedy(base, DFlash(base, num_layers=1, block_size=4, aux_layers=AUX, draft_vocab_size=None), 80)


@pytest.mark.parametrize("gamma", [1, 3])
def test_generate_drafts_exactly_the_training_logits(base, trained, gamma):
    """Each block drafted inside `generate` (ragged batch, partial acceptance, a block shorter than trained) equals
    forward_train's at its anchor for the committed prefix + anchor, position by position."""
    calls, _ = generated_blocks(base, trained, PROMPTS, gamma)
    assert len(calls) > 10
    for committed, anchor, logits in calls:
        ids = torch.tensor([committed + [anchor]])
        feats = base.features(ids, layers=trained.feature_layers)
        if gamma == trained.block_size - 1:
            expected = trained.forward_train(feats, ids).logits[0, -1]  # [b − 1, V]
        else:  # a shorter block: the same model over γ + 1 slots
            short = DFlash(base, **{**trained.hparams, "block_size": gamma + 1})
            short.load_state_dict(trained.state_dict())
            expected = short.forward_train(feats, ids).logits[0, -1]
        torch.testing.assert_close(logits, expected)


def greedy_accepted(base, d: DFlash, cfg: dict) -> tuple[torch.Tensor, int]:
    cfg = SamplerConfig(max_new_tokens=30, eos_token_id=[], **cfg)
    plain = generate(base, PROMPTS, None, cfg, engine=auto_engine())
    spec = generate(base, PROMPTS, d, cfg, engine=auto_engine())
    assert torch.equal(spec.tokens, plain.tokens)
    return spec.tokens, sum(map(sum, spec.accepted))


@pytest.mark.parametrize("cfg", [dict(gamma=1), dict(gamma=3), dict(tree="static", paths=[[0, 0, 0], [1], [0, 1]]),
                                 dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)],
                         ids=["chain1", "chain3", "static", "dynamic"])
def test_greedy_identical_and_training_is_what_gets_drafts_accepted(base, trained, cfg):
    _, accepted = greedy_accepted(base, trained, cfg)
    _, untrained = greedy_accepted(base, DFlash(base, block_size=4, aux_layers=AUX, draft_vocab_size=None), cfg)
    assert accepted > untrained + 5, (accepted, untrained)


def test_refusals_in_one_line(base, trained, tmp_path):
    cfg = SamplerConfig(max_new_tokens=5, eos_token_id=[], gamma=4)
    with pytest.raises(ValueError, match=r"draft depth 4 > the drafter's max_depth 3"):
        generate(base, PROMPTS, trained, cfg, engine=auto_engine())
    save_drafter(trained, tmp_path / "d")
    other = tiny_base(num_layers=4, dtype="float64", seed=1)
    with pytest.raises(ValueError, match="was trained on base .tiny-h32-l4-s0., not on .tiny-h32-l4-s1."):
        load_drafter(tmp_path / "d", other)
    assert torch.equal(load_drafter(tmp_path / "d", base).fc.weight, trained.fc.weight)


def test_monte_carlo_lossless():
    """docs/sampler.md §6.3 at T = 1: a block of 2 drafted positions on the micro base, 10^5 rows, redrawn so that q
    differs from p (some drafts accepted, some not)."""
    micro = micro_base()
    torch.manual_seed(0)
    drafter = DFlash(micro, num_layers=1, block_size=3, aux_layers=[1], draft_vocab_size=None, mask_token_id=0)
    with torch.no_grad():
        for p in drafter.layers.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    cfg = SamplerConfig(max_new_tokens=TOKENS, temperature=1.0, eos_token_id=[], gamma=2)
    r = generate(micro, [PROMPT] * 100_000, drafter, cfg, torch.Generator().manual_seed(0), engine=auto_engine())
    assert 0 < sum(map(sum, r.accepted)) < sum(map(sum, r.drafted))
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) > 1e-3
