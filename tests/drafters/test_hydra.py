"""Hydra heads: which tokens each head reads, parameter layout, identity init, and sampling == training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.base import LAST, Features, tiny_base
from specdec.drafters.hydra import Hydra
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine

T = 9

HOST = SimpleNamespace(on_device=lambda t: t)  # expand's context where nothing leaves the CPU


@pytest.fixture(scope="module")
def base():
    return tiny_base(dtype="float64")


def randomized(drafter: Hydra, seed: int = 0) -> Hydra:
    """Fresh heads ignore the tokens (identity init): give every parameter random values to see the wiring."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return drafter


def data(base, seed: int = 0) -> tuple[torch.Tensor, Features]:
    ids = torch.randint(3, base.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    return ids, base.features(ids)


def test_targets_and_names(base):
    d = Hydra(base, num_heads=3)
    assert d.target_offsets == [1, 2, 3] and d.head_names == ["head1", "head2", "head3"] and d.max_depth == 3
    ids, feats = data(base)
    assert d.forward_train(feats, ids).logits.shape == (2, T, 3, base.vocab_size)


def test_fresh_heads_are_the_base_head(base):
    """Identity init: every fresh head returns the base's own next-token logits at t (like a fresh Medusa)."""
    ids, feats = data(base)
    logits = Hydra(base, num_heads=3, num_layers=2).forward_train(feats, ids).logits
    torch.testing.assert_close(logits, feats.logits[:, :, None].expand_as(logits))


def test_head_k_reads_exactly_tokens_t1_to_tk(base):
    """Head k at position t predicts x_{t+k+1}: it must read x_{t+1}..x_{t+k} and no other token. Changing
    x_s (base features held fixed) changes head k at t iff t < s <= t+k: x_{t+1} moves every head, x_{t+2}
    moves head 2 and up but not head 1, and nothing moves a head at or after s."""
    k_max = 3
    d = randomized(Hydra(base, num_heads=k_max, num_layers=1))
    ids, feats = data(base)
    ref = d.forward_train(feats, ids).logits  # [B, T, K, V]
    for s in range(T):
        changed_ids = ids.clone()
        changed_ids[:, s] = (ids[:, s] + 7) % base.vocab_size
        out = d.forward_train(feats, changed_ids).logits
        moved = (out - ref).abs().amax(dim=(0, 3)) > 1e-9  # [T, K]
        t = torch.arange(T)[:, None]
        k = torch.arange(1, k_max + 1)[None]
        assert torch.equal(moved, (t < s) & (s <= t + k)), f"token {s}"


def test_heads_read_h_t_only(base):
    d = randomized(Hydra(base, num_heads=2))
    ids, feats = data(base)
    ref = d.forward_train(feats, ids).logits
    h = feats.hidden[LAST].clone()
    h[:, 4] += 1.0
    out = d.forward_train(Features(hidden={LAST: h}, logits=feats.logits), ids).logits
    moved = (out - ref).abs().amax(dim=(0, 2, 3)) > 1e-9  # [T]
    assert moved.tolist() == [t == 4 for t in range(T)]


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_parameter_count_and_no_shared_modules(base, own_lm_head):
    k_max, layers = 3, 2
    d = Hydra(base, num_heads=k_max, num_layers=layers, own_lm_head=own_lm_head)
    h, v = base.hidden_size, base.vocab_size
    # head k: embedding norm (H) + in_proj ((k+1)H -> H, bias) + `layers` ResBlocks (H -> H, bias);
    # own projections H x V each
    expected = sum(h + (k + 1) * h * h + h + layers * (h * h + h) for k in range(1, k_max + 1))
    expected += k_max * h * v if own_lm_head else 0
    assert sum(p.numel() for p in d.parameters()) == expected
    # A module reused by list multiplication would appear once in parameters() but many times here.
    all_params = list(d.named_parameters(remove_duplicate=False))
    assert len({p.data_ptr() for _, p in all_params}) == len(all_params)


def test_state_dict_holds_no_base_weights(base):
    d = Hydra(base, num_heads=2, own_lm_head=True)
    sd = d.state_dict()
    assert all(k.startswith(("heads.", "lm_heads.")) for k in sd)
    base_ptrs = {p.data_ptr() for p in base.model.parameters()}
    assert not base_ptrs & {t.data_ptr() for t in sd.values()}
    assert all(p.requires_grad for p in d.parameters())


def test_sampling_matches_training_along_a_tree(base):
    """observe + expand over a small tree gives, for every node, the training logits of the sequence that
    runs through that node: head d+1 on h_t and the node's path (root first)."""
    k_max = 3
    d = randomized(Hydra(base, num_heads=k_max))
    ids, feats = data(base)
    t = 4  # newest committed position; the root is x_{t+1}
    state = d.init_state(2, 64)
    h = feats.hidden[LAST][:, : t + 1]
    d.observe(state, None, Features(hidden={LAST: h}, logits=feats.logits[:, : t + 1]), ids[:, : t + 1],
              torch.tensor([t + 1, t + 1]), ids[:, t + 1])
    # Tree: root -> {a = x_{t+2}, b = other}; a -> {x_{t+3}}, b -> {c}. Node indices in registration order.
    other = (ids[:, t + 2] + 5) % base.vocab_size
    c = (ids[:, t + 3] + 11) % base.vocab_size
    got = [d.expand(state, HOST, ids[:, t + 1 : t + 2], torch.tensor([-1]), 0, torch.tensor([0]))]
    got.append(d.expand(state, HOST, torch.stack([ids[:, t + 2], other], 1), torch.tensor([0, 0]), 1,
                        torch.tensor([1, 2])))
    got.append(d.expand(state, HOST, torch.stack([ids[:, t + 3], c], 1), torch.tensor([1, 2]), 2,
                        torch.tensor([3, 4])))

    def train_logits(seq: torch.Tensor) -> torch.Tensor:  # [B, T, K, V] with base features fixed
        return d.forward_train(feats, seq).logits

    main = train_logits(ids)
    alt = ids.clone()
    alt[:, t + 2], alt[:, t + 3] = other, c
    branch = train_logits(alt)
    torch.testing.assert_close(got[0][:, 0], main[:, t, 0])
    torch.testing.assert_close(got[1][:, 0], main[:, t, 1])
    torch.testing.assert_close(got[1][:, 1], branch[:, t, 1])
    torch.testing.assert_close(got[2][:, 0], main[:, t, 2])
    torch.testing.assert_close(got[2][:, 1], branch[:, t, 2])
    with pytest.raises(ValueError):
        d.expand(state, HOST, ids[:, :1], torch.tensor([3]), k_max, torch.tensor([5]))


def test_explicit_node_indices_with_unexpanded_leaves(base):
    """The sampler numbers every node of the tree, leaves included: with `nodes` given, a parent is looked up by
    its own index even when indices in between were never expanded."""
    d = randomized(Hydra(base, num_heads=3))
    ids, feats = data(base)
    t = 4
    state = d.init_state(2, 64)
    d.observe(state, None, Features(hidden={LAST: feats.hidden[LAST][:, : t + 1]}, logits=feats.logits),
              ids[:, : t + 1], torch.tensor([t + 1, t + 1]), ids[:, t + 1])
    other = (ids[:, t + 2] + 5) % base.vocab_size
    d.expand(state, HOST, ids[:, t + 1 : t + 2], torch.tensor([-1]), 0, nodes=torch.tensor([0]))
    # nodes 1 (leaf, never expanded) and 2 = other, 3 = x_{t+2} under the root; expand only 3 and 2, then 5 under 2.
    d.expand(state, HOST, torch.stack([ids[:, t + 2], other], 1), torch.tensor([0, 0]), 1, nodes=torch.tensor([3, 2]))
    got = d.expand(state, HOST, ids[:, t + 3 : t + 4], torch.tensor([2]), 2, nodes=torch.tensor([5]))
    alt = ids.clone()
    alt[:, t + 2] = other
    torch.testing.assert_close(got[:, 0], d.forward_train(feats, alt).logits[:, t, 2])
    with pytest.raises(IndexError):  # node 7 was never expanded: no silent zero path
        d.expand(state, HOST, ids[:, :1], torch.tensor([7]), 2, torch.tensor([8]))


# -- through the sampler's public `generate` ----------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41]]


def self_distilled(base, drafter: Hydra, steps: int = 60) -> Hydra:
    """A few Adam steps on the base's own greedy continuations, so drafts get accepted (partial, ragged)."""
    ref = generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=40, eos_token_id=[]), engine=auto_engine())
    ids = torch.tensor([p[-2:] + t for p, t in zip(PROMPTS, ref.tokens.tolist())])  # [3, 42]
    feats = base.features(ids)
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


@pytest.fixture(scope="module")
def trained(base):
    torch.manual_seed(0)
    return self_distilled(base, Hydra(base, num_heads=4))


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
    """Every chain drafted inside `generate` (ragged batch, partial acceptance) gets at depth d head d+1's
    training logits for the sequence committed prefix + root + the drafted tokens."""
    calls = []
    max_new = 24

    class Recording(Hydra):
        def observe(self, state, ctx, feats, tokens, n_new, next_token):
            for b in range(tokens.shape[0]):
                self.committed[b] += tokens[b, : int(n_new[b])].tolist()
            self.paths = [[int(r)] for r in next_token]
            super().observe(state, ctx, feats, tokens, n_new, next_token)

        def expand(self, state, ctx, tokens, parents, depth, nodes):
            logits = super().expand(state, ctx, tokens, parents, depth, nodes)
            for b in range(tokens.shape[0]):
                if depth:
                    self.paths[b].append(int(tokens[b, 0]))
                if len(self.committed[b]) - len(PROMPTS[b]) < max_new:  # finished rows keep drafting, unused
                    calls.append((list(self.committed[b]), list(self.paths[b]), logits[b, 0]))
            return logits

    rec = Recording(base, **trained.hparams)
    rec.load_state_dict(trained.state_dict())
    rec.committed = [[] for _ in PROMPTS]
    generate(base, PROMPTS, rec, SamplerConfig(max_new_tokens=max_new, eos_token_id=[], tree="chain", gamma=3),
             engine=auto_engine())
    assert len(calls) > 20
    for committed, path, logits in calls:
        ids = torch.tensor([committed + path + [0] * 3])  # padded: head k reads k tokens past t
        expected = rec.forward_train(base.features(ids), ids).logits
        torch.testing.assert_close(logits, expected[0, len(committed) - 1, len(path) - 1])


@pytest.mark.slow
def test_on_smollm2():
    from specdec.base import load_base

    real = load_base(device="cpu")
    enc = real.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                             add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([enc["input_ids"]])
    feats = real.features(ids)
    d = Hydra(real, num_heads=3)
    logits = d.forward_train(feats, ids).logits  # [1, T, 3, V]
    torch.testing.assert_close(logits, feats.logits[:, :, None].expand_as(logits))  # fresh = the base's head
    cfg = SamplerConfig(max_new_tokens=12, tree="chain", gamma=3)
    assert torch.equal(generate(real, ids.tolist(), d, cfg, engine=auto_engine()).tokens, generate(real, ids.tolist(), None, cfg, engine=auto_engine()).tokens)
