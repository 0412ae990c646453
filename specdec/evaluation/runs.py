"""What an evaluation measures and keeps: a Run (one method on one prompt turn), a Method (how it answers a batch),
the methods' names, the time helpers a report reads runs by, and the runs kept on disk as each prompt finishes, so
that a killed evaluation rerun into the same folder runs only what is missing."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec.checkpoint import write_json

AR = "ar (ours)"
LOOKUP = "lookup (ours)"  # n-gram lookup alone, no drafter
PLAIN = (AR, "llama_cpp", "hf_generate")  # the plain decoders: "vs best AR" divides by the fastest of them in the run


@dataclass
class Run:
    """One method on one prompt turn."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)  # per round (our sampler only)
    drafted: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    t_draft_s: float = 0.0  # summed over rounds
    t_verify_s: float = 0.0
    rounds: int = 0
    peer_drafted: int = 0  # a peer's own speculation, per answer (llama.cpp reports no rounds)
    peer_accepted: int = 0
    peer_rounds: int = 0  # a peer's base forwards (HF assisted and prompt lookup: each verifies one draft)


@dataclass
class Method:
    name: str
    run: Callable[[list[list[int]]], list[Run]]  # a batch of prompts (token ids) -> one Run per prompt
    lossless: bool | None  # None: a peer's own speculation, whose acceptance rule nothing here checks
    chain_gamma: int | None = None  # set for chain drafters: the Leviathan check applies
    batch: int = 1
    peer: bool = False  # a peer (HF, llama.cpp): takes its turn after ours (run.py: _take_turns)
    computes: str | None = None  # a peer that computes another model than the reference's: what it is


def cut_at_eos(tokens: list[int], eos) -> list[int]:
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]  # EOS counts as a generated token, as in our sampler
    return tokens


def _decode_s(runs: list[Run]) -> float:
    """Seconds after the first token (the prefill's), summed over runs of our sampler."""
    return sum(r.seconds - r.ttft_s for r in runs)


def per_round(runs: list[Run]) -> float:
    """Seconds per decode round after the first token."""
    return _decode_s(runs) / max(sum(r.rounds for r in runs), 1)


def decode_s_per_token(runs: list[Run]) -> float:
    """Seconds per token after the first."""
    return _decode_s(runs) / max(sum(len(r.tokens) - 1 for r in runs), 1)


def sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def same_config(config: dict) -> dict:
    """The parts of an evaluation config that decide its numbers (not `paths`, where the project sits: the drafters
    and prompts it reads are compared resolved)."""
    return {k: v for k, v in config.items() if k not in ("overwrite", "wandb", "tags", "paths")}


def _method_path(out_dir: Path, name: str) -> Path:
    return out_dir / "methods" / (re.sub(r"[^\w.-]+", "_", name) + ".json")


def save_method(out_dir: Path, name: str, config: dict, runs: list[list[Run]]) -> None:
    _method_path(out_dir, name).parent.mkdir(parents=True, exist_ok=True)
    write_json(_method_path(out_dir, name), {"config": same_config(config),
                                             "runs": [[asdict(r) for r in turns] for turns in runs]})


def load_method(out_dir: Path, name: str, config: dict, runs: dict[str, list[list[Run]]]) -> bool:
    """Fill runs[name] with the prompts (in order) an earlier, interrupted evaluation of the same config answered;
    False if there is none."""
    path = _method_path(out_dir, name)
    if not path.exists():
        return False
    saved = json.loads(path.read_text())
    if saved["config"] != same_config(config):
        return False
    runs[name] = [[Run(**r) for r in turns] for turns in saved["runs"]]
    return True


def earlier_report(out_dir: Path, config: dict, overwrite: bool) -> dict | None:
    """A run dir with a report is never overwritten silently: the same config returns the earlier report (a rerun
    of a table re-measures nothing), another config is refused unless overwrite=true."""
    path = out_dir / "results.json"
    if overwrite or not path.exists():
        return None
    report = json.loads(path.read_text())
    if same_config(report.get("config", {})) == same_config(config):
        print(f"[specdec] {out_dir} already holds this evaluation; its report is returned (overwrite=true re-measures)")
        return report
    raise FileExistsError(f"{out_dir} already holds a report of another config; pick another hydra.run.dir or set "
                          f"overwrite=true")
