"""Where training text comes from. Every source returns an HF `datasets.Dataset` with either a `text` column
or a `messages` column (list of {role, content}); the data module renders messages with the base's chat
template. A local file and a hub dataset name go through the same `load_rows`."""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import warnings
from pathlib import Path

from datasets import Dataset, load_dataset

# Builders of the `datasets` library for local files, by suffix.
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".md": "text", ".py": "text", ".parquet": "parquet", ".csv": "csv"}
# stdlib folders that are tests, demos or GUI code rather than ordinary library source.
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "tkinter", "__pycache__"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def load_rows(path: str, split: str = "train", name: str | None = None, on_bad_lines: str = "fail") -> Dataset:
    """A local file/glob (builder chosen by suffix) or an HF hub dataset name (needs network). Local jsonl is read
    here, line by line, so a malformed line is reported by file and line number (`on_bad_lines`: fail | skip). A local
    path or glob that matches no file, or only empty ones, fails in one line naming it."""
    if not is_local(path):
        return load_dataset(path, name, split=split)
    files = local_files(path)
    suffix = Path(path).suffix
    if suffix == ".jsonl":
        rows = read_jsonl(path, on_bad_lines)
        if not rows:
            raise ValueError(f"{path}: no JSON rows in {_matched(files)} (every line blank or skipped)")
        return Dataset.from_list(rows)
    builder = BUILDERS.get(suffix, "text")
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    return load_dataset(builder, data_files=files, split="train", **kwargs)


def is_local(path: str) -> bool:
    """Whether `path` names local files (an existing path, a glob, a file suffix, or an absolute / relative / home
    path) rather than a hub dataset (`owner/name`)."""
    return (Path(path).expanduser().exists() or any(c in path for c in "*?[") or Path(path).suffix in BUILDERS
            or path.startswith(("/", "./", "../", "~")))


def local_files(path: str) -> list[str]:
    """The files a local path or glob names, sorted; one line (FileNotFoundError / ValueError) naming `path` when it
    matches no file, is a folder, or matches only empty files."""
    full = os.path.expanduser(path)
    if any(c in path for c in "*?["):
        files = [f for f in sorted(glob.glob(full, recursive=True)) if os.path.isfile(f)]
        if not files:
            raise FileNotFoundError(f"no files match {path}")
    elif os.path.isdir(full):
        raise ValueError(f"{path} is a folder: name its files with a glob, e.g. {os.path.join(path, '*.txt')}")
    elif not os.path.isfile(full):
        raise FileNotFoundError(f"no such file: {path}")
    else:
        files = [full]
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"{path}: {_matched(files)} are empty" if len(files) > 1 else f"{path} is an empty file")
    return files


def _matched(files: list[str]) -> str:
    return f"the {len(files)} files it matches" if len(files) > 1 else "the file"


def read_jsonl(path: str, on_bad_lines: str = "fail") -> list[dict]:
    """Rows of one jsonl file or glob. A line that is not a JSON object fails with its file:line, or with
    on_bad_lines=skip is dropped and counted in one warning."""
    if on_bad_lines not in ("fail", "skip"):
        raise ValueError(f"on_bad_lines must be fail or skip, got {on_bad_lines!r}")
    files = local_files(path)
    rows, bad = [], []
    for f in files:
        for n, line in enumerate(Path(f).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"a JSON {type(row).__name__}, not an object")
            except ValueError as e:
                if on_bad_lines == "fail":
                    raise ValueError(f"{f}:{n}: malformed jsonl line ({e}); fix it or set on_bad_lines=skip") from None
                bad.append(f"{Path(f).name}:{n}")
                continue
            rows.append(row)
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} malformed line(s): {', '.join(bad[:10])}"
                      + (" ..." if len(bad) > 10 else ""), stacklevel=2)
    return rows


def text(path: str, split: str = "train", field: str = "text", name: str | None = None,
         on_bad_lines: str = "fail") -> Dataset:
    """Plain text: text files (one document per file), or a `field` of jsonl rows / a hub dataset."""
    ds = load_rows(path, split, name, on_bad_lines)
    if field not in ds.column_names:
        raise ValueError(f"{path}: no field {field!r} in its rows (fields: {', '.join(ds.column_names) or 'none'})")
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds.select_columns(["text"])


def chat(path: str, split: str = "train", field: str = "messages", name: str | None = None,
         on_bad_lines: str = "fail") -> Dataset:
    """Chat rows: OpenAI-style `messages` [{role, content}] or ShareGPT `conversations` [{from, value}]. A row
    without an assistant turn has nothing to train on: it fails (with its row numbers) or, with
    on_bad_lines=skip, is dropped and counted."""
    ds = load_rows(path, split, name, on_bad_lines)
    if field not in ds.column_names:
        raise ValueError(f"{path}: no field {field!r} in its rows (fields: {', '.join(ds.column_names) or 'none'})")

    def to_messages(row: dict) -> dict:
        turns = row[field] or []
        if turns and "from" in turns[0]:  # ShareGPT
            turns = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        return {"messages": [{"role": t["role"], "content": t["content"]} for t in turns]}

    ds = ds.map(to_messages, remove_columns=ds.column_names)
    answered = [any(m["role"] == "assistant" and m["content"] for m in ms) for ms in ds["messages"]]
    missing = [i for i, ok in enumerate(answered) if not ok]
    if missing and on_bad_lines == "fail":
        raise ValueError(f"{path}: {len(missing)} chat row(s) without an assistant turn (rows {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}); drop them or set on_bad_lines=skip")
    if missing:
        warnings.warn(f"{path}: skipped {len(missing)} chat row(s) without an assistant turn", stacklevel=2)
        ds = ds.select([i for i, ok in enumerate(answered) if ok])
    return ds


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
