"""The decode loop on tiny bases: greedy identity, rollback, batching, stopping, determinism (docs/sampler.md §6.5-9)."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from specdec.base import tiny_base
from specdec.drafters.drafter import Drafter
from specdec.sampling.decode import SamplerConfig, generate
from specdec.sampling.metrics import prompt_metrics

from conftest import auto_engine
from sampling_stubs import Oracle

NEW = 12
TREE = [[0, 0, 0], [0, 1], [1], [1, 0], [2]]


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 9, 3)]


def reference(base, prompts, new=NEW):
    """Plain greedy decoding without any cache (on the base's device)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=base.device)
        for _ in range(new):
            ids = torch.cat([ids, base(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        out.append(ids[0, len(p):].tolist())
    return out


def cfg(**kw):
    return SamplerConfig(max_new_tokens=NEW, eos_token_id=[], **kw)


def test_plain_decoding_matches_no_cache_greedy(base, prompts):
    r = generate(base, prompts, None, cfg(), engine=auto_engine())
    assert r.tokens.tolist() == reference(base, prompts)
    assert all(a == [0] * (NEW - 1) for a in r.accepted)  # AR: one token per round after the prefill's


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("right_for", [0, 1, 3, 100])  # none / partial / all accepted
def test_chain_greedy_identity_and_accept_counts(base, prompts, gamma, right_for):
    r = generate(base, prompts, Oracle(base, right_for), cfg(gamma=gamma), engine=auto_engine())
    assert r.tokens.tolist() == reference(base, prompts)
    for row in r.accepted:  # every round accepts exactly min(k, γ); the last may be cut by the budget
        assert row[:-1] == [min(right_for, gamma)] * (len(row) - 1)
        assert row[-1] == min(right_for, gamma)


@pytest.mark.parametrize("kw", [dict(tree="static", paths=TREE),
                                dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)])
@pytest.mark.parametrize("right_for", [0, 2, 100])
def test_tree_greedy_identity(base, prompts, kw, right_for):
    r = generate(base, prompts, Oracle(base, right_for), cfg(**kw), engine=auto_engine())
    assert r.tokens.tolist() == reference(base, prompts)
    assert max(max(a) for a in r.accepted) == min(right_for, 3)


# yaml defaults sized for SmolLM2 that the 2-layer tiny base cannot take
TINY_OVERRIDES = {"early_exit": {"exit_layers": [1], "num_extra_layers": 1}, "draft_model": {"num_layers": 1},
                  "layer_skip": {"skip_layers": [1]}}


def drafter_configs():
    return sorted(Path(__file__).resolve().parents[2].glob("configs/drafter/*.yaml"))


def perturb(drafter: torch.nn.Module) -> None:
    """An untrained drafter accepts nothing: perturb it so some drafts are right."""
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def family_drafter(base, path: Path) -> Drafter:
    """The family of configs/drafter/<path> sized for the tiny base, on its device, perturbed, in eval mode."""
    node = OmegaConf.merge(OmegaConf.load(path), TINY_OVERRIDES.get(path.stem, {}))
    drafter = hydra.utils.instantiate(node)(base=base).to(base.device)
    perturb(drafter)
    return drafter.eval()


def accepting_drafter(base, prompts, path: Path, steps: int = 40) -> Drafter:
    """The family of configs/drafter/<path> sized for the tiny base, fitted by Adam to the base's own greedy choices
    over `prompts` and the first half of their greedy continuations, in eval mode: its drafts get accepted early in a
    decode and rejected later. A family with nothing to train (layer skip) skips no layer: it is the base itself."""
    node = OmegaConf.merge(OmegaConf.load(path), TINY_OVERRIDES.get(path.stem, {}))
    if path.stem == "layer_skip":
        node.skip_layers = []
    torch.manual_seed(0)
    drafter = hydra.utils.instantiate(node)(base=base).to(base.device)
    rows = [torch.tensor([p + t[: NEW // 2]], device=base.device) for p, t in zip(prompts, reference(base, prompts))]
    feats = [base.features(x, layers=drafter.feature_layers) for x in rows]
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2) if params else None
    for _ in range(steps if params else 0):
        loss = 0
        for x, f in zip(rows, feats):
            logits = drafter.forward_train(f, x).logits[0]  # [T, K, V_d]
            target = f.logits[0].argmax(-1)  # [T]: the base's token after each position
            if drafter.draft_vocab is not None:
                target = drafter.draft_vocab.from_base(target)
            for j, o in enumerate(drafter.target_offsets):  # entry j at t drafts the token after t + o
                loss = loss + torch.nn.functional.cross_entropy(logits[: x.shape[1] - o, j], target[o:],
                                                                ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def assert_family_lossless(base, prompts, drafter: Drafter, *more: dict, engine=None) -> list:
    """Greedy decoding with the drafter as a chain and as a static tree (and with each of `more` sampler settings)
    gives plain greedy decoding's tokens, on `engine` (None: the one evaluate.py runs on a CPU). Returns the runs."""
    depth = min(3, drafter.max_depth or 3)
    ref = reference(base, prompts)
    engine = engine or auto_engine()
    runs = []
    for kw in (dict(gamma=depth), dict(tree="static", paths=[p[:depth] for p in TREE]), *more):
        runs.append(generate(base, prompts, drafter, cfg(**kw), engine=engine))
        assert runs[-1].tokens.tolist() == ref
    return runs


@pytest.mark.parametrize("path", drafter_configs(), ids=lambda p: p.stem)
def test_every_drafter_family_is_greedy_lossless(base, prompts, path):
    """With drafts that get accepted, so that a round's accepted tokens and the drafter's state after them are
    exercised, not only rejections: a family whose drafts are garbage fails the count."""
    drafter = accepting_drafter(base, prompts, path)
    assert isinstance(drafter, Drafter)
    chain, tree = assert_family_lossless(base, prompts, drafter)
    # a garbage draft is right about once in 259 (of the 20-230 drafted per run here: 0-2 accepted); fitted ones
    # get 8-27 accepted
    for run in (chain, tree):
        assert sum(map(sum, run.accepted)) >= 5
    if path.stem == "layer_skip":  # skipping no layer is the base: every chain draft is accepted
        assert chain.accepted == chain.drafted


@pytest.mark.parametrize("fan", [1, 2])
@pytest.mark.parametrize("path", [None, *drafter_configs()], ids=lambda p: "oracle" if p is None else p.stem)
def test_greedy_chains_draft_as_the_tree_path_does(base, prompts, path, fan, monkeypatch):
    """A chain at T = 0 is drafted column by column (trees._greedy_chain) instead of through the tree's gathers and
    scatters: the same drafts, so the same accepted counts, for every family (state read from parents, layers run;
    the prophet's and Hydra's whole chain in one native call, `Drafter.greedy_chain`) and for an oracle right for two tokens a round (so that
    drafts are accepted); so is a chain that fans out at its end (its last depth's top 2)."""
    import dataclasses

    from specdec.sampling import trees

    drafter = Oracle(base, 2) if path is None else family_drafter(base, path)
    depth = min(3, drafter.max_depth or 3)
    paths = [[0] * (depth - 1) + [k] for k in range(fan)]
    assert trees.static_tree(tuple(map(tuple, paths))).fan == fan
    assert trees.static_tree(((0,), (1,), (0, 0))).fan == trees.static_tree(((1, 0),)).fan == 0
    kw = dict(gamma=depth) if fan == 1 else dict(tree="static", paths=paths)
    chained = generate(base, prompts, drafter, cfg(**kw), engine=auto_engine())
    tree_path = trees.static_tree
    monkeypatch.setattr(trees, "static_tree", lambda paths: dataclasses.replace(tree_path(paths), fan=0))
    gathered = generate(base, prompts, drafter, cfg(**kw), engine=auto_engine())
    assert chained.tokens.tolist() == gathered.tokens.tolist() == reference(base, prompts)
    assert chained.accepted == gathered.accepted and chained.drafted == gathered.drafted
    if path is None:
        assert all(row[:-1] == [2] * (len(row) - 1) for row in chained.accepted)


@pytest.mark.parametrize("kw", [dict(gamma=4), dict(tree="static", paths=TREE)])
def test_kv_rollback_matches_fresh_forward(base, prompts, kw):
    """After rejections, the base's cached verify logits of every committed position equal a no-cache forward
    over the accepted text: stale draft slots never leak into attention."""
    oracle = Oracle(base, right_for=2)  # (it reads the verify's logits: the engine computes them, no shortlist)
    r = generate(base, prompts, oracle, cfg(**kw), engine=auto_engine(greedy_shortlist=False))
    for b, p in enumerate(prompts):
        text = torch.tensor([p + r.tokens[b].tolist()])
        fresh = base(text)[0]  # [T, V]
        at = len(p)  # position of the first round's root
        for logits, n_new in zip(oracle.seen_logits[1:], oracle.seen_n_new[1:]):
            k = int(n_new[b])
            if at + k > text.shape[1]:
                break
            torch.testing.assert_close(logits[b, :k], fresh[at : at + k], atol=1e-4, rtol=1e-4)
            at += k


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch_rows_equal_single_rows(base, prompts, temperature):
    def gens():
        return [torch.Generator().manual_seed(100 + b) for b in range(len(prompts))]

    c = cfg(gamma=3, temperature=temperature)
    batch = generate(base, prompts, Oracle(base, right_for=2), c, gens(), engine=auto_engine())
    g = gens()
    for b, p in enumerate(prompts):
        single = generate(base, [p], Oracle(base, right_for=2), c, [g[b]], engine=auto_engine())
        assert batch.tokens[b].tolist() == single.tokens[0].tolist()
        assert batch.accepted[b] == single.accepted[0]


def test_ragged_acceptance_in_one_batch(base, prompts):
    """Rows accept different counts in the same round and still match plain decoding, and each row alone."""
    rows = [0, 2, 4]
    r = generate(base, prompts, Oracle(base, right_for=rows), cfg(gamma=4), engine=auto_engine())
    assert r.tokens.tolist() == reference(base, prompts)
    assert [a[0] for a in r.accepted] == rows
    for b, p in enumerate(prompts):
        assert generate(base, [p], Oracle(base, rows[b]), cfg(gamma=4),
                        engine=auto_engine()).accepted[0] == r.accepted[b]


def test_eos_and_max_new_tokens(base, prompts):
    ref = reference(base, prompts, new=NEW)
    eos = ref[1][4]  # a token row 1 emits at step 5
    for drafter, kw in [(None, {}), (Oracle(base), dict(gamma=4)), (Oracle(base, 1), dict(tree="static", paths=TREE))]:
        r = generate(base, prompts, drafter, SamplerConfig(max_new_tokens=NEW, eos_token_id=eos, **kw),
                     engine=auto_engine())
        for b, row in enumerate(r.tokens.tolist()):
            stop = ref[b].index(eos) + 1 if eos in ref[b] else NEW
            assert row[:stop] == ref[b][:stop] and row[stop:] == [-1] * (NEW - stop)
            assert r.num_generated[b] == stop
        assert r.num_generated[1] == ref[1].index(eos) + 1 <= 5
    for new in (1, 2, 5):  # never past max_new_tokens, even when a round accepts more than the room left
        r = generate(base, prompts, Oracle(base), SamplerConfig(max_new_tokens=new, eos_token_id=[], gamma=4),
                     engine=auto_engine())
        assert r.tokens.shape == (3, new) and r.num_generated == [new] * 3


def test_seeded_determinism(base, prompts):
    c = cfg(tree="static", paths=TREE, temperature=0.8, top_k=20, top_p=0.9)
    runs = [generate(base, prompts, Oracle(base, 1), c, torch.Generator().manual_seed(7),
                     engine=auto_engine()) for _ in range(2)]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist()
    other = generate(base, prompts, Oracle(base, 1), c, torch.Generator().manual_seed(8), engine=auto_engine())
    assert other.tokens.tolist() != runs[0].tokens.tolist()


def test_metrics_from_a_run(base, prompts):
    r = generate(base, prompts, Oracle(base, right_for=2), cfg(gamma=4), engine=auto_engine())
    prompts_m = [prompt_metrics(r.accepted[b], r.drafted[b], r.num_generated[b], r.total_s, r.decode_s)
                 for b in range(len(prompts))]
    accepted = [a for row in r.accepted for a in row]
    assert r.lossless and len(prompts_m) == 3
    assert (sum(accepted) + len(accepted)) / len(accepted) == pytest.approx(3.0, abs=0.5)  # 2 + bonus, the last cut short
    p = prompts_m[0]
    assert p["tau"] == pytest.approx(1 + sum(p["r"]))  # τ = 1 + Σ r_i
    assert p["alpha_i"][:2] == [1.0, 1.0] and p["accept_hist"].keys() <= {1, 2}
    assert len(r.step_verify_s) == len(r.step_draft_s) == len(r.step_overhead_s) > 0
    # the phases tile the rounds (cost.PhaseClock's marks): every one non-negative, together within the decode's time
    phases = [*r.step_draft_s, *r.step_verify_s, *r.step_overhead_s]
    assert min(phases) >= 0 and 0 < sum(phases) <= r.decode_s


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_finished_rows_leave_the_batch(base, temperature):
    """Plain decoding drops finished rows from the batch; the rows that go on are unchanged (each equals itself
    alone, with one generator per row), whichever rows finish first."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (4, 7, 2, 5, 6, 3, 8, 5)]
    c = SamplerConfig(max_new_tokens=16, eos_token_id=[], temperature=temperature)
    free = [generate(base, [p], None, c, [torch.Generator().manual_seed(b)], engine=auto_engine()).tokens[0].tolist()
            for b, p in enumerate(prompts)]
    eos = sorted({row[k] for k, row in zip((1, 3, 5, 9), free)})  # tokens that end some rows early
    c = SamplerConfig(max_new_tokens=16, eos_token_id=eos, temperature=temperature)
    batch = generate(base, prompts, None, c, [torch.Generator().manual_seed(b) for b in range(len(prompts))],
                     engine=auto_engine())
    lengths = set(batch.num_generated)
    assert len(lengths) > 2  # rows really ended at different rounds
    for b, p in enumerate(prompts):
        alone = generate(base, [p], None, c, [torch.Generator().manual_seed(b)], engine=auto_engine())
        assert batch.tokens[b].tolist() == alone.tokens[0].tolist()


@pytest.mark.parametrize("cost, most", [(lambda rows: 1.0, 6),  # flat: every node up to the budget
                                        (lambda rows: 1.0 if rows <= 9 else 5.0, 2)])  # a step past 9 rows
def test_dynamic_tree_sized_by_the_verify_cost(base, prompts, monkeypatch, cost, most):
    import specdec.sampling.decode as decode

    # v by the rows a verify multiplies: the batch's 3 rows verify 3 tokens each within the step's 9 rows
    monkeypatch.setattr(decode, "verify_costs",
                        lambda base, n_max, *a, **k: [0.0] + [cost(r) for r in range(1, n_max + 1)])
    kw = dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6, dynamic_by_cost=True)
    r = generate(base, prompts, Oracle(base), cfg(**kw), engine=auto_engine())
    assert r.tokens.tolist() == reference(base, prompts)  # lossless whatever the size
    # the Oracle is confident in its top path only: a flat curve still verifies every node, a step keeps the best 2
    assert {n for row in r.drafted for n in row} == {most}


class SecondBest(Oracle):
    """The Oracle's drafts with its top two swapped: the base's greedy token is the second-ranked child."""

    def expand(self, state, ctx, tokens, parents, depth, nodes):
        logits = super().expand(state, ctx, tokens, parents, depth, nodes)  # [B, F, V] the right token ~10 above
        best = logits.argmax(-1, keepdim=True)
        return logits.scatter(-1, (best + 1) % logits.shape[-1], logits.gather(-1, best) + 1)


def test_a_tree_moves_only_paths_that_are_not_in_place(base, monkeypatch):
    """A round that accepts the root's first child leaves its path where the verify wrote it (no move); one that
    accepts the second child moves it (the KV of node 2 to slot 1); both decode the base's greedy tokens."""
    from specdec.sampling.context import SamplingContext

    moves = []
    run = SamplingContext.move_path
    monkeypatch.setattr(SamplingContext, "move_path", lambda self, *a: moves.append(1) or run(self, *a))
    prompts = [[5, 6, 7, 8, 9]]
    siblings = SamplerConfig(max_new_tokens=NEW, eos_token_id=[], tree="static", paths=[[0], [1]])
    for drafter, moved in ((Oracle(base), False), (SecondBest(base), True)):
        moves.clear()
        r = generate(base, prompts, drafter, siblings, engine=auto_engine())
        assert r.tokens.tolist() == reference(base, prompts)
        assert all(a == 1 for a in r.accepted[0][:-1])  # a draft token accepted every round (but maybe the last)
        assert bool(moves) == moved and len(moves) in (0, len(r.accepted[0]), len(r.accepted[0]) - 1)


def test_rounds_know_when_they_are_chains():
    """A chain's round says so (the sampler then moves nothing of its accepted path)."""
    from specdec.sampling.lookup import lookup_round
    from specdec.sampling.trees import Round, chain_paths, static_tree

    def round_of(paths):
        t = static_tree(paths)
        return Round(torch.zeros(1, t.parents.numel(), dtype=torch.long), t.parents, t.depth, t.ancestors, t.depth)

    assert round_of(tuple(chain_paths(3))).is_chain()
    assert not round_of(((0,), (1,), (0, 0))).is_chain()
    assert lookup_round(torch.tensor([5]), [[1, 2]]).is_chain()
