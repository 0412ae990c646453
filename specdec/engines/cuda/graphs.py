"""CUDA graphs for the decode's forwards of a few tokens: the base's decode steps and verifies, and drafters' layers.

On a GPU a 135M base is launch-bound: one forward over a few tokens is ~15 kernels per layer, 450 for SmolLM2's 30
layers, each launched from Python for microseconds of work, while streaming its weights once takes a fraction of a
millisecond: an eager forward is mostly launches. A CUDA graph records those launches once and replays them in one
call. A graph replays fixed addresses and shapes, so what it records is the
static form of `SamplingContext.base_forward` / `run_layers`:

- a store's K/V live in a pool's buffers of `max_len` slots (the context's store is pointed at them), written at slots
  computed in the graph from the committed lengths, and attended over all `max_len` slots;
- the additive mask [B, 1, n, max_len] and the rotary rows are made in the graph from static inputs: the committed
  lengths [B], the layout's round slots and depths [n], and which round slots each query sees [n, max_len];
- one graph per (layers, batch, query count, input dtype, feature layers kept, position offset, head, the measured
  forms of its products and attention in use: cuda_kernels.py), recorded the first
  time that forward is asked for and replayed from then on; the time it took is counted (`GraphPool.capture_s`,
  reported by make bench).

The math is the eager lean forward's (LeanLayer.lean_forward over the same weights): masked slots get weight 0, so
attending over the whole buffer adds only zeros. What can't be recorded runs eagerly as before: prefills, forwards of
more than MAX_QUERIES tokens or MAX_ROWS rows, layers without a lean forward, a rotary that a table does not
reproduce, a batch that dropped rows.

A greedy verify (T = 0) records the lm_head and the argmax too (`head`): the host then reads [B, n] token ids once a
round, where the eager lm_head, a finiteness check and an argmax were launched one by one after each replay.

On a CPU nothing is recorded (`EngineConfig.cuda_graphs` applies to the CUDA engine); the static forward itself runs on any
device, which is how the tests check it without a GPU."""

from __future__ import annotations

import time
import weakref
from typing import Collection, Sequence

import torch
from torch import nn

from specdec.engines.cuda import kernels as cuda_kernels
from specdec.engines.cuda import layer as cuda_layer
from specdec.engines.eager.lean import LeanLayer
from specdec.sampling.cache import SlotCache
from specdec.sampling.rotary import MARGIN, RotaryTable
from specdec.sampling.verify import checked_argmax

MAX_QUERIES = 64  # forwards of more query tokens run eagerly (and prefills of any length: see SamplingContext)
MAX_ROWS = 32  # and batches of more rows (not launch-bound; their buffers would grow with the batch)
WARMUP = 2  # eager runs on a side stream before recording (cuBLAS handles and workspaces are made outside the graph)

# base model -> its pools (per store name, batch size and slot bucket; more than one while several contexts live)
_POOLS: weakref.WeakKeyDictionary[nn.Module, list[GraphPool]] = weakref.WeakKeyDictionary()


def slot_bucket(max_len: int) -> int:
    """Slots a pool holds for a decode of max_len: the next power of two from 256 on, so decodes of nearby lengths
    share one pool and its recorded graphs."""
    return max(256, 1 << (max_len - 1).bit_length())


class Layout:
    """The static inputs a recorded forward reads besides its tokens or hidden states (set by `GraphPool.forward`)."""

    def __init__(self, n: int, max_len: int, device: torch.device):
        self.rel = torch.zeros(n, dtype=torch.long, device=device)  # [n] round slot of each query
        self.depth = torch.zeros(n, dtype=torch.long, device=device)  # [n] rotary depth past the committed length
        self.visible = torch.zeros(n, max_len, dtype=torch.bool, device=device)  # [n, M] round slots each query sees


class GraphPool:
    """One store's K/V buffers (per layer index: [B, kv_heads, max_len, head_dim]), rotary tables over those positions,
    and the graphs recorded over them. One context holds it at a time (`claim`)."""

    def __init__(self, base, store: str, batch: int, max_len: int):
        self.store, self.batch, self.max_len = store, batch, max_len
        # the parts of the base it runs (not the model itself: a model's pools go with it, see _POOLS)
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.device = base.lm_head.weight.device
        self.record = self.device.type == "cuda"  # elsewhere the static forward runs eagerly (tests)
        self.cache = SlotCache(max_len)  # the graphs' view of the buffers; its slots are set inside the graph
        self.length = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B] static input
        self.key_slots = torch.arange(max_len, device=self.device)  # [M]
        self.ropes: dict[torch.dtype, RotaryTable] = {}
        self.graphs: dict[tuple, _Graph] = {}
        # one memory pool for all its graphs: they replay one after another on one stream, and each call clones what
        # it returns before the next replay
        self.memory = torch.cuda.graph_pool_handle() if self.record else None
        self.owner: weakref.ref | None = None
        self.capture_s, self.captures = 0.0, 0

    def rope(self, dtype: torch.dtype) -> RotaryTable | None:
        """The rotary table in dtype, None where it does not reproduce the model's rotary (no graph then)."""
        if dtype not in self.ropes:
            self.ropes[dtype] = RotaryTable(self.rotary, torch.empty(0, dtype=dtype, device=self.device),
                                            self.max_len)
        table = self.ropes[dtype]
        return table if table.exact else None

    def adopt(self, store: SlotCache, fast: Sequence[LeanLayer]) -> None:
        """Point `store`'s layers of `fast` at the pool's buffers, made here (holding what the store had written so
        far): the context's eager forwards (prefills, rollback moves) and the graphs then share one K/V."""
        for f in fast:
            i = f.layer_idx
            keys, values = self.cache.buffers(i, f.qkv.weight.new_empty(self.batch, 1, 1), f.kv_heads, f.head_dim)
            own = store.layers[i] if i < len(store.layers) else None
            if own is not None and own.is_initialized:
                if own.keys is keys:
                    continue
                keys[:, :, : own.keys.shape[2]].copy_(own.keys)
                values[:, :, : own.values.shape[2]].copy_(own.values)
            store.share(i, keys, values)

    def forward(self, fast: Sequence[LeanLayer], x: torch.Tensor, length: torch.Tensor, rel: torch.Tensor,
                depth: torch.Tensor, visible: torch.Tensor, *, embed: bool = False, keep: Collection[int] = (),
                offset: int = 0, head: nn.Module | None = None
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """The layers `fast` over x (token ids [B, n] with embed: then the base's embeddings first and its final
        norm last; else hidden states [B, n, H]) at round slots rel [n] after each row's committed length [B]
        (device), rotated at length + depth [n] + offset, query i seeing round slots visible[i] [n, r] (rel, depth
        and visible on the device, or the CPU: a blocking copy) -> [B, n, H], {i: the input of layer i} for i in
        keep, and with a `head` (an lm_head) `checked_argmax` of its logits [B, n] (else None); fresh tensors, not
        the graph's."""
        n = x.shape[1]
        key = (tuple(fast), embed, x.dtype, n, tuple(sorted(keep)), offset, head, cuda_kernels.active())
        graph = self.graphs.get(key)
        # inside a larger recording (a whole draft, draft_graph.py) the ops join that graph: no graph of their own is
        # recorded or replayed there
        inline = self.record and torch.cuda.is_current_stream_capturing()
        new = graph is None and not inline
        t0 = time.perf_counter()
        if graph is None:
            graph = _Graph(self, fast, x, embed, key[4], offset, head)
            if new:
                self.graphs[key] = graph
        graph.inputs(x, length, rel, depth, visible, inline)
        if new:
            graph.capture()
            self.capture_s += time.perf_counter() - t0
            self.captures += 1
        out, kept, top = graph._run() if inline else graph.replay()
        return out.clone(), {i: h.clone() for i, h in kept.items()}, None if top is None else top.clone()

    def static_forward(self, fast: Sequence[LeanLayer], x: torch.Tensor, layout: Layout, embed: bool,
                       keep: tuple[int, ...], offset: int, head: nn.Module | None = None
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """What a graph records: every tensor made from the static inputs x, layout and the pool's length [B]."""
        length, m = self.length, self.max_len
        hidden = self.embed(x) if embed else x  # [B, n, H]
        cache = self.cache
        cache.write_slots = length[:, None] + layout.rel[None]  # [B, n]
        cache.write_start, cache.width = None, m
        key_rel = self.key_slots[None] - length[:, None]  # [B, M] slot - committed length
        seen = layout.visible[:, key_rel.clamp(0, m - 1)].permute(1, 0, 2)  # [B, n, M] (False past the round)
        allowed = (key_rel < 0)[:, None] | ((key_rel >= 0)[:, None] & seen)  # the prefix, and the round's seen slots
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)[:, None]  # [B, 1, n, M]
        table = self.rope(hidden.dtype)
        rows = length[:, None] + layout.depth[None] + (offset + MARGIN)  # [B, n] rotary table rows
        rope = table.lean_cos[rows][:, None], table.lean_sin[rows][:, None]  # [B, 1, n, d] each
        kept = {}
        for i, f in enumerate(fast):
            if i in keep:
                kept[i] = hidden
            hidden = f.lean_forward(hidden, rope, mask, cache, cuda_kernels.units(f))
        out = self.norm(hidden) if embed else hidden
        return out, kept, None if head is None else checked_argmax(head(out))


class _Graph:
    """One recorded forward: its static inputs, the graph, and its outputs (overwritten by every replay)."""

    def __init__(self, pool: GraphPool, fast: Sequence[LeanLayer], x: torch.Tensor, embed: bool,
                 keep: tuple[int, ...], offset: int, head: nn.Module | None = None):
        self.pool, self.fast, self.embed, self.keep, self.offset = pool, list(fast), embed, keep, offset
        self.head = head
        self.x = torch.zeros_like(x, memory_format=torch.contiguous_format)
        self.layout = Layout(x.shape[1], pool.max_len, pool.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None] | None = None
        self.held: tuple = ()  # the layout tensors (and their versions) the static layout last copied in

    def inputs(self, x: torch.Tensor, length: torch.Tensor, rel: torch.Tensor, depth: torch.Tensor,
               visible: torch.Tensor, inline: bool = False) -> None:
        """Copy a call's inputs into the static ones. The layout's are skipped when they are the very tensors copied
        last time, unchanged (a decode's rounds repeat a few layouts, each one `SamplingContext.on_device` copy):
        four fewer launches a call. Inside another recording (inline) every copy is recorded."""
        layout = self.layout
        self.x.copy_(x)
        self.pool.length.copy_(length)
        given = (rel, depth, visible)
        if not inline and self.held and all(t is h and t._version == v for t, (h, v) in zip(given, self.held)):
            return
        self.held = () if inline else tuple((t, t._version) for t in given)  # (held: their ids are never reused)
        layout.rel.copy_(rel)
        layout.depth.copy_(depth)
        r = visible.shape[1]
        layout.visible[:, :r].copy_(visible)
        layout.visible[:, r:] = False

    def _run(self) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        return self.pool.static_forward(self.fast, self.x, self.layout, self.embed, self.keep, self.offset,
                                        self.head)

    def capture(self) -> None:
        """Record the forward (CUDA), after WARMUP eager runs on a side stream. Every run computes this call's real
        forward from the inputs already in place, so the K/V they write are the ones the call writes anyway."""
        if not self.pool.record:
            return
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side), cuda_layer.warming():
            for _ in range(WARMUP):
                self._run()
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool.memory):
            self.out = self._run()

    def replay(self) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        if self.graph is None:  # not recorded (not CUDA): the static forward, eagerly
            return self._run()
        self.graph.replay()
        return self.out


def claim(ctx, store: str, batch: int, max_len: int) -> GraphPool:
    """A pool for `ctx`'s (a SamplingContext's) store `store` with room for max_len slots: one no live context holds
    (its recorded graphs reused), else a new one."""
    base = ctx.base
    pools = _POOLS.setdefault(base.model, [])
    slots = slot_bucket(max_len)
    for pool in pools:
        free = pool.owner is None or pool.owner() is None
        if free and (pool.store, pool.batch, pool.max_len) == (store, batch, slots):
            break
    else:
        pool = GraphPool(base, store, batch, slots)
        pools.append(pool)
    pool.owner = weakref.ref(ctx)
    return pool


def pools(base) -> list[GraphPool]:
    """The base's pools (for reports: recording time and count)."""
    return list(_POOLS.get(base.model, []))


def pool_for(ctx, store: str, fast: Sequence[LeanLayer | None], x: torch.Tensor) -> GraphPool | None:
    """The pool whose recorded graphs run `fast` over x [B, n(, H)] on ctx's (a SamplingContext's) `store` in its
    current layout, its buffers made the store's; None where this forward runs eagerly (graphs off, a prefill, a layer
    without a lean forward)."""
    if not ctx.graphs or x.shape[1] > MAX_QUERIES or x.shape[0] > MAX_ROWS or any(f is None for f in fast):
        return None
    if min(ctx.length_host) == 0:  # a prefill (or a drafter reading it): its length is seen once, not recorded
        return None
    if store not in ctx.pools:
        ctx.pools[store] = claim(ctx, store, len(ctx.length_host), ctx.max_len)
    pool = ctx.pools[store]
    if pool.rope(x.dtype if x.is_floating_point() else ctx.base.dtype) is None:
        return None  # the rotary has no exact table: positions are computed per call
    key = (store, tuple(fast))
    if key not in ctx.adopted:
        pool.adopt(ctx.slot_cache(store), fast)
        ctx.adopted.add(key)
    return pool
