"""Draft cost c per family at this revision against another git revision, the two taking turns in fresh processes, so a
change to how chains are drafted (the sampler's draft paths, a drafter's `expand`, the engine's whole chains) is
measured as a difference on one machine state.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_draft_cost.py --rev HEAD~1 [--turns 3] [--gammas 1 3]
        [--families medusa hydra prophet eagle3 dflash] [--out experiments/results/ab/draft_cost_<cpu>.md]

Each turn runs one process per revision (REV from a temporary `git worktree`, then this tree), alternating which goes
first. Each revision keeps its measured kernel choices in a store of its own (SPECDEC_CACHE): the two libraries'
sources differ, and one store would be measured again at every turn. A process builds untrained drafters on SmolLM2
(the cost does not depend on the weights; draft vocab 8,192),
decodes one HumanEval prompt at T = 0 with a chain of γ and the default engine, and reads c = (draft time per round /
γ) / T_1, the median over three decodes after a warm-up, T_1 one base forward over one token in the same process.
The report gives each revision's mean ± sd over the turns."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("medusa", "hydra", "prophet", "eagle3", "dflash")


def measure(families: list[str], gammas: list[int], new: int) -> dict:
    """In a worker: {family/γ: c} and T_1, for the revision whose root is first on sys.path."""
    import torch

    from specdec.base import load_base
    from specdec.data.prompts import humaneval, render_chat
    from specdec.engines import build
    from specdec.sampling.cost import forward_costs
    from specdec.sampling.decode import SamplerConfig, generate

    base = load_base(device="cpu")
    prompt = render_chat(base.tokenizer, [{"role": "user", "content": humaneval(1)[0]["turns"][0]}])
    engine = build(device="cpu")
    t1 = forward_costs(base, [1], prompt_len=len(prompt), engine=engine)[1]

    def drafter(family: str, gamma: int):
        if family in ("medusa", "hydra"):
            module = __import__(f"specdec.drafters.{family}", fromlist=["x"])
            return getattr(module, family.capitalize())(base, num_heads=gamma, draft_vocab_size=8192)
        from specdec.drafters.dflash import DFlash
        from specdec.drafters.eagle3 import Eagle3
        from specdec.drafters.prophet import Prophet
        return {"prophet": Prophet, "eagle3": Eagle3, "dflash": DFlash}[family](base, draft_vocab_size=8192)

    c = {}
    for family in families:
        for gamma in gammas:
            d = drafter(family, gamma).eval()
            cfg = SamplerConfig(max_new_tokens=new, gamma=gamma, eos_token_id=[])
            generate(base, [prompt], d, cfg, engine=engine)  # warm-up
            per_round = []
            for _ in range(3):
                r = generate(base, [prompt], d, cfg, engine=engine)
                per_round.append(sum(r.step_draft_s) / len(r.step_draft_s))
            c[f"{family}/{gamma}"] = statistics.median(per_round) / gamma / t1
    return {"t1_ms": t1 * 1e3, "c": c, "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", required=True)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 3])
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--new", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:  # a worker: the revision's root first on the path
        sys.path.insert(0, str(a.worker))
        print(json.dumps(measure(a.families, a.gammas, a.new)))
        return
    sys.path.insert(0, str(ROOT))
    from specdec.engines.measure import machine_key

    rev = subprocess.run(["git", "rev-parse", "--short", a.rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    runs: dict[str, list[dict]] = {rev: [], "this tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for turn in range(a.turns):
                order = [(rev, other), ("this tree", ROOT)]
                for name, tree in (order if turn % 2 == 0 else order[::-1]):
                    env = dict(os.environ, SPECDEC_CACHE=str(Path(tmp) / f"cache_{name.replace(' ', '_')}"))
                    out = subprocess.run([sys.executable, __file__, "--rev", a.rev, "--worker", str(tree),
                                          "--families", *a.families, "--gammas", *map(str, a.gammas),
                                          "--new", str(a.new)], cwd=tree, check=True, capture_output=True, text=True,
                                         env=env)
                    runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(f"turn {turn} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[name][-1]["c"].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)

    def stat(name: str, key: str) -> str:
        xs = [r["c"][key] for r in runs[name]]
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"

    cpu = machine_key()
    keys = list(runs[rev][0]["c"])
    lines = [f"# Draft cost c per family: {rev} against {head}{' (uncommitted changes)' if dirty else ''}", "",
             f"- **Command**: `OMP_NUM_THREADS={runs[rev][0]['threads']} .venv/bin/python experiments/ab_draft_cost.py "
             f"--rev {a.rev} --turns {a.turns} --gammas {' '.join(map(str, a.gammas))} --families "
             f"{' '.join(a.families)}`",
             f"- **Machine**: {cpu}", f"- **Date**: {__import__('datetime').date.today()}",
             f"- T_1: {statistics.mean(r['t1_ms'] for r in runs[rev]):.2f} ms ({rev}), "
             f"{statistics.mean(r['t1_ms'] for r in runs['this tree']):.2f} ms ({head}); "
             f"mean ± sd over {a.turns} turns",
             "", f"| family / γ | c at {rev} | c at {head} |", "|---|---|---|"]
    lines += [f"| {k} | {stat(rev, k)} | {stat('this tree', k)} |" for k in keys]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps({"rev": rev, "head": head, "cpu": cpu, "runs": runs},
                                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
