"""The measuring machinery every engine shares: what a choice depends on (the machine's key), where choices are kept
(one JSON file per engine, an entry per machine), how a choice measured at some row counts applies to every count, and
a race between two ways of one step timed where it runs. An engine's table hashes what it measured (its candidates and
their sources: `signature`) next to its choices, so a change to either measures anew."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def cache_path(name: str) -> Path:
    """Where an engine keeps its measured choices: $SPECDEC_CACHE (default ~/.cache/specdec) / name."""
    return Path(os.environ.get("SPECDEC_CACHE", "~/.cache/specdec")).expanduser() / name


def cpu_fields() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo as {field: value} (all cores of a machine here are alike); empty
    where there is no /proc/cpuinfo."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in block.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name (what `lscpu` calls it) with its family and model numbers, e.g. "AMD EPYC (family 25,
    model 1)": virtual machines often report only "AMD EPYC" for CPUs generations apart (family 25 model 1 and
    model 17, whose kernel choices differ). The architecture when /proc/cpuinfo is missing."""
    fields = cpu_fields()
    if "model name" in fields:
        ids = [f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model") if k in fields]
        return fields["model name"] + (f" ({', '.join(ids)})" if ids else "")
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What a CPU kernel choice depends on: the CPU model, the thread count, the torch build."""
    return f"{cpu_model()} | threads {torch.get_num_threads()} | torch {torch.__version__}"


def gpu_key(device: torch.device) -> str:
    """What a GPU kernel choice depends on: the GPU (or, in tests, the CPU), torch's and Triton's versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import triton
        version = triton.__version__
    except Exception:  # noqa: BLE001
        version = "none"
    return f"{name} | torch {torch.__version__} | triton {version}"


def signature(text: str) -> str:
    """A short hash of what a table's choices were measured with (candidate names, settings, kernel sources)."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def store(path: Path | None, key: str, entry: dict) -> None:
    """Write entry under key (a machine's) into the JSON file at path, keeping the other machines' entries; the file
    replaced at once, so a reader never sees half of it. Nothing without a path."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored[key] = entry
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(stored, indent=1))
    os.replace(tmp, path)


def per_count(choice: dict[int, str], most: int, default: str) -> list[str]:
    """{measured count: name} -> a name for every count 0..most: the smallest measured count at or above it (default
    at 0 and past the largest measured one)."""
    names = [default]
    for n in range(1, most + 1):
        bucket = min((r for r in choice if r >= n), default=None)
        names.append(choice[bucket] if bucket is not None else default)
    return names


class Race:
    """Two ways of one step (the first: a native or fused call; the second: the plain one): the first ROUNDS calls of
    each, alternating from the first way, are timed by the caller (`record`); then the faster by median is kept for the
    rest of the process. A call where the first way declined (it cannot take that call) is not recorded. A race
    `decided` by the config (True: the first way) is never timed."""

    ROUNDS = 3

    def __init__(self, decided: bool | None = None):
        self.times: tuple[list[float], list[float]] = ([], [])  # seconds a call: the second way, the first
        self.winner: bool | None = decided  # True: the first way

    def first(self) -> bool:
        """Whether to try the first way now."""
        if self.winner is not None:
            return self.winner
        return len(self.times[1]) <= len(self.times[0])

    def record(self, first: bool, seconds: float) -> None:
        if self.winner is not None:
            return
        self.times[first].append(seconds)
        if min(map(len, self.times)) >= self.ROUNDS:
            self.winner = statistics.median(self.times[1]) <= statistics.median(self.times[0])


def patched_forward(lin: nn.Linear, plan: list, run: Callable[[object, torch.Tensor], torch.Tensor | None]
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward an engine gives `lin` (assigned as lin.forward for the duration of its install): x [..., I] of
    `rows` rows runs run(plan[rows], x as [rows, I]) -> [rows, O], F.linear where the plan has no entry for that many
    rows or run declines (None). The engines' plans differ (the CPU's kernel and operand, the GPU's kernel name)."""
    weight, bias, limit = lin.weight, lin.bias, len(plan)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        chosen = plan[rows] if rows < limit else None
        y = run(chosen, x.reshape(rows, x.shape[-1])) if chosen is not None else None
        if y is None:
            return F.linear(x, weight, bias)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    forward.plan = plan  # (read by the CPU engine's native chains: the copy a weight is multiplied from)
    return forward
