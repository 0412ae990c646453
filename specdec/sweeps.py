"""Hydra multirun plumbing: one failed job does not end the sweep, and every sweep ends with a summary of its jobs
(overrides, status, optimised metric) written next to them, whatever launcher ran them (local, SLURM). A sweep in
which a job failed exits non-zero after its summary, so a script or CI notices."""

from __future__ import annotations

import functools
import json
import math
import traceback
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from specdec.checkpoint import write_json, write_text

FAILED = "failed.json"  # a failed job's error and traceback, in its own run dir
RESULT = "result.json"  # a finished training job's metrics (train())
REPORT = "results.json"  # a finished evaluation job's report (evaluate())

# ${if_null:${drafter.uniform},search}: a value, or the given name where it is null; for sweep subdirs over a key whose
# null means something (OmegaConf's own oc.select returns a null as it is). Registered on import: train.py,
# evaluate.py and the sweep callback import this module before Hydra resolves a run dir.
OmegaConf.register_new_resolver("if_null", lambda value, name: name if value is None else value, replace=True)


class ConfigError(ValueError):
    """A bad setting that fails every job alike (e.g. an optimized_metric nobody logs): a sweep stops on it."""


def keep_sweep_going(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """In a multirun, a job that raises records failed.json in its run dir and returns NaN (Optuna marks the trial
    failed), so the remaining jobs still run; a ConfigError, or any error outside a multirun, propagates."""

    @functools.wraps(task)
    def run(cfg: DictConfig) -> Any:
        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return task(cfg)
        out = Path(HydraConfig.get().runtime.output_dir)
        (out / FAILED).unlink(missing_ok=True)  # a rerun of a job that failed before
        try:
            return task(cfg)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - recorded and reported in the sweep summary
            write_json(out / FAILED, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            print(f"[specdec] job {HydraConfig.get().job.num} failed: {type(e).__name__}: {e} (sweep goes on)")
            return math.nan

    return run


class SweepSummary(Callback):
    """On multirun end: summary.md + summary.csv in the sweep dir, one row per job dir found there; then exit 1 if a
    job failed (SystemExit passes through Hydra's callback guard, which catches only Exception)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_rows(sweep_dir, config.get("optimized_metric"))
        if not rows:
            return
        metric = config.get("optimized_metric") or "metric"
        lines = [f"| job | overrides | status | {metric} |", "|---|---|---|---|"]
        lines += [f"| {r['job']} | {r['overrides']} | {r['status']} | {r['value']} |" for r in rows]
        failed = [r for r in rows if r["status"] != "completed"]
        lines.append(f"\n{len(rows) - len(failed)} of {len(rows)} jobs completed"
                     + (f"; failed: {', '.join(r['job'] for r in failed)} (see failed.json in each)" if failed else ""))
        write_text(sweep_dir / "summary.md", "\n".join(lines) + "\n")
        csv = ["job,overrides,status,value"] + [f"{r['job']},\"{r['overrides']}\",{r['status']},{r['value']}" for r in rows]
        write_text(sweep_dir / "summary.csv", "\n".join(csv) + "\n")
        print("\n".join(lines), flush=True)
        if failed:
            raise SystemExit(1)


def sweep_rows(sweep_dir: Path, metric: str | None) -> list[dict[str, Any]]:
    """Every job dir under a sweep dir (one with .hydra/overrides.yaml): the overrides that set it apart from the
    other jobs, its status and its metric."""
    jobs = sorted(p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml"))
    overrides = {job: list(OmegaConf.load(job / ".hydra" / "overrides.yaml")) for job in jobs}
    shared = set.intersection(*(set(o) for o in overrides.values())) if len(jobs) > 1 else set()
    rows = []
    for job in jobs:
        status, value = "unfinished", ""
        if (job / FAILED).exists():
            status, value = "failed", json.loads((job / FAILED).read_text())["error"]
        elif (job / RESULT).exists():
            status = "completed"
            value = json.loads((job / RESULT).read_text()).get("metrics", {}).get(metric, "") if metric else ""
        elif (job / REPORT).exists():
            status = "completed"
        own = " ".join(o for o in overrides[job] if o not in shared)
        rows.append({"job": str(job.relative_to(sweep_dir)), "overrides": own, "status": status, "value": value})
    return rows
