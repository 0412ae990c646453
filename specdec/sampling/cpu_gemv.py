"""Decode-time matrix-vector products on CPU, split across threads.

With one or a few query rows, every nn.Linear of the base is a matrix-vector product, and PyTorch's CPU
kernel for it runs on one thread at ~9 GB/s while two cores can stream ~33 GB/s (SmolLM2's lm_head alone is
113 MB of fp32). Viewing W [O, I] as [n, O/n, I] and multiplying with bmm runs the n row blocks on n threads:
the same products in the same dtype, ~1.5x faster decoding on 2 cores. A TorchFunctionMode swaps the kernel
for the duration of a decode only; the base's modules are untouched."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

BIG = 1 << 24  # weights this large (the vocab projection) are split also for a few rows (a verify block)


class SplitGemv(TorchFunctionMode):
    def __init__(self, max_rows: int = 16):
        super().__init__()
        self.max_rows = max_rows
        self.threads = torch.get_num_threads()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.threads > 1:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // x.shape[-1]
            split = rows == 1 or (rows <= self.max_rows and w.numel() >= BIG)
            if split and x.device.type == "cpu" and w.shape[0] % self.threads == 0 and w.is_contiguous():
                n, (o, i) = self.threads, w.shape
                xt = x.reshape(rows, i).T  # [I, rows]
                y = torch.bmm(w.view(n, o // n, i), xt.expand(n, i, rows))  # [n, O/n, rows]
                y = y.reshape(o, rows).T.reshape(*x.shape[:-1], o)
                return y if bias is None else y + bias
        return func(*args, **kwargs)
