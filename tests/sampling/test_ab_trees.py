"""experiments/ab_trees.py: the decode loop of two source trees, each in its own process, interleaved. The processes are
faked here (a real one loads SmolLM2 and decodes HumanEval); what is checked is the bookkeeping around them: the order
flips every pass, each tree's rates pool its processes, the outputs are compared with this tree's AR loop, and a worker
that imported another tree's specdec stops the run."""

import sys
from pathlib import Path

import pytest

from conftest import experiment_script

ab = experiment_script("ab_trees")


def fake_worker(rates: dict, calls: list, outputs: dict | None = None):
    """run_tree's stand-in: tree -> {method: tok/s} (64 tokens a process), its specdec where the tree holds it."""

    def run_tree(tree: Path, args) -> dict:
        calls.append(tree)
        out = {m: {"tokens": 64, "s": 64 / r, "outputs": (outputs or {}).get((tree, m), [[1, 2, 3]])}
               for m, r in rates[tree].items()}
        return out | {"specdec": str(tree / "specdec" / "__init__.py")}

    return run_tree


def test_interleaved_pooled_and_compared(tmp_path, monkeypatch, capsys):
    other = tmp_path / "before"
    rates = {ab.ROOT: {"ar": 200.0, "drafter": 250.0}, other: {"ar": 100.0, "drafter": 150.0}}
    calls = []
    drifted = {(other, "drafter"): [[1, 2, 4]]}  # the other tree's drafter emits another token
    monkeypatch.setattr(ab, "run_tree", fake_worker(rates, calls, drifted))
    monkeypatch.setattr(sys, "argv", ["ab_trees.py", "--other", str(other), "--passes", "3"])
    ab.main()
    assert calls == [ab.ROOT, other, other, ab.ROOT, ab.ROOT, other]  # the order flips every pass
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| this") or line.startswith("| other")}
    assert rows[("this tree", "ar")] == ["200.0", "1.000", "2.000", "yes"]
    assert rows[("this tree", "drafter")] == ["250.0", "1.250", "1.667", "yes"]
    assert rows[("other", "ar")] == ["100.0", "1.000", "0.500", "yes"]
    assert rows[("other", "drafter")] == ["150.0", "1.500", "0.600", "NO"]


def test_a_worker_that_imported_another_tree_stops_the_run(tmp_path, monkeypatch):
    other = tmp_path / "before"
    calls = []
    wrong = fake_worker({ab.ROOT: {"ar": 1.0}, other: {"ar": 1.0}}, calls)
    monkeypatch.setattr(ab, "run_tree", lambda tree, args: wrong(ab.ROOT, args))  # always this tree's specdec
    monkeypatch.setattr(sys, "argv", ["ab_trees.py", "--other", str(other), "--passes", "1"])
    with pytest.raises(SystemExit, match="imported another tree's specdec"):
        ab.main()
