"""Drafters out of specdec and into it: `python -m specdec.export <drafter dir> --to <format> --out <dir>` writes a
trained drafter in a serving engine's own format; `load(path, base)` reads any of those formats (or a specdec
checkpoint) back into a drafter our sampler runs, so `evaluate.py drafters=[<dir>]` judges a drafter trained
elsewhere (SpecForge, speculators, z-lab, the EAGLE repo, Medusa) beside ours.

| format | family | who loads it |
|---|---|---|
| speculators | eagle3, dflash, peagle | vLLM (auto-detected), the speculators package |
| sglang | eagle3, dflash | SGLang (dflash: DFLASH, z-lab's layout), the EAGLE repo, SpecForge (`LlamaForCausalLMEagle3`) |
| vllm_medusa | medusa | vLLM's MedusaModel |
| medusa | medusa | the Medusa repo, TGI and TensorRT-LLM's converters |
| hf | draft_model | HF from_pretrained / generate(assistant_model=), vLLM draft-model speculation |
| gguf | draft_model, eagle3 | llama.cpp --model-draft (eagle3: --spec-type draft-eagle3) |
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdec.base import Base
from specdec.checkpoint import META, load_drafter, read_meta
from specdec.drafters.dflash import DFlash
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.drafter import Drafter
from specdec.drafters.eagle3 import Eagle3
from specdec.drafters.medusa import Medusa
from specdec.drafters.peagle import PEagle
from specdec.export import dflash, draft_model, eagle3, gguf, medusa, peagle
from specdec.export.common import SPECDEC, CheckpointError


@dataclass(frozen=True)
class Format:
    family: type | tuple[type, ...]
    write: Callable[[Any, Path, str], None]
    loads_it: str


def by_family(writers: dict[type, Callable[[Any, Path, str], None]]) -> Callable[[Any, Path, str], None]:
    """One format's writer for several families: each drafter goes to its own family's writer."""
    return lambda d, out, source: writers[type(d)](d, out, source)


FORMATS = {
    "speculators": Format((Eagle3, DFlash, PEagle), by_family({Eagle3: eagle3.write_speculators,
                                                               DFlash: dflash.write_speculators,
                                                               PEagle: peagle.write_speculators}), "vLLM, speculators"),
    "sglang": Format((Eagle3, DFlash), by_family({Eagle3: eagle3.write_sglang, DFlash: dflash.write_sglang}),
                     "SGLang (dflash: --speculative-algorithm DFLASH), the EAGLE repo, SpecForge"),
    "vllm_medusa": Format(Medusa, medusa.write_vllm, "vLLM MedusaModel"),
    "medusa": Format(Medusa, medusa.write_repo, "the Medusa repo, TGI, TensorRT-LLM"),
    "hf": Format(DraftModel, draft_model.write_hf, "HF from_pretrained, generate(assistant_model=), vLLM"),
    "gguf": Format((DraftModel, Eagle3), gguf.write, "llama.cpp --model-draft (EAGLE-3: --spec-type draft-eagle3)"),
}


def export(drafter: Drafter, to: str, out: str | Path, source: str = "") -> Path:
    """Write `drafter` in format `to` into the folder `out` (created); refused in one line where the family has no
    such format."""
    if to not in FORMATS:
        raise CheckpointError(f"unknown format {to!r}; formats: {', '.join(FORMATS)}")
    fmt = FORMATS[to]
    if not _of(drafter, fmt):  # (the exact family: a subclass may hold more than the format can say)
        have = formats_of(drafter)
        raise CheckpointError(
            f"a {type(drafter).__name__.lower()} drafter has no {to} form; "
            + (f"its formats: {', '.join(have)}" if have else
               f"only {', '.join(sorted(_family_names()))} drafters have serving "
               f"formats ({', '.join(FORMATS)})"))
    why = dflash.refusal(drafter, to) if isinstance(drafter, DFlash) else None
    if why:  # (before the folder is made: nothing is written that would serve other drafts)
        raise CheckpointError(f"a dflash drafter has no faithful {to} form: {why}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fmt.write(drafter, out, source)
    return out


def formats_of(drafter: Drafter) -> list[str]:
    """The formats `drafter` exports to ([] for a family no engine loads)."""
    return [n for n, f in FORMATS.items() if _of(drafter, f)]


def _of(drafter: Drafter, fmt: Format) -> bool:
    return type(drafter) in (fmt.family if isinstance(fmt.family, tuple) else (fmt.family,))


def _family_names() -> set[str]:
    # (their drafter= config names)
    names = {Eagle3: "eagle3", DFlash: "dflash", PEagle: "peagle", Medusa: "medusa", DraftModel: "draft_model"}
    return {names[c] for f in FORMATS.values() for c in (f.family if isinstance(f.family, tuple) else (f.family,))}


def detect(path: str | Path) -> str:
    """Which format the folder holds: specdec (a checkpoint of ours) or one of FORMATS."""
    return _reader(path)[0]


def _reader(path: str | Path) -> tuple[str, type | None, Callable[[Path, Base], Drafter] | None]:
    """The folder's format, the family it holds and the reader that loads it (None, None for a checkpoint of
    ours)."""
    path = Path(path)
    if (path / META).exists():
        return "specdec", None, None
    config = path / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"no drafter at {path}: neither a specdec checkpoint ({META}) nor a config.json")
    cfg = json.loads(config.read_text())
    for fmt, family, is_it, reader in [("speculators", Eagle3, eagle3.is_speculators, eagle3.read),
                                       ("speculators", DFlash, dflash.is_speculators, dflash.read),
                                       ("speculators", PEagle, peagle.is_speculators, peagle.read),
                                       ("sglang", Eagle3, eagle3.is_sglang, eagle3.read),
                                       ("sglang", DFlash, dflash.is_zlab, dflash.read),
                                       ("vllm_medusa", Medusa, medusa.is_vllm, medusa.read),
                                       ("medusa", Medusa, medusa.is_repo, medusa.read)]:
        if is_it(cfg):
            return fmt, family, reader
    if draft_model.is_hf(path):
        return "hf", DraftModel, draft_model.read
    raise CheckpointError(f"{path}: config.json is of no drafter format specdec reads ({', '.join(FORMATS)})")


def describe(path: str | Path) -> dict:
    """What evaluate.py names and reports a drafter by, read before the base is loaded: its family ("target") and,
    for an export or a checkpoint from elsewhere, its format and the base it names."""
    fmt, family, _ = _reader(path)
    if fmt == "specdec":
        return read_meta(path)
    record = Path(path) / SPECDEC
    base_name = json.loads(record.read_text())["base_name"] if record.exists() else None
    return {"target": f"{family.__module__}.{family.__qualname__}", "format": fmt, "base_name": base_name}


def load(path: str | Path, base: Base) -> Drafter:
    """Any drafter folder -> a drafter on `base`: a specdec checkpoint, or a checkpoint in one of FORMATS (refused
    in one line when it is for another base, or malformed)."""
    fmt, _, reader = _reader(path)
    if fmt == "specdec":
        return load_drafter(Path(path), base)
    return reader(Path(path), base)
