"""Where training text comes from. Every source returns an HF `datasets.Dataset` with either a `text` column
or a `messages` column (list of {role, content}); the data module renders messages with the base's chat
template. A local file and a hub dataset name go through the same `load_rows`."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from datasets import Dataset, load_dataset

# Builders of the `datasets` library for local files, by suffix.
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".md": "text", ".py": "text", ".parquet": "parquet", ".csv": "csv"}
# stdlib folders that are tests, demos or GUI code rather than ordinary library source.
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "tkinter", "__pycache__"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def load_rows(path: str, split: str = "train", name: str | None = None) -> Dataset:
    """A local file/glob (builder chosen by suffix) or an HF hub dataset name (needs network)."""
    suffix = Path(path.split("*")[0] if "*" in path else path).suffix
    local = Path(path).exists() or "*" in path
    if local:
        builder = BUILDERS.get(suffix, "text")
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        return load_dataset(builder, data_files=path, split="train", **kwargs)
    return load_dataset(path, name, split=split)


def text(path: str, split: str = "train", field: str = "text", name: str | None = None) -> Dataset:
    """Plain text: text files (one document per file), or a `field` of jsonl rows / a hub dataset."""
    ds = load_rows(path, split, name)
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds.select_columns(["text"])


def chat(path: str, split: str = "train", field: str = "messages", name: str | None = None) -> Dataset:
    """Chat rows: OpenAI-style `messages` [{role, content}] or ShareGPT `conversations` [{from, value}]."""
    ds = load_rows(path, split, name)

    def to_messages(row: dict) -> dict:
        turns = row[field]
        if turns and "from" in turns[0]:  # ShareGPT
            turns = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        return {"messages": [{"role": t["role"], "content": t["content"]} for t in turns]}

    return ds.map(to_messages, remove_columns=ds.column_names)


def stdlib_files() -> tuple[Path, list[Path]]:
    """This Python's standard-library root and its source files, sorted, without tests/demos/GUI code."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_SKIP]  # pruned, not walked: site-packages can be huge
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return root, sorted(files)


def stdlib_code(max_files: int | None = None) -> Dataset:
    """The embedded default corpus: this Python's own standard-library source files (no tests/GUI code)."""
    root, files = stdlib_files()
    files = files[:max_files]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return Dataset.from_dict({"text": texts, "path": [str(p.relative_to(root)) for p in files]})
