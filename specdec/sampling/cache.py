"""A preallocated KV cache written at explicit slots, one pointer per row (kept by the DraftContext).

HF attention layers call `cache.update(k, v, layer_idx)` and attend over whatever it returns; here `update`
scatters the new keys into the slots the context chose for this call and returns the slot window [0, width),
whose visibility the context's 4D mask decides. Rollback is therefore free: slots at or past a row's committed
length are never visible unless rewritten in the current call, so rejecting a draft just leaves them behind."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """K/V of one layer: [B, kv_heads, max_len, head_dim], allocated on the first write."""

    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        self.keys = key_states.new_zeros(b, h, self.owner.max_len, key_states.shape[-1])
        self.values = value_states.new_zeros(b, h, self.owner.max_len, value_states.shape[-1])
        self.is_initialized = True
        self.owner.version += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.write_slots  # [B, n]
        if self.owner.write_start is not None:  # one contiguous run shared by all rows: a cheap slice copy
            s = self.owner.write_start
            self.keys[:, :, s : s + key_states.shape[2]] = key_states
            self.values[:, :, s : s + value_states.shape[2]] = value_states
        else:
            index = slots[:, None, :, None]  # [B, 1, n, 1]
            self.keys.scatter_(2, index.expand_as(key_states), key_states)
            self.values.scatter_(2, index.expand_as(value_states), value_states)
        w = self.owner.width
        return self.keys[:, :, :w], self.values[:, :, :w]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return self.owner.max_len


class SlotCache(Cache):
    """One store: a SlotLayer per `layer_idx`, created on first use (drafter-built layers may use any index)."""

    def __init__(self, max_len: int):
        super().__init__(layers=[])
        self.max_len = max_len
        # Set by the context before every forward through this store.
        self.write_slots: torch.Tensor | None = None  # [B, n] slot of each query
        self.write_start: int | None = None  # set when write_slots is the same arange(s, s+n) for every row
        self.width = 0  # keys returned: slots [0, width)
        # bumped whenever a layer's buffers are (re)placed: a native layer bound to them reads their addresses again
        self.version = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def buffers(self, layer_idx: int, like: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """Layer `layer_idx`'s key and value stores [B, kv_heads, max_len, head_dim], allocated here if no `update`
        has yet (B and dtype from like [B, n, H]): for a native layer, which writes them itself."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SlotLayer(self))
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            shape = (like.shape[0], kv_heads, 0, head_dim)
            layer.lazy_initialization(like.new_empty(shape), like.new_empty(shape))
        return layer.keys, layer.values

    def share(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make layer `layer_idx` store into the given buffers [B, kv_heads, >= max_len, head_dim] (a CUDA graph
        pool's, which its recorded forwards write too)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SlotLayer(self))
        layer = self.layers[layer_idx]
        layer.keys, layer.values, layer.is_initialized = keys, values, True
        self.version += 1

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` [B'] of every layer."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.version += 1

    @torch.no_grad()
    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src [B, k] to dst [B, k] in every layer (the accepted path -> contiguous slots).
        All sources are read before any write, so overlapping ranges are safe."""
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            for buf in (layer.keys, layer.values):
                h, d = buf.shape[1], buf.shape[3]
                taken = buf.gather(2, src[:, None, :, None].expand(-1, h, -1, d))  # [B, h, k, d]
                buf.scatter_(2, dst[:, None, :, None].expand(-1, h, -1, d), taken)
