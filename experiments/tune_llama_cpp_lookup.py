"""llama.cpp's n-gram speculation settings for the `llama_cpp_lookup` peer, chosen on the tuning split (HumanEval
problems 82-163): each candidate's llama-server beside a plain one, the candidates taking turns prompt by prompt,
on the same GGUF and threads. The best goes into configs/evaluate.yaml (llama_cpp.lookup_args).

    OMP_NUM_THREADS=2 .venv/bin/python experiments/tune_llama_cpp_lookup.py      # after make peers

Writes experiments/results/llama_cpp_lookup/<cpu>/tune.{json,md}."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specdec.base import load_base, smollm2_gguf_path  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.engines.measure import cpu_model  # noqa: E402
from tables import cpu_label  # noqa: E402
from specdec.peers.llama_cpp import LlamaServer  # noqa: E402

SIMPLE = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n"]
CANDIDATES = {  # llama.cpp's defaults (12-gram keys, 48-token drafts) and shorter keys and drafts, as ours uses
    "plain": [],
    "ngram-simple (defaults)": ["--spec-type", "ngram-simple"],
    "ngram-simple n=2 m=8": [*SIMPLE, "2", "--spec-ngram-simple-size-m", "8"],
    "ngram-simple n=3 m=4": [*SIMPLE, "3", "--spec-ngram-simple-size-m", "4"],
    "ngram-simple n=3 m=8": [*SIMPLE, "3", "--spec-ngram-simple-size-m", "8"],
    "ngram-simple n=4 m=16": [*SIMPLE, "4", "--spec-ngram-simple-size-m", "16"],
    "ngram-mod (defaults)": ["--spec-type", "ngram-mod"],
    "ngram-mod match=4 n=2..8": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4",
                                 "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "8"],
    "ngram-map-k (defaults)": ["--spec-type", "ngram-map-k"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    base = load_base()
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": p["turns"][0]}])
               for p in humaneval(limit=args.prompts, split="tune")]
    threads = torch.get_num_threads()
    rates = {k: [] for k in CANDIDATES}
    drafted = {k: [0, 0] for k in CANDIDATES}
    tokens = {k: [] for k in CANDIDATES}
    with ExitStack() as stack:
        servers = {k: stack.enter_context(LlamaServer(smollm2_gguf_path(), threads, a)) for k, a in CANDIDATES.items()}
        for s in servers.values():
            s.complete(prompts[0], 8)  # warm-up, not timed
        for i, p in enumerate(prompts):
            names = list(CANDIDATES)
            for k in names[i % len(names):] + names[: i % len(names)]:  # turns rotate prompt by prompt
                c = servers[k].complete(p, args.max_new_tokens)
                rates[k].append(len(c.tokens) / c.seconds)
                drafted[k][0] += c.drafted
                drafted[k][1] += c.accepted
                tokens[k].append(c.tokens)
    plain = statistics.mean(rates["plain"])
    rows = [{"candidate": k, "args": CANDIDATES[k], "tok_s": statistics.mean(v),
             "per_prompt_vs_plain": [a / b for a, b in zip(v, rates["plain"])],
             "vs_plain": statistics.mean(v) / plain, "drafted": drafted[k][0], "accepted": drafted[k][1],
             "same_tokens_as_plain": sum(a == b for a, b in zip(tokens[k], tokens["plain"]))} for k, v in rates.items()]
    report = {"command": "python experiments/tune_llama_cpp_lookup.py " + " ".join(sys.argv[1:]), "cpu": cpu_model(),
              "threads": threads, "date": time.strftime("%Y-%m-%d"), "prompts": f"HumanEval tune split, first "
              f"{args.prompts}", "max_new_tokens": args.max_new_tokens, "rows": rows,
              "best": max(rows[1:], key=lambda r: r["vs_plain"])["candidate"]}
    out = args.out or ROOT / "experiments/results/llama_cpp_lookup" / cpu_label()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(report, indent=1))
    lines = ["# llama.cpp n-gram speculation on the tuning split", "", f"- **Command**: `{report['command']}`",
             f"- **Machine**: {report['cpu']}, {threads} threads", f"- **Date**: {report['date']}",
             f"- **Prompts**: {report['prompts']}, {args.max_new_tokens} new tokens, T = 0", "",
             "| candidate | tok/s | × plain | drafted | accepted | answers equal to plain llama.cpp's |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['candidate']} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}× | {r['drafted']} | {r['accepted']} | "
              f"{r['same_tokens_as_plain']}/{len(prompts)} |" for r in rows]
    lines += ["", f"Best: **{report['best']}**. llama.cpp verifies a draft in one batch whose products round "
              "differently from its one-token steps, so its speculation does not always repeat its own plain "
              "answers (last column)."]
    (out / "tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
