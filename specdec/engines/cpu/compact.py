"""Exact compact forms of float32 weights: the same numbers, bit for bit, in a quarter to an eighth of the bytes.

A decode step on a CPU streams every weight once, so its time is the weights' bytes over the memory bandwidth. Many
float32 weights carry far fewer bits than 32: a model dequantised from a GGUF file holds, per block of 32 weights of a
row, w = fp32(d·q + m) with fp16 d and m and a 4-bit q (llama.cpp's Q4_1) or w = d·q with an 8-bit q (Q8_0), and a
checkpoint saved in bfloat16 and loaded in float32 holds bfloat16 values. The embedded SmolLM2 is the first kind: its
layers are Q4_1 and its tied embedding / lm_head Q8_0 inside the GGUF, and transformers dequantises them to float32.

`form(w)` finds such a form where one reproduces EVERY element of w exactly (checked by decoding it back and comparing
the float32 bits), and smallm.c's compact kernels decode it in registers: for Q4_1 blocks fma(d, q, m) in float32,
which is the exact float32 rounding of d·q + m (d·q is exact in float32: 11 + 4 significant bits), i.e. the very
number dequantisation stored; for Q8_0 blocks d·q, exact as well. The product then multiplies with the model's own
float32 weights and sums in float32, like every other exact kernel (only the order of the sum differs), so greedy
decoding stays the base's; there is no approximation to bound. A weight without such a form (any trained float32
weight) simply has none, and the kernels that read float32 serve it.

Layouts (what the kernels read), per packed block of R output rows (R = smallm_pack_rows(), 2·V with V lanes per
vector) and per group of 32 input columns, the groups of a block consecutive:
  q4:   d [R] float16, m [R] float16, then 32 columns of V bytes: byte k holds row k's q (low nibble) and row
        k + V's (high nibble)                                                           -> 0.625 bytes per weight
  q8:   d [R] float16, then 32 columns of R int8                                          -> 1.0625 bytes per weight
  bf16: smallm_packed's layout over the bfloat16 values (native.pack)                      -> 2 bytes per weight
and, for a drafter's weights only (rounded, never exact), per block of 16 output rows and group of 32 columns:
  q4a8: d [16] float16, m [16] float16, then 4 units of 64 bytes: byte 4r + k of unit u holds row r's q of column
        4u + k (low nibble) and of column 16 + 4u + k (high nibble); multiplied by x rounded to int8 per group
        (smallm.c's smallm_q4a8)                                                          -> 0.625 bytes per weight"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from specdec.engines.cpu import native

GROUP = 32  # weights per (d, m) block along a row: llama.cpp's QK4_1 and QK8_0


@dataclass(frozen=True)
class Compact:
    """A weight [O, I] in one of the layouts above, `kind` q4 | q8 | bf16."""

    kind: str
    blocks: torch.Tensor  # uint8 (q4, q8) or the bf16 packed blocks [ceil(O/R), I, R]
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()


# id(weight) -> (a weak reference to it, its version, its form): found once per weight, dropped with it
_FORMS: dict[int, tuple[weakref.ref, int, Compact | None]] = {}


@torch.no_grad()
def form(w: torch.Tensor) -> Compact | None:
    """w's exact compact form (the narrowest of q4, q8, bf16 that reproduces it), or None; found once per weight (and
    again if it changed in place). Needs a float32 2-D CPU weight (q4, q8: rows of whole groups) and the native
    library."""
    ref, version, found = _FORMS.get(id(w), (None, None, None))
    if ref is not None and ref() is w and version == w._version:
        return found
    found = _find(w.detach())
    _FORMS[id(w)] = (weakref.ref(w, lambda _, k=id(w): _FORMS.pop(k, None)), w._version, found)
    return found


def _find(w: torch.Tensor) -> Compact | None:
    if not (w.dtype == torch.float32 and w.dim() == 2 and w.device.type == "cpu" and native.available()):
        return None
    o, i = w.shape
    if i % GROUP == 0:
        q4 = q4_blocks(w)
        if q4 is not None:
            return Compact("q4", pack_q4(*q4), o, i)
        q8 = q8_blocks(w)
        if q8 is not None:
            return Compact("q8", pack_q8(*q8), o, i)
    bf16 = w.to(torch.bfloat16)
    if torch.equal(bf16.float(), w):
        return Compact("bf16", native.pack(bf16).blocks, o, i)
    return None


def _codes(x: torch.Tensor, d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """round(x / d) clamped to [lo, hi], 0 where the scale d is 0 (an all-equal group)."""
    return (x / torch.where(d > 0, d, torch.ones_like(d))).round().clamp(lo, hi)


def _fp16_exact(t: torch.Tensor) -> torch.Tensor:
    """Where float64 t holds a float16 value (finite)."""
    return torch.isfinite(t) & (t.to(torch.float16).double() == t)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise a == b as float32 bit patterns (so -0.0 is not 0.0: the decoded weight is the stored one)."""
    return a.view(torch.int32) == b.view(torch.int32)


def q4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d [O, G], m [O, G] float32 holding float16 values, q [O, I] uint8 in 0..15) with w == fp32(d·q + m) for every
    element (G = I/32, each (d, m) shared by a row's 32 consecutive weights), or None.

    m is the group's minimum (its q is 0); d is tried at the float16 values next to (max − m)/15 (the maximum's q is
    15, and any d that reproduces the whole group will do): each candidate's q = round((w − m)/d), kept per group
    where it decodes back to w exactly."""
    o, i = w.shape
    g = w.double().view(o, i // GROUP, GROUP)  # [O, G, 32]
    m = g.amin(-1, keepdim=True)  # [O, G, 1]
    if not bool(_fp16_exact(m).all()):
        return None
    target = w.view(o, i // GROUP, GROUP)
    d0 = ((g.amax(-1, keepdim=True) - m) / 15).to(torch.float16)
    best_d, best_q = torch.zeros_like(m), torch.zeros(o, i // GROUP, GROUP, dtype=torch.uint8)
    done = torch.zeros(o, i // GROUP, 1, dtype=torch.bool)
    bits = d0.view(torch.int16)
    for step in (0, -1, 1, -2, 2):
        d = (bits + step).view(torch.float16).double()  # the float16 `step` values away (d0 ≥ 0: bits are ordered)
        d = torch.where(d > 0, d, torch.zeros_like(d))
        q = _codes(g - m, d, 0, 15)
        # d·q (≤ 15 significant bits) and m (≤ 11) are exact in float64 and so is their sum unless their exponents
        # lie ~38 apart; the cast to float32 is then the one rounding an fma makes
        exact = (d * q + m).float()
        ok = _same_bits(exact, target).all(-1, keepdim=True) & ~done
        best_d = torch.where(ok, d, best_d)
        best_q = torch.where(ok, q.to(torch.uint8), best_q)
        done |= ok
        if bool(done.all()):
            break
    if not bool(done.all()) or not _sum_exact(best_d * best_q.double(), m):
        return None
    return best_d.squeeze(-1).float(), m.squeeze(-1).float(), best_q.view(o, i)


def _sum_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a + b (float64, broadcast) is exact everywhere (TwoSum's error term is zero)."""
    s = a + b
    bb = s - a
    return bool(((a - (s - bb)) + (b - bb) == 0).all())


def q8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d [O, G] float32 holding float16 values, q [O, I] int8 in -127..127) with w == d·q exactly, or None. d is
    the group's largest magnitude over 127 (that weight's q is ±127)."""
    o, i = w.shape
    g = w.double().view(o, i // GROUP, GROUP)
    d = g.abs().amax(-1, keepdim=True) / 127
    if not bool(_fp16_exact(d).all()):
        return None
    q = _codes(g, d, -127, 127)
    if not bool(_same_bits((d * q).float(), w.view(o, i // GROUP, GROUP)).all()):
        return None
    return d.squeeze(-1).float(), q.to(torch.int8).view(o, i)


def _blocked(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [O, ...] zero-padded to whole blocks of `rows` rows -> [ceil(O/rows), rows, ...]."""
    pad = -t.shape[0] % rows
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, rows, *t.shape[1:])


def pack_q4(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, r: int | None = None) -> torch.Tensor:
    """The q4 layout (module docstring) as uint8 [blocks·G·(4R + 16R)]: d, m [O, G] holding float16 numbers; R the
    library's block rows unless given (a test packs for a library built for other vectors)."""
    r = r or native._library().smallm_pack_rows()
    v = r // 2
    o, i = q.shape
    gs = i // GROUP
    scales = torch.stack([_blocked(d.half(), r), _blocked(m.half(), r)], 1)  # [nb, 2, R, G]
    scales = scales.permute(0, 3, 1, 2).contiguous().view(torch.uint8).flatten(2)  # [nb, G, 2·R·2] bytes
    qb = _blocked(q, r).view(-1, r, gs, GROUP)  # [nb, R, G, 32]
    nib = qb[:, :v] | (qb[:, v:] << 4)  # [nb, V, G, 32]: row k low, row k + V high
    nib = nib.permute(0, 2, 3, 1).reshape(-1, gs, GROUP * v)  # [nb, G, 32·V]: column by column
    return native.huge_pages(torch.cat([scales, nib], -1).reshape(-1).contiguous())


def pack_q8(d: torch.Tensor, q: torch.Tensor, r: int | None = None) -> torch.Tensor:
    """The q8 layout (module docstring) as uint8 [blocks·G·(2R + 32R)]: d [O, G] holding float16 numbers; R as pack_q4."""
    r = r or native._library().smallm_pack_rows()
    o, i = q.shape
    gs = i // GROUP
    scales = _blocked(d.half(), r).permute(0, 2, 1).contiguous().view(torch.uint8)  # [nb, G, R·2] bytes
    qb = _blocked(q, r).view(-1, r, gs, GROUP).permute(0, 2, 3, 1).reshape(-1, gs, GROUP * r)  # [nb, G, 32·R]
    return native.huge_pages(torch.cat([scales, qb.view(torch.uint8)], -1).reshape(-1).contiguous())


A8_ROWS = 16  # output rows per block of the q4a8 layout (smallm.c's A8_ROWS)
# how far a q4a8 product may be from the float32 product of its rounded weights, as a fraction of the output's largest
# magnitude: x rounded to int8 per group of 32 moves each product by up to ~1 % of it (the kernel table's check, and
# a native layer's against its lean form)
A8_TOLERANCE = 5e-2


def pack_q4a8(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The q4a8 layout (module docstring) as uint8 [blocks·G·320]: d, m [O, G] float16, q [O, I] uint8 in 0..15."""
    o, i = q.shape
    gs = i // GROUP
    scales = torch.stack([_blocked(d, A8_ROWS), _blocked(m, A8_ROWS)], 1)  # [nb, 2, 16, G] float16
    scales = scales.permute(0, 3, 1, 2).contiguous().view(torch.uint8).flatten(2)  # [nb, G, 64] bytes
    qb = _blocked(q, A8_ROWS).view(-1, A8_ROWS, gs, 2, 4, 4)  # [nb, r, G, half, u, k]: column 16·half + 4u + k
    nib = qb[:, :, :, 0] | (qb[:, :, :, 1] << 4)  # [nb, r, G, u, k]
    nib = nib.permute(0, 2, 3, 1, 4).reshape(-1, gs, 4 * A8_ROWS * 4)  # [nb, G, 256]: unit by unit, row by row
    return native.huge_pages(torch.cat([scales, nib], -1).reshape(-1).contiguous())


def _rounding_groups(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w [O, I] as [O, I/32, 32]; raises where it is not float32 CPU rows of whole groups."""
    o, i = w.shape
    if i % GROUP or w.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError(f"{kind} blocks need float32 CPU rows of whole groups of {GROUP}, got {tuple(w.shape)} "
                         f"{w.dtype}")
    return w.detach().view(o, i // GROUP, GROUP)


def _half(t: torch.Tensor) -> torch.Tensor:
    """t rounded to float16 numbers (the layouts' scales), held in float32."""
    return t.half().float()


def _q8_rounded(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 rounding (per 32 weights of a row: d = their largest magnitude / 127 rounded to float16, q =
    round(w / d)): d [O, G, 1], q [O, G, 32]. A group whose d is below float16's least (largest magnitude < 4e-6)
    rounds to zeros, as llama.cpp's."""
    g = _rounding_groups(w, "Q8_0")
    d = _half(g.abs().amax(-1, keepdim=True) / 127)
    return d, _codes(g, d, -127, 127)


def _q4_rounded(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 rounding (per 32 weights of a row: m = their minimum, d = their range / 15, each rounded to
    float16 before q = round((w − m) / d) in 0..15 is taken): d, m [O, G, 1], q [O, G, 32]."""
    g = _rounding_groups(w, "Q4_1")
    m = _half(g.amin(-1, keepdim=True))
    d = _half((g.amax(-1, keepdim=True) - m) / 15)
    return d, m, _codes(g - m, d, 0, 15)


@torch.no_grad()
def quantize_q8(w: torch.Tensor) -> Compact:
    """w ROUNDED to Q8_0 blocks (`_q8_rounded`) in the q8 layout: not an exact form, so only for a drafter's weights
    (draft_precision=q8 or q4), where a rounded weight changes what is drafted, never what the base accepts. Each
    weight moves by at most d/2, 1/254 of its group's largest; raises where a row is not whole groups."""
    d, q = _q8_rounded(w)
    return Compact("q8", pack_q8(d.squeeze(-1), q.to(torch.int8).flatten(1)), *w.shape)


@torch.no_grad()
def quantize_q4(w: torch.Tensor) -> Compact:
    """w ROUNDED to Q4_1 blocks (`_q4_rounded`) in the q4 layout (0.625 bytes per weight against Q8_0's 1.0625): for a
    drafter's weights under draft_precision=q4, as quantize_q8. Each weight moves by at most d/2, 1/30 of its group's
    range; raises where a row is not whole groups."""
    d, m, q = _q4_rounded(w)
    return Compact("q4", pack_q4(d.squeeze(-1), m.squeeze(-1), q.to(torch.uint8).flatten(1)), *w.shape)


@torch.no_grad()
def quantize_q4a8(w: torch.Tensor) -> Compact:
    """w ROUNDED to Q4_1 blocks (`_q4_rounded`) in the q4a8 layout, whose product also rounds x to
    int8 per group of 32 (0.625 bytes per weight, a few integer ops per 64 of them): for a drafter's weights under
    draft_precision=q4a8, as quantize_q8; raises where a row is not whole groups."""
    d, m, q = _q4_rounded(w)
    return Compact("q4a8", pack_q4a8(d.squeeze(-1).half(), m.squeeze(-1).half(), q.to(torch.uint8).flatten(1)),
                   *w.shape)


@torch.no_grad()
def rounded(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weight [O, I] that quantize_q8 / quantize_q4 / quantize_q4a8 (kind q8 | q4 | q4a8) multiply with:
    what their products are checked against (q4a8's up to its rounding of x as well)."""
    if kind == "q8":
        d, q = _q8_rounded(w)
        return (d * q).flatten(1)
    d, m, q = _q4_rounded(w)
    return torch.addcmul(m, d, q).flatten(1)  # d·q + m, as the kernel's fma (one rounding)


def gemm(x: torch.Tensor, c: Compact) -> torch.Tensor:
    """x [M, I] (float32, CPU) · Wᵀ -> [M, O] from W's compact form."""
    lib = native._library()
    kernel = {"q4": lib.smallm_packed_q4, "q8": lib.smallm_packed_q8, "bf16": lib.smallm_packed_bf16,
              "q4a8": lib.smallm_q4a8}[c.kind]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != c.in_features:
        raise ValueError(f"compact product: x {tuple(x.shape)} {x.dtype} does not multiply a [{c.out_features}, "
                         f"{c.in_features}] weight on the CPU")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], c.out_features)
    kernel(x.data_ptr(), c.blocks.data_ptr(), y.data_ptr(), x.shape[0], c.in_features, c.out_features,
           torch.get_num_threads())
    return y


def pack(w: torch.Tensor) -> Compact:
    """The kernel table's operand (kernels.py): w's compact form; raises where it has none (the candidate is then left
    out for that weight)."""
    c = form(w)
    if c is None:
        raise ValueError("this weight has no exact compact form")
    return c
