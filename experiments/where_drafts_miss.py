"""Where a trained drafter's first draft token misses, against what n-gram lookup would have proposed there.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/where_drafts_miss.py [LABEL=]<drafter dir> [...] \
        [--prompts humaneval|question] [--split tune] [--limit 20] [--new 128] [--out <dir>]

At T = 0 a chain of one accepts its draft exactly when the drafter's first entry, given the committed prefix, names
the base's greedy next token. So over the base's own greedy answers (HF `generate` in float32, outside every engine,
as the evaluation's identity reference) one teacher-forced pass of the drafter gives, for every answer position, what
a chain of one would draft there, and `ngram_match` over the same prefix gives what lookup would propose. Each
position falls in one of three classes by lookup (its proposal right, wrong, or no 2-3-gram match) and in one of two
regions of the answer (inside a fenced code block or outside it); the report gives each class's share of the
positions and the drafter's top-1 accuracy in it, and how often either of the two would have been right. It answers
"are the drafter's misses the copies lookup gets, or the tokens nobody predicts". Nothing is timed.

The accuracy is over every answer position, where a chain of one drafts only at the positions its rounds reach (after
an accepted draft it skips one), so it is close to, not equal to, the α a decode measures. The drafter runs in float32
from its checkpoint (the evaluation may draft from Q8_0 or Q4_1 copies, which can propose other tokens)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import Base, load_base  # noqa: E402
from specdec.checkpoint import load_drafter  # noqa: E402
from specdec.data.prompts import humaneval, question_jsonl, render_chat  # noqa: E402
from specdec.drafters.drafter import Drafter  # noqa: E402
from specdec.engines.measure import cpu_model  # noqa: E402
from specdec.ngram import ngram_match  # noqa: E402

CLASSES = ("lookup right", "lookup wrong", "no match")
REGIONS = ("code", "prose")
FENCE = "```"


@torch.no_grad()
def greedy_answer(base: Base, prompt: list[int], new: int) -> list[int]:
    """The base's greedy answer [≤ new] to prompt, from HF generate in float32 (stops at its end-of-turn token)."""
    out = base.model.generate(torch.tensor([prompt], device=base.device), max_new_tokens=new, do_sample=False,
                              pad_token_id=base.tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def first_drafts(drafter: Drafter, base: Base, ids: list[int]) -> dict[int, int]:
    """Teacher-forced over ids [T]: {position p: the base token id the drafter's first entry drafts for p}, for
    every p its first entry reaches (entry 0 at t predicts token t + 1 + target_offsets[0])."""
    x = torch.tensor([ids], device=base.device)
    feats = base.features(x, layers=drafter.feature_layers)
    logits = drafter.forward_train(feats, x).logits[0, :, 0]  # [T, V_d]: entry 0 at every position
    drafted = drafter.token_ids(logits.argmax(-1)).tolist()  # [T] base ids
    o = drafter.target_offsets[0]
    return {t + 1 + o: tok for t, tok in enumerate(drafted) if t + 1 + o < len(ids)}


def regions(base: Base, answer: list[int]) -> list[str]:
    """[len(answer)]: code where the answer so far has opened a fenced block it has not closed, else prose."""
    out = []
    for i in range(len(answer)):
        before = base.tokenizer.decode(answer[:i])
        out.append("code" if before.count(FENCE) % 2 == 1 else "prose")
    return out


def classify(prompt: list[int], answer: list[int], drafts: dict[int, int], where: list[str],
             min_ngram: int = 2, max_ngram: int = 3) -> list[dict]:
    """One record per answer position the drafter reaches: its region, lookup's class there, whether the drafter's
    first draft and lookup's first proposal are the base's token. The first answer token is left out: the round
    before it is the prefill, which drafts nothing."""
    ids = prompt + answer
    rows = []
    for i in range(1, len(answer)):
        p = len(prompt) + i
        if p not in drafts:
            continue
        proposal, _ = ngram_match(ids[:p], 1, min_ngram, max_ngram)
        kind = "no match" if not proposal else ("lookup right" if proposal[0] == ids[p] else "lookup wrong")
        rows.append({"region": where[i], "class": kind, "drafter": drafts[p] == ids[p],
                     "lookup": bool(proposal) and proposal[0] == ids[p]})
    return rows


def summary(rows: list[dict]) -> dict:
    """Shares and accuracies over rows (by class, by region, and in all)."""
    def acc(sel: list[dict]) -> dict:
        n = len(sel)
        return {"positions": n, "drafter": sum(r["drafter"] for r in sel) / n if n else None,
                "lookup": sum(r["lookup"] for r in sel) / n if n else None,
                "either": sum(r["drafter"] or r["lookup"] for r in sel) / n if n else None}

    out = {"all": acc(rows)}
    for region in (None, *REGIONS):
        inside = [r for r in rows if region is None or r["region"] == region]
        for kind in CLASSES:
            sel = [r for r in inside if r["class"] == kind]
            out[f"{region or 'all'}/{kind}"] = {**acc(sel), "share": len(sel) / len(inside) if inside else None}
        if region:
            out[region] = {**acc(inside), "share": len(inside) / len(rows) if rows else None}
    return out


def render(results: dict[str, dict], header: dict) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"# Where the first draft token misses ({header['prompts']}, {header['n_prompts']} prompts)", "",
             f"`{header['command']}` · {header['date']} · {header['machine']}", "",
             f"Answers: HF generate, float32, greedy, up to {header['new']} new tokens; the drafter teacher-forced in "
             f"float32; lookup: {header['ngram']}-grams, its first proposed token.", "",
             "| drafter | positions | where | share | drafter top-1 | lookup right | either right |",
             "|---|---|---|---|---|---|---|"]
    for name, s in results.items():
        lines.append(f"| {name} | {s['all']['positions']} | all | 1.00 | {fmt(s['all']['drafter'])} | "
                     f"{fmt(s['all']['lookup'])} | {fmt(s['all']['either'])} |")
        for key in (*REGIONS, *(f"all/{k}" for k in CLASSES), *(f"{r}/{k}" for r in REGIONS for k in CLASSES)):
            c = s[key]
            lines.append(f"| {name} | {c['positions']} | {key} | {fmt(c['share'])} | {fmt(c['drafter'])} | "
                         f"{fmt(c['lookup'])} | {fmt(c['either'])} |")
    lines += ["", "share: of all positions (a region) or of its region's positions (a class); drafter top-1: its "
              "first draft token is the base's greedy token (what a chain of one accepts at T = 0); lookup right: "
              "lookup proposes that token; either: one of the two does (a drafter that also copied as lookup does "
              "could reach it).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafters", nargs="+", help="drafter checkpoint dirs (train.py's <run>/drafter), each as "
                    "LABEL=DIR to name its rows LABEL")
    ap.add_argument("--prompts", default="humaneval", help="humaneval, or a question.jsonl path")
    ap.add_argument("--split", default="tune", help="HumanEval's split (tune: the one settings are chosen on)")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", help="a directory for where_drafts_miss.md and .json")
    ap.add_argument("--base", default="smollm2_135m")
    args = ap.parse_args()
    base = load_base(args.base)
    items = (humaneval(args.limit, split=args.split) if args.prompts == "humaneval"
             else question_jsonl(args.prompts, args.limit))
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": it["turns"][0]}]) for it in items]
    answers = [greedy_answer(base, p, args.new) for p in prompts]
    where = [regions(base, a) for a in answers]
    results = {}
    for arg in args.drafters:
        label, _, path = arg.rpartition("=")
        drafter = load_drafter(path, base)
        rows = [r for p, a, w in zip(prompts, answers, where)
                for r in classify(p, a, first_drafts(drafter, base, p + a), w)]
        results[label or path] = summary(rows)
    name = args.prompts if args.prompts == "humaneval" else Path(args.prompts).stem
    header = {"prompts": f"{name} ({args.split} split)" if args.prompts == "humaneval" else name,
              "n_prompts": len(items), "new": args.new, "ngram": "2-3", "machine": cpu_model(),
              "date": datetime.date.today().isoformat(),
              "command": "python experiments/where_drafts_miss.py " + " ".join(sys.argv[1:])}
    text = render(results, header)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "where_drafts_miss.md").write_text(text)
        (out / "where_drafts_miss.json").write_text(json.dumps({"header": header, "results": results}, indent=1))


if __name__ == "__main__":
    main()
