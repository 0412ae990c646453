"""llama.cpp's formats: a draft model or an EAGLE-3 drafter as one GGUF file, made by llama.cpp's own
convert_hf_to_gguf.py (from the tree `make peers` unpacks, run as a tool over our HF-layout export, never copied).

- draft_model: the plain HF directory (export `hf`) converted in float32; llama.cpp runs it with `--model-draft` and
  `--spec-type draft-simple`.
- eagle3: the speculators directory converted with `--target-model-dir` (the base's HF directory: the converter
  takes the base's tokenizer, layer count and hidden size from it); llama.cpp runs it with `--model-draft` and
  `--spec-type draft-eagle3`, reading the inputs of the fused layers from its own forward of the base."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec.drafters.eagle3 import Eagle3
from specdec.export.common import write_record
from specdec.peers import llama_cpp

FILE = "drafter.gguf"


def converter() -> Path:
    script = llama_cpp.bin_dir().parent / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.exists():
        raise FileNotFoundError(f"{script} is missing: `make peers` unpacks llama.cpp's converter")
    return script


def write(d, out: Path, source: str) -> None:
    from specdec.export import draft_model, eagle3  # (the HF-layout writers this converts from)

    if isinstance(d, Eagle3):
        eagle3.refuse_eagle31(d, "llama.cpp's converter (conversion/llama.py)")
    script = converter()
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if isinstance(d, Eagle3):
            eagle3.write_speculators(d, Path(tmp), source)
            extra = ["--target-model-dir", str(d.base.model.config._name_or_path)]
        else:
            draft_model.write_hf(d, Path(tmp), source)
        done = subprocess.run([sys.executable, str(script), tmp, "--outtype", "f32", "--outfile", str(out / FILE),
                               *extra], capture_output=True, text=True, env=dict(os.environ))
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed: {' | '.join(tail)}")
    write_record(out, d.base, "gguf", source, family="eagle3" if isinstance(d, Eagle3) else "draft_model")


def server_args(path: str | Path) -> list[str]:
    """llama-server's flags for a draft GGUF: the file and its speculation type (EAGLE-3's where its record says so;
    `-md` alone loads a draft model without drafting with it)."""
    import json

    path = Path(path)
    record = path.parent / "specdec.json" if path.is_file() else path / "specdec.json"
    file = path if path.is_file() else path / FILE
    family = json.loads(record.read_text()).get("family") if record.exists() else None
    return ["-md", str(file), "--spec-type", "draft-eagle3" if family == "eagle3" else "draft-simple"]
