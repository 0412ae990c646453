"""Acceptance rules in exact arithmetic (docs/sampler.md §6.1, §6.2, §6.4) and the small pieces around them."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from specdec.sampling import verify
from specdec.sampling.trees import static_tree

V, GAMMA, T = 3, 2, 3  # vocabulary, draft length, emitted tokens compared


def rand_dist(*key, v=V, sharp=1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(key) % (2**31))
    return (torch.randn(v, generator=g, dtype=torch.float64) * sharp).softmax(-1)


@pytest.mark.parametrize("case", ["random", "disjoint", "equal", "one_hot", "q_one_hot"])
def test_identity(case):
    """q·min(1, p/q) + (1 − Σ min(p, q))·norm(max(0, p − q)) = p exactly, in float64."""
    v = 7
    p, q = rand_dist("p", case, v=v), rand_dist("q", case, v=v)
    if case == "disjoint":
        p, q = torch.cat([p[:3], torch.zeros(4, dtype=p.dtype)]), torch.cat([torch.zeros(3, dtype=p.dtype), q[3:]])
        p, q = p / p.sum(), q / q.sum()
    elif case == "equal":
        q = p.clone()
    elif case == "one_hot":
        p = torch.nn.functional.one_hot(torch.tensor(2), v).double()
    elif case == "q_one_hot":
        q = torch.nn.functional.one_hot(torch.tensor(5), v).double()
    x = torch.arange(v)
    accept = torch.where(q > 0, verify.accept_probability(p.expand(v, v), q.expand(v, v), x), 0.0)
    total = q * accept + (1 - torch.minimum(p, q).sum()) * verify.residual(p[None], q[None])[0]
    torch.testing.assert_close(total, p, atol=1e-15, rtol=0)


def base_p(ctx: tuple) -> torch.Tensor:
    return rand_dist("base", ctx)


def draft_q(ctx: tuple) -> torch.Tensor:
    return rand_dist("draft", ctx, sharp=2.5)


def drafts(ctx: tuple, bug: str | None):
    """Every chain of GAMMA drafts with its probability and the q each draft reports."""
    for d in itertools.product(range(V), repeat=GAMMA):
        prob, qs = 1.0, []
        for i in range(GAMMA):
            q = draft_q(ctx + d[:i])
            if bug == "greedy_with_q":  # the draft takes argmax but reports its full q (HF #32867)
                prob *= float(d[i] == int(q.argmax()))
            else:
                prob *= float(q[d[i]])
            qs.append(q)
        if prob > 0:
            yield d, prob, qs


def speculative_law(ctx: tuple, n: int, bug: str | None = None) -> dict[tuple, float]:
    """Exact law of the next n emitted tokens, enumerating every draft and every acceptance event."""
    if n <= 0:
        return {(): 1.0}
    law: dict[tuple, float] = defaultdict(float)
    for d, prob, qs in drafts(ctx, bug):
        reach = prob  # probability of drafting d and accepting its first k tokens
        for k in range(GAMMA + 1):
            p = base_p(ctx + d[:k])
            if k == GAMMA:  # all accepted: bonus from p
                blocks = [(d + (y,), reach * float(p[y])) for y in range(V)]
            else:
                x = torch.tensor([d[k]])
                a = 1.0 if bug == "accept_all" else float(verify.accept_probability(p[None], qs[k][None], x))
                r = verify.residual(p[None], qs[k][None])[0]
                blocks = [(d[:k] + (y,), reach * (1 - a) * float(r[y])) for y in range(V)]
                reach *= a
            for block, w in blocks:
                if w == 0:
                    continue
                for rest, w2 in speculative_law(ctx + block, n - len(block), bug).items():
                    law[(block + rest)[:n]] += w * w2
            if k < GAMMA and reach == 0:
                break
    return law


def autoregressive_law(ctx: tuple, n: int) -> dict[tuple, float]:
    law = {}
    for seq in itertools.product(range(V), repeat=n):
        law[seq] = float(torch.prod(torch.stack([base_p(ctx + seq[:i])[seq[i]] for i in range(n)])))
    return law


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def test_exact_enumeration_equals_autoregressive_law():
    target = autoregressive_law((0,), T)
    law = speculative_law((0,), T)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert max_gap(law, target) < 1e-12


@pytest.mark.parametrize("bug", ["accept_all", "greedy_with_q"])
def test_exact_enumeration_catches_broken_samplers(bug):
    """Negative controls: the same enumeration must see the two classic bugs."""
    assert max_gap(speculative_law((0,), T, bug), autoregressive_law((0,), T)) > 1e-3


def test_process_logits_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(verify.process_logits(logits, 0.5), (logits / 0.5).softmax(-1))
    p = verify.process_logits(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and p[0, :2].sum() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    p = verify.process_logits(logits, 1.0, top_p=float(full[0]) + 1e-3)  # needs the top two tokens
    assert (p[0] > 0).tolist() == [True, True, False, False]


def test_top_p_found_among_the_top_k_equals_the_full_sort():
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.01, 0.1, 1.0, 3.0, 5.0, 8.0]).view(6, 1, 1)  # flat rows (the k cannot cover) to peaked
    z = torch.randn(6, 2, 500, generator=g) * scale
    for top_p in (0.5, 0.9, 0.95):
        sorted_p, order = z.softmax(-1).sort(-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        reference = drop.scatter(-1, order, drop)
        for k in (8, 64, 500):
            assert torch.equal(verify._outside_top_p(z, top_p, k), reference)


def test_sample_is_inverse_cdf():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(4, 4)
    assert verify.sample(probs, torch.tensor([0.0, 0.49, 0.5, 0.999])).tolist() == [1, 1, 3, 3]


def test_rejection_on_a_tree_with_point_masses():
    """Root with children a (rank 0) and b (rank 1): p puts all mass on b, so a is rejected (p(a) = 0), the
    residual is p itself and b is accepted with probability 1; the bonus comes from p at b."""
    p = torch.zeros(1, 3, 4)
    p[0, 0, 2] = 1.0  # at the root the base wants token 2
    p[0, 2, 3] = 1.0  # after b it wants 3
    p[0, 1] = 0.25
    tokens = torch.tensor([[0, 1, 2]])
    children = torch.tensor([[1, 2], [-1, -1], [-1, -1]])
    best, bonus = verify.rejection(p, tokens, children, None, 1, lambda: torch.rand(1))
    assert best.tolist() == [2] and bonus.tolist() == [3]


def greedy_targets(target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                   depth: torch.Tensor, present: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """T = 0: a node is right when it is the base's argmax after its parent. target [B, N] the base's argmax after each
    node, tokens [B, N], parents [N] (-1 root), ancestors [N, N] bool (ancestor-or-self), depth [N]; present [B, N]
    bool: the nodes each row proposes (None = all; a row's chain may end early with an adaptive draft length) ->
    the deepest accepted node [B] and the bonus token [B]: the rule in tensor ops, what verify.greedy_paths (the decode
    loop's, on host lists) is checked against."""
    ok = tokens == target[:, parents.clamp(min=0)]
    if present is not None:
        ok &= present
    ok[:, 0] = True
    best = verify._deepest(ok, ancestors, depth)
    return best, target.gather(1, best[:, None])[:, 0]


def test_greedy_and_typical_pick_the_deepest_accepted_node():
    parents = torch.tensor([-1, 0, 0, 1])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    logits = torch.full((1, 4, 5), -5.0)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 3, 4] = 5.0  # base: root -> 1 -> 3 -> 4
    tokens = torch.tensor([[0, 1, 2, 3]])
    assert [t.tolist() for t in greedy_targets(logits.argmax(-1), tokens, parents, anc, depth)] == [[3], [4]]
    p = verify.process_logits(logits, 1.0)
    best, bonus = verify.typical(p, tokens, parents, anc, depth, 0.3, 0.09, lambda: torch.zeros(1))
    assert best.tolist() == [3]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_on_host_lists_takes_the_same_path_as_the_tensor_rule(seed):
    """verify.greedy_paths (what a greedy round on the CPU decides by) against greedy_targets: random trees of up to
    13 nodes (parents before children), 3 rows, a vocabulary of 3 so that many drafts match, some rows ending early
    (present)."""
    g = torch.Generator().manual_seed(seed)
    n, b = int(torch.randint(1, 14, (1,), generator=g)), 3
    parents, depth = [-1], [0]
    for i in range(1, n):
        parents.append(int(torch.randint(0, i, (1,), generator=g)))
        depth.append(depth[parents[i]] + 1)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        anc[i] = anc[parents[i]] if i else anc[i]
        anc[i, i] = True
    tokens, target = torch.randint(0, 3, (b, n), generator=g), torch.randint(0, 3, (b, n), generator=g)
    limit = torch.randint(0, max(depth) + 1, (b,), generator=g)
    for present in (None, torch.tensor(depth)[None] <= limit[:, None]):
        best, bonus = greedy_targets(target, tokens, torch.tensor(parents), anc, torch.tensor(depth), present)
        paths = verify.greedy_paths(target.tolist(), tokens.tolist(), parents,
                                    None if present is None else present.tolist())
        assert [p[-1] for p in paths] == best.tolist()
        assert [target[r, p[-1]].item() for r, p in enumerate(paths)] == bonus.tolist()
        for r, p in enumerate(paths):  # root first, each node's parent before it: the ancestors of the best node
            assert p[0] == 0 and all(parents[c] == a for a, c in zip(p, p[1:]))


def test_static_tree_layout():
    """A static tree's structure, made once per shape: node i+1 is the i-th closed path, each level expands the
    parents of that depth's children and places each child at its parent's rank."""
    tree = static_tree(((1, 0), (0,), (0, 1)))  # closed: (0,), (1,), (0, 1), (1, 0)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2] and tree.depth.tolist() == [0, 1, 1, 2, 2]
    assert tree.ancestors.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                       [1, 0, 1, 0, 1]]
    first, second = tree.levels
    assert first.frontier.tolist() == [0] and first.kids.tolist() == [1, 2] and first.rank.tolist() == [0, 1]
    assert first.top == 2 and first.parent_pos.tolist() == [0, 0]
    assert second.frontier.tolist() == [1, 2] and second.parents.tolist() == [0, 0] and second.kids.tolist() == [3, 4]
    assert second.parent_pos.tolist() == [0, 1] and second.rank.tolist() == [1, 0] and second.top == 2
    assert torch.equal(second.visible, tree.ancestors[[1, 2]]) and second.frontier_depth.tolist() == [1, 1]
    assert static_tree(((1, 0), (0,), (0, 1))) is tree  # made once
