"""Evaluate drafters against plain decoding and peers (HF generate, llama.cpp) on the same base, prompts and machine, in
one run: a Spec-Bench-style table (markdown, CSV, JSON), plots, and wandb logging (docs/sampler.md §4, §5, §7).

run.py: evaluate(cfg), the turns and the reference; methods.py: what is timed (ours and the peers); runs.py: what one
answer records and how the answers are kept; report.py: the table from the answers."""

from specdec.evaluation.run import drafter_names, evaluate

__all__ = ["drafter_names", "evaluate"]
