"""A feature drafter's greedy chain (the prophet's, EAGLE's) as one native call (chain.c), for one row on the CPU.

Drafted depth by depth from Python, each depth of the prophet is ~40 PyTorch ops and a layer stack's argument handling
around its three products: on a 2-core Zen 5 EPYC, 315 µs a depth (c ≈ 0.1 of an AR step) of which the native layer
call is 58 and the draft head ~60. chain.c runs the whole chain in one call over the same weight copies: the decoder
layers' native forms (native_layer.py, attached where measurement picked them for one row) and, for fc and the head,
the copy each one's measured kernel multiplies from at one row where chain.c can read it (a compact or packed copy),
else its float32 weight packed. So it drafts what the Python chain drafts, its sums in another order.

`draft` returns None (the caller then drafts depth by depth) wherever chain.c does not take the call: off the CPU, a
batch of several rows, no native layers attached, a norm of another formula, a window past the cache. Whether it is
used at all where it does is decided by timing it against the depth-by-depth draft (trees._greedy_chain)."""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdec.sampling import native, native_layer
from specdec.sampling.compact import Compact
from specdec.sampling.kernels import default_table
from specdec.sampling.lean import rms_form

if TYPE_CHECKING:
    from specdec.sampling.context import SamplingContext


@dataclass(frozen=True)
class ChainParts:
    """What a feature drafter's depth is made of: the token embeddings [V, H], the embedding's RMSNorm, fc [H, 2H]
    over [ĥ; norm(emb)], the decoder layers, the final RMSNorm (-> ĥ), the vocab head [V_d, H] and the draft vocab's
    base token ids [V_d] (None without one)."""

    embed: torch.Tensor
    emb_norm: nn.Module
    fc: nn.Linear
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Linear
    vocab: torch.Tensor | None


class _Chain(ctypes.Structure):
    """chain.c's chain_t."""

    _fields_ = [("embed", ctypes.c_void_p), ("emb_norm", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("fc", ctypes.c_void_p), ("head", ctypes.c_void_p), ("vocab", ctypes.c_void_p),
                ("layers", ctypes.c_void_p)] + \
               [(name, ctypes.c_int) for name in ("count", "hidden", "draft_vocab", "rope_dim", "fc_form",
                                                  "head_form")] + \
               [("emb_eps", ctypes.c_float), ("norm_eps", ctypes.c_float)]


def _copy(lin: nn.Linear) -> Compact | native.Packed:
    """The copy of lin's weight chain.c multiplies from: the one its measured kernel uses at one row where chain.c
    reads that form (kernels._forward keeps the plan), else the float32 weight (or its bfloat16 copy) packed."""
    plan = getattr(lin.__dict__.get("forward"), "plan", None)
    chosen = plan[1] if plan is not None and len(plan) > 1 else None
    operand = chosen[1] if chosen is not None else lin.weight
    if isinstance(operand, (Compact, native.Packed)):
        return operand
    if isinstance(operand, torch.Tensor) and operand.layout == torch.strided and operand.shape == lin.weight.shape \
            and operand.dtype in (torch.float32, torch.bfloat16):
        return native.pack(operand.detach())  # the same numbers (a bfloat16 copy's, where the kernel reads one)
    return native_layer._operand(default_table(), "exact")(lin.weight.detach())  # packed once per weight


class FeatureChain:
    """One drafter's chain_t and what it points into, for one set of native layers and kernel plans (`key`)."""

    def __init__(self, parts: ChainParts, natives: list[native_layer.NativeLayer], key: tuple):
        self.key, self.natives = key, natives
        self.copies = [_copy(parts.fc), _copy(parts.head)]  # kept alive: chain.c reads them by address
        self.layers = (ctypes.c_void_p * len(natives))(*(ctypes.addressof(l.struct) for l in natives))
        self.shapes = native_layer._shapes(natives)
        self.vocab = None if parts.vocab is None else parts.vocab.contiguous()
        (emb_w, emb_eps), (norm_w, norm_eps) = rms_form(parts.emb_norm), rms_form(parts.norm)
        self.keep = (parts.embed, emb_w, norm_w)
        c = self.struct = _Chain()
        c.embed, c.emb_norm, c.norm = (t.data_ptr() for t in self.keep)
        c.fc, c.head = (p.blocks.data_ptr() for p in self.copies)
        c.fc_form, c.head_form = (native_layer.FORMATS[native_layer._held_as(p)] for p in self.copies)
        c.vocab = None if self.vocab is None else self.vocab.data_ptr()
        c.layers, c.count = ctypes.addressof(self.layers), len(natives)
        c.hidden, c.draft_vocab = parts.embed.shape[1], parts.head.weight.shape[0]
        c.rope_dim = natives[0].fast.head_dim
        c.emb_eps, c.norm_eps = emb_eps, norm_eps
        lib = native._library()
        self.work = torch.empty(lib.smallm_chain_work(ctypes.byref(c)))


_CHAINS: weakref.WeakKeyDictionary[nn.Module, FeatureChain] = weakref.WeakKeyDictionary()  # drafter -> its chain


def draft(drafter: nn.Module, parts: ChainParts, ctx: SamplingContext, root: torch.Tensor, gamma: int, store: str,
          position_offset: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The greedy chain of γ tokens from root [1, 1, H] (the root entry's layer output) as `expand` would draft it depth
    by depth, its layers' keys and values written to `store` in the same slots -> (tokens [1, γ] base ids, each depth's
    ĥ [1, γ, H]), or None where chain.c does not take the call (see the module docstring)."""
    lib = native._load()
    if (lib is None or not hasattr(lib, "smallm_feature_chain") or root.device.type != "cpu" or root.shape[0] != 1
            or root.dtype != torch.float32 or parts.embed.dtype != torch.float32 or not parts.embed.is_contiguous()
            or store not in ctx.stores):
        return None
    fasts = ctx._lean(parts.blocks)
    natives = [f.native_rows[1] if f is not None and len(f.native_rows) > 1 else None for f in fasts]
    if any(n is None for n in natives) or rms_form(parts.emb_norm) is None or rms_form(parts.norm) is None:
        return None
    length = ctx.length_host[0]
    first, last = length + 1 + position_offset, length + gamma - 1 + position_offset  # depths 1 .. γ-1
    if length + gamma > ctx.max_len or ctx.rope is None or (gamma > 1 and not ctx.rope.covers(first, last)):
        return None
    cache = ctx.stores[store]
    if not all(n.bind(cache, root) for n in natives):
        return None
    key = (tuple(map(id, natives)), *(id(lin.__dict__.get("forward")) for lin in (parts.fc, parts.head)),
           *((w.data_ptr(), w._version) for w in (parts.fc.weight, parts.head.weight, parts.embed,
                                                   parts.emb_norm.weight, parts.norm.weight)))
    chain = _CHAINS.get(drafter)
    if chain is None or chain.key != key:
        chain = _CHAINS[drafter] = FeatureChain(parts, natives, key)
    tokens = torch.empty(1, gamma, dtype=torch.long)
    hats = torch.empty(1, gamma, root.shape[-1])
    # the rotary rows of depths 1 .. γ-1: [1, 1, γ-1, d] each, views of the context's table (none read at γ = 1)
    cos, sin = ctx.rope.lean_run(first, gamma - 1) if gamma > 1 else (hats, hats)
    threads = torch.get_num_threads()
    scratch = native_layer._scratch(max(lib.smallm_layer_scratch(ctypes.byref(l.struct), 1, length + gamma, threads)
                                        for l in chain.shapes))
    done = lib.smallm_feature_chain(ctypes.byref(chain.struct), root.contiguous().data_ptr(), gamma, cos.data_ptr(),
                                    sin.data_ptr(), length, scratch.data_ptr(), chain.work.data_ptr(), threads,
                                    tokens.data_ptr(), hats.data_ptr())
    return (tokens, hats) if done == 0 else None
