"""Drafter checkpoints: the trained weights (safetensors) and a small json (class, constructor args, base
fingerprint, training config). Never the frozen base; loading needs no training code."""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdec.base import Base
from specdec.drafters.drafter import Drafter

WEIGHTS, META = "drafter.safetensors", "drafter.json"


class BaseMismatchError(ValueError):
    pass


def save_drafter(drafter: Drafter, dirpath: str | Path, train_config: dict | None = None,
                 metrics: dict[str, float] | None = None) -> Path:
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    cls = type(drafter)
    meta = {
        "target": f"{cls.__module__}.{cls.__qualname__}",
        "hparams": drafter.hparams,
        "base": drafter.base.fingerprint(),
        "base_name": drafter.base.name,
        "metrics": metrics or {},
        "train_config": train_config or {},
    }
    # own storage per tensor: decoding re-points some weights as views of one fused tensor (sampling/lean.py)
    state = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in drafter.state_dict().items()}
    atomic_write(dirpath / WEIGHTS, lambda p: save_file(state, p))
    write_json(dirpath / META, meta)
    return dirpath


def load_drafter(dirpath: str | Path, base: Base) -> Drafter:
    """Rebuild a saved drafter on `base`; refuses a base whose fingerprint differs from the training base."""
    dirpath = Path(dirpath)
    meta = read_meta(dirpath)
    found = base.fingerprint()
    if meta["base"] != found:
        diff = {k: (meta["base"].get(k), found.get(k)) for k in found if meta["base"].get(k) != found.get(k)}
        raise BaseMismatchError(
            f"drafter {dirpath} was trained on base {meta.get('base_name')!r}, not on {base.name!r} "
            f"(fingerprint differs: {', '.join(f'{k} {a} != {b}' for k, (a, b) in diff.items())})"
        )
    module, _, name = meta["target"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    drafter: Drafter = cls(base, **meta["hparams"])
    drafter.load_state_dict(load_file(dirpath / WEIGHTS))
    return drafter.to(device=base.device).eval()


def read_meta(dirpath: str | Path) -> dict[str, Any]:
    path = Path(dirpath) / META
    if not path.exists():
        raise FileNotFoundError(f"no drafter checkpoint at {dirpath} (expected {META} and {WEIGHTS})")
    return json.loads(path.read_text())


def atomic_write(path: Path, write) -> None:
    """Write to a temp file in the same folder, then rename: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result gets the permissions a plain write would
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda p: Path(p).write_text(text))


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, default=str))
