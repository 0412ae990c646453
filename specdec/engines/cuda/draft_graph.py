"""A round's whole greedy draft of a static tree (chains included) as one CUDA graph.

With the base's forwards replayed from graphs (graphs.py), a drafter's depth on a GPU is still ~50 kernels launched
one by one from Python around its one replayed layer stack, so a depth costs a large share of an AR step whatever
its arithmetic. At T = 0 a static tree's draft is the same device ops every round; what changes is the root tokens,
the committed lengths and what the drafter's `observe` left in its state. So the draft is recorded once, with those in
static buffers, and each later round copies them in and replays it: one launch instead of hundreds (its measurement:
experiments/pages/cuda.md).

What is recorded is `trees.draft_static` itself, after WARMUP eager runs on a side stream, with:
- the context's committed lengths read from a static buffer [B] (every layout and graphed forward reads them);
- the drafter's state tensors copied into static buffers, its NodeTables fresh (a round's own);
- the layer stacks' forwards (graphs.py) inlined into this graph rather than replayed as graphs of their own.
The rest of its inputs hold still between rounds: the weights, the pools' K/V buffers, and the tree's index tensors
(ctx.on_device copies, which the graph keeps alive).

One graph per (drafter, tree, batch, the context's graph pools, the state's shapes), kept with the drafter: later
decodes that claim the same pools replay it. A context's first draft runs eagerly, so that it has claimed the pools
its draft runs on. Only drafters that declare `graph_draft` are recorded (their `expand` is device ops alone);
sampling at T > 0, adaptive draft lengths and dynamic trees draft eagerly. On a CPU nothing is recorded and the same
code runs eagerly each round (that is how the tests check it without a GPU)."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

from specdec.drafters.drafter import Drafter, NodeTable
from specdec.engines.cuda import kernels as cuda_kernels
from specdec.engines.cuda import layer as cuda_layer
from specdec.engines.cuda.graphs import WARMUP
from specdec.sampling.context import SamplingContext
from specdec.sampling.trees import Round, draft_static

# drafter -> its recorded drafts by key (see `draft`)
_GRAPHS: weakref.WeakKeyDictionary[Drafter, dict[tuple, DraftGraph]] = weakref.WeakKeyDictionary()
_DRAFTED: weakref.WeakSet[SamplingContext] = weakref.WeakSet()  # contexts past their first (eager) draft


def draft(drafter: Drafter, state: dict[str, Any], ctx: SamplingContext, root: torch.Tensor,
          paths: Sequence[Sequence[int]]) -> Round:
    """draft_static(drafter, state, ctx, root, paths) at T = 0, replayed from a recorded graph where one fits."""
    if ctx not in _DRAFTED:  # the first draft claims the pools the graph will run on
        _DRAFTED.add(ctx)
        return draft_static(drafter, state, ctx, root, paths)
    signature = _signature(state)
    if signature is None:
        return draft_static(drafter, state, ctx, root, paths)
    tree = tuple(map(tuple, paths))
    key = (tree, root.shape[0], tuple(sorted((name, id(pool)) for name, pool in ctx.pools.items())), signature,
           cuda_kernels.active())
    table = _GRAPHS.setdefault(drafter, {})
    graph = table.get(key)
    if graph is None:
        graph = table[key] = DraftGraph(drafter, tree, ctx, root, state)
    return graph(ctx, root, state)


def _signature(state: dict[str, Any]) -> tuple | None:
    """The state's keys with each tensor's shape and dtype; None where it holds what a graph can't take in."""
    out = []
    for name, value in sorted(state.items()):
        if isinstance(value, torch.Tensor):
            out.append((name, tuple(value.shape), value.dtype))
        elif isinstance(value, NodeTable) or value is None:
            out.append((name, type(value).__name__))
        else:
            return None
    return tuple(out)


def recorded(drafter: Drafter) -> list[DraftGraph]:
    """The drafter's recorded drafts (for tests and reports)."""
    return list(_GRAPHS.get(drafter, {}).values())


class DraftGraph:
    """One recorded draft: its static inputs (committed lengths, root tokens, the drafter's state tensors), the
    graph, and its outputs (overwritten by every replay)."""

    def __init__(self, drafter: Drafter, tree: tuple, ctx: SamplingContext, root: torch.Tensor,
                 state: dict[str, Any]):
        self.drafter, self.tree = drafter, tree
        self.pools = list(ctx.pools.values())  # kept: their K/V buffers are the graph's
        self.length = ctx.length.clone()  # [B]
        self.root = root.clone()  # [B]
        self.inputs = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.rest = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Round, dict[str, Any]] | None = None
        self.keep: list[torch.Tensor] = []
        if root.device.type == "cuda":  # inside the round that first needs it: its time counts in that round's drafting
            self._capture(ctx)

    def _run(self, ctx: SamplingContext) -> tuple[Round, dict[str, Any]]:
        """draft_static over the static inputs, with the context's lengths read from the static buffer."""
        state = {k: NodeTable() if isinstance(v, NodeTable) else v for k, v in self.rest.items()} | self.inputs
        length, ctx.length = ctx.length, self.length
        try:
            return draft_static(self.drafter, state, ctx, self.root, self.tree), state
        finally:
            ctx.length = length

    def _capture(self, ctx: SamplingContext) -> None:
        """Record after WARMUP eager runs on a side stream (they draft this round's tree from the inputs in place,
        so what they write to the drafter's stores is what the round writes anyway)."""
        dev = self.root.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), cuda_layer.warming():
            for _ in range(WARMUP):
                self._run(ctx)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run(ctx)
        self.keep = ctx.device_copies()  # the index tensors it read: never freed while it lives

    def __call__(self, ctx: SamplingContext, root: torch.Tensor, state: dict[str, Any]) -> Round:
        self.length.copy_(ctx.length)
        self.root.copy_(root)
        for k, buf in self.inputs.items():
            buf.copy_(state[k])
        if self.graph is None:  # not recorded (not CUDA): the same draft, eagerly
            rnd, tables = self._run(ctx)
        else:
            self.graph.replay()
            rnd, tables = self.out
        state.update({k: v for k, v in tables.items() if isinstance(v, NodeTable)})  # the round's own tables
        return Round(rnd.tokens.clone(), rnd.parents, rnd.depth, rnd.ancestors, rnd.draft_slots)
