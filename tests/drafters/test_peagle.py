"""P-EAGLE: what each depth reads (the features and tokens up to its anchor's root entry, never a later token), COD's
thinning (nested chains; only the kept entries get gradient, every entry its value), sampling == training inside
`generate`, lossless drafting at T = 0 and T = 1, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import auto_engine
from specdec.base import Base, Features, tiny_base
from specdec.checkpoint import load_drafter, save_drafter
from specdec.drafters.peagle import PEagle, cod_entries
from specdec.sampling.decode import SamplerConfig, generate
from test_dflash import PROMPTS, fit_to_greedy
from test_eagle3 import AUX, T, data, randomized  # random weights and T = 8 tokens with the base's features
from test_sampling_mc import PROMPT, TOKENS, chi_square_pvalue, exact_joint

K = 4


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=4, dtype="float64")


def test_names_shapes_and_what_is_saved(base):
    d = PEagle(base, num_depths=K, num_layers=2, draft_vocab_size=64, aux_layers=AUX)
    h = base.hidden_size
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    # speculators' PEagleDraftModel names (vLLM's too): EAGLE-3's, a plain later layer, and mask_hidden [1, 1, 3H]
    assert shapes["mask_hidden"] == (1, 1, 3 * h) and shapes["fc.weight"] == (h, 3 * h)
    assert shapes["layers.0.self_attn.q_proj.weight"][1] == 2 * h and "layers.0.hidden_norm.weight" in shapes
    assert shapes["layers.1.self_attn.q_proj.weight"][1] == h and "layers.1.hidden_norm.weight" not in shapes
    assert shapes["lm_head.weight"] == (64, h) and not any("embed" in k for k in shapes)
    assert len(list(d.parameters())) == len(shapes) - 1  # (draft_vocab.tokens) no module shared between layers
    ids, feats = data(base, d)
    assert d.forward_train(feats, ids).logits.shape == (2, T, K, 64)
    assert d.target_offsets == [1, 2, 3, 4] and d.head_names == ["depth0", "depth1", "depth2", "depth3"]
    assert d.max_depth == K and d.hparams["mask_token_id"] == base.vocab_size - 1  # (ByT5's specials: pad, eos, unk)


def test_each_depth_reads_its_anchors_context_and_never_a_later_token(base):
    """Depth k at anchor t moves with the features of positions ≤ t (each fused layer) and the tokens ≤ t + 1 (its
    root entry's): never a token it would draft, nor a later feature; mask_hidden moves the masked depths only."""
    d = randomized(PEagle(base, num_depths=3, num_layers=2, draft_vocab_size=None, aux_layers=AUX)).eval()
    ids, feats = data(base, d)
    ref = d.forward_train(feats, ids).logits  # [B, T, 3, V]
    t = torch.arange(T)[:, None].expand(-1, 3)
    for layer in AUX:
        for s in range(T):
            hidden = {k: v.clone() for k, v in feats.hidden.items()}
            hidden[layer][:, s] += 0.5
            moved = (d.forward_train(Features(hidden, None), ids).logits - ref).abs().amax(dim=(0, 3)) > 1e-9
            assert torch.equal(moved, s <= t), f"layer {layer}, feature {s}"
    for s in range(T):
        changed = ids.clone()
        changed[:, s] = (ids[:, s] + 7) % base.vocab_size
        moved = (d.forward_train(feats, changed).logits - ref).abs().amax(dim=(0, 3)) > 1e-9
        assert torch.equal(moved, s <= t + 1), f"token {s}"
    with torch.no_grad():
        d.mask_hidden.add_(0.5)
    moved = (d.forward_train(feats, ids).logits - ref).abs().amax(dim=(0, 1, 3)) > 1e-9
    assert moved.tolist() == [False, True, True]


def test_cod_keeps_nested_chains_and_trains_only_them(base):
    """speculators' counts (depth k keeps int(n_k · max(0.7^k, 0.2)) of the anchors with a depth-k target, drawn among
    those depth k − 1 kept); in training every entry has its dense value, and the gradient reaches the kept ones."""
    anchors, depths = cod_entries(40, 6, 0.7, 0.2, torch.Generator().manual_seed(0))
    kept = {k: set(anchors[depths == k].tolist()) for k in range(1, 6)}
    assert [len(kept[k]) for k in kept] == [int((38 - k) * max(0.7**k, 0.2)) for k in range(1, 6)] == [25, 17, 12, 8, 6]
    assert all(kept[k] <= kept[k - 1] for k in range(2, 6)) and all(a <= 37 - k for k in kept for a in kept[k])

    d = randomized(PEagle(base, num_depths=K, draft_vocab_size=None, aux_layers=AUX))
    ids = torch.randint(3, base.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    feats = base.features(ids, layers=d.feature_layers)
    torch.manual_seed(3)
    logits = d.train().forward_train(feats, ids).logits  # [1, 16, K, V]
    torch.manual_seed(3)
    anchors, depths = cod_entries(16, K, d.down_sample_ratio, d.down_sample_ratio_min)
    with torch.no_grad():
        torch.testing.assert_close(logits, d.eval().forward_train(feats, ids).logits)
    kept = set(zip(anchors.tolist(), depths.tolist()))
    assert 0 < len(kept) < 3 * 12
    for t in range(16):
        for k in range(1, K):
            grad = torch.autograd.grad(logits[0, t, k].sum(), d.mask_hidden, retain_graph=True)[0]
            assert bool(grad.abs().sum() > 0) == ((t, k) in kept), (t, k)


NEW = 20


@pytest.fixture(scope="module")
def trained(base):
    """COD's thinned gradient fitted to the base's greedy continuations."""
    torch.manual_seed(0)
    d = PEagle(base, num_depths=K, num_layers=2, draft_vocab_size=None, aux_layers=AUX)
    return fit_to_greedy(base, d, 60).eval()


@pytest.mark.parametrize("cfg", [dict(gamma=1), dict(gamma=3), dict(tree="static", paths=[[0, 0, 0, 0], [1], [0, 1]])],
                         ids=["chain1", "chain3", "static"])
def test_generate_drafts_exactly_the_training_logits(base, trained, cfg):
    """Each round's one pass inside `generate` (ragged batch, partial acceptance, fewer depths than trained) equals
    forward_train's depths at its root entry, for the committed prefix + root."""
    calls = []

    class Recording(PEagle):
        def observe(self, state, ctx, feats, tokens, n_new, next_token):
            for b in range(tokens.shape[0]):
                self.committed[b] += tokens[b, : int(n_new[b])].tolist()
            super().observe(state, ctx, feats, tokens, n_new, next_token)

        def draft_block(self, state, ctx, root):
            logits = super().draft_block(state, ctx, root)
            for b in range(logits.shape[0]):
                if len(self.committed[b]) + 1 - len(PROMPTS[b]) < NEW:  # (a row still decoding)
                    calls.append((list(self.committed[b]), int(root[b]), logits[b]))
            return logits

    rec = Recording(base, **trained.hparams)
    rec.load_state_dict(trained.state_dict())
    rec.eval()
    rec.committed = [[] for _ in PROMPTS]
    generate(base, PROMPTS, rec, SamplerConfig(max_new_tokens=NEW, eos_token_id=[], **cfg), engine=auto_engine())
    assert len(calls) > 10
    for committed, root, logits in calls:
        ids = torch.tensor([committed + [root]])
        expected = trained.forward_train(base.features(ids, layers=trained.feature_layers), ids).logits
        torch.testing.assert_close(logits, expected[0, len(committed) - 1, : len(logits)])


def accepted(base, d: PEagle, cfg: dict) -> int:
    cfg = SamplerConfig(max_new_tokens=30, eos_token_id=[], **cfg)
    plain = generate(base, PROMPTS, None, cfg, engine=auto_engine())
    spec = generate(base, PROMPTS, d, cfg, engine=auto_engine())
    assert torch.equal(spec.tokens, plain.tokens)
    return sum(map(sum, spec.accepted))


@pytest.mark.parametrize("cfg", [dict(gamma=1), dict(gamma=3), dict(tree="static", paths=[[0, 0, 0], [1], [0, 1]]),
                                 dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)],
                         ids=["chain1", "chain3", "static", "dynamic"])
def test_greedy_identical_and_training_is_what_gets_drafts_accepted(base, trained, cfg):
    torch.manual_seed(0)
    untrained = PEagle(base, num_depths=K, num_layers=2, draft_vocab_size=None, aux_layers=AUX).eval()
    assert accepted(base, trained, cfg) > accepted(base, untrained, cfg) + 15


def test_every_depth_of_one_pass_gets_accepted(base, trained):
    cfg = SamplerConfig(max_new_tokens=30, eos_token_id=[], gamma=K)
    spec = generate(base, PROMPTS, trained, cfg, engine=auto_engine())
    assert max(map(max, spec.accepted)) == K  # a round took the root entry's draft and all three masked ones


def test_refusals_in_one_line(base, trained, tmp_path):
    for cfg, message in [(dict(gamma=5), r"^draft depth 5 > the drafter's max_depth 4$"),
                         (dict(tree="dynamic", dynamic_depth=5), r"^dynamic_depth 5 > the drafter's max_depth 4$")]:
        with pytest.raises(ValueError, match=message):
            generate(base, PROMPTS, trained, SamplerConfig(max_new_tokens=5, eos_token_id=[], **cfg),
                     engine=auto_engine())
    with pytest.raises(ValueError, match=r"^peagle: mask_token_id 259 is outside the base's vocabulary \[0, 259\)$"):
        PEagle(base, mask_token_id=base.vocab_size, aux_layers=AUX)
    save_drafter(trained, tmp_path / "d")
    other = tiny_base(num_layers=4, dtype="float64", seed=1)
    with pytest.raises(ValueError, match="was trained on base .tiny-h32-l4-s0., not on .tiny-h32-l4-s1.") as e:
        load_drafter(tmp_path / "d", other)
    assert "\n" not in str(e.value)
    back = load_drafter(tmp_path / "d", base)
    assert back.hparams == trained.hparams and torch.equal(back.mask_hidden, trained.mask_hidden)


def micro_two_layers() -> Base:
    """test_sampling_mc's micro base (6 tokens, a peaked lm_head) with two layers: P-EAGLE, as EAGLE-3, fuses the
    input of an inner layer, which a one-layer base has none of."""
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=6, max_position_embeddings=64, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        model.lm_head.weight.data *= 40.0
    return Base(model, None, "micro-v6-l2")


def test_monte_carlo_lossless():
    """docs/sampler.md §6.3 at T = 1: a chain of 2 from one pass (the root entry and one masked), 10^5 rows, drafts
    perturbed so that q differs from p (some accepted, some not)."""
    micro = micro_two_layers()
    torch.manual_seed(0)
    d = PEagle(micro, num_depths=2, draft_vocab_size=None, aux_layers=[1, 1, 1], mask_token_id=0)
    with torch.no_grad():
        for p in d.layers.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    cfg = SamplerConfig(max_new_tokens=TOKENS, temperature=1.0, eos_token_id=[], gamma=2)
    r = generate(micro, [PROMPT] * 100_000, d.eval(), cfg, torch.Generator().manual_seed(0), engine=auto_engine())
    assert 0 < sum(map(sum, r.accepted)) < sum(map(sum, r.drafted))
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) > 1e-3
