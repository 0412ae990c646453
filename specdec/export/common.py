"""What every format's writer and reader share: the verifier's name, the record of the base an export was trained on,
and the one-line refusals (another base, a malformed checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.base import SMOLLM2, Base

SPECDEC = "specdec.json"  # beside every export: the base's fingerprint and where the export came from
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded base's name on the hub (serving engines load it)


class CheckpointError(ValueError):
    """A checkpoint this base cannot use (another base) or one that is malformed: one line, naming what."""


def verifier_name(base: Base) -> str:
    """The base as serving engines name it: the embedded SmolLM2 by its hub name, any other by what it was loaded
    from."""
    return SMOLLM2_HUB if base.name == SMOLLM2 else base.name


def speculators_config(base: Base, algorithm: str, tokens: int) -> dict:
    """speculators' `speculators_config` of a drafter: its algorithm, a greedy proposal of `tokens` drafted tokens,
    and the verifier (the base, as serving engines name it)."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(base), "architectures": [type(base.model).__name__]}}


def write_record(out: Path, base: Base, fmt: str, source: str, family: str | None = None) -> None:
    record = {"format": fmt, "family": family, "source": source, "base_name": base.name,
              "verifier": verifier_name(base), "base": base.fingerprint()}
    (out / SPECDEC).write_text(json.dumps(record, indent=2) + "\n")


def check_base(path: Path, base: Base, verifier: str | None, hidden: int | None, vocab: int | None) -> None:
    """Refuse, in one line, a checkpoint for another base: its fingerprint where specdec wrote it, else the
    verifier's name, hidden size and vocabulary the checkpoint declares."""
    record = path / SPECDEC
    if record.exists():
        want = json.loads(record.read_text())["base"]
        found = base.fingerprint()
        if want != found:
            diff = ", ".join(f"{k} {want.get(k)} != {found.get(k)}" for k in found if want.get(k) != found.get(k))
            raise CheckpointError(f"{path}: exported from another base than {base.name!r} ({diff})")
    if verifier is not None and not _same_model(verifier, verifier_name(base)):
        raise CheckpointError(f"{path}: drafts for verifier {verifier!r}, not for this base {verifier_name(base)!r}")
    if hidden is not None and hidden != base.hidden_size:
        raise CheckpointError(f"{path}: reads hidden states of size {hidden}, the base's are {base.hidden_size}")
    if vocab is not None and vocab != base.vocab_size:
        raise CheckpointError(f"{path}: has a vocabulary of {vocab:,} tokens, the base {base.vocab_size:,}")


def _same_model(a: str, b: str) -> bool:
    """Hub names and local copies of them agree by their last path part (".../SmolLM2-135M-Instruct")."""
    return a == b or Path(a).name.lower() == Path(b).name.lower()


def read_config(path: Path, name: str = "config.json") -> dict:
    file = path / name
    if not file.exists():
        raise CheckpointError(f"{path}: no {name}")
    return json.loads(file.read_text())


def read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    file = path / name
    if not file.exists():
        raise CheckpointError(f"{path}: no {name}")
    return load_file(file)


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...] | None, path: Path) -> torch.Tensor:
    """tensors[name], refused in one line where it is missing or of another shape."""
    if name not in tensors:
        raise CheckpointError(f"{path}: tensor {name} is missing")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def save(tensors: dict[str, torch.Tensor], file: Path) -> None:
    # (a tensor written under several names, e.g. the base lm_head for every Medusa head, gets its own copy each)
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, file)
