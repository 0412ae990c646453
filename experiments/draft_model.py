"""Table `draft_model` (Leviathan et al.; llama.cpp's speculative example): the standalone draft model's depth
against its acceptance, its draft cost c and the speedup, with our sampler, with HF
`generate(assistant_model=<the same model>)` and with llama.cpp's server drafting with the same model as GGUF
(`--model-draft`, γ a round). One draft model per depth is trained by the draft model recipe (full vocab, so that
every engine runs the same model); each depth is evaluated in its own job against its own AR run and llama.cpp's
plain decode. The llama.cpp columns need `make peers`.

    python experiments/draft_model.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from specdec.tables import SMOKE_FROM_RAW_CODE, Table, eval_reports, main, method_row, tau_and_speedup, train_runs


def build(root):
    trained = train_runs(root)
    rows = []
    for job, report in eval_reports(root).items():
        layers = report["config"]["layers"]
        run = trained.get(f"L{layers}", {})
        metrics = run.get("metrics", {})
        tokens = metrics.get("val/train_tokens")
        r = method_row(report, "draftmodel")
        lev = r.get("leviathan", {})
        hf, lc, lc_draft = (method_row(report, p, {}) for p in ("hf_assisted", "llama_cpp", "llama_cpp_draft"))
        rows.append({"layers": layers, "params": run.get("trainable_params"),
                     "tokens": None if tokens is None else int(tokens), "val_top1": metrics.get("val/draft_top1"),
                     "val_tau": metrics.get("val/expected_tau"), "alpha": r["alpha"],
                     "alpha_token": lev.get("alpha_token"), "tau": r["tau"], "c": lev.get("c"),
                     "v": lev.get("verify_cost"), "tok_s": r["tok_per_s"], "speedup": r["speedup_vs_ar"],
                     "speedup_model": lev.get("predicted_speedup"), "hf_speedup": hf.get("speedup_vs_ar"),
                     "ours_vs_hf": r["tok_per_s"] / hf["tok_per_s"] if hf.get("tok_per_s") else None,
                     "hf_tau": hf.get("tau"), "lc_alpha": lc_draft.get("alpha"),
                     "lc_speedup": lc_draft.get("speedup_vs_ar"),
                     "lc_vs_lc": lc_draft["tok_per_s"] / lc["tok_per_s"] if lc.get("tok_per_s") and lc_draft else None})
    rows.sort(key=lambda r: r["layers"])

    def plot(fig):
        x = [r["layers"] for r in rows]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        tau_and_speedup(fig, "draft model layers",
                        [("measured", x, col("tau"), "o-"), ("predicted (validation)", x, col("val_tau"), "s--")],
                        [("our sampler", x, col("speedup"), "o-"), ("τ/(v + γc)", x, col("speedup_model"), "s:"),
                         ("HF assisted, same model", x, col("hf_speedup"), "^-"),
                         ("llama.cpp --model-draft, same model", x, col("lc_speedup"), "v-")])

    header = next(iter(eval_reports(root).values()), {}).get("header", {})
    return Table("Standalone draft model: depth vs α, c and speedup; our sampler, HF assisted generation and "
                 "llama.cpp's speculation with the same model", rows,
                 {"layers": "layers", "params": "trainable params", "tokens": "train tokens",
                  "val_top1": "val top-1", "val_tau": "val τ (predicted)", "alpha": "α",
                  "alpha_token": "α per token",
                  "tau": "τ", "c": "c", "v": "v(γ+1)", "tok_s": "tok/s", "speedup": "× AR (ours)",
                  "speedup_model": "τ/(v + γc)", "hf_speedup": "HF assisted × AR (ours)",
                  "ours_vs_hf": "ours / HF assisted", "hf_tau": "HF τ", "lc_alpha": "llama.cpp α",
                  "lc_speedup": "llama.cpp + draft × AR (ours)", "lc_vs_lc": "llama.cpp + draft × llama.cpp"}, plot,
                 [(f"{header['draft']}; base {header['base']}. " if header else "")
                  + "Each depth is its own evaluation job with its own AR baseline (same prompts); HF assisted "
                  "and llama.cpp draft the same number of tokens a round. c: draft time per depth / T_1; τ/(v + γc): "
                  "the speedup predicted from α per token and the costs measured in that job. HF τ: its tokens per "
                  "base forward (its first forward verifies a draft, ours only prefills). llama.cpp α: its accepted "
                  "/ drafted tokens, its own 8-bit-activation arithmetic on both models (docs/sampler.md §7). "
                  "llama.cpp reports 1.8× for a 30B base with a 7B draft."])


if __name__ == "__main__":
    # HF assisted runs in the smoke too
    main("draft_model", build, smoke_train=SMOKE_FROM_RAW_CODE,
         smoke_eval=("peers=[hf_assisted]",))
