"""How much a validation split that shares prompts with training inflates a drafter's val τ.

Feature caches built before the split by group (specdec/data/datamodule.py) split the distilled answers by document:
a validation answer then often has a sibling in training (the greedy or sampled answer to the same prompt, or another
request about the same function). This script rebuilds that old split of `configs/data/completions.yaml`, checks it
against the cache's validation blocks token for token, sorts the blocks into those whose every answer has no sibling
in training ("clean") and the rest ("leaked"), and reports each drafter's validation metrics on both:

    .venv/bin/python experiments/val_leak.py logs/recipe/early_exit_all/drafter logs/recipe/early_exit_2000/drafter \
        [--cache ~/.cache/specdec/features/stdlib_complete_all] [--out experiments/results/val_leak]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, Subset  # noqa: E402

from specdec.base import load_base  # noqa: E402
from specdec.checkpoint import load_drafter  # noqa: E402
from specdec.data.cached import FeatureShards  # noqa: E402
from specdec.data.datamodule import TextDataModule  # noqa: E402
from specdec.data.distill import distilled  # noqa: E402
from specdec.data.features import read_meta  # noqa: E402
from specdec.training import DraftTrainer  # noqa: E402


def block_flags(base, meta: dict, val_ids: np.ndarray) -> list[bool]:
    """For each validation block of the cache [N, T]: True where it holds part of an answer whose group is also in
    training under the old (ungrouped) split."""
    src = OmegaConf.load(ROOT / "configs" / "data" / "completions.yaml").source
    ds = distilled(list(src.path), kinds=list(src.kinds))
    dm = TextDataModule(lambda: ds, base.tokenizer, block_size=meta["block_size"], cache_dir=None)  # data defaults
    texts, groups, _ = dm._docs(ds)
    val, train = dm._split(len(texts), None)  # the old split: every document its own group
    seen = {groups[i] for i in train}
    docs = [texts[i] for i in val]
    if not np.array_equal(dm._pack(docs)[0][: len(val_ids)], val_ids):  # the data module's own packing of that split
        raise SystemExit("the cache's validation blocks are not the old split of configs/data/completions.yaml")
    lengths = [len(d) + 1 for d in base.tokenizer(docs, add_special_tokens=False)["input_ids"]]  # + its EOS
    owner = np.repeat(np.arange(len(docs)), lengths)  # [tokens]: which validation answer each packed token is from
    T = meta["block_size"]
    return [any(groups[val[k]] in seen for k in set(owner[b * T : (b + 1) * T])) for b in range(len(val_ids))]


def validate(base, drafter, blocks: Subset) -> dict[str, float]:
    module = DraftTrainer(base, drafter, optimizer=None)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(module, DataLoader(blocks, batch_size=8), verbose=False)
    return {k: round(float(v), 4) for k, v in metrics.items() if k in ("val/expected_tau", "val/expected_tau_greedy")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="+", type=Path)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/specdec/features/stdlib_complete_all").expanduser())
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "val_leak")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = load_base(device="cpu")
    meta = read_meta(args.cache)
    shards = FeatureShards([args.cache / "val"], meta["layers"])
    val_ids = np.stack([shards[i]["input_ids"].numpy() for i in range(len(shards))])
    leaked = block_flags(base, meta, val_ids)
    sets = {"all": list(range(len(leaked))), "clean": [i for i, f in enumerate(leaked) if not f],
            "leaked": [i for i, f in enumerate(leaked) if f]}
    print(f"{len(leaked)} validation blocks: {len(sets['clean'])} clean, {len(sets['leaked'])} leaked")
    rows = []
    for path in args.drafters:
        drafter = load_drafter(path, base)
        row = {"drafter": str(path), **{f"{name} ({len(idx)} blocks)": validate(base, drafter, Subset(shards, idx))
                                        for name, idx in sets.items()}}
        print(json.dumps(row))
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "val_leak.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
