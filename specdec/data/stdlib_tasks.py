"""Embedded offline prompts for self-distillation: requests a user would send a chat assistant about the public,
documented functions and methods of this Python's standard library (implement it from its signature and
docstring, explain its source, show a usage example, complete its body). Only stdlib source is read, so no
evaluation prompt (HumanEval) can leak into training data.

The `complete` kind asks in the *format* code-completion benchmarks use (an instruction, then the bare signature and
docstring, unfenced: what `specdec.data.prompts.humaneval` sends), so the base's answers to it teach a drafter the
shape of a completion answer; its content is still a stdlib function, never a benchmark problem. `complete_method`
asks the same of the documented public methods, each stub on its own."""

from __future__ import annotations

import ast
import random
import textwrap
from pathlib import Path
from typing import Sequence

from datasets import Dataset

from specdec.data.sources import stdlib_files

MAX_CHARS = 1500  # docstrings are cut here; longer sources are not asked about (half a function is no task)

TEMPLATES = {
    "implement": "Implement this Python {what} from the `{module}` module:\n\n```python\n{stub}\n```",
    "explain": "Explain what the following Python function does:\n\n```python\n{source}\n```",
    "example": "Write a short usage example for `{module}.{qualname}` from the Python standard library:\n\n"
               "```python\n{stub}\n```",
    "complete": "Complete the following Python function.\n\n{stub}\n",
    # the same request for a method's stub (self and all, no class around it): more answers in the completion
    # format once the stdlib's documented module-level functions are used up (1,273 of them; 2,583 methods)
    "complete_method": "Complete the following Python function.\n\n{stub}\n",
}
KINDS = ("implement", "explain", "example")  # the default set (the shipped text's first part); "complete" is opt-in


def stdlib_tasks(limit: int | None = None, seed: int = 0, kinds: Sequence[str] = KINDS) -> Dataset:
    """Rows {id: "json/decoder.py:JSONDecoder.decode:implement", messages: [one user turn]} of the template `kinds`,
    shuffled by `seed` from one deterministic order, so the first `limit` rows are a varied sample."""
    unknown = sorted(set(kinds) - set(TEMPLATES))
    if unknown:
        raise ValueError(f"unknown stdlib task kinds {unknown}; choose from {sorted(TEMPLATES)}")
    root, files = stdlib_files()
    rows = [row for path in files for row in _file_tasks(path, path.relative_to(root).as_posix(), kinds)]
    random.Random(seed).shuffle(rows)
    rows = rows[:limit]
    return Dataset.from_dict({"id": [r[0] for r in rows],
                              "messages": [[{"role": "user", "content": r[1]}] for r in rows]})


def task_kind(task_id: str) -> str:
    """The template kind of a row id ("json/decoder.py:JSONDecoder.decode:implement" -> "implement")."""
    return task_id.rsplit(":", 1)[-1]


def task_group(task_id: str) -> str:
    """The function a row asks about ("json/decoder.py:JSONDecoder.decode:implement" -> "json/decoder.py:
    JSONDecoder.decode"): every kind of request about it, and every answer to each, greedy or sampled, share it.
    An id of another form is its own group."""
    head, _, kind = task_id.rpartition(":")
    return head if head and kind in TEMPLATES else task_id


def _file_tasks(path: Path, rel: str, kinds: Sequence[str]) -> list[tuple[str, str]]:
    """(id, request) pairs for the public documented functions of one file, in source order."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a file kept for another Python version
        return []
    lines = text.splitlines()
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    tasks, seen = [], set()
    for qualname, fn in _public_functions(tree):
        if qualname in seen:  # a property setter or a redefinition: the first one is enough
            continue
        seen.add(qualname)
        start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
        cls = qualname.rpartition(".")[0]
        fields = {"module": module, "qualname": qualname, "stub": _stub(fn),
                  "what": f"method of the `{cls}` class" if cls else "function",
                  "source": textwrap.dedent("\n".join(lines[start - 1 : fn.end_lineno]))}
        for kind in kinds:
            if kind == "explain" and len(fields["source"]) > MAX_CHARS:
                continue
            if (kind == "complete" and cls) or (kind == "complete_method" and not cls):
                continue  # module-level functions / methods of module-level classes
            tasks.append((f"{rel}:{qualname}:{kind}", TEMPLATES[kind].format(**fields)))
    return tasks


def _public_functions(tree: ast.Module):
    """Module-level functions and methods of module-level classes: public names with a docstring."""
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, funcs):
            candidates = [(node.name, node)]
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            candidates = [(f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, funcs)]
        else:
            continue
        for qualname, fn in candidates:
            if not qualname.rpartition(".")[2].startswith("_") and ast.get_docstring(fn):
                yield qualname, fn


def _stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The signature and docstring (cut at MAX_CHARS) without the body or decorators, as `ast.unparse` writes it."""
    doc = ast.get_docstring(fn)
    if len(doc) > MAX_CHARS:
        doc = doc[:MAX_CHARS].rsplit("\n", 1)[0] + "\n..."
    doc = textwrap.indent(doc, "    ").lstrip() + ("\n    " if "\n" in doc else "")  # laid out as in a source file
    stub = type(fn)(name=fn.name, args=fn.args, body=[ast.Expr(ast.Constant(doc))], decorator_list=[],
                    returns=fn.returns, type_comment=None, type_params=[])
    return ast.unparse(ast.fix_missing_locations(stub))
