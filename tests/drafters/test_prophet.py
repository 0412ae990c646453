"""ProphetNet-style predictor: which features/tokens each unrolled step reads (its OWN predicted features, not
the teacher's), the training attention against a per-chain brute force, parameters, and sampling == training."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdec.base import LAST, Features, tiny_base
from specdec.drafters.prophet import Prophet
from specdec.sampling.context import SamplingContext
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine

T = 8


@pytest.fixture(scope="module")
def base():
    return tiny_base(dtype="float64")


def randomized(drafter: Prophet, seed: int = 0) -> Prophet:
    """The identity init zeroes the token path and the blocks' outputs: random values expose the wiring."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return drafter


def data(base, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, Features]:
    ids = torch.randint(3, base.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))
    return ids, base.features(ids)


def test_targets_and_names(base):
    d = Prophet(base, unroll_steps=3)
    assert d.target_offsets == [1, 2, 3] and d.head_names == ["step1", "step2", "step3"] and d.max_depth is None
    ids, feats = data(base)
    assert d.forward_train(feats, ids).logits.shape == (2, T, 3, base.vocab_size)


@pytest.mark.parametrize("fuse_layers", [None, [1]])
def test_fresh_predictor_is_the_base_head(base, fuse_layers):
    """Identity init: ĥ = h at every step, so a fresh predictor starts from the base's own head on h_t (up to
    the RMSNorm eps, which is not negligible against the random tiny base's small residual stream); a fused one
    too (its inner layers' columns start at zero)."""
    ids = data(base)[0]
    d = Prophet(base, num_layers=2, unroll_steps=3, fuse_layers=fuse_layers)
    feats = base.features(ids, layers=d.feature_layers)
    logits = d.forward_train(feats, ids).logits  # [B, T, 3, V]
    torch.testing.assert_close(logits, feats.logits[:, :, None].expand_as(logits), atol=2e-3, rtol=2e-3)
    assert torch.equal(logits.argmax(-1), feats.logits.argmax(-1)[:, :, None].expand(-1, -1, 3))


def test_unrolled_steps_read_own_features_not_the_teachers(base):
    """Step j at t (predicting x_{t+j+2}) may read the real features h_{≤t} and the tokens x_{≤t+j+1} only.
    A predictor that fed the teacher's h_{t+j} to step j (teacher features only) would move when a later real
    feature changes: this test fails for it. Exhaustive over every (changed position, t, step)."""
    steps = 3
    d = randomized(Prophet(base, num_layers=2, unroll_steps=steps))
    ids, feats = data(base)
    ref = d.forward_train(feats, ids).logits  # [B, T, steps, V]
    t = torch.arange(T)[:, None]
    j = torch.arange(steps)[None]
    for s in range(T):
        h = feats.hidden[LAST].clone()
        h[:, s] += 0.5
        out = d.forward_train(Features(hidden={LAST: h}, logits=feats.logits), ids).logits
        moved = (out - ref).abs().amax(dim=(0, 3)) > 1e-9  # [T, steps]
        assert torch.equal(moved, (s <= t).expand(-1, steps)), f"feature {s}"

        changed = ids.clone()
        changed[:, s] = (ids[:, s] + 7) % base.vocab_size
        out = d.forward_train(feats, changed).logits
        moved = (out - ref).abs().amax(dim=(0, 3)) > 1e-9
        assert torch.equal(moved, s <= t + j + 1), f"token {s}"


def test_unroll_equals_a_causal_forward_per_chain(base):
    """The batched unroll (one 4D mask over [steps × T] keys) equals, chain by chain, the plain causal forward
    over [sink, real entries 0..t, the chain's own steps 1..j] at positions -1..t+j, fed step by step."""
    steps = 3
    d = randomized(Prophet(base, num_layers=2, unroll_steps=steps, feature_weight=0.0))
    ids, feats = data(base, batch=1)
    h = feats.hidden[LAST]
    logits, hats = d.unroll(h, ids, steps)  # [1, T, steps, V], [1, T, steps, H]
    emb = base.embed_tokens(ids)
    for t in range(T - steps):
        seq = d.step_input(torch.cat([torch.zeros_like(h[:, :1]), h[:, : t + 1]], 1), emb[:, : t + 2])
        for step in range(steps):
            n = seq.shape[1]
            causal = torch.zeros(n, n, dtype=seq.dtype).masked_fill_(
                ~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(seq.dtype).min
            )
            out = d._run(seq, torch.arange(-1, n - 1), causal, DynamicCache())[:, -1]
            hat, logit = d.readout(out)
            torch.testing.assert_close(hat, hats[:, t, step])
            torch.testing.assert_close(logit, logits[:, t, step])
            if step + 1 < steps:
                seq = torch.cat([seq, d.step_input(hat, emb[:, t + step + 2])[:, None]], 1)


def test_fusion_reads_the_inner_layer_of_real_entries_only(base):
    """With fuse_layers the real entries carry fuse([norm(h^l); h]): changing the inner layer's state at s moves
    the chains rooted at t ≥ s (every step), like the last layer's does, and the regression target stays the last
    layer (the inner state does not enter the feature loss)."""
    d = randomized(Prophet(base, num_layers=1, unroll_steps=2, fuse_layers=[1], feature_weight=0.5))
    assert d.feature_layers == (1, LAST) and d.hparams["fuse_layers"] == [1]
    ids = data(base)[0]
    feats = base.features(ids, layers=d.feature_layers)
    ref = d.forward_train(feats, ids)
    s = 3
    inner = feats.hidden[1].clone()
    inner[:, s] += 0.5
    out = d.forward_train(Features({1: inner, LAST: feats.hidden[LAST]}, feats.logits), ids)
    moved = (out.logits - ref.logits).abs().amax(dim=(0, 3)) > 1e-9  # [T, steps]
    assert torch.equal(moved, (s <= torch.arange(T))[:, None].expand(-1, 2))
    _, hats = d.unroll(d.real_feature({1: inner, LAST: feats.hidden[LAST]}), ids, 2)
    h = feats.hidden[LAST]
    by_hand = torch.stack([torch.nn.functional.smooth_l1_loss(hats[:, : T - 1 - j, j], h[:, 1 + j :]) for j in (0, 1)])
    torch.testing.assert_close(out.aux_metrics["feature_loss"], by_hand.mean())
    with pytest.raises(ValueError, match="fuse_layers"):
        Prophet(base, fuse_layers=[base.num_layers])


def test_feature_regression(base):
    ids, feats = data(base)
    assert Prophet(base, feature_weight=0.0).forward_train(feats, ids).aux_loss is None
    d = randomized(Prophet(base, unroll_steps=2, feature_weight=0.5))
    out = d.forward_train(feats, ids)
    _, hats = d.unroll(feats.hidden[LAST], ids, 2)
    h = feats.hidden[LAST]
    by_hand = torch.stack([
        torch.nn.functional.smooth_l1_loss(hats[:, : T - 1, 0], h[:, 1:]),
        torch.nn.functional.smooth_l1_loss(hats[:, : T - 2, 1], h[:, 2:]),
    ]).mean()
    torch.testing.assert_close(out.aux_loss, 0.5 * by_hand)
    torch.testing.assert_close(out.aux_metrics["feature_loss"], by_hand)
    out.aux_loss.backward()
    assert d.fc.weight.grad.abs().sum() > 0 and d.blocks[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_parameter_count_and_no_shared_modules(base, own_lm_head):
    layers = 2
    d = Prophet(base, num_layers=layers, own_lm_head=own_lm_head)
    c = base.config
    h, v, i = c.hidden_size, c.vocab_size, c.intermediate_size
    hd = h // c.num_attention_heads
    attn = h * c.num_attention_heads * hd * 2 + h * c.num_key_value_heads * hd * 2  # q, o + k, v (no biases)
    block = attn + 3 * h * i + 2 * h  # + gate/up/down + two RMSNorms
    # embedding norm + fc + blocks + final norm (+ own head)
    expected = h + 2 * h * h + layers * block + h + (h * v if own_lm_head else 0)
    assert sum(p.numel() for p in d.parameters()) == expected
    all_params = list(d.named_parameters(remove_duplicate=False))
    assert len({p.data_ptr() for _, p in all_params}) == len(all_params)


def test_state_dict_holds_no_base_weights(base):
    d = Prophet(base, own_lm_head=True)
    sd = d.state_dict()
    assert all(k.startswith(("emb_norm.", "fc.", "blocks.", "norm.", "lm_head.")) for k in sd)
    base_ptrs = {t.data_ptr() for t in base.model.state_dict().values()}
    assert not base_ptrs & {t.data_ptr() for t in sd.values()}
    assert all(p.requires_grad for p in d.parameters())
    assert not any(p.requires_grad for p in base.model.parameters())


def test_sampling_matches_training_on_a_tree(base):
    """observe + expand through the sampler's DraftContext, on a tree numbered like the sampler numbers it
    (an unexpanded leaf between expanded nodes, frontier indices passed as `nodes`), gives for each node the
    training unroll logits of the sequence through that node; the root's entry comes from observe's own pass."""
    d = randomized(Prophet(base, num_layers=2, unroll_steps=3))
    ids, feats = data(base, batch=2)
    p = 4  # committed prompt length; root = x_4, chain positions t = 3
    ctx = SamplingContext(base, 2, 32, auto_engine())
    state = d.init_state(2, 32)
    ctx.commit_layout(p)
    d.observe(state, ctx, Features({LAST: feats.hidden[LAST][:, :p]}, feats.logits[:, :p]), ids[:, :p],
              torch.tensor([p, p]), ids[:, p])
    ctx.commit(torch.tensor([p, p]), [p, p])
    other = (ids[:, p + 1] + 3) % base.vocab_size
    # Nodes: 0 root; 1 = x_5, 2 = other (children of 0); 3 = a leaf under 1 (never expanded); 4 = x_6 under 2.
    tokens = torch.stack([ids[:, p], ids[:, p + 1], other, ids[:, p + 2], ids[:, p + 2]], 1)  # [B, 5]
    parents = [-1, 0, 0, 1, 2]
    anc = torch.zeros(5, 5, dtype=torch.bool)
    for n, par in enumerate(parents):
        anc[n] = anc[par] if par >= 0 else anc[n]
        anc[n, n] = True

    def expand(frontier: list[int], depth: int) -> torch.Tensor:
        f = torch.tensor(frontier)
        ctx.tree_layout(f, torch.full_like(f, depth), anc[f])
        return d.expand(state, ctx, tokens[:, f], torch.tensor([parents[i] for i in frontier]), depth, nodes=f)

    runs = []
    run_layers = ctx.run_layers
    ctx.run_layers = lambda *a, **k: runs.append(1) or run_layers(*a, **k)
    got0 = expand([0], 0)
    assert not runs  # the root entry ran in observe's pass: depth 0 only reads it out
    got1, got2 = expand([1, 2], 1), expand([4], 2)
    assert len(runs) == 2
    main = d.forward_train(feats, ids).logits  # [B, T, 3, V]
    alt = ids.clone()
    alt[:, p + 1] = other
    branch = d.forward_train(base.features(alt), alt).logits
    t = p - 1
    torch.testing.assert_close(got0[:, 0], main[:, t, 0])
    torch.testing.assert_close(got1[:, 0], main[:, t, 1])
    torch.testing.assert_close(got1[:, 1], branch[:, t, 1])
    torch.testing.assert_close(got2[:, 0], branch[:, t, 2])


# -- through the sampler's public `generate` ----------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41]]


def self_distilled(base, drafter: Prophet, steps: int = 60) -> Prophet:
    """A few Adam steps on the base's own greedy continuations, so drafts get accepted (partial, ragged)."""
    ref = generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=40, eos_token_id=[]), engine=auto_engine())
    ids = torch.tensor([p[-2:] + t for p, t in zip(PROMPTS, ref.tokens.tolist())])  # [3, 42]
    feats = base.features(ids, layers=drafter.feature_layers)
    target = feats.logits.argmax(-1)  # [3, 42] the base's greedy next token
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = drafter.forward_train(feats, ids).logits  # [3, T, K, V]
        loss = sum(
            torch.nn.functional.cross_entropy(logits[:, : ids.shape[1] - k, j].flatten(0, 1), target[:, k:].flatten())
            for j, k in enumerate(drafter.target_offsets)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.requires_grad_(False)


@pytest.fixture(scope="module", params=[None, [1]], ids=["last", "fused"])
def trained(base, request):
    torch.manual_seed(0)
    return self_distilled(base, Prophet(base, num_layers=1, unroll_steps=4, fuse_layers=request.param))


@pytest.mark.parametrize(
    "cfg",
    [dict(tree="chain", gamma=1), dict(tree="chain", gamma=4), dict(tree="static", paths=[[0, 0, 0], [1, 0], [0, 1], [2]]),
     dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)],
    ids=["chain1", "chain4", "static", "dynamic"],
)
def test_greedy_speculative_equals_plain_greedy(base, trained, cfg):
    cfg = SamplerConfig(max_new_tokens=30, eos_token_id=[], **cfg)
    plain = generate(base, PROMPTS, None, cfg, engine=auto_engine())
    spec = generate(base, PROMPTS, trained, cfg, engine=auto_engine())
    assert torch.equal(spec.tokens, plain.tokens)
    if cfg.tree == "chain":
        assert sum(map(sum, spec.accepted)) > 0  # the accept / rollback / ragged-observe paths were exercised


def test_generate_drafts_exactly_the_training_logits(base, trained):
    """Every chain drafted inside `generate` (ragged batch, partial acceptance) gets at depth j the training
    unroll's step-j logits for the sequence committed prefix + root + the drafted tokens."""
    calls = []

    class Recording(Prophet):
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
                if len(self.committed[b]) - len(PROMPTS[b]) < max_new:  # finished rows keep drafting, unused
                    calls.append((list(self.committed[b]), list(self.paths[b]), logits[b, 0]))
            return logits

    rec = Recording(base, **trained.hparams)
    rec.load_state_dict(trained.state_dict())
    rec.committed = [[] for _ in PROMPTS]
    max_new = 24
    generate(base, PROMPTS, rec, SamplerConfig(max_new_tokens=max_new, eos_token_id=[], tree="chain", gamma=3),
             engine=auto_engine())
    assert len(calls) > 20
    for committed, path, logits in calls:
        ids = torch.tensor([committed + path])
        expected, _ = rec.unroll(rec.real_feature(base.features(ids, layers=rec.feature_layers).hidden), ids, len(path))
        torch.testing.assert_close(logits, expected[0, len(committed) - 1, len(path) - 1])


@pytest.mark.slow
@pytest.mark.long  # (20-40 s: HF generate in float32 beside ours on the real base)
def test_on_smollm2():
    """The real base: decoder blocks built from its config, identity init, and lossless greedy drafting."""
    from specdec.base import load_base

    real = load_base(device="cpu")
    enc = real.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                             add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([enc["input_ids"]])
    feats = real.features(ids)
    d = Prophet(real, num_layers=1, unroll_steps=3)
    logits = d.forward_train(feats, ids).logits  # [1, T, 3, V]
    assert torch.equal(logits[..., 0, :].argmax(-1), feats.logits.argmax(-1))  # fresh = the base's head on h_t
    cfg = SamplerConfig(max_new_tokens=12, tree="chain", gamma=3)
    assert torch.equal(generate(real, ids.tolist(), d, cfg, engine=auto_engine()).tokens, generate(real, ids.tolist(), None, cfg, engine=auto_engine()).tokens)


@pytest.mark.parametrize("rows", [1, 2])
def test_observe_keeps_its_state_through_the_next_verify(base, monkeypatch, rows):
    """One row's observe keeps its newest feature and root entry as views of the verify's outputs: each verify must
    make new ones (a reused buffer would hand the next round's observe the wrong f_{t}: lossless still, a lower τ)."""
    d = randomized(Prophet(base)).eval()
    observe, seen = Prophet.observe, []

    def checked(self, state, ctx, feats, tokens, n_new, next_token):
        if "kept" in state:
            seen.append(all(torch.equal(state[k], v) for k, v in state["kept"].items()))
        observe(self, state, ctx, feats, tokens, n_new, next_token)
        state["kept"] = {k: state[k].clone() for k in ("f", "root")}

    monkeypatch.setattr(Prophet, "observe", checked)
    generate(base, [list(range(5, 17))] * rows, d, SamplerConfig(max_new_tokens=12, gamma=3, eos_token_id=[]),
             engine=auto_engine())
    assert len(seen) > 3 and all(seen)
