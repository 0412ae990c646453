"""The CPU engine: the eager engine's lean layers, with every product of the base and the drafters run by the kernel
measured fastest on this machine for its shape and row count (kernels.py: PyTorch's, oneDNN's or the native C ones
in smallm.c, from the weights' exact compact blocks where they have them), whole decoder layers and stacks as one
native call (native_layer.py, layer.c) and the verify's argmax from a bfloat16 shortlist of the lm_head (argmax.py),
each only where it measured faster, or, under cpu_kernels=native, wherever it can run, nothing measured; and, unless
whole_chains is off, a drafter's greedy chain as one call wherever it can run (native_chain.py, chain.c)."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

from specdec.engines.config import EngineConfig
from specdec.engines.cpu import native_chain, native_layer
from specdec.engines.cpu.argmax import shortlist
from specdec.engines.cpu.kernels import KernelTable, forced_table, measured_kernels
from specdec.engines.eager.engine import EagerEngine
from specdec.engines.measure import Race


class CpuEngine(EagerEngine):
    name = "cpu"

    def __init__(self, cfg: EngineConfig | None = None, table: KernelTable | None = None):
        super().__init__(cfg or EngineConfig(name="cpu"))
        # None: the process-wide kernel table (measured once per machine, kept on disk; cpu_kernels=native: one that
        # measures nothing)
        self.table = table or (forced_table() if self.cfg.cpu_kernels == "native" else None)
        # drafter -> whether its real entries as one native call are the faster way here (measured over its first calls)
        self._entries: weakref.WeakKeyDictionary[nn.Module, Race] = weakref.WeakKeyDictionary()

    def key(self, greedy: bool) -> tuple:
        c = self.cfg
        return (self.name, c.cpu_kernels, c.lean, c.native_layers, c.compact_weights, greedy and c.greedy_shortlist,
                c.draft_precision, c.whole_chains)

    def installed(self, base: nn.Module, drafters: Sequence[nn.Module] = ()):
        c = self.cfg
        rounded = list(drafters) if c.draft_precision != "fp32" else []  # the drafters' weights may be rounded
        quant = c.draft_precision if c.draft_precision in ("q8", "q4", "q4a8") else ""  # ... to these blocks too
        return measured_kernels(base, *drafters, table=self.table, lean=c.lean, bf16=rounded,
                                native_layers=c.native_layers, compact=c.compact_weights, quant=quant)

    def run_layer(self, fast, hidden, rope, mask, cache):
        """The layer as one native call where one is attached for this many rows (a batch of one), else lean."""
        native = native_layer.for_rows(fast, hidden.shape[1]) if hidden.shape[0] == 1 else None
        if native is not None and hidden.dtype == torch.float32:
            out = native(hidden, rope, mask, cache)
            if out is not None:
                return out
        return fast(hidden, rope, mask, cache)

    def run_stack(self, fast, hidden, rope, mask, cache, keep, norm):
        return native_layer.run_stack(fast, hidden, rope, mask, cache, keep, norm)

    def greedy_head(self, lm_head: nn.Linear):
        return shortlist(lm_head, forced=self.cfg.cpu_kernels == "native") if self.cfg.greedy_shortlist else None

    def feature_chain(self, drafter, parts, ctx, root, gamma, store, position_offset, stop=0.0):
        if not self.cfg.whole_chains:
            return None
        return native_chain.draft(drafter, parts, ctx, root, gamma, store, position_offset, stop)

    def feature_entries(self, drafter, parts, ctx, features, tokens, store, position_offset, otherwise):
        c = self.cfg
        decided = False if not c.whole_chains else True if c.cpu_kernels == "native" else None
        race = self._entries.setdefault(drafter, Race(decided))
        return native_chain.entries(drafter, parts, ctx, features, tokens, store, position_offset, otherwise, race)

    def head_chain(self, drafter, heads, embed, vocab, h, root, top=1):
        if not self.cfg.whole_chains:
            return None
        return native_chain.head_chain(drafter, heads, embed, vocab, h, root, top)
