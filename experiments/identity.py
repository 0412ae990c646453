"""Greedy identity against an independent reference, over full prompt sets: every decoding mode of our sampler (plain,
n-gram lookup, each drafter as a chain, a dynamic tree and with lookup rounds), and llama.cpp where `make peers` built
it, each compared token for token with HF `generate` in float32 (stock PyTorch, nothing patched, no measured kernel).

    OMP_NUM_THREADS=2 .venv/bin/python experiments/identity.py --drafter logs/demo/<time>/train/drafter
    .venv/bin/python experiments/identity.py --limit 4 --max-new-tokens 32          # a quick look

Why it is needed: our loop multiplies the base's Q4_1 blocks in a reassociated form (d·Σq·x + m·Σx) and its softmax
and SiLU use a polynomial exp, so its logits equal float32's only to rounding; greedy identity then holds by
measurement. A mismatch is reported where it happened with the reference's top-2 logit margin at that position: a
near-tie (a margin of rounding size) is told apart from a bug (a large margin).

Prompts: all 164 HumanEval problems and experiments/prompts/question.jsonl (every turn, each after the reference's
own earlier answers, so every method decodes the same context). The reference decodes are kept in
~/.cache/specdec/identity and read back by a rerun. Writes identity.json and identity.md to --out."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specdec.base import Base, load_base, smollm2_gguf_path  # noqa: E402
from specdec.checkpoint import load_drafter, write_json, write_text  # noqa: E402
from specdec.data.prompts import humaneval, question_jsonl, render_chat  # noqa: E402
from specdec.engines import build  # noqa: E402
from specdec.engines.measure import cpu_model  # noqa: E402
from tables import cpu_label  # noqa: E402
from specdec.evaluation.runs import cut_at_eos  # noqa: E402  (EOS counted as a generated token, as everywhere)
from specdec.sampling.config import SamplerConfig  # noqa: E402
from specdec.sampling.decode import generate  # noqa: E402
from specdec.sampling.lookup import fresh_counts  # noqa: E402


def contexts(base: Base, limit: int | None, max_new: int, cache: Path, batch: int = 16) -> list[dict]:
    """Every (set, prompt, turn) context with the reference's greedy answer: HF generate in float32, before any engine
    is built, `batch` contexts at a time (left-padded under an attention mask: stock PyTorch still, its sums in
    another order than at batch 1, which only the margins at a mismatch can tell). Turn k of a conversation follows
    the reference's own answers to turns < k. Kept in `cache`/reference.json (a rerun with the same settings reads
    it back)."""
    path = cache / "reference.json"
    key = {"limit": limit, "max_new_tokens": max_new, "base": base.name, "batch": batch}
    if path.exists() and json.loads(path.read_text())["key"] == key:
        return json.loads(path.read_text())["contexts"]
    items = [("humaneval", it) for it in humaneval(limit=limit, split=None)]
    items += [("question", it) for it in question_jsonl(str(ROOT / "experiments/prompts/question.jsonl"), limit=limit)]
    eos, pad = base.config.eos_token_id, base.tokenizer.pad_token_id or 0
    histories: list[list[dict]] = [[] for _ in items]
    done, t0 = [], time.time()
    for turn in range(max(len(it["turns"]) for _, it in items)):
        rows = [i for i, (_, it) in enumerate(items) if turn < len(it["turns"])]
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            prompts = []
            for i in chunk:
                histories[i].append({"role": "user", "content": items[i][1]["turns"][turn]})
                prompts.append(render_chat(base.tokenizer, histories[i]))
            width = max(map(len, prompts))
            x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=base.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=base.device)
            seq = base.model.generate(x, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                      eos_token_id=eos, pad_token_id=pad)
            for i, p, row in zip(chunk, prompts, seq[:, width:].tolist()):
                answer = cut_at_eos(row, eos)
                name, it = items[i]
                done.append({"set": name, "id": str(it["id"]), "turn": turn, "prompt": p, "reference": answer})
                histories[i].append({"role": "assistant",
                                     "content": base.tokenizer.decode(answer, skip_special_tokens=True)})
            print(f"[identity] reference: turn {turn}, {start + len(chunk)}/{len(rows)} after {time.time() - t0:.0f} s",
                  flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    write_json(path, {"key": key, "contexts": done})
    return done


@torch.no_grad()
def margin_at(base: Base, prompt: list[int], reference: list[int], pos: int, theirs: int) -> dict:
    """The reference model's logits where a method first parted from it: its top-2 margin and the rank it gives the
    method's token (float32, stock forward)."""
    x = torch.tensor([prompt + reference[:pos]], device=base.device)
    logits = base.model(x).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {"pos": pos, "reference_token": reference[pos] if pos < len(reference) else None, "their_token": theirs,
            "margin": float(top.values[0] - top.values[1]),
            "their_rank": int((logits > logits[theirs]).sum()) if theirs is not None else None}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def methods(drafters: list[str], base: Base, max_new: int, lookup: int) -> list[tuple[str, object, SamplerConfig]]:
    plain = SamplerConfig(max_new_tokens=max_new)
    out = [("ar (ours)", None, plain), ("lookup (ours)", None, SamplerConfig(max_new_tokens=max_new, lookup_tokens=lookup))]
    for path in drafters:
        d = load_drafter(path, base)
        name = Path(path).parent.name if Path(path).name == "drafter" else Path(path).name
        name = type(d).__name__.lower() + f" ({name})"
        out += [(f"{name} chain γ=1", d, SamplerConfig(max_new_tokens=max_new, gamma=1)),
                (f"{name} dynamic tree", d, SamplerConfig(max_new_tokens=max_new, tree="dynamic", dynamic_by_cost=True)),
                (f"{name} chain γ=1 + lookup", d, SamplerConfig(max_new_tokens=max_new, gamma=1, lookup_tokens=lookup))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", default=[], help="a trained drafter dir (repeatable)")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts of each set (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even where it is built")
    ap.add_argument("--out", type=Path, default=None, help="default: experiments/results/identity/<cpu>")
    ap.add_argument("--render", action="store_true", help="only rewrite identity.md from the identity.json in --out")
    args = ap.parse_args()
    out = args.out or ROOT / "experiments/results/identity" / cpu_label()
    if args.render:
        write_text(out / "identity.md", render(json.loads((out / "identity.json").read_text())))
        return
    base = load_base()
    todo = contexts(base, args.limit, args.max_new_tokens, Path("~/.cache/specdec/identity").expanduser())
    engine = build(device=base.device)  # (after the reference: nothing it builds can touch the reference's decode)
    eos = base.config.eos_token_id

    results = []
    for name, drafter, cfg in methods(args.drafter, base, args.max_new_tokens, args.lookup):
        counts = fresh_counts(cfg.lookup_tokens, cfg.lookup_max_ngram) if cfg.lookup_tokens else None
        def decode(ids: list[int], d=drafter, c=cfg, n=counts) -> list[int]:
            r = generate(base, [ids], d, c, engine=engine, lookup_counts=n)
            return r.tokens[0, : r.num_generated[0]].tolist()

        results.append(_compare(base, name, todo, decode, eos, "ours"))
        print(f"[identity] {name}: {results[-1]['identical']}/{results[-1]['contexts']} identical", flush=True)
    from specdec.peers import llama_cpp
    if not args.no_llama_cpp and llama_cpp.available() is None and base.name == "smollm2_135m":
        with llama_cpp.LlamaServer(smollm2_gguf_path(), torch.get_num_threads()) as server:
            results.append(_compare(base, "llama_cpp", todo, lambda ids: server.complete(ids, args.max_new_tokens).tokens,
                                    eos, "llama.cpp's own computation: 8-bit activations"))
        print(f"[identity] llama_cpp: {results[-1]['identical']}/{results[-1]['contexts']} identical", flush=True)

    report = {"command": "python experiments/identity.py " + " ".join(sys.argv[1:]), "cpu": cpu_model(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "base": base.name,
              "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d"),
              "sets": {s: sum(c["set"] == s for c in todo) for s in ("humaneval", "question")},
              "reference": "HF generate, float32, stock PyTorch, batches of 16 left-padded", "methods": results}
    write_json(out / "identity.json", report)
    write_text(out / "identity.md", render(report))
    print(render(report))


def _compare(base, name, todo, decode, eos, computes) -> dict:
    mismatches = []
    for c in todo:
        theirs = cut_at_eos(decode(c["prompt"]), eos)
        pos = first_difference(theirs, c["reference"])
        if pos is not None:
            tok = theirs[pos] if pos < len(theirs) else None
            mismatches.append({"set": c["set"], "id": c["id"], "turn": c["turn"],
                               **margin_at(base, c["prompt"], c["reference"], pos, tok)})
    return {"method": name, "computes": computes, "contexts": len(todo), "identical": len(todo) - len(mismatches),
            "mismatches": mismatches}


def render(r: dict) -> str:
    lines = ["# Greedy identity against HF generate (float32, unpatched)", "",
             f"- **Command**: `{r['command']}`", f"- **Machine**: {r['cpu']}, {r['threads']} threads, torch {r['torch']}",
             f"- **Date**: {r['date']}", f"- **Reference**: {r.get('reference', 'HF generate, float32')}",
             "- **Contexts**: " + ", ".join(f"{n} {s}" for s, n in r["sets"].items()) +
             f" (every turn), up to {r['max_new_tokens']} tokens each", "",
             "| method | computes | identical | mismatches | median margin | the smallest margins (reference top-1 − "
             "top-2 logit) | first positions | their token's rank |", "|---|---|---|---|---|---|---|---|"]
    for m in r["methods"]:
        mm = m["mismatches"]
        margins = ", ".join(f"{x['margin']:.3g}" for x in sorted(mm, key=lambda x: x["margin"])[:12]) or "—"
        positions = ", ".join(str(x["pos"]) for x in mm[:12]) or "—"
        ranks = ", ".join(str(x["their_rank"]) for x in mm[:12]) or "—"
        median = f"{statistics.median(x['margin'] for x in mm):.3g}" if mm else "—"
        lines.append(f"| {m['method']} | {m['computes']} | {m['identical']}/{m['contexts']} | {len(mm)} | {median} | "
                     f"{margins} | {positions} | {ranks} |")
    lines += ["", "A mismatch is the first position where a method's answer parts from the reference's; its margin is "
              "the reference's top-1 minus top-2 logit there (a near-tie reads near 0: rounding decides it), its rank "
              "the place the reference gives the method's token (1: the runner-up). The margins are sorted and "
              "at most 12 shown; identity.json lists every mismatch."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
