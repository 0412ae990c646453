"""Contamination check: no evaluation prompt may be in the training data, and "in" means shared word 13-grams (the
n-gram test of GPT-3's and PaLM's contamination studies), not equal lines: a request that quotes half a HumanEval
docstring, or an answer that restates a question from question.jsonl, shares long n-grams with it while no line is
equal.

    python -m specdec.data.overlap <distilled out_dir or shipped .jsonl.gz> [more ...]   # prints what overlaps"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterable

N = 13
_WORD = re.compile(r"\w+")


def ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    """The word n-grams of `text`, lowercased: punctuation and spacing do not hide a copy."""
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def eval_texts(extra: Iterable[str | Path] = ()) -> list[str]:
    """Every prompt specdec evaluates on: all 164 HumanEval problems, experiments/prompts/*.jsonl (every turn), and
    any more jsonl prompt files given."""
    from specdec.data.prompts import humaneval, question_jsonl

    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "experiments" / "prompts").glob("*.jsonl")) + [Path(p) for p in extra]
    texts = [t for it in humaneval(limit=None, split=None) for t in it["turns"]]
    return texts + [t for f in files for it in question_jsonl(str(f)) for t in it["turns"]]


class Overlap:
    """The 13-grams of the evaluation prompts, asked of each training text in turn."""

    def __init__(self, texts: Iterable[str], n: int = N):
        self.n = n
        self.grams: set[tuple[str, ...]] = set().union(*(ngrams(t, n) for t in texts))

    def hits(self, text: str) -> set[tuple[str, ...]]:
        return ngrams(text, self.n) & self.grams


def main(paths: list[str]) -> int:
    from specdec.data.distill import distilled

    check = Overlap(eval_texts())
    rows = distilled(paths)
    bad = []  # (row, one shared n-gram): every turn checked, the requests and the answers alike
    for i, r in enumerate(rows):
        hits = set().union(*(check.hits(m["content"]) for m in r["messages"]))
        if hits:
            bad.append((r.get("id", i), " ".join(sorted(hits)[0])))
    for row_id, gram in bad[:20]:
        print(f"row {row_id}: shares {N}-grams with an evaluation prompt, e.g. {gram!r}")
    print(f"{len(bad)} of {len(rows)} rows share a {N}-gram with an evaluation prompt")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
