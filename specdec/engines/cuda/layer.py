"""Triton kernels for the small ops of a lean decoder layer's forward over a few tokens on a GPU.

There a 135M base is launch-bound: a kernel costs microseconds whatever its size, and the products are only half a
forward's kernels. Per layer, the attention as PyTorch runs it is several kernels (two batched products, a scale, a
mask add, a softmax, and for n > 1 a copy of its output to [B, n, H]), and so are the rotary and the K/V write (two
multiplies, a roll, an add, two scatters, slower at n > 1 where their inputs are strided). Here each is one kernel:

- `attention`: softmax(q·kᵀ·scale + mask)·v for up to 64 queries (a tree's verify), the keys in blocks with a running
  max (the online softmax): one program per (row, query head) walking all the keys, or split, one per block of keys
  and a second kernel joining their sums (flash-decoding: at a few queries one program per head would walk hundreds
  of keys in sequence on a few SMs), or split and joined by whichever block's program finishes last (no second
  kernel). It writes [B, n, heads, d] and returns the
  [B, heads, n, d] view of it, so the o_proj input that LeanLayer makes from it (transpose, reshape) is a view, not a
  copy. Float32 products (no TF32): the attention to float32 rounding, like the math form.
- `rope_write`: q and k rotated as LeanLayer rotates them (x·cos + roll(x, d/2)·sin', separately rounded: bitwise the
  PyTorch form), q written as [B, heads, n, d] and k, v at their slots of a SlotCache's buffers.

cuda_kernels' table offers both as candidates beside the PyTorch forms, per layer geometry and query count, and keeps
one only where it reproduces the PyTorch form (the rotary and the write bitwise, the attention within its tolerance)
and measures faster in a recorded graph. Like the Triton products they run only inside graph recordings (and the
warm-up runs before one): launched from Python one by one, a Triton kernel's launch costs more than it saves.
Measurements: experiments/pages/cuda.md."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from specdec.engines.eager.lean import split_rotate
from specdec.sampling.cache import SlotCache

MAX_QUERIES = 64  # queries per program: one block of 16, 32 or 64 rows (tl.dot's smallest tile side is 16)
# attention candidates: name -> (keys per step of the online softmax, how the keys are shared out):
# - "walk": one program per (row, query head) walks all the keys;
# - "split": one program per block of keys, and a second kernel joining their partial sums (flash-decoding);
# - "last": split, and the block's program that finishes last joins them (a counter per head, counted atomically):
#   no second kernel, whose launch and gap on the stream cost more than its work of a few hundred floats.
FORMS = {"triton_w64": (64, "walk"), "triton_w128": (128, "walk"), "triton_split64": (64, "split"),
         "triton_split128": (128, "split"), "triton_last64": (64, "last"), "triton_last128": (128, "last")}

_KERNELS: dict[str, object] = {}
# per device, one int32 per (row, query head) of a "last" attention, zero between calls: two such attentions must not
# run at once on two streams of one device (a decode runs its graphs on one stream)
COUNTERS = 4096
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _kernels() -> dict[str, object]:
    if not _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def join_sums(part, out, b, head, heads, splits, n, so_b, so_n, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr):
            # the split attention's partial sums of (b, head) over its key blocks, in block order, rescaled to their
            # common max (loads past the L1: another SM wrote them)
            rows = tl.arange(0, BLOCK_N)
            dims = tl.arange(0, BLOCK_D)
            top = tl.full([BLOCK_N], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_N], tl.float32)
            acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            for s in range(0, splits):
                cell = part + ((b * heads + head) * splits + s) * BLOCK_N * (BLOCK_D + 2) + rows * (BLOCK_D + 2)
                its_top = tl.load(cell + BLOCK_D, cache_modifier=".cg")
                new_top = tl.maximum(top, its_top)
                keep, its_keep = tl.exp(top - new_top), tl.exp(its_top - new_top)
                acc = acc * keep[:, None] + tl.load(cell[:, None] + dims[None, :], cache_modifier=".cg") * its_keep[
                    :, None]
                total = total * keep + tl.load(cell + BLOCK_D + 1, cache_modifier=".cg") * its_keep
                top = new_top
            tl.store(out + b * so_b + rows[:, None] * so_n + head * D + dims[None, :], acc / total[:, None],
                     mask=(rows < n)[:, None] & (dims < D)[None, :])

        # (a module global, where the kernels below find it when Triton compiles them on any of its versions)
        globals()["_join_sums"] = join_sums

        @triton.jit(do_not_specialize=["n", "w"])
        def attention(q, k, v, mask, out, part, counts, n, w, scale, sq_b, sq_h, sq_n, sk_b, sk_h, sk_w, sv_b, sv_h,
                      sv_w, sm_b, sm_n, so_b, so_n, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
                      LAST: tl.constexpr):
            # program (b, head, s): the n queries of one query head over the w keys of its KV head (SPLIT: over its
            # s-th block of BLOCK_W keys, the partial max, sum and weighted values written to part for `join`, or with
            # LAST joined by the program of (b, head) that counts last)
            b = tl.program_id(0)
            head = tl.program_id(1)
            kv = head // GROUP
            rows = tl.arange(0, BLOCK_N)
            dims = tl.arange(0, BLOCK_D)
            live = rows < n
            inside_d = dims < D
            qs = tl.load(q + b * sq_b + head * sq_h + rows[:, None] * sq_n + dims[None, :],
                         mask=live[:, None] & inside_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            top = tl.full([BLOCK_N], float("-inf"), tl.float32)  # running max of each query's scores
            total = tl.zeros([BLOCK_N], tl.float32)  # running sum of exp(score - top)
            acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            first, last = 0, w
            if SPLIT:
                first = tl.program_id(2) * BLOCK_W
                last = first + BLOCK_W
            for start in range(first, last, BLOCK_W):
                cols = start + tl.arange(0, BLOCK_W)
                inside = cols < w
                ks = tl.load(k + b * sk_b + kv * sk_h + cols[:, None] * sk_w + dims[None, :],
                             mask=inside[:, None] & inside_d[None, :], other=0.0)  # [BLOCK_W, BLOCK_D]
                s = tl.dot(qs, tl.trans(ks), input_precision="ieee") * scale  # [BLOCK_N, BLOCK_W]
                if HAS_MASK:  # (padding rows read 0: finite, never stored)
                    s += tl.load(mask + b * sm_b + rows[:, None] * sm_n + cols[None, :],
                                 mask=live[:, None] & inside[None, :], other=0.0)
                s = tl.where(inside[None, :], s, float("-inf"))
                new_top = tl.maximum(top, tl.max(s, 1))
                p = tl.exp(s - new_top[:, None])
                keep = tl.exp(top - new_top)  # rescales what was summed under the old max (0 on the first block)
                vs = tl.load(v + b * sv_b + kv * sv_h + cols[:, None] * sv_w + dims[None, :],
                             mask=inside[:, None] & inside_d[None, :], other=0.0)  # [BLOCK_W, BLOCK_D]
                acc = acc * keep[:, None] + tl.dot(p, vs, input_precision="ieee")
                total = total * keep + tl.sum(p, 1)
                top = new_top
            if SPLIT:  # part [B, heads, S, BLOCK_N, BLOCK_D + 2]: the weighted values, then the max and the sum
                cell = part + ((b * tl.num_programs(1) + head) * tl.num_programs(2) + tl.program_id(2)) * BLOCK_N * (
                    BLOCK_D + 2) + rows * (BLOCK_D + 2)
                tl.store(cell[:, None] + dims[None, :], acc)
                tl.store(cell + BLOCK_D, top)
                tl.store(cell + BLOCK_D + 1, total)
                if LAST:  # every thread's stores above, then one acq_rel count: the last to count sees them all
                    tl.debug_barrier()
                    counter = counts + b * tl.num_programs(1) + head
                    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
                        _join_sums(part, out, b, head, tl.num_programs(1), tl.num_programs(2), n, so_b, so_n, D,
                                   BLOCK_D, BLOCK_N)
                        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next call (a graph's
                        # replays reuse it; the kernel's end orders it before them)
            else:
                tl.store(out + b * so_b + rows[:, None] * so_n + head * D + dims[None, :], acc / total[:, None],
                         mask=live[:, None] & inside_d[None, :])

        @triton.jit(do_not_specialize=["n", "splits"])
        def join(part, out, n, splits, so_b, so_n, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
            # program (b, head): join_sums as its own kernel, after the attention's
            _join_sums(part, out, tl.program_id(0), tl.program_id(1), tl.num_programs(1), splits, n, so_b, so_n, D,
                       BLOCK_D, BLOCK_N)

        @triton.jit(do_not_specialize=["n"])
        def rope_write(qkv, cos, sin, slots, q_out, keys, values, n, sc_b, sc_n, ss_b, ss_n, sl_b, sk_b, sk_h, sk_w,
                       HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
            # program (row, head) over qkv's heads: q heads, then k heads, then v heads
            row = tl.program_id(0)  # b·n + token
            head = tl.program_id(1)
            b = row // n
            t = row % n
            dims = tl.arange(0, BLOCK_D)
            inside = dims < D
            base = qkv + row * (HEADS + 2 * KV) * D + head * D
            x = tl.load(base + dims, mask=inside, other=0.0)
            slot = tl.load(slots + b * sl_b + t)
            if head < HEADS + KV:  # rotated: x·cos + roll(x, d/2)·sin', each product rounded (no FMA: the PyTorch ops)
                partner = tl.load(base + (dims + D // 2) % D, mask=inside, other=0.0)
                c = tl.load(cos + b * sc_b + t * sc_n + dims, mask=inside, other=0.0)
                s = tl.load(sin + b * ss_b + t * ss_n + dims, mask=inside, other=0.0)
                y = x * c + partner * s
                if head < HEADS:  # q_out [B, HEADS, n, D] contiguous
                    tl.store(q_out + ((b * HEADS + head) * n + t) * D + dims, y, mask=inside)
                else:
                    tl.store(keys + b * sk_b + (head - HEADS) * sk_h + slot * sk_w + dims, y, mask=inside)
            else:
                tl.store(values + b * sk_b + (head - HEADS - KV) * sk_h + slot * sk_w + dims, x, mask=inside)

        _KERNELS.update(attention=attention, join=join, rope_write=rope_write)
    return _KERNELS


_WARMING: list[bool] = []  # inside `warming()`


@contextmanager
def warming() -> Iterator[None]:
    """The eager runs before a graph recording: they launch the Triton kernels the recording will, so each is compiled
    and its module loaded there, not while the stream captures (where loading a module invalidates the capture, as
    in a process whose kernel table came from the disk cache and that has compiled nothing yet)."""
    _WARMING.append(True)
    try:
        yield
    finally:
        _WARMING.pop()


def launchable(t: torch.Tensor) -> bool:
    """Whether a decode runs the Triton kernels (these and cuda_kernels' products) on t's device now: inside graph
    recordings and the runs warming them up on a GPU, and on CPU tensors (Triton's interpreter, in tests)."""
    return not t.is_cuda or bool(_WARMING) or torch.cuda.is_current_stream_capturing()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              form: str = "triton_w64") -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v: q [B, h, n, d], k, v [B, kv, W, d] (rows of d contiguous), mask [B or 1, 1, n, W]
    additive or None -> [B, h, n, d] (float32, n ≤ MAX_QUERIES), a view of [B, n, h, d] storage."""
    b, h, n, d = q.shape
    kv, w = k.shape[1], k.shape[2]
    if n > MAX_QUERIES or h % kv or any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in (q, k, v)) or (
            mask is not None and (mask.shape[1] != 1 or mask.stride(-1) != 1)):
        raise ValueError("attention takes up to 64 float32 queries, grouped KV heads and rows of d contiguous")
    block_w, how = FORMS[form]
    split, last = how != "walk", how == "last" and b * h <= COUNTERS and counters(q.device) is not None
    block_d = max(16, 1 << (d - 1).bit_length())
    block_n = max(16, 1 << (n - 1).bit_length())  # (a compiled variant per size: 16, 32, 64)
    splits = -(-w // block_w) if split else 1
    out = torch.empty(b, n, h, d, dtype=q.dtype, device=q.device)
    part = q.new_empty(b, h, splits, block_n, block_d + 2) if split else out  # (unread unless split)
    m = mask.expand(b, 1, n, w) if mask is not None else q  # (any tensor: not read without a mask)
    counts = counters(q.device) if last else out  # (unread unless last)
    kernels = _kernels()
    kernels["attention"][(b, h, splits)](
        q, k, v, m, out, part, counts, n, w, scale, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), m.stride(0), m.stride(-2), out.stride(0), out.stride(1),
        GROUP=h // kv, D=d, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_W=block_w, HAS_MASK=mask is not None,
        SPLIT=split, LAST=last, num_warps=4)
    if split and not last:
        kernels["join"][(b, h)](part, out, n, splits, out.stride(0), out.stride(1), D=d, BLOCK_D=block_d,
                                BLOCK_N=block_n, num_warps=4)
    return out.transpose(1, 2)


def counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counters of the "last" attention, made on first use in the eager runs that warm a graph
    recording up (None inside a recording before that: its memory would be the graph's); every call leaves them zero."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [B, n, (heads + 2·kv)·d] (contiguous: the fused q|k|v product), cos, sin [B or 1, 1, n, d] (lean_rope's),
    slots [B, n] -> q [B, heads, n, d] rotated; k rotated and v written at `slots` of keys, values [B, kv, M, d]."""
    b, n, _ = qkv.shape
    kv, d = keys.shape[1], keys.shape[3]
    if not (qkv.dtype == keys.dtype == torch.float32 and qkv.is_contiguous() and qkv.shape[2] == (heads + 2 * kv) * d
            and keys.stride(-1) == 1 and keys.stride() == values.stride() and d % 2 == 0
            and cos.stride(-1) == 1 and sin.stride(-1) == 1):
        raise ValueError("rope_write takes the contiguous q|k|v product and rows of d contiguous")
    q = torch.empty(b, heads, n, d, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.expand(b, 1, n, d), sin.expand(b, 1, n, d)
    slots = slots.expand(b, n)
    _kernels()["rope_write"][(b * n, heads + 2 * kv)](
        qkv, cos, sin, slots, q, keys, values, n, cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
        slots.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), HEADS=heads, KV=kv, D=d,
        BLOCK_D=max(16, 1 << (d - 1).bit_length()), num_warps=1, enable_fp_fusion=False)
    return q


def rope_write_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, heads: int) -> torch.Tensor:
    """`rope_write` as LeanLayer.lean_forward computes it in PyTorch ops (what the kernel is checked and timed
    against)."""
    q, k, v = split_rotate(qkv, (cos, sin), heads, keys.shape[1], keys.shape[3])
    index = slots[:, None, :, None]  # [B, 1, n, 1]
    keys.scatter_(2, index.expand_as(k), k)
    values.scatter_(2, index.expand_as(v), v)
    return q


def slot_buffers(cache, layer_idx: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(the slots [B, n] this forward writes, the layer's keys and values buffers [B, kv, M, d]) where the cache is a
    SlotCache with this layer's float32 buffers in place and a kernel can run on t here (inside a graph recording);
    None otherwise (the PyTorch ops then)."""
    if not isinstance(cache, SlotCache) or cache.write_slots is None or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    if not (layer.is_initialized and t.dtype == layer.keys.dtype == torch.float32 and launchable(t)
            and layer.keys.shape[2] >= cache.width):
        return None
    return cache.write_slots, layer.keys, layer.values


def fused_rope_write(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache, layer_idx: int,
                     heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """LeanLayer's rotary and cache update in one kernel: (q [B, heads, n, d], the keys and values to attend
    [B, kv, width, d]) where `slot_buffers` finds the cache's; None otherwise (the PyTorch ops then)."""
    found = slot_buffers(cache, layer_idx, qkv)
    if found is None:
        return None
    slots, keys, values = found
    q = rope_write(qkv, *rope, slots, keys, values, heads)
    w = cache.width
    return q, keys[:, :, :w], values[:, :, :w]
