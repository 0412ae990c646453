"""The sampler's side of the `DraftContext` protocol (specdec/drafters/drafter.py): it owns every KV store,
the per-row committed lengths, and the query layout (slots, rotary positions, 4D mask) of the current call.

Slot arithmetic, shared by every store: a committed token at position t lives in slot t. In a round, node i
of the draft tree (0 = the root, the base's newest token) is written at slot L_b + i and rotated as position
L_b + depth(i), where L_b is row b's committed length. A query sees the committed prefix (slots < L_b) plus
the round slots its layout marks visible (its ancestors, itself included). Everything else, stale drafts of
earlier rounds included, is masked; this is what makes rollback a pointer move."""

from __future__ import annotations

import functools
from typing import Collection, Sequence

import torch
from torch import nn

from specdec.base import Base, cache_arg, layer_keys
from specdec.sampling.cache import SlotCache
from specdec.sampling.engine import REFERENCE, Engine
from specdec.sampling.rotary import RotaryTable, lean_rope
from specdec.sampling.verify import checked_argmax

_PENDING = object()  # a layout's mask not made yet


@functools.lru_cache(maxsize=64)
def _causal(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(arange(n), the causal [n, n] bool) (CPU, read-only): made once per n. Made afresh right after a verify they
    cost far more than in a loop (a decode's caches are cold then): the prophet's drafting at γ = 4, two such layouts a
    round, 1.36 -> 1.32 ms a round on a 2-core Zen 5 (interleaved runs)."""
    return torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()


@functools.lru_cache(maxsize=16)
def _full(n: int) -> torch.Tensor:
    """[n, n] all true (CPU, read-only): a block's queries see each other."""
    return torch.ones(n, n, dtype=torch.bool)


class SamplingContext:
    def __init__(self, base: Base, batch_size: int, max_len: int, engine: Engine = REFERENCE):
        self.base = base
        self.dtype = base.dtype  # (Base.dtype goes through HF's embedding getters: ~5-10 µs a read)
        self.max_len = max_len
        self.engine = engine  # how layers run (sampling/engine.py); the reference: each layer's own HF forward
        # forwards of a few tokens (base and drafter layers) replayed from recorded graphs where the engine has them;
        # a store a graph runs on then lives in its pool's buffers
        self.graphs = engine.graphs
        self.pools: dict[str, object] = {}  # store -> the engine's graph pool for it
        self.adopted: set[tuple] = set()  # (store, layers) whose K/V a pool's buffers hold
        self.stores: dict[str, SlotCache] = {"base": SlotCache(max_len)}
        self.length = torch.zeros(batch_size, dtype=torch.long, device=base.device)  # [B] committed L_b
        self.length_host = [0] * batch_size  # the same on the host: sizes the key window without a sync
        # layout of the current call (set by commit_layout / tree_layout)
        self._at = self.length  # [B] the committed lengths it was laid out at (`commit` makes a new tensor)
        self._slots: torch.Tensor | None = None  # [B, n] see `slots`
        self._pos: torch.Tensor | None = None  # [B, n] see `positions`
        self._visible: torch.Tensor | None = None  # [n, r] the round slots each query sees
        self._mask: torch.Tensor | None | object = None  # see `mask`
        self._start: int | None = None  # one row, consecutive rotary positions: the first (host), else None
        self.width = 0
        self.draft_depth = 1  # DraftContext.draft_depth (set by the sampler before it drafts)
        self.write_start: int | None = None
        self.span = (0, 0)  # lowest and highest position of the layout (host ints)
        self.rel: torch.Tensor | None = None  # [n] (CPU) round slot of each query
        self.depth: torch.Tensor | None = None  # [n] (CPU) rotary depth of each query past the committed length
        self.rope: RotaryTable | None = None  # made on the first forward
        # device copies of the small layout tensors (a decode repeats a few layouts): a blocking copy from host memory
        # would make the host wait for the GPU's queue on every forward
        self._copies: dict[tuple, torch.Tensor] = {}
        self._leans: dict[tuple[int, ...], tuple[list[nn.Module], list[nn.Module | None]]] = {}  # see `_lean`

    # -- layouts -------------------------------------------------------------------------------
    def commit_layout(self, n: int) -> None:
        """Queries = the n positions after each row's committed prefix, causal (prefill and `observe`)."""
        rel, causal = _causal(n)
        self._layout(rel, rel, causal)

    def tree_layout(self, rel_slots: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> None:
        """Queries = round nodes at round-relative slots rel_slots [n] (CPU), rotary depth [n] (CPU);
        visible [n, R] (CPU, bool): which round-relative slots each query sees (its ancestors and itself)."""
        self._layout(rel_slots, depth, visible)

    def block_layout(self, n: int) -> None:
        """Queries = the round's first n slots (the root's and n − 1 after it) at depths 0 .. n − 1, each seeing all
        n and the committed prefix: a block drafted in one pass."""
        rel, _ = _causal(n)
        self._layout(rel, rel, _full(n))

    def _layout(self, rel: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> None:
        rel_host, depth_host = rel.tolist(), depth.tolist()  # a few ints: host arithmetic beats tensor ops here
        n = len(rel_host)
        r = max(rel_host) + 1  # round slots past the last query are never visible: keep them out of the window
        lmin, lmax = min(self.length_host), max(self.length_host)
        self.width = lmax + r
        if self.width > self.max_len:
            raise RuntimeError(f"KV window {self.width} exceeds the preallocated {self.max_len} slots")
        self._at, self._slots, self._pos = self.length, None, None
        self.span = (lmin + min(depth_host), lmax + max(depth_host))
        self.rel, self.depth = rel, depth
        contiguous = rel_host == list(range(rel_host[0], rel_host[0] + n))
        self.write_start = lmax + rel_host[0] if lmin == lmax and contiguous else None
        self._visible = visible[:, :r]
        consecutive = depth_host == list(range(depth_host[0], depth_host[0] + n))
        self._start = lmax + depth_host[0] if len(self.length_host) == 1 and consecutive else None
        self._mask = _PENDING

    @property
    def slots(self) -> torch.Tensor:
        """[B, n] the slot each query's K/V is written at. Made on first use: a recorded forward (graphs.py) computes
        its own, so a graphed round launches neither this nor `positions`."""
        if self._slots is None:
            self._slots = self._at[:, None] + self.on_device(self.rel)[None]
        return self._slots

    @property
    def positions(self) -> torch.Tensor:
        """[B, n] each query's rotary position (made on first use, as `slots`)."""
        if self._pos is None:
            self._pos = self._at[:, None] + self.on_device(self.depth)[None]
        return self._pos

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor on the context's device, copied once per distinct value."""
        dev = self.length.device
        if t.device == dev:
            return t
        key = (t.dtype, tuple(t.shape), t.numpy().tobytes())
        have = self._copies.get(key)
        if have is None:
            if len(self._copies) >= 1024:  # (a dynamic tree's layouts vary; most recur)
                self._copies.clear()
            have = self._copies[key] = t.to(dev)
        return have

    def device_copies(self) -> list[torch.Tensor]:
        """The device copies `on_device` has made (a recorded graph that read them keeps them alive)."""
        return list(self._copies.values())

    @property
    def mask(self) -> torch.Tensor | None:
        """The current layout's additive mask [B, 1, n, W], or None when nothing needs masking. Made on first use: a
        layout that runs no layers (a drafter whose `observe` only reads features) never pays for it."""
        if self._mask is _PENDING:
            self._mask = self._make_mask()
        return self._mask

    def _make_mask(self) -> torch.Tensor | None:
        dev, dtype = self.length.device, self.dtype
        visible = self._visible  # [n, r]
        n, r = visible.shape
        lmax, neg = self.width - r, torch.finfo(dtype).min
        if min(self.length_host) == lmax:  # every row at the same length: one mask for all
            if n == 1 and bool(visible.numpy().all()):  # (numpy: no op dispatch for a few bools)
                return None  # one query that sees the whole window: sdpa needs no mask
            mask = torch.zeros(n, self.width, dtype=dtype, device=dev)
            mask[:, lmax:].masked_fill_(~self.on_device(visible), neg)  # the committed prefix is seen by all
            return mask.expand(self.length.shape[0], 1, n, self.width)
        key_rel = torch.arange(self.width, device=dev)[None] - self._at[:, None]  # [B, W]
        in_round = (key_rel >= 0) & (key_rel < r)
        seen = self.on_device(visible)[:, key_rel.clamp(0, r - 1)].permute(1, 0, 2)  # [B, n, W]
        allowed = (key_rel < 0)[:, None, :] | (in_round[:, None, :] & seen)
        return torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, neg)[:, None]

    def slot_cache(self, name: str) -> SlotCache:
        if name not in self.stores:
            self.stores[name] = SlotCache(self.max_len)
        return self.stores[name]

    def _store(self, name: str, start: int = 0) -> SlotCache:
        """The store `name` set up to write the current layout's queries from index `start` on (eagerly)."""
        store = self.slot_cache(name)
        store.write_slots = self.slots[:, start:] if start else self.slots
        store.write_start = None if self.write_start is None else self.write_start + start
        store.width = self.width
        return store

    # -- forwards ------------------------------------------------------------------------------
    def run_layers(
        self, layers: Sequence[nn.Module], hidden: torch.Tensor, store: str = "base", position_offset: int = 0
    ) -> torch.Tensor:
        """DraftContext.run_layers: HF decoder layers over hidden [B, n, H] in the current layout -> [B, n, H]."""
        fast = self._lean(layers)
        pool = self._graph_pool(store, fast, hidden)
        if pool is not None:
            return pool.forward(fast, hidden, self._at, *self._graph_layout(), offset=position_offset)[0]
        return self._run(layers, fast, hidden, self._store(store), position_offset)[0]

    def write_keys(self, layers: Sequence[nn.Module], hidden: torch.Tensor, store: str, position_offset: int = 0
                   ) -> None:
        """DraftContext.write_keys: each layer's keys and values of hidden [B, n, H] at the layout's slots of `store`,
        read by its k_proj / v_proj with no input norm and rotated at the layout's positions; no query runs."""
        cache = self._store(store)
        cos, sin = self._rotary(hidden, position_offset, True, False)[0]  # [B, n, d]
        for layer in layers:
            k, v = layer_keys(layer, hidden, cos, sin)
            cache.update(k, v, layer.self_attn.layer_idx)

    def _run(self, layers: Sequence[nn.Module], fast: list[nn.Module | None], hidden: torch.Tensor, cache: SlotCache,
             position_offset: int = 0, keep: Collection[int] = (),
             norm: nn.Module | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over hidden [B, n, H] (each lean where `fast` has it), rotated at the layout's positions +
        position_offset, then `norm` if given -> [B, n, H] and {i: the input of layer i} for i in keep."""
        rope, lean_table = self._rotary(hidden, position_offset, any(f is None for f in fast),
                                        any(f is not None for f in fast))
        inputs, mask = {}, self.mask
        if lean_table is not None and all(f is not None for f in fast):  # every layer fast: one call for all?
            done = self.engine.run_stack(fast, hidden, lean_table, mask, cache, keep, norm)
            if done is not None:
                return done
        for i, (layer, lean_layer) in enumerate(zip(layers, fast)):
            if i in keep:
                inputs[i] = hidden
            if lean_layer is not None:
                hidden = self.engine.run_layer(lean_layer, hidden, lean_table, mask, cache)
                continue
            out = layer(
                hidden, attention_mask=mask, position_ids=self._positions(position_offset), use_cache=True,
                **cache_arg(layer, cache), position_embeddings=rope,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return (hidden if norm is None else norm(hidden)), inputs

    def _positions(self, offset: int) -> torch.Tensor:
        """The layout's rotary positions + offset [B, n]."""
        return self.positions + offset if offset else self.positions

    def _rotary(self, hidden: torch.Tensor, offset: int, hf: bool, fast: bool):
        """The rotary (cos, sin) [B, n, head_dim] at the layout's positions + offset for HF layers (if hf) and their
        `lean_rope` form for lean layers (if fast; made once for all of them), looked up in the context's table where
        it holds them: for one row at consecutive positions (a chain, an `observe`) as a view of its rows."""
        if self.rope is None:
            self.rope = RotaryTable(self.base.rotary_emb, hidden, self.max_len)
        if self.rope.covers(self.span[0] + offset, self.span[1] + offset):
            if self._start is not None and not hf:
                return None, self.rope.lean_run(self._start + offset, len(self.rel))
            pos = self._positions(offset)
            return self.rope(pos) if hf else None, self.rope.lean(pos) if fast else None
        rope = self.base.rotary_emb(hidden, self._positions(offset))
        return rope, lean_rope(*rope) if fast else None

    def _lean(self, layers: Sequence[nn.Module]) -> list[nn.Module | None]:
        """The engine's fast form of each layer, None where it runs its own HF forward. Looked up once per context and
        stack of layers: a decode does not replace weights, and checking that every layer's lean form is still current
        took ~0.3 ms of a 7.6 ms AR step."""
        if torch.is_grad_enabled():  # (the fast forms are for decoding)
            return [None] * len(layers)
        key = tuple(map(id, layers))
        have = self._leans.get(key)
        if have is None:
            have = self._leans[key] = (list(layers), [self.engine.fast_layer(layer) for layer in layers])  # (ids kept)
        return have[1]

    def run_model(self, model: nn.Module, input_ids: torch.Tensor, store: str) -> torch.Tensor:
        """DraftContext.run_model: a whole HF decoder stack over input_ids [B, m], the last m queries of the current
        layout, on `store` -> its last hidden state [B, m, H']."""
        start = len(self.rel) - input_ids.shape[1]
        if start < 0:
            raise ValueError(f"run_model got {input_ids.shape[1]} queries for a layout of {len(self.rel)}")
        # the mask is None only for a single query, which never has start > 0
        mask = self.mask[:, :, start:] if start else self.mask
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=self.positions[:, start:],
                    use_cache=True, **cache_arg(model, self._store(store, start)))
        return out.last_hidden_state

    def base_forward(self, input_ids: torch.Tensor, feature_layers: Sequence[int] = ()):
        """The base over input_ids [B, n] in the current layout, writing the base store: embeddings, its layers
        (lean where every one has a lean forward, else the model's own forward) and final norm. Returns the normed
        last hidden state [B, n, H] and {layer: [B, n, H]} for feature_layers (HF's hidden_states numbering:
        l = the input of layer l, 0 = the embeddings; num_layers or -1 = the normed output)."""
        return self._base_forward(input_ids, feature_layers)[:2]

    def verify_forward(self, input_ids: torch.Tensor, feature_layers: Sequence[int] = ()):
        """base_forward at T = 0: the base's greedy tokens [B, n] (`checked_argmax` of its logits: -1 where a query's
        logits are not finite) and the features, the lm_head and argmax recorded with the layers where the forward
        is replayed from a graph."""
        _, feats, target = self._base_forward(input_ids, feature_layers, self.base.lm_head)
        return target, feats

    def _base_forward(self, input_ids: torch.Tensor, feature_layers: Sequence[int], head: nn.Module | None = None
                      ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """(hidden, features) as `base_forward` returns them, and with a head `checked_argmax(head(hidden))`."""
        base, n = self.base, self.base.num_layers
        fast = self._lean(base.layers)
        top = None
        if all(f is not None for f in fast):  # the model's forward, embeddings to norm, with every layer lean
            wanted = {l % (n + 1) for l in feature_layers}
            pool = self._graph_pool("base", fast, input_ids)
            if pool is not None:
                hidden, inputs, top = pool.forward(fast, input_ids, self._at, *self._graph_layout(), embed=True,
                                                   keep=wanted - {n}, head=head)
            else:
                hidden, inputs = self._run(base.layers, fast, base.embed_tokens(input_ids), self._store("base"),
                                           keep=wanted - {n}, norm=base.norm)
            feats = {l: hidden if l % (n + 1) == n else inputs[l % (n + 1)] for l in feature_layers}
        else:
            out = base.model.model(
                input_ids=input_ids, attention_mask=self.mask, position_ids=self.positions,
                use_cache=True, output_hidden_states=bool(feature_layers),
                **cache_arg(base.model.model, self._store("base")),
            )
            hidden = out.last_hidden_state
            feats = {l: out.hidden_states[l] for l in feature_layers} if feature_layers else {}
        if head is not None and top is None:  # an eager forward: the same argmax, op by op
            top = checked_argmax(head(hidden))
        return hidden, feats, top

    def _graph_pool(self, store: str, fast: list[nn.Module | None], x: torch.Tensor):
        """The engine's recorded-graph pool for this forward, or None where it runs eagerly."""
        return self.engine.graph_pool(self, store, fast, x) if self.graphs else None

    def _graph_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layout as a recorded forward takes it: rel [n], depth [n], visible [n, r] on the device."""
        return self.on_device(self.rel), self.on_device(self.depth), self.on_device(self._visible.contiguous())

    # -- a drafter's calls in one go, where the engine has them (DraftContext) -------------------------
    def feature_chain(self, drafter: nn.Module, parts, root: torch.Tensor, gamma: int, store: str,
                      position_offset: int, stop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """DraftContext.feature_chain: the engine's whole greedy chain of a feature drafter, or None."""
        return self.engine.feature_chain(drafter, parts, self, root, gamma, store, position_offset, stop)

    def feature_entries(self, drafter: nn.Module, parts, features: torch.Tensor, tokens: torch.Tensor, store: str,
                        position_offset: int, otherwise) -> torch.Tensor:
        """DraftContext.feature_entries: a feature drafter's real entries, in one call where the engine has one."""
        return self.engine.feature_entries(drafter, parts, self, features, tokens, store, position_offset, otherwise)

    def head_chain(self, drafter: nn.Module, heads: list, embed: torch.Tensor, vocab: torch.Tensor | None,
                   h: torch.Tensor, root: torch.Tensor, top: int = 1) -> torch.Tensor | None:
        """DraftContext.head_chain: the engine's whole chain of Hydra heads, or None."""
        return self.engine.head_chain(drafter, heads, embed, vocab, h, root, top)

    # -- bookkeeping ---------------------------------------------------------------------------
    def move_path(self, verify_rel: torch.Tensor, draft_rel: torch.Tensor) -> None:
        """Move the accepted path to contiguous slots L_b, L_b + 1, ... in every store. verify_rel / draft_rel
        [B, k]: round-relative slots of the path in the verify forward (base store) and in `expand` (other
        stores); they differ only when a dynamic tree is pruned between drafting and verification."""
        dst = self.length[:, None] + torch.arange(verify_rel.shape[1], device=self.length.device)  # [B, k]
        for name, store in self.stores.items():
            src = verify_rel if name == "base" else draft_rel
            store.move(self.length[:, None] + src, dst)

    def keep_rows(self, keep: list[int]) -> None:
        """Drop every row but those at batch positions `keep` [B'] from the lengths and every store."""
        index = torch.tensor(keep, device=self.length.device)
        if self.pools:  # the stores become copies of fewer rows: eager forwards from here on
            for pool in self.pools.values():
                pool.owner = None
            self.pools, self.graphs = {}, False
        self.length = self.length[index]
        self.length_host = [self.length_host[i] for i in keep]
        for store in self.stores.values():
            store.keep_rows(index)

    def commit(self, n_new: torch.Tensor, n_new_host: list[int]) -> None:
        """Advance each row's committed length by n_new [B] (given on host too, to avoid a sync). A new tensor, not in
        place: the current layout's lazily made slots and positions stay at the lengths it was laid out at."""
        self.length = self.length + n_new
        self.length_host = [l + k for l, k in zip(self.length_host, n_new_host)]
