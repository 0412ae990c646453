"""The prophet's greedy chain as one native call (chain.c), and its `observe` as another, for one row on the CPU;
and Hydra's chain of heads as one call (`head_chain`, at the end). No other family calls them (EAGLE-3 drafts
through PyTorch).

Drafted depth by depth from Python, each depth of the prophet is ~40 PyTorch ops and a layer stack's argument handling
around its three small products, and its `observe` (fc over the newly committed entries, then its layers) spends much
of its time outside the layers' call: at one row that dispatch, not the arithmetic, is most of a depth's cost.
chain.c runs each in one call over the same weight copies: the decoder
layers' native forms (native_layer.py, attached where measurement picked them for that many rows) and, for fc and the
head, the copy each one's measured kernel multiplies from at that many rows where chain.c can read it (a compact or
packed copy), else its float32 weight packed. So they compute what the PyTorch path computes, the sums in another order.

`draft` and `_native_entries` return None (the caller then runs the PyTorch path) wherever chain.c does not take the
call: off the CPU, a batch of several rows, no native layers for those rows (a prefill), a norm of another formula, a
window past the cache. The chains run wherever they can (the engine's whole_chains off: never); `entries` is timed
against that path over a drafter's first calls and the faster kept (`Race`, unless the config decides it)."""

from __future__ import annotations

import ctypes
import time
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from specdec.drafters.drafter import ChainParts, HeadParts
from specdec.engines.cpu import native, native_layer
from specdec.engines.cpu.compact import Compact
from specdec.engines.cpu.kernels import default_table
from specdec.engines.eager.lean import rms_form
from specdec.engines.measure import Race

if TYPE_CHECKING:
    from specdec.sampling.context import SamplingContext


class _Chain(ctypes.Structure):
    """chain.c's chain_t."""

    _fields_ = [("embed", ctypes.c_void_p), ("emb_norm", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("fc", ctypes.c_void_p), ("head", ctypes.c_void_p), ("vocab", ctypes.c_void_p),
                ("layers", ctypes.c_void_p)] + \
               [(name, ctypes.c_int) for name in ("count", "hidden", "draft_vocab", "rope_dim", "fc_form",
                                                  "head_form")] + \
               [("emb_eps", ctypes.c_float), ("norm_eps", ctypes.c_float)]


def _copy(lin: nn.Linear, rows: int = 1) -> Compact | native.Packed:
    """The copy of lin's weight chain.c multiplies from at `rows` rows: the one its measured kernel uses there where
    chain.c reads that form (kernels._forward keeps the plan), else the float32 weight (or its bfloat16 copy) packed."""
    plan = getattr(lin.__dict__.get("forward"), "plan", None)
    chosen = plan[rows] if plan is not None and len(plan) > rows else None
    operand = chosen[1] if chosen is not None else lin.weight
    if isinstance(operand, (Compact, native.Packed)):
        return operand
    if isinstance(operand, torch.Tensor) and operand.layout == torch.strided and operand.shape == lin.weight.shape \
            and operand.dtype in (torch.float32, torch.bfloat16):
        return native.pack(operand.detach())  # the same numbers (a bfloat16 copy's, where the kernel reads one)
    return native_layer._operand(default_table(), "exact")(lin.weight.detach())  # packed once per weight


class FeatureChain:
    """One drafter's chain_t and what it points into (kept alive here), made once per decode (`witness`)."""

    def __init__(self, parts: ChainParts, natives: list[native_layer.NativeLayer], witness: tuple):
        self.witness, self.natives, self.fc = witness, natives, parts.fc
        self.copies = [_copy(parts.fc), _copy(parts.head)]  # kept alive: chain.c reads them by address
        self.fc_copies: dict[int, tuple] = {}  # rows -> (fc's copy, its form) for the entries (`fc_copy`)
        self.layers, self.shapes = native_layer.pointers(natives)  # (the array kept: chain.c reads it by address)
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

    def fc_copy(self, rows: int) -> tuple[Compact | native.Packed, int]:
        """fc's copy at `rows` rows and its layer.c form code."""
        have = self.fc_copies.get(rows)
        if have is None:
            copy = _copy(self.fc, rows)
            have = self.fc_copies[rows] = (copy, native_layer.FORMATS[native_layer._held_as(copy)])
        return have


_CHAINS: weakref.WeakKeyDictionary[nn.Module, FeatureChain] = weakref.WeakKeyDictionary()  # drafter -> its chain


def _chain(drafter: nn.Module, parts: ChainParts, ctx: SamplingContext, x: torch.Tensor) -> FeatureChain | None:
    """The drafter's FeatureChain for this decode, or None where chain.c takes no call: no library, off the CPU, several
    rows, not float32 (x [B, n, H]), no native layers for one row, a norm of another formula."""
    lib = native._load()
    if (lib is None or x.device.type != "cpu" or x.shape[0] != 1
            or x.dtype != torch.float32):
        return None
    # the native forms the sampler attached to the first block for this decode (`native_layer.attach` gives each decode
    # a list of its own): nothing chain.c reads changes within a decode
    first = ctx._lean(parts.blocks)[0]
    witness = None if first is None else (first, native_layer.rows_of(first))
    chain = _CHAINS.get(drafter)
    if chain is not None and witness is not None and chain.witness[0] is first and chain.witness[1] is witness[1]:
        return chain
    natives = _natives(ctx, parts, 1)
    if (natives is None or parts.embed.dtype != torch.float32 or not parts.embed.is_contiguous()
            or rms_form(parts.emb_norm) is None or rms_form(parts.norm) is None):
        return None
    chain = _CHAINS[drafter] = FeatureChain(parts, natives, witness)
    return chain


def _natives(ctx: SamplingContext, parts: ChainParts, rows: int) -> list[native_layer.NativeLayer] | None:
    """The drafter's layers' native forms for `rows` rows (attached where measurement picked them), or None."""
    natives = [native_layer.for_rows(f, rows) if f is not None else None
               for f in ctx._lean(parts.blocks)]
    return None if any(n is None for n in natives) else natives


def draft(drafter: nn.Module, parts: ChainParts, ctx: SamplingContext, root: torch.Tensor, gamma: int, store: str,
          position_offset: int, stop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The greedy chain of γ tokens from root [1, 1, H] (the root entry's layer output) as `expand` would draft it depth
    by depth, its layers' keys and values written to `store` in the same slots -> (tokens [1, γ] base ids, each depth's
    ĥ [1, γ, H]), or None where chain.c does not take the call (see the module docstring). With stop > 0 the chain
    ends after its first token whose top-1 probability is < stop (an adaptive draft length): [1, d] and [1, d, H],
    d ≤ γ."""
    chain = _chain(drafter, parts, ctx, root)
    if chain is None or store not in ctx.stores:
        return None
    length = ctx.length_host[0]
    first, last = length + 1 + position_offset, length + gamma - 1 + position_offset  # depths 1 .. γ-1
    if length + gamma > ctx.max_len or ctx.rope is None or (gamma > 1 and not ctx.rope.covers(first, last)):
        return None
    if not all(n.bind(ctx.stores[store], root) for n in chain.natives):
        return None
    lib = native._library()
    tokens = torch.empty(1, gamma, dtype=torch.long)
    hats = torch.empty(1, gamma, root.shape[-1])
    # the rotary rows of depths 1 .. γ-1: [1, 1, γ-1, d] each, views of the context's table (none read at γ = 1)
    cos, sin = ctx.rope.lean_run(first, gamma - 1) if gamma > 1 else (hats, hats)
    threads = torch.get_num_threads()
    scratch = native_layer._scratch(max(lib.smallm_layer_scratch(ctypes.byref(l.struct), 1, length + gamma, threads)
                                        for l in chain.shapes))
    done = lib.smallm_feature_chain(ctypes.byref(chain.struct), root.contiguous().data_ptr(), gamma, cos.data_ptr(),
                                    sin.data_ptr(), length, scratch.data_ptr(), chain.work.data_ptr(), threads,
                                    tokens.data_ptr(), hats.data_ptr(), stop)
    if done < 1:
        return None
    return (tokens, hats) if done == gamma else (tokens[:, :done], hats[:, :done])


def entries(drafter: nn.Module, parts: ChainParts, ctx: SamplingContext, features: torch.Tensor,
            tokens: torch.Tensor, store: str, position_offset: int,
            otherwise: Callable[[], torch.Tensor], race: Race) -> torch.Tensor:
    """The drafter's real entries in the context's current layout: otherwise() (its `run_layers(blocks,
    step_input(features, embed(tokens)), store, position_offset)`) -> the layers' output [1, n, H], their keys and values
    written to `store`; as one native call where chain.c takes it (see `_native_entries`) and, timed against
    otherwise() over the drafter's first calls, that is the faster way here (`race`: the engine's, which the config
    may have decided)."""
    start = time.perf_counter()
    if race.first():
        out = _native_entries(drafter, parts, ctx, features, tokens, store, position_offset)
        if out is not None:
            race.record(True, time.perf_counter() - start)
            return out
        return otherwise()  # (not taken: not timed)
    out = otherwise()
    race.record(False, time.perf_counter() - start)
    return out




def _native_entries(drafter: nn.Module, parts: ChainParts, ctx: SamplingContext, features: torch.Tensor,
                    tokens: torch.Tensor, store: str, position_offset: int) -> torch.Tensor | None:
    """`entries` in one native call (features [1, n, H], tokens [1, n]), or None where chain.c does not take it (see
    `_chain`; also more rows than the native layers were measured for: a prefill)."""
    chain = _chain(drafter, parts, ctx, features)
    n = features.shape[1]
    natives = None if chain is None else _natives(ctx, parts, n)
    if natives is None:
        return None
    cache = ctx._store(store)
    if not all(l.bind(cache, features) for l in natives):
        return None
    _, rope = ctx._rotary(features, position_offset, False, True)
    out = torch.empty_like(features)
    layers, shapes = native_layer.pointers(natives)
    call = native_layer._Call(out, rope, ctx.mask, cache, shapes)
    fc, form = chain.fc_copy(n)
    work = torch.empty(n, 2 * features.shape[-1])
    done = native._library().smallm_feature_entries(
        ctypes.byref(chain.struct), fc.blocks.data_ptr(), form, layers, len(natives),
        features.contiguous().data_ptr(), tokens.contiguous().data_ptr(), work.data_ptr(), out.data_ptr(), *call.args)
    return out if done == 0 else None


# -- Hydra's chain of heads ------------------------------------------------------------------------------------------
class _Linear(ctypes.Structure):
    """chain.c's linear_t."""

    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("form", ctypes.c_int), ("inputs", ctypes.c_int),
                ("outputs", ctypes.c_int)]


class _Head(ctypes.Structure):
    """chain.c's head_t."""

    _fields_ = [("in_proj", _Linear), ("head", _Linear), ("blocks", ctypes.c_void_p), ("emb_norm", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("count", ctypes.c_int)]


class HeadChain:
    """A Hydra drafter's head_t's for a chain of len(heads) and what they point into (kept alive here), made once per
    decode (`current`)."""

    def __init__(self, heads: list[HeadParts], embed: torch.Tensor, vocab: torch.Tensor | None):
        self.embed, self.vocab, self.keep = embed, vocab, []
        # a linear whose kernel plan the sampler patched in for this decode (`supports`: there is one): nothing chain.c
        # reads changes within a decode, and the next decode patches a new plan
        self.witness = next((l, l.forward) for part in heads for l in (part.in_proj, *part.blocks, part.head)
                            if getattr(l.__dict__.get("forward"), "plan", None) is not None)
        self.structs = (_Head * len(heads))()
        for s, part in zip(self.structs, heads):
            s.in_proj, s.head = self._linear(part.in_proj), self._linear(part.head)
            blocks = (_Linear * len(part.blocks))(*(self._linear(l) for l in part.blocks))
            self.keep.append(blocks)
            s.blocks, s.count = ctypes.addressof(blocks), len(part.blocks)
            weight, s.eps = rms_form(part.emb_norm)
            s.emb_norm = weight.data_ptr()
        self.hidden, self.size = embed.shape[1], heads[0].head.out_features
        self.work = torch.empty(native._library().smallm_head_chain_work(len(heads), self.hidden, self.size))

    @staticmethod
    def supports(heads: list[HeadParts], embed: torch.Tensor) -> bool:
        """Whether chain.c computes these heads: float32 on the CPU, norms of F.rms_norm's formula, within the
        CPU engine's measured kernels (some linear has a plan: the eager engine runs PyTorch's own ops)."""
        linears = [l for part in heads for l in (part.in_proj, *part.blocks, part.head)]
        return (embed.dtype == torch.float32 and embed.device.type == "cpu" and embed.is_contiguous()
                and all(l.weight.dtype == torch.float32 and l.weight.device.type == "cpu" for l in linears)
                and any(getattr(l.__dict__.get("forward"), "plan", None) is not None for l in linears)
                and all(rms_form(part.emb_norm) is not None for part in heads))

    def current(self, embed: torch.Tensor, vocab: torch.Tensor | None) -> bool:
        """Whether it was made in this decode, for these tensors (one lookup: a full check of every weight's version
        would cost a noticeable share of a round)."""
        lin, plan = self.witness
        return lin.__dict__.get("forward") is plan and embed is self.embed and vocab is self.vocab

    def _linear(self, lin: nn.Linear) -> _Linear:
        copy = _copy(lin)
        bias = None if lin.bias is None else lin.bias.detach().contiguous()
        self.keep += [copy, bias]
        return _Linear(copy.blocks.data_ptr(), None if bias is None else bias.data_ptr(),
                       native_layer.FORMATS[native_layer._held_as(copy)], lin.in_features, lin.out_features)


# drafter -> chain length -> its head chain
_HEADS: weakref.WeakKeyDictionary[nn.Module, dict[int, HeadChain]] = weakref.WeakKeyDictionary()


def head_chain(drafter: nn.Module, heads: list[HeadParts], embed: torch.Tensor, vocab: torch.Tensor | None,
               h: torch.Tensor, root: torch.Tensor, top: int = 1) -> torch.Tensor | None:
    """The greedy chain of len(heads) tokens that a Hydra drafter's `expand` calls would draft from its newest base
    feature h [1, H] and the root token root [1] (head d reading the root and the d tokens drafted before), as one
    native call -> tokens [1, γ − 1 + top] (base ids; with top > 1 the last head's `top` best tokens, best first, in
    place of its top-1); None where chain.c does not take it: no library, off the CPU, several rows, not float32
    (`HeadChain.supports`)."""
    lib = native._load()
    if (lib is None or h.device.type != "cpu" or h.shape[0] != 1
            or h.dtype != torch.float32):
        return None
    chains = _HEADS.setdefault(drafter, {})
    gamma = len(heads)
    chain = chains.get(gamma)
    if chain is None or not chain.current(embed, vocab):
        if not HeadChain.supports(heads, embed):
            return None
        chain = chains[gamma] = HeadChain(heads, embed, vocab)
    tokens = torch.empty(1, gamma - 1 + top, dtype=torch.long)
    done = lib.smallm_head_chain(chain.structs, gamma, top, embed.data_ptr(),
                                 None if vocab is None else vocab.data_ptr(), chain.hidden, chain.size,
                                 h.contiguous().data_ptr(), int(root), chain.work.data_ptr(), torch.get_num_threads(),
                                 tokens.data_ptr())
    return tokens if done == 0 else None
