"""EAGLE-3: which base layers, tokens and own outputs each TTT step reads, the tensor names the serving formats use,
sampling == training on a tree and a chain inside `generate`, and lossless greedy drafting; the same with each of
EAGLE-3.1's switches (fc_norm, norm_output), and what each switch changes."""

from __future__ import annotations

import pytest
import torch

from conftest import auto_engine
from specdec.base import Features, tiny_base
from specdec.drafters.eagle3 import Eagle3, default_aux_layers
from specdec.sampling.context import SamplingContext
from specdec.sampling.decode import SamplerConfig, generate

T = 8
AUX = [1, 2, 3]
# EAGLE-3 and EAGLE-3.1's two switches, each alone (speculators' --fc-norm, --norm-output)
VARIANTS = {"eagle3": {}, "fc_norm": {"fc_norm": True}, "norm_output": {"norm_output": True}}


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=4, dtype="float64")


def randomized(d: Eagle3, seed: int = 0) -> Eagle3:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return d


def data(base, d: Eagle3, batch: int = 2, seed: int = 0):
    ids = torch.randint(3, base.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))
    return ids, base.features(ids, layers=d.feature_layers)


def test_layers_names_and_shapes(base):
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M: the inputs of layers 2, L//2, L-3
    d = Eagle3(base, ttt_steps=3, draft_vocab_size=64, aux_layers=AUX)
    h = base.hidden_size
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    # the names speculators' Eagle3DraftModel and vLLM read (d2t / t2d are derived from draft_vocab.tokens)
    assert shapes["fc.weight"] == (h, 3 * h)
    assert shapes["layers.0.self_attn.q_proj.weight"][1] == 2 * h and shapes["layers.0.self_attn.o_proj.weight"] == (h, h)
    assert {"layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
            "norm.weight"} <= set(shapes)
    assert shapes["lm_head.weight"] == (64, h)
    assert not any("embed" in k for k in shapes)  # the base's embeddings, frozen, never saved
    ids, feats = data(base, d)
    assert d.forward_train(feats, ids).logits.shape == (2, T, 3, 64)
    assert d.target_offsets == [1, 2, 3] and d.head_names == ["step1", "step2", "step3"]
    assert (d.d2t() + torch.arange(64) == d.draft_vocab.tokens).all() and d.t2d().sum() == 64


def test_a_fresh_drafter_starts_as_the_base_layer_on_its_highest_input(base):
    # aux_layers[-1] = 3 is the input of the tiny base's last layer: step 0 then computes about the base's own
    # next-token distribution (its attention reads one key per committed position, as the base does, plus the sink)
    d = Eagle3(base, ttt_steps=2, draft_vocab_size=base.vocab_size, aux_layers=AUX)
    src, layer = base.layers[AUX[-1]], d.layers[0]
    h = base.hidden_size
    assert torch.equal(layer.self_attn.q_proj.weight[:, h:], src.self_attn.q_proj.weight)
    assert not layer.self_attn.q_proj.weight[:, :h].any()  # the token half starts at zero
    assert torch.equal(layer.mlp.down_proj.weight, src.mlp.down_proj.weight)
    ids, feats = data(base, d, batch=4)
    step0 = d.forward_train(feats, ids).logits[:, :, 0]  # [B, T, V]
    tv = (step0.softmax(-1) - feats.logits.softmax(-1)).abs().sum(-1).mean()  # 0.007 on this base
    assert tv < 0.05, tv


def test_refuses_layers_outside_the_base(base):
    with pytest.raises(ValueError, match="three inner base layers"):
        Eagle3(base, aux_layers=[1, 2, 4])


def test_steps_read_the_three_layers_and_their_own_outputs(base):
    """Step j at t reads the real features of positions ≤ t from each of the three layers (a change at s moves
    exactly the steps at t ≥ s) and the tokens ≤ t+j+1; never a later real feature (teacher features would)."""
    steps = 3
    d = randomized(Eagle3(base, ttt_steps=steps, draft_vocab_size=None, aux_layers=AUX))
    ids, feats = data(base, d)
    ref = d.forward_train(feats, ids).logits
    t, j = torch.arange(T)[:, None], torch.arange(steps)[None]
    for layer in AUX:
        for s in range(T):
            hidden = {k: v.clone() for k, v in feats.hidden.items()}
            hidden[layer][:, s] += 0.5
            moved = (d.forward_train(Features(hidden, None), ids).logits - ref).abs().amax(dim=(0, 3)) > 1e-9
            assert torch.equal(moved, (s <= t).expand(-1, steps)), f"layer {layer}, feature {s}"
    for s in range(T):
        changed = ids.clone()
        changed[:, s] = (ids[:, s] + 7) % base.vocab_size
        moved = (d.forward_train(feats, changed).logits - ref).abs().amax(dim=(0, 3)) > 1e-9
        assert torch.equal(moved, s <= t + j + 1), f"token {s}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampling_matches_training_on_a_tree(base, variant):
    d = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=None, aux_layers=AUX, **VARIANTS[variant]))
    ids, feats = data(base, d)
    p = 4
    ctx = SamplingContext(base, 2, 32, auto_engine())
    state = d.init_state(2, 32)
    ctx.commit_layout(p)
    d.observe(state, ctx, Features({k: v[:, :p] for k, v in feats.hidden.items()}, None), ids[:, :p],
              torch.tensor([p, p]), ids[:, p])
    ctx.commit(torch.tensor([p, p]), [p, p])
    other = (ids[:, p + 1] + 3) % base.vocab_size
    tokens = torch.stack([ids[:, p], ids[:, p + 1], other, ids[:, p + 2], ids[:, p + 2]], 1)  # [B, 5]
    parents = [-1, 0, 0, 1, 2]  # node 3: a leaf never expanded
    anc = torch.zeros(5, 5, dtype=torch.bool)
    for n, par in enumerate(parents):
        anc[n] = anc[par] if par >= 0 else anc[n]
        anc[n, n] = True

    def expand(frontier: list[int], depth: int) -> torch.Tensor:
        f = torch.tensor(frontier)
        ctx.tree_layout(f, torch.full_like(f, depth), anc[f])
        return d.expand(state, ctx, tokens[:, f], torch.tensor([parents[i] for i in frontier]), depth, nodes=f)

    got0, got1, got2 = expand([0], 0), expand([1, 2], 1), expand([4], 2)
    main = d.forward_train(feats, ids).logits
    alt = ids.clone()
    alt[:, p + 1] = other
    branch = d.forward_train(base.features(alt, layers=d.feature_layers), alt).logits
    t = p - 1
    torch.testing.assert_close(got0[:, 0], main[:, t, 0])
    torch.testing.assert_close(got1[:, 0], main[:, t, 1])
    torch.testing.assert_close(got1[:, 1], branch[:, t, 1])
    torch.testing.assert_close(got2[:, 0], branch[:, t, 2])


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41]]


@pytest.fixture(scope="module", params=list(VARIANTS))
def trained(base, request):
    """A few Adam steps on the base's own greedy continuations, so drafts get accepted (partial, ragged); once per
    variant, so that every test below runs with each switch."""
    torch.manual_seed(0)
    d = Eagle3(base, ttt_steps=4, draft_vocab_size=None, aux_layers=AUX, **VARIANTS[request.param])
    ref = generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=40, eos_token_id=[]), engine=auto_engine())
    ids = torch.tensor([p[-2:] + t for p, t in zip(PROMPTS, ref.tokens.tolist())])
    feats = base.features(ids, layers=d.feature_layers)
    target = feats.logits.argmax(-1)
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    for _ in range(60):
        logits = d.forward_train(feats, ids).logits
        loss = sum(torch.nn.functional.cross_entropy(logits[:, : ids.shape[1] - k, j].flatten(0, 1),
                                                     target[:, k:].flatten())
                   for j, k in enumerate(d.target_offsets))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.requires_grad_(False)


@pytest.mark.parametrize("cfg", [dict(tree="chain", gamma=1), dict(tree="chain", gamma=4),
                                 dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)],
                         ids=["chain1", "chain4", "dynamic"])
def test_greedy_speculative_equals_plain_greedy(base, trained, cfg):
    cfg = SamplerConfig(max_new_tokens=30, eos_token_id=[], **cfg)
    plain = generate(base, PROMPTS, None, cfg, engine=auto_engine())
    spec = generate(base, PROMPTS, trained, cfg, engine=auto_engine())
    assert torch.equal(spec.tokens, plain.tokens)
    if cfg.tree == "chain":
        assert sum(map(sum, spec.accepted)) > 0


def test_generate_drafts_exactly_the_training_logits(base, trained):
    """Every chain drafted inside `generate` (ragged batch, partial acceptance) gets at depth j the TTT unroll's
    step-j logits for the committed prefix + root + the drafted tokens."""
    calls = []

    class Recording(Eagle3):
        def observe(self, state, ctx, feats, tokens, n_new, next_token):
            for b in range(tokens.shape[0]):
                self.committed[b] += tokens[b, : int(n_new[b])].tolist()
            self.paths = [[int(r)] for r in next_token]
            super().observe(state, ctx, feats, tokens, n_new, next_token)

        def expand(self, state, ctx, tokens, parents, depth, nodes):
            logits = super().expand(state, ctx, tokens, parents, depth, nodes)
            if depth:
                for b in range(tokens.shape[0]):
                    self.paths[b].append(int(tokens[b, 0]))
            for b in range(tokens.shape[0]):
                if len(self.committed[b]) - len(PROMPTS[b]) < 24:
                    calls.append((list(self.committed[b]), list(self.paths[b]), logits[b, 0]))
            return logits

    rec = Recording(base, **trained.hparams)
    rec.load_state_dict(trained.state_dict())
    rec.committed = [[] for _ in PROMPTS]
    generate(base, PROMPTS, rec, SamplerConfig(max_new_tokens=24, eos_token_id=[], gamma=3), engine=auto_engine())
    assert len(calls) > 20
    for committed, path, logits in calls:
        ids = torch.tensor([committed + path])
        expected = rec.unroll(rec.real_feature(base.features(ids, layers=rec.feature_layers).hidden), ids, len(path))
        torch.testing.assert_close(logits, expected[0, len(committed) - 1, len(path) - 1])


def test_eagle31_switches_add_their_norms_and_are_saved(base):
    h = base.hidden_size
    off = Eagle3(base, ttt_steps=2, draft_vocab_size=64, aux_layers=AUX)
    on = Eagle3(base, ttt_steps=2, draft_vocab_size=64, aux_layers=AUX, fc_norm=True, norm_output=True)
    extra = {k: tuple(v.shape) for k, v in on.state_dict().items() if k not in off.state_dict()}
    assert extra == {f"fc_norm.{i}.weight": (h,) for i in range(3)}  # one norm per fused layer, not one shared
    assert len({p.data_ptr() for p in on.fc_norm.parameters()}) == 3
    assert not off.hparams["fc_norm"] and not off.hparams["norm_output"]  # the default is EAGLE-3
    assert on.hparams["fc_norm"] and on.hparams["norm_output"]  # (checkpoints rebuild the drafter from hparams)


def with_weights_of(d: Eagle3, **switches) -> Eagle3:
    """The same drafter with switches flipped: every shared weight equal (fc_norm's own start at one)."""
    other = Eagle3(d.base, **(d.hparams | switches))
    other.load_state_dict(d.state_dict(), strict=False)
    return other


def test_fc_norm_normalises_each_fused_layer_before_fc(base):
    """A switch silently ignored fails here: fc_norm changes every step's logits, and makes them blind to the scale of
    each fused layer's hidden state (an RMSNorm on each, before fc), where EAGLE-3's are not."""
    off = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=None, aux_layers=AUX))
    on = with_weights_of(off, fc_norm=True)
    ids, feats = data(base, off)
    # (the tiny base's states have a mean square of ~5e-4: at 100x the norms' eps, 1e-6, is out of the picture)
    feats = Features({k: v * 100 for k, v in feats.hidden.items()}, None)
    ref_off, ref_on = off.forward_train(feats, ids).logits, on.forward_train(feats, ids).logits
    assert ((ref_on - ref_off).abs().amax(dim=(0, 1, 3)) > 1e-3).all()  # every step
    for layer in AUX:
        hidden = dict(feats.hidden) | {layer: feats.hidden[layer] * 3.0}
        scaled = Features(hidden, None)
        torch.testing.assert_close(on.forward_train(scaled, ids).logits, ref_on, rtol=1e-4, atol=1e-5)
        assert (off.forward_train(scaled, ids).logits - ref_off).abs().amax() > 1e-3


def test_norm_output_feeds_the_normed_output_to_the_next_step(base):
    """norm_output leaves step 0 as it is and changes every later step; the g each later step reads is norm(out):
    with the final norm's weight set to c, every row of it has RMS c, where EAGLE-3 feeds the raw output."""
    off = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=None, aux_layers=AUX))
    on = with_weights_of(off, norm_output=True)
    ids, feats = data(base, off)
    lo, ln = off.forward_train(feats, ids).logits, on.forward_train(feats, ids).logits
    torch.testing.assert_close(ln[:, :, 0], lo[:, :, 0])
    assert ((ln - lo).abs().amax(dim=(0, 1, 3))[1:] > 1e-3).all()
    for d, normed in [(off, False), (on, True)]:
        fed = []
        d.step_input = lambda g, emb, d=d: fed.append(g) or Eagle3.step_input(d, g, emb)
        with torch.no_grad():
            d.norm.weight.fill_(0.7)
        d.forward_train(feats, ids)
        rms = torch.stack([g.pow(2).mean(-1).sqrt() for g in fed[1:]])  # the steps after the first
        assert torch.allclose(rms, torch.full_like(rms, 0.7), atol=1e-4) == normed
