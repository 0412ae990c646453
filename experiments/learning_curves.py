"""Learning curves: offline predicted τ (val/expected_tau_greedy: 1 + Σ_k Π_{j≤k} top-1_j, what T = 0 accepts, and
val/expected_tau: the same from Σ_v min(p, q)) against training tokens, one line per training run.

    .venv/bin/python experiments/learning_curves.py logs/recipe/prophet logs/recipe/medusa [--out experiments/results/learning_curves]

Each argument is a train.py run dir (its csv/ logger output); the label is the run's drafter family and dir name."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import yaml

METRICS = ("val/expected_tau_greedy", "val/expected_tau")


def curve(run: Path) -> tuple[str, list[dict]]:
    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    label = cfg["drafter"]["_target_"].rsplit(".", 1)[-1].lower()
    rows = []
    for path in sorted(run.glob("csv/version_*/metrics.csv")):
        with open(path) as f:
            for r in csv.DictReader(f):
                if r.get("val/train_tokens"):
                    rows.append({"tokens": float(r["val/train_tokens"]), "step": int(r["step"]),
                                 **{m: float(r[m]) for m in METRICS if r.get(m)}})
    rows.sort(key=lambda r: r["tokens"])
    return label, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/learning_curves"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    table = []
    for run in args.runs:
        label, rows = curve(run)
        if not rows:
            print(f"{run}: no validation rows yet", file=sys.stderr)
            continue
        for ax, metric in zip(axes, METRICS):
            pts = [(r["tokens"] / 1e6, r[metric]) for r in rows if metric in r]
            ax.plot(*zip(*pts), "o-", ms=3, label=f"{label} ({run.name})")  # two runs of one family differ
        table += [{"run": str(run), "drafter": label, **r} for r in rows]
    for ax, metric in zip(axes, METRICS):
        ax.set(xlabel="training tokens (M)", ylabel=metric, title=metric.replace("val/", "predicted τ: "))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "learning_curves.png", dpi=110)
    with open(args.out / "learning_curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["run", "drafter", "step", "tokens", *METRICS])
        w.writeheader()
        w.writerows(table)
    print(f"wrote {args.out}/learning_curves.png and .csv ({len(table)} points)")


if __name__ == "__main__":
    main()
