"""CUDA graphs (specdec/engines/cuda/graphs.py): the static forward a graph records gives the eager forward's numbers, and
decoding through it is greedy-identical for every drafter family, chains and trees, ragged batches; pools are reused
by later decodes and never shared by two live ones; what can't be recorded runs eagerly. On the CPU nothing is
recorded and the static forward runs eagerly: that is what these tests check. tests/test_cuda.py records and replays
on a GPU."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from specdec.base import tiny_base
from specdec.engines.config import EngineConfig
from specdec.engines.cuda import draft_graph, graphs
from specdec.engines.cuda.engine import CudaEngine
from specdec.sampling import decode
from specdec.sampling.context import SamplingContext
from specdec.sampling.rotary import RotaryTable

from conftest import prefill_and_verify
from sampling_stubs import Oracle
from test_sampling_decode import TREE, assert_family_lossless, cfg, drafter_configs, family_drafter, prompts, reference  # noqa: F401


@pytest.fixture
def base():
    return tiny_base()  # its own: the pools of a base live as long as it does


@pytest.fixture
def graphs_on():
    """The CUDA engine on the CPU: decodes take the graph path (the static forward, run eagerly)."""
    return CudaEngine()


def recorded(base) -> dict[str, int]:
    """store -> graphs made in the base's pools."""
    out: dict[str, int] = {}
    for pool in graphs.pools(base):
        if pool.graphs:
            out[pool.store] = out.get(pool.store, 0) + len(pool.graphs)
    return out


@pytest.mark.parametrize("tree", [False, True])
def test_static_forward_gives_the_eager_numbers(base, tree):
    prompt = list(range(3, 20))
    with torch.no_grad():
        want, want_feats = prefill_and_verify(base, prompt, tree)
        got, feats = prefill_and_verify(base, prompt, tree, graphs=True)
    assert recorded(base) == {"base": 1}  # the verify (the prefill ran eagerly)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in want_feats:
        torch.testing.assert_close(feats[layer], want_feats[layer], rtol=1e-5, atol=1e-5)


def test_plain_decoding_is_greedy_identical(base, prompts, graphs_on):
    ref = reference(base, prompts)
    assert decode.generate(base, prompts[:1], None, cfg(), engine=graphs_on).tokens.tolist() == ref[:1]
    assert recorded(base) == {"base": 1}  # every step after the prefill: one token
    # a ragged batch: rows leave it as they finish, and the rest decode eagerly
    assert decode.generate(base, prompts, None, cfg(), engine=graphs_on).tokens.tolist() == ref


@pytest.mark.parametrize("kw", [dict(gamma=4), dict(tree="static", paths=TREE),
                                dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)])
@pytest.mark.parametrize("right_for", [0, 2, 100])
def test_chains_and_trees_are_greedy_identical(base, prompts, graphs_on, kw, right_for):
    got = decode.generate(base, prompts, Oracle(base, right_for), cfg(**kw), engine=graphs_on).tokens.tolist()
    assert got == reference(base, prompts)
    assert recorded(base)["base"] >= 1


@pytest.mark.parametrize("path", drafter_configs(), ids=lambda p: p.stem)
def test_every_drafter_family_is_greedy_identical(base, prompts, graphs_on, path):
    """Drafters' own layers (prophet's blocks, an early exit's base layers and head) run through graphs too."""
    assert_family_lossless(base, prompts, family_drafter(base, path), engine=graphs_on)
    assert recorded(base)["base"] >= 1


@pytest.mark.parametrize("path", drafter_configs(), ids=lambda p: p.stem)
def test_whole_drafts_replay_the_eager_drafts(base, prompts, graphs_on, path):
    """A family that declares graph_draft drafts its greedy chains and static trees through draft_graph (recorded
    once per tree, replayed by a later decode); the drafts are the eager ones: every round accepts as many tokens.
    (Greedy identity alone would not show it: a wrong draft is rejected, and the tokens stay right.)"""
    drafter = family_drafter(base, path)
    depth = min(3, drafter.max_depth or 3)
    ref = reference(base, prompts)
    for kw in (dict(gamma=depth), dict(tree="static", paths=[p[:depth] for p in TREE]), dict(gamma=depth)):
        whole = decode.generate(base, prompts, drafter, cfg(**kw), engine=graphs_on)
        eager = decode.generate(base, prompts, drafter, cfg(**kw),
                                engine=CudaEngine(EngineConfig(cuda_graph_draft=False)))
        assert whole.tokens.tolist() == eager.tokens.tolist() == ref
        assert whole.accepted == eager.accepted
    assert len(draft_graph.recorded(drafter)) == (2 if drafter.graph_draft else 0)  # the chain's, the tree's


def test_sampled_and_adaptive_drafts_run_eagerly(base, prompts, graphs_on):
    drafter = family_drafter(base, next(p for p in drafter_configs() if p.stem == "prophet"))
    decode.generate(base, prompts, drafter, cfg(gamma=3, temperature=1.0), torch.Generator().manual_seed(0),
                    engine=graphs_on)
    decode.generate(base, prompts, drafter, cfg(gamma=3, adaptive_threshold=0.5), engine=graphs_on)
    decode.generate(base, prompts, drafter, cfg(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6),
                    engine=graphs_on)
    assert draft_graph.recorded(drafter) == []


def decode_step(ctx: SamplingContext) -> None:
    """A prefill of 3 tokens, then one decode step (the forward a graph records)."""
    ctx.commit_layout(3)
    ctx.base_forward(torch.tensor([[5, 6, 7]] * len(ctx.length_host)))
    ctx.commit(torch.full((len(ctx.length_host),), 3), [3] * len(ctx.length_host))
    ctx.commit_layout(1)
    ctx.base_forward(torch.tensor([[8]] * len(ctx.length_host)))


def test_pools_are_reused_and_never_shared(base):
    with torch.no_grad():
        first, second = SamplingContext(base, 1, 40, CudaEngine()), SamplingContext(base, 1, 40, CudaEngine())
        decode_step(first)
        decode_step(second)
        assert first.pools["base"] is not second.pools["base"]  # both alive: each its own buffers
        pool = first.pools["base"]
        del first
        gc.collect()
        third = SamplingContext(base, 1, 100, CudaEngine())  # another length in the same slot bucket
        decode_step(third)
        assert third.pools["base"] is pool and len(pool.graphs) == 1  # recorded once, replayed by later decodes
        batch = SamplingContext(base, 2, 40, CudaEngine())
        decode_step(batch)
        assert batch.pools["base"] not in (pool, second.pools["base"])  # another batch size: other buffers


def test_prefills_run_eagerly(base):
    with torch.no_grad():
        ctx = SamplingContext(base, 1, 200, CudaEngine())
        n = graphs.MAX_QUERIES + 1
        ctx.commit_layout(n)
        ctx.base_forward(torch.randint(3, 250, (1, n)))
    assert recorded(base) == {}


def test_without_an_exact_rotary_table_decoding_runs_eagerly(base, prompts, graphs_on, monkeypatch):
    monkeypatch.setattr(RotaryTable, "_agrees", lambda self, like: False)
    r = decode.generate(base, prompts, Oracle(base, 2), cfg(gamma=3), engine=graphs_on)
    assert r.tokens.tolist() == reference(base, prompts)
    assert recorded(base) == {}


def test_off_means_off(base, prompts, graphs_on):
    decode.generate(base, prompts, Oracle(base, 2), cfg(gamma=3), engine=CudaEngine(EngineConfig(cuda_graphs=False)))
    assert recorded(base) == {}


def test_pools_go_with_their_base(prompts, graphs_on):
    base = tiny_base()
    decode.generate(base, prompts[:1], None, cfg(), engine=graphs_on)
    model = weakref.ref(base.model)
    assert graphs.pools(base)
    del base
    gc.collect()
    assert model() is None  # the pools (and their buffers) held no reference to the model


def test_greedy_verifies_record_the_argmax(base, prompts, graphs_on):
    """At T = 0 the verify's graph ends with the lm_head and `checked_argmax` (the host reads [B, n] ids); sampling
    and a drafter that reads the base's logits take the logits as before."""
    def heads(n: int) -> set:  # the heads recorded in the base's verifies of n tokens
        return {key[6] for pool in graphs.pools(base) for key in pool.graphs if key[3] == n}

    decode.generate(base, prompts[:1], None, cfg(), engine=graphs_on)
    assert heads(1) == {base.lm_head}
    decode.generate(base, prompts[:1], None, cfg(temperature=1.0), torch.Generator().manual_seed(0), engine=graphs_on)
    assert heads(1) == {base.lm_head, None}
    r = decode.generate(base, prompts[:1], Oracle(base, 2), cfg(gamma=3),
                        engine=graphs_on)  # (the Oracle reads the verify's logits)
    assert heads(4) == {None} and r.tokens.tolist() == reference(base, prompts[:1])


def test_a_changed_layout_is_copied_in(base):
    """A graph skips copying its layout when a call passes the very tensors it copied last; a call with another layout
    of as many queries (a chain, then a tree, then the chain again) gets its own: each verify as the eager one."""
    chain = (torch.arange(4), torch.arange(4), torch.ones(4, 4, dtype=torch.bool).tril())
    tree = (torch.arange(4), torch.tensor([0, 1, 1, 2]),
            torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))
    tokens = torch.tensor([[7, 8, 9, 10]])

    def verifies(graphed: bool) -> list[torch.Tensor]:
        ctx = SamplingContext(base, 1, 64, CudaEngine(EngineConfig(cuda_graphs=graphed)))
        ctx.commit_layout(12)
        ctx.base_forward(torch.arange(3, 15)[None])
        ctx.commit(torch.tensor([12]), [12])
        out = []
        for layout in (chain, chain, tree, tree, chain):
            ctx.tree_layout(*layout)
            out.append(ctx.verify_forward(tokens, feature_layers=(-1,))[1][-1])
        return out

    with torch.no_grad():
        want, got = verifies(False), verifies(True)
    assert recorded(base) == {"base": 1}  # one graph, three layouts through it
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want[0], want[2])  # the tree's verify is not the chain's
