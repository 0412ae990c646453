"""`trainer.precision=auto`: train a drafter in bf16 autocast where this machine multiplies bf16 faster, else in fp32.

A drafter's training step is its products (block, fc, the draft-vocab head, forward and backward) and little else
once the loss is fused (specdec/losses.py). Whether bf16 pays is a property of the CPU: one with native bf16 instructions
(AVX-512 BF16, AMX) runs these products well faster than fp32, while one without converts and may well be slower
than fp32. So the choice is timed here, once per run (per process: DDP ranks time it each), on the drafter's own
head shape, with fp32 as the fallback. The frozen base is not touched: its features come from the cache or from its
own forward in its own dtype."""

from __future__ import annotations

import time

import torch

AUTO = "auto"
MIN_GAIN = 1.25  # bf16 must be this much faster: autocast adds casts the product timing does not see
ROWS = 2048  # one batch of the recipes (8 x 256 tokens)
# A product ~1/400 of an lm_head's, timed first: where the CPU has no bf16 instructions (AVX2 only) torch's fallback
# can be tens of times slower than fp32, so timing SmolLM2's full [2048, 576] x [576, 49152] in bf16 would take minutes.
# A probe that slow decides fp32 at once; one that is not is no verdict (small products understate a native gain).
PROBE_ROWS, PROBE_OUT = 256, 1024
PROBE_LOSS = 2.0  # bf16 this many times slower than fp32 on the probe: fp32 without timing the full shape


def choose_precision(device: torch.device | str, hidden: int, out: int, repeats: int = 3) -> tuple[str, str]:
    """(Lightning precision, why) for training a drafter whose widest product is [ROWS, hidden] x [hidden, out]."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "CUDA with bf16"
        return "32-true", "CUDA without bf16"
    if device.type != "cpu":
        return "32-true", f"{device.type}: not measured"
    try:
        probe_out = min(out, PROBE_OUT)
        gain = (_time_product(torch.float32, hidden, probe_out, repeats, PROBE_ROWS)
                / _time_product(torch.bfloat16, hidden, probe_out, repeats, PROBE_ROWS))
        if gain < 1 / PROBE_LOSS:
            return "32-true", (f"bf16 product {gain:.2f}x fp32 here on a probe "
                               f"([{PROBE_ROWS}, {hidden}] x [{hidden}, {probe_out}]): no native bf16 kernels")
        fp32 = _time_product(torch.float32, hidden, out, repeats)
        bf16 = _time_product(torch.bfloat16, hidden, out, repeats)
    except RuntimeError as err:  # a build without bf16 kernels: fp32
        return "32-true", f"bf16 product failed ({err})"
    gain = fp32 / bf16
    why = f"bf16 product {gain:.2f}x fp32 here ([{ROWS}, {hidden}] x [{hidden}, {out}])"
    return ("bf16-mixed" if gain >= MIN_GAIN else "32-true"), why


def _time_product(dtype: torch.dtype, hidden: int, out: int, repeats: int, rows: int = ROWS) -> float:
    """Best-of-`repeats` seconds (the first run is the warm-up the best leaves out) of one product [rows, hidden] x
    [hidden, out], forward and both backward products, on the CPU."""
    x = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(out, hidden, dtype=dtype)
    g = torch.randn(rows, out, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x @ w.T, g @ w, g.T @ x
        best = min(best, time.perf_counter() - start)
    return best
