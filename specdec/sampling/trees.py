"""Draft trees: their shapes (chain, static Medusa-style paths, dynamic EAGLE-2-style growth) and one round of
drafting through `drafter.expand`. The tree structure is shared by all rows of a batch (the `expand` protocol
passes one `parents` for all rows); only the tokens differ per row."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specdec.drafters.drafter import Drafter
from specdec.sampling.adaptive import DraftLength
from specdec.sampling.context import SamplingContext
from specdec.sampling.verify import process_logits, sample

Path = tuple[int, ...]  # (i_1, ..., i_d): the i_1-th top token at depth 1, then the i_2-th of its children, ...
# Staged drafting's cheaper stage (`_greedy_chain`): (the chain's tokens after the root so far [B, d], the most tokens
# it may propose) -> the tokens it proposes for depths d + 1, d + 2, ... [B, k], 1 ≤ k ≤ most, or None (a plain pass)
Stage = Callable[[torch.Tensor, int], torch.Tensor | None]


def chain_paths(gamma: int) -> list[Path]:
    return [(0,) * d for d in range(1, gamma + 1)]


def close_paths(paths: Sequence[Sequence[int]]) -> list[Path]:
    """Add every missing prefix and order by (depth, path): parents come before children, siblings by rank."""
    out = {()}
    for p in paths:
        out.update(tuple(p[:d]) for d in range(1, len(p) + 1))
    return sorted(out - {()}, key=lambda p: (len(p), p))


@dataclass
class Round:
    """The draft tree of one round; node 0 is the root. Draft nodes keep the indices they were drafted at. The
    structure tensors (parents, depth, ancestors) of a static tree are shared by every round: read them only."""

    tokens: torch.Tensor  # [B, N]
    parents: torch.Tensor  # [N] (CPU), -1 for the root
    depth: torch.Tensor  # [N] (CPU)
    ancestors: torch.Tensor  # [N, N] bool (CPU), ancestor-or-self
    draft_slots: torch.Tensor  # [N] (CPU) round-relative slot each node had during drafting
    q: torch.Tensor | None = None  # [B, N, V] distribution each node's token was sampled from (sampled chains)
    limit: torch.Tensor | None = None  # [B] deepest depth each row proposes (adaptive draft length); None: all
    # drafter passes (`expand` calls) that drafted it where that is not one per depth (a staged chain, a dynamic tree);
    # None: one per depth
    passes: int | None = None

    def is_chain(self) -> bool:
        """Whether node i's parent is i - 1 for every node (its accepted nodes are then 0..n-1: nothing to move).
        On the host: the same test as tensor ops would cost several ops a round, each cold after a verify."""
        return self.parents.tolist() == list(range(-1, self.size - 1))

    def present(self) -> torch.Tensor | None:
        """[B, N] bool: the nodes each row proposes (None: every node, every row)."""
        if self.limit is None:
            return None
        return self.depth.to(self.limit.device)[None] <= self.limit[:, None]

    def drafted(self) -> list[int]:
        """Draft nodes each row proposes: γ_s (N_s - 1 for trees)."""
        if self.limit is None:
            return [self.size - 1] * self.tokens.shape[0]
        return self.limit.clamp(max=int(self.depth.max())).tolist()

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def children(self) -> torch.Tensor:
        """[N, K] children in sibling (rank) order, -1 padded."""
        n = self.size
        kids: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        k = max(1, max(len(c) for c in kids))
        return torch.tensor([c + [-1] * (k - len(c)) for c in kids], dtype=torch.long)


class TreeBuilder:
    """Grows a round's tree node by node (dynamic trees; a static one is laid out once, `static_tree`); `expand` runs
    the drafter on a frontier in the matching layout."""

    def __init__(self, root: torch.Tensor, capacity: int):
        b = root.shape[0]
        self.tokens = root.new_zeros(b, capacity)
        self.tokens[:, 0] = root
        self.parents, self.depth = [-1], [0]
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool)
        self.ancestors[0, 0] = True

    @property
    def size(self) -> int:
        return len(self.parents)

    def add(self, parents: list[int], tokens: torch.Tensor) -> list[int]:
        """Register children of `parents` with tokens [B, k]."""
        ids = list(range(self.size, self.size + len(parents)))
        self.tokens[:, ids] = tokens
        for i, p in zip(ids, parents):
            self.parents.append(p)
            self.depth.append(self.depth[p] + 1)
            self.ancestors[i] = self.ancestors[p]
            self.ancestors[i, i] = True
        return ids

    def expand(self, drafter: Drafter, state: Any, ctx: SamplingContext, frontier: list[int]) -> torch.Tensor:
        """Children draft logits [B, F, V_d] of the frontier nodes (all at one depth), over the draft vocab."""
        f = torch.tensor(frontier)
        depth = self.depth[frontier[0]]
        if drafter.runs_layers:
            ctx.tree_layout(f, torch.full_like(f, depth), self.ancestors[f])
        parents = torch.tensor([self.parents[i] for i in frontier])
        return drafter.expand(state, ctx, self.tokens[:, frontier], parents, depth, f)

    def finish(self, keep: list[int]) -> Round:
        """The round of the nodes `keep` (closed under ancestors, root first), renumbered in that order."""
        remap = {old: new for new, old in enumerate(keep)}
        k = torch.tensor(keep)
        return Round(
            tokens=self.tokens[:, keep],
            parents=torch.tensor([remap.get(self.parents[i], -1) for i in keep]),
            depth=torch.tensor([self.depth[i] for i in keep]),
            ancestors=self.ancestors[k][:, k],
            draft_slots=k,
        )


@dataclass(frozen=True)
class Level:
    """One depth of a static tree: the frontier nodes it expands and where their children go (CPU tensors)."""

    depth: int
    frontier: torch.Tensor  # [F] node ids expanded at this depth
    frontier_depth: torch.Tensor  # [F] all `depth`
    parents: torch.Tensor  # [F] the frontier nodes' parents
    visible: torch.Tensor  # [F, N] bool, each frontier node's ancestors-or-self
    kids: torch.Tensor  # [K] node ids of the children
    parent_pos: torch.Tensor  # [K] each child's parent's index in `frontier`
    rank: torch.Tensor  # [K] each child's rank among its parent's draft top-k
    top: int  # the top-k this depth needs


@dataclass(frozen=True)
class StaticTree:
    """A static tree's structure, the same every round: node i+1 is paths[i] (closed, by depth), node 0 the root."""

    parents: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    ancestors: torch.Tensor  # [N, N] bool, ancestor-or-self
    levels: tuple[Level, ...]
    slots: torch.Tensor  # [N] arange: where node i sits during drafting
    # a chain (node i's one child is i + 1, every depth drafts one node) or one that fans out at its end (its last
    # depth's nodes are the children of the one before it, ranks 0..fan-1: [[0], [1]], [[0, 0], [0, 1], [0, 2]]): how
    # many nodes its last depth drafts (1: a chain); 0 for any other tree
    fan: int


@functools.lru_cache(maxsize=64)
def static_tree(paths: tuple[Path, ...]) -> StaticTree:
    """The structure of the tree of `paths`, made once per shape (a decode drafts it every round; read-only)."""
    nodes = [(), *close_paths(paths)]
    index = {p: i for i, p in enumerate(nodes)}
    parents = [-1] + [index[p[:-1]] for p in nodes[1:]]
    ancestors = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for i, p in enumerate(nodes):
        ancestors[i, [index[p[:d]] for d in range(len(p) + 1)]] = True
    levels = []
    for d in range(max(len(p) for p in nodes)):
        kids = [p for p in nodes if len(p) == d + 1]
        frontier = sorted({index[p[:-1]] for p in kids})
        pos = {node: j for j, node in enumerate(frontier)}
        levels.append(Level(
            depth=d, frontier=torch.tensor(frontier), frontier_depth=torch.full((len(frontier),), d),
            parents=torch.tensor([parents[i] for i in frontier]), visible=ancestors[frontier],
            kids=torch.tensor([index[p] for p in kids]), parent_pos=torch.tensor([pos[index[p[:-1]]] for p in kids]),
            rank=torch.tensor([p[-1] for p in kids]), top=max(p[-1] for p in kids) + 1,
        ))
    deepest = len(nodes[-1])
    last = [p for p in nodes if len(p) == deepest]
    fan = len(last) if (len(nodes) == deepest + len(last)  # one node a depth before the last
                        and all(p[:-1] == (0,) * (deepest - 1) for p in last)
                        and [p[-1] for p in last] == list(range(len(last)))) else 0
    return StaticTree(torch.tensor(parents), torch.tensor([len(p) for p in nodes]), ancestors, tuple(levels),
                      torch.arange(len(nodes)), fan)


def draft_static(drafter: Drafter, state: Any, ctx: SamplingContext, root: torch.Tensor,
                 paths: Sequence[Sequence[int]],
                 sample_chain: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 length: DraftLength | None = None, stage: Stage | None = None) -> Round:
    """A static tree (chains included; `paths` are closed by `static_tree`): at each depth expand the nodes that have
    children and take, for the child with path P + (k,), the k-th top token of its parent's draft logits. With
    `sample_chain` (sampling at T > 0 on a chain) the single child is instead drawn from the post-processed q, which
    is kept.
    With `length` (adaptive draft length, chains only) each row's chain ends after its first token for which
    length.keep_going(top1) [B] is false, top1 [B] = the draft's top-1 probability (of the q it samples from, or of
    softmax(logits) at T = 0); that token is still proposed (its logits are paid for). The round's chain, shared by
    the batch, goes as deep as its longest row; Round.limit keeps each row's own length for verification. A chain with
    neither (T = 0, a fixed length) is drafted by `_greedy_chain`: the same drafts with fewer ops; so is a chain that
    fans out at its end (StaticTree.fan); and one row's adaptive chain at T = 0 by the drafter's `adaptive_chain`
    where it has one that takes the call (the prophet's: one native call on the CPU, which ends the chain itself).
    `stage` (staged drafting, greedy chains only): the lookup that proposes the drafter's next tokens (`Stage`)."""
    tree = static_tree(tuple(map(tuple, paths)))
    if tree.fan and sample_chain is None and length is None:
        return _greedy_chain(drafter, state, ctx, root, tree, stage)
    if length is not None and tree.fan == 1 and sample_chain is None and root.shape[0] == 1:
        drafted = drafter.adaptive_chain(state, ctx, root, len(tree.levels), length.threshold)  # [1, d] or None
        if drafted is not None:
            size = drafted.shape[1] + 1
            return Round(tokens=torch.cat([root[:, None], drafted], 1), parents=tree.parents[:size],
                         depth=tree.depth[:size], ancestors=tree.ancestors[:size, :size], draft_slots=tree.slots[:size],
                         limit=torch.full_like(root, size - 1))
    size = tree.depth.numel()
    tokens = root.new_zeros(root.shape[0], size)  # [B, N]
    tokens[:, 0] = root
    qs = []  # [B, V] per drafted node (sampled chains)
    limit = going = None
    if length is not None:
        limit = torch.full_like(root, len(tree.levels))  # [B]
        going = torch.ones_like(root, dtype=torch.bool)  # [B] rows still drafting
    on_device = ctx.on_device  # the levels' indices copied once (an index in host memory would be a blocking copy)
    for level in tree.levels:
        if drafter.runs_layers:
            ctx.tree_layout(level.frontier, level.frontier_depth, level.visible)
        logits = drafter.expand(state, ctx, tokens[:, on_device(level.frontier)], level.parents, level.depth,
                                level.frontier)  # [B, F, V_d]
        q = None
        if sample_chain is not None:
            token, q = sample_chain(drafter.full_vocab(logits[:, 0]))  # [B], [B, V]
            tokens[:, on_device(level.kids)] = token[:, None]
            qs.append(q)
        else:
            # [B, F, k]; a chain's top-1 by argmax (cheaper than topk on a CPU)
            top = drafter.token_ids(logits.argmax(-1, keepdim=True) if level.top == 1
                                    else logits.topk(level.top, dim=-1).indices)
            tokens[:, on_device(level.kids)] = top[:, on_device(level.parent_pos), on_device(level.rank)]
        if length is not None and level.depth + 1 < len(tree.levels):
            probs = q if q is not None else logits[:, 0].float().softmax(-1)  # [B, V] or [B, V_d]: the same top-1
            stop = going & ~length.keep_going(probs.max(-1).values)  # [B] rows whose chain ends at depth d + 1
            limit = torch.where(stop, level.depth + 1, limit)
            going = going & ~stop
            if not bool(going.any()):
                size = int(level.kids.max()) + 1  # nodes are numbered by depth: the deeper ones were never drafted
                break
    return Round(
        tokens=tokens[:, :size], parents=tree.parents[:size], depth=tree.depth[:size],
        ancestors=tree.ancestors[:size, :size], draft_slots=tree.slots[:size],
        q=torch.stack([torch.zeros_like(qs[0]), *qs], 1) if qs else None,  # [B, N, V], none for the root
        limit=limit,
    )


def _greedy_chain(drafter: Drafter, state: Any, ctx: SamplingContext, root: torch.Tensor, tree: StaticTree,
                  stage: Stage | None = None) -> Round:
    """draft_static on a chain at T = 0: each depth's top-1 kept as a column [B] and the columns stacked once, in place
    of the tree's gathers and scatters (four ops a depth fewer, each cold after a verify on a CPU); or the whole chain
    in one call where the drafter's `greedy_chain` takes it (the prophet's and Hydra's: one native call where the
    sampler's engine has one). A chain that fans out at its end (tree.fan > 1) takes its last depth's top
    `fan` instead of its top-1, the nodes in the tree's order (the chain, then the fan best first).
    Staged drafting (Spector & Ré 2023): with `stage`, a pass expands the chain's newest node together with the k
    tokens the stage proposes after it, as a chain of k + 1 nodes in one `expand`; a proposed token is kept while every
    row's equals the drafter's own argmax at the node before it, and the drafter's own token follows the kept ones. A
    drafter whose `expand` reads only its nodes' path tokens (Drafter.drafts_from_tokens) then drafts the chain it
    drafts alone (exactly where its forward rounds k + 1 rows as it rounds one), in one pass per run of kept tokens
    instead of one per token; slots a pass wrote for tokens that were not kept lie past its newest node, where no
    query sees them until a later pass has written them again. Without a proposal a pass is the plain one."""
    gamma, top = len(tree.levels), tree.fan
    drafted = None if stage is not None else drafter.greedy_chain(state, ctx, root, gamma, top)  # [B, γ − 1 + top]
    if drafted is not None:
        return Round(tokens=torch.cat([root[:, None], drafted], 1), parents=tree.parents, depth=tree.depth,
                     ancestors=tree.ancestors, draft_slots=tree.slots)
    columns = [root[:, None]]  # [B, m] each: the root, then the token(s) each pass drafted
    d = passes = 0  # depth of the chain's newest node: the one the next pass expands
    while d < gamma:
        level = tree.levels[d]
        # the last depth's node is the newest of its pass, never a proposal: its children are the round's leaves
        ahead = None  # [B, k] proposed tokens for depths d + 1 .. d + k
        if stage is not None and d < gamma - 1:
            ahead = stage(torch.cat(columns[1:], 1) if d else columns[0][:, :0], gamma - 1 - d)
        if ahead is None:
            if drafter.runs_layers:
                ctx.tree_layout(level.frontier, level.frontier_depth, level.visible)
            logits = drafter.expand(state, ctx, columns[-1][:, :1], level.parents, level.depth, level.frontier)
            k = 0
        else:
            k = ahead.shape[1]
            nodes = torch.arange(d, d + k + 1)  # a chain's node at depth j is node j, drafted in slot j
            if drafter.runs_layers:
                ctx.tree_layout(nodes, nodes, tree.ancestors[d : d + k + 1])
            # [B, 1 + k, V_d]: the children of the newest node and of each proposed token
            logits = drafter.expand(state, ctx, torch.cat([columns[-1][:, :1], ahead], 1), nodes - 1, d, nodes)
        passes += 1
        kept = 0
        if k:
            own = drafter.token_ids(logits[:, :k].argmax(-1))  # [B, k] the drafter's token after each node but the last
            same = (own == ahead).all(0).tolist()  # [k] on the host: how many are kept decides the next pass
            kept = same.index(False) if False in same else k
            if kept:
                columns.append(ahead[:, :kept])
        last, want = logits[:, kept], tree.levels[d + kept].top  # [B, V_d] at the newest kept node (depth d + kept)
        columns.append(drafter.token_ids(last.argmax(-1, keepdim=True) if want == 1 else last.topk(want).indices))
        d += kept + 1
    return Round(tokens=torch.cat(columns, 1), parents=tree.parents, depth=tree.depth, ancestors=tree.ancestors,
                 draft_slots=tree.slots, passes=passes if stage is not None else None)


def draft_dynamic(drafter: Drafter, state: Any, ctx: SamplingContext, root: torch.Tensor, depth: int,
                  topk: int, budget: int, verify_cost: list[float] | None = None) -> Round:
    """EAGLE-2-style: at each depth expand the `topk` best frontier nodes by path confidence (sum of the draft's
    log-probs, averaged over rows since the structure is shared), each proposing its top-`topk` tokens; then keep
    the `budget` best draft nodes. A child never scores above its parent, so the kept set is closed under
    ancestors (ties resolve to the lower index, which is the parent). With `verify_cost` (v(n) per n query tokens,
    n = 0..), keep instead the number of best nodes, at most `budget`, that `cost_budget` picks."""
    tree = TreeBuilder(root, 1 + depth * topk * topk)
    score = torch.zeros(1 + depth * topk * topk)  # [capacity] mean path log-prob
    frontier = [0]
    for _ in range(depth):
        logp = tree.expand(drafter, state, ctx, frontier).float().log_softmax(-1)  # [B, F, V_d]
        top = logp.topk(topk, dim=-1)  # [B, F, k]
        parents = [f for f in frontier for _ in range(topk)]
        ids = tree.add(parents, drafter.token_ids(top.indices).flatten(1))
        score[ids] = score[parents] + top.values.mean(0).flatten().cpu()
        order = sorted(ids, key=lambda i: -score[i].item())
        frontier = sorted(order[:topk])
    ranked = sorted(range(1, tree.size), key=lambda i: (-score[i].item(), i))
    if verify_cost is not None:
        budget = cost_budget(score[ranked].exp(), verify_cost, budget)
    rnd = tree.finish([0] + sorted(ranked[:budget]))
    rnd.passes = depth  # a pruned tree may keep fewer depths than it expanded
    return rnd


def cost_budget(p: torch.Tensor, verify_cost: list[float], most: int) -> int:
    """How many of a round's best draft nodes to verify: the n ≤ most that maximises the expected tokens per verify
    cost, (1 + Σ_{i≤n} p_i) / v(n + 1). p [K]: the nodes' path probabilities, best first (a node is accepted only with
    its whole path, so p_i is its chance to be; with the root's bonus token a round's τ is 1 + their sum); v(n): a
    verify of n tokens in AR steps. On a flat curve (a GPU) that is every node; where the curve steps up (a CPU's
    next pass over the weights) only the nodes likely enough to pay for the step."""
    most = min(most, p.numel(), len(verify_cost) - 2)
    tau = 1 + p[:most].double().cumsum(0)  # [most] expected τ with the best 1..most nodes
    value = tau / torch.tensor(verify_cost[2 : most + 2], dtype=torch.float64)
    return int(value.argmax()) + 1


def sample_chain_fn(temperature: float, top_k: int, top_p: float, uniform) -> Callable:
    """Drafting at T > 0 on a chain: sample the child from the post-processed q and keep that q."""

    def draw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = process_logits(logits, temperature, top_k, top_p)  # [B, V]
        return sample(q, uniform()), q

    return draw
