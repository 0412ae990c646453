"""A/B the sampler's code between two source trees: this checkout and `--other` (e.g. a `git worktree` of an earlier
revision). Our AR loop, and with --drafter a trained drafter, decode the same HumanEval prompts in each tree, every
tree in a process of its own (its `specdec` imported from that tree), the processes alternating, so a change to the
decode loop itself (not one class, as ab_drafter.py does) is measured as a ratio on one machine state.

    git worktree add /tmp/before HEAD~1
    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_trees.py --other /tmp/before
    python experiments/ab_trees.py --other /tmp/before --device cuda --drafter <its dir> --gamma 1
    python experiments/ab_trees.py --other /tmp/before --drafter <its dir> --paths '[[0], [1]]'   # a static tree
    python experiments/ab_trees.py --other /tmp/before --drafter <its dir> --lookup 8   # + n-gram lookup rounds

Prints each process's rates as it ends, then per tree: our AR loop's tok/s (and the drafter's and lookup's, each × AR),
each tree's ratio to the other's, and whether every output equals this tree's AR (greedy: both trees must emit the
base's own tokens). Rates are wall clock around each `generate` call, its set-up included, alike in both trees."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """In one tree's process: a warm-up decode of each method (kernel tables, graphs), then every prompt timed. It
    imports that tree's specdec, so it calls only what older trees have too (no helper newer than the tree compared)."""
    import specdec
    from specdec.base import load_base
    from specdec.checkpoint import load_drafter
    from specdec.data.prompts import humaneval, render_chat
    from specdec.sampling.cost import wall_clock
    from specdec.sampling.decode import SamplerConfig, generate

    base = load_base(device=args.device)
    try:  # a tree whose sampler takes its engine as an argument (older trees pick theirs inside generate)
        from specdec.engines import build
        run = {"engine": build(device=base.device)}
    except ImportError:
        run = {}
    try:  # settings are chosen on the tuning split (an older tree's humaneval has no splits: the same half by hand)
        items = humaneval(limit=args.prompts, split="tune")
    except TypeError:
        items = humaneval()[82: 82 + args.prompts]
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in items]
    cfg = SamplerConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma, lookup_tokens=args.lookup,
                        **(dict(tree="static", paths=json.loads(args.paths)) if args.paths else {}))
    plain = SamplerConfig(max_new_tokens=args.max_new_tokens)
    methods = {"ar": (None, plain)} | ({"lookup": (None, cfg)} if args.lookup else {}) | \
        ({"drafter": (load_drafter(args.drafter, base), cfg)} if args.drafter else {})
    for drafter, c in methods.values():
        generate(base, prompts[:1], drafter, c, **run)
    out = {}
    for name, (drafter, c) in methods.items():
        tokens, seconds, texts = 0, 0.0, []
        for prompt in prompts:
            t = wall_clock(base.device)
            r = generate(base, [prompt], drafter, c, **run)
            seconds += wall_clock(base.device) - t
            tokens += r.num_generated[0]
            texts.append(r.tokens[0, : r.num_generated[0]].tolist())
        out[name] = {"tokens": tokens, "s": seconds, "outputs": texts}
    print("RESULT " + json.dumps(out | {"specdec": specdec.__file__}))


def run_tree(tree: Path, args: argparse.Namespace) -> dict:
    """This script's worker with `tree`'s specdec first on the path."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", args.device, "--prompts",
           str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--gamma", str(args.gamma),
           "--lookup", str(args.lookup)] + \
        (["--paths", args.paths] if args.paths else [])
    if args.drafter:
        cmd += ["--drafter", str(Path(args.drafter).resolve())]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"the worker in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", help="the other source tree (a checkout holding specdec/)")
    ap.add_argument("--drafter", help="a trained drafter's directory (else our AR loop alone)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gamma", type=int, default=1)
    ap.add_argument("--paths", help="a static tree's paths as JSON, e.g. '[[0], [1]]' (instead of a chain of --gamma)")
    ap.add_argument("--lookup", type=int, default=0, help="n-gram lookup rounds of up to this many tokens (the "
                    "drafter's, and lookup alone as a method of its own); 0: none")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2, help="processes per tree, alternating (the order flips each pass)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not args.other:
        ap.error("--other is required")
    trees = {"this tree": ROOT, "other": Path(args.other).resolve()}
    totals: dict[str, dict[str, dict]] = {name: {} for name in trees}
    for p in range(args.passes):
        for name in (list(trees) if p % 2 == 0 else list(trees)[::-1]):
            result = run_tree(trees[name], args)
            if Path(result.pop("specdec")).resolve().parents[1] != trees[name]:
                sys.exit(f"the worker for {trees[name]} imported another tree's specdec")
            print(f"pass {p + 1}, {name}: " + ", ".join(f"{m} {r['tokens'] / r['s']:.1f} tok/s"
                                                     for m, r in result.items()), flush=True)
            for method, r in result.items():
                tot = totals[name].setdefault(method, {"tokens": 0, "s": 0.0, "outputs": []})
                tot["tokens"] += r["tokens"]
                tot["s"] += r["s"]
                tot["outputs"].append(r["outputs"])
    reference = totals["this tree"]["ar"]["outputs"][0]
    print(f"\n{args.prompts} HumanEval prompts × {args.max_new_tokens} tokens, {args.passes} processes per tree, "
          f"device {args.device}; other = {trees['other']}\n")
    print("| tree | method | tok/s | × its AR | × the other tree | output = AR's (this tree) |")
    print("|---|---|---|---|---|---|")
    rate = {(t, m): tot["tokens"] / tot["s"] for t, methods in totals.items() for m, tot in methods.items()}
    for (tree, method), r in rate.items():
        other = "other" if tree == "this tree" else "this tree"
        same = all(o == reference for o in totals[tree][method]["outputs"])
        print(f"| {tree} | {method} | {r:.1f} | {r / rate[tree, 'ar']:.3f} | {r / rate[other, method]:.3f} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
