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

from specdec.drafters.drafter import Drafter
from specdec.engines.config import EngineConfig
from specdec.engines.cpu import native_chain, native_layer
from specdec.engines.cpu.argmax import shortlist
from specdec.engines.cpu.kernels import KernelTable, default_table, forced_table, kernel_names, measured_kernels
from specdec.engines.eager.engine import EagerEngine
from specdec.engines.eager.lean import decode_linears, lean_layers
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

    def paths(self, base, drafters=()):
        """Per forward kind, the path each row count takes on this machine (1 row: a plain step; γ + 1: a chain's
        verify), read inside `installed` after what it measures: the base's layers and a product of theirs, the
        lm_head, the verify's argmax, and each drafter's layers, its widest product and its chain."""
        out = {}
        with self.installed(base, drafters) as table:
            table = table or self.table or default_table()
            head = self.greedy_head(base.lm_head)
            for name, module in [("base", base)] + [(type(d).__name__.lower(), d) for d in drafters]:
                fasts = lean_layers(module) if self.cfg.lean else []
                if fasts:
                    out[f"{name} layers"] = _layers(fasts[0])
                linears = [m for m in decode_linears(module) if kernel_names(m, table)]
                if module is base:
                    linears = [m for m in linears if m is not base.lm_head][:1]
                    out["lm_head"] = _ranges(kernel_names(base.lm_head, table)) or "F.linear"
                elif linears:
                    linears = [max(linears, key=lambda m: m.weight.numel())]
                if linears:
                    out[f"{name} products"] = _ranges(kernel_names(linears[0], table))
                if module is not base and type(module).greedy_chain is not Drafter.greedy_chain:  # a whole chain to run
                    whole = self.cfg.whole_chains
                    out[f"{name} chain"] = "one native call (T = 0, one row)" if whole else "depth by depth"
            wins = [head is not None and head.wins(n) for n in range(1, 17)]
            out["verify argmax"] = _ranges(["bf16 shortlist" if w else "float32 logits" for w in wins])
        return out

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


def _ranges(names: list[str]) -> str:
    """Per row count 1, 2, ... -> "1: a; 2-4: b; 5-16: c" (row counts past 16 go with 16's)."""
    names, spans = names[:16], []
    for rows, name in enumerate(names, 1):
        if spans and spans[-1][2] == name:
            spans[-1][1] = rows
        else:
            spans.append([rows, rows, name])
    return "; ".join(f"{a}{'' if a == b else f'-{b}'} rows: {n}" for a, b, n in spans)


def _layers(fast) -> str:
    """How one lean layer runs per row count: its native form where one is attached, else the lean PyTorch ops."""
    rows = native_layer.rows_of(fast)
    return _ranges([f"native layer.c ({rows[n].form})" if n < len(rows) and rows[n] is not None else "lean ops"
                    for n in range(1, 17)])
