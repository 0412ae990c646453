"""An evaluation's report from its runs: one row per method (τ, α, tok/s, speedups against our AR loop, the fastest
plain decoder in the run and HF generate, their spread over passes, greedy identity with the reference, the Leviathan
check with the costs measured in the run), written as markdown, JSON and CSV, plotted, and logged to wandb
(docs/sampler.md §4, §7, §8)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from specdec.checkpoint import write_text
from specdec.engines.measure import cpu_model
from specdec.evaluation.runs import AR, PLAIN, Method, Run, decode_s_per_token, per_round
from specdec.sampling.cost import chain_tau, predicted_speedup
from specdec.sampling.decode import SamplerConfig
from specdec.sampling.metrics import prompt_metrics, token_acceptance


def tabulate(cfg, base, items, methods, runs, sampler, metas, costs: dict[int, float], reference: dict | None = None,
             passes: int = 1) -> dict[str, Any]:
    categories = sorted({it["category"] for it in items})
    ar_runs = runs[AR]

    def tok_s(rs: list[Run]) -> float:
        return sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs)

    def mean_tok_s(method: str, idx: list[int]) -> float:  # mean over prompts of per-prompt tok/s
        return sum(tok_s(runs[method][i]) for i in idx) / len(idx)

    everyone = list(range(len(items)))
    by_cat = {c: [i for i, it in enumerate(items) if it["category"] == c] for c in categories}
    by_pass = [[i for i, it in enumerate(items) if it.get("passed", 0) == p] for p in range(passes)]
    ar_mean = mean_tok_s(AR, everyone)
    hf_mean = mean_tok_s("hf_generate", everyone) if "hf_generate" in runs else float("nan")
    # the fastest plain decoder in the run (ours, llama.cpp's, HF's): no speedup rests on a slow baseline
    best_ar = max((n for n in PLAIN if n in runs), key=lambda n: mean_tok_s(n, everyone))

    def per_pass(method: str, baseline: str) -> list[float]:  # the speedup in each pass: a ratio within one pass
        if baseline not in runs:
            return [float("nan")] * passes
        return [mean_tok_s(method, idx) / mean_tok_s(baseline, idx) for idx in by_pass]

    def spread(xs: list[float]) -> float:
        return statistics.stdev(xs) if len(xs) > 1 and all(map(math.isfinite, xs)) else float("nan")
    rows = []
    for m in methods:
        flat = [r for prompt in runs[m.name] for r in prompt]
        accepted = [a for r in flat for a in r.accepted]
        drafted = [g for r in flat for g in r.drafted]
        ours = bool(accepted) or m.name == AR
        per_prompt = [prompt_metrics([a for r in p for a in r.accepted], [g for r in p for g in r.drafted],
                                     sum(len(r.tokens) for r in p), sum(r.seconds for r in p),
                                     sum(r.seconds for r in p)) for p in runs[m.name]] if ours else []
        mean = mean_tok_s(m.name, everyone)
        identical, same_prompts = None, None  # n/a: no reference ran
        if reference is not None and m.name == reference["source"]:
            identical = True  # (its own answers: the report marks the row as the reference)
        elif reference is not None:
            want = reference["tokens"]
            same = [all(r.tokens == w for r, w in zip(p, want[i % len(want)])) for i, p in enumerate(runs[m.name])]
            identical, same_prompts = all(same), sum(same)
        alpha = sum(accepted) / sum(drafted) if sum(drafted) else float("nan")
        if not drafted and sum(r.peer_drafted for r in flat):  # a peer's own speculation (llama.cpp's)
            alpha = sum(r.peer_accepted for r in flat) / sum(r.peer_drafted for r in flat)
        depth = max(accepted, default=0)
        reach = [sum(a >= i for a in accepted) for i in range(depth + 1)]
        tau = (sum(accepted) + len(accepted)) / len(accepted) if accepted else (1.0 if m.name == AR else float("nan"))
        if not accepted and sum(r.peer_rounds for r in flat):
            # a peer's tokens per base forward: its first forward verifies a draft after the prompt, where ours
            # prefills alone, so on n tokens it reads n/R against our (n-1)/R
            tau = sum(len(r.tokens) for r in flat) / sum(r.peer_rounds for r in flat)
        row = {
            "method": m.name,
            "lossless": m.lossless,
            "tau": tau,
            "draft_len": sum(drafted) / len(drafted) if sum(drafted) else float("nan"),  # mean γ_s (adaptive: < γ)
            "alpha": alpha,
            "tok_per_s": mean,
            "pooled_tok_per_s": tok_s(flat),
            "speedup_vs_ar": mean / ar_mean,
            "speedup_vs_hf": mean / hf_mean,
            "speedup_vs_best_ar": mean / mean_tok_s(best_ar, everyone),
            "speedup_vs_best_ar_sd": spread(per_pass(m.name, best_ar)),
            # over passes: each pass's ratio, their mean and standard deviation (nan for one pass)
            "speedup_vs_ar_passes": per_pass(m.name, AR),
            "speedup_vs_ar_sd": spread(per_pass(m.name, AR)),
            "speedup_vs_hf_sd": spread(per_pass(m.name, "hf_generate")),
            "per_prompt_speedup_vs_ar": [tok_s(runs[m.name][i]) / tok_s(runs[AR][i]) for i in everyone],
            "pooled_speedup_vs_ar": tok_s(flat) / tok_s([r for p in ar_runs for r in p]),
            "greedy_identical": identical,
            "identical_prompts": same_prompts,  # of len(items): answers (every turn) equal to the reference's
            "computes": m.computes,  # a peer of another computation: its identity is measured, not expected
            "is_reference": reference is not None and m.name == reference["source"],
            "alpha_i": [reach[i] / reach[i - 1] for i in range(1, depth + 1)],
            "accept_hist": {str(k): sum(a == k for a in accepted) for k in range(depth + 1)},
            "ttft_s": _nanmean([r.ttft_s for r in flat]),
            "tokens": sum(len(r.tokens) for r in flat),
            "per_category_speedup": {c: mean_tok_s(m.name, idx) / mean_tok_s(AR, idx) for c, idx in by_cat.items()},
            "per_prompt": per_prompt,
        }
        if m.chain_gamma and accepted:  # Leviathan et al. with the measured verify cost (docs/sampler.md §8)
            g = m.chain_gamma
            t1 = costs[1]  # one base forward over one token, measured in this run
            c = sum(r.t_draft_s for r in flat) / max(sum(drafted), 1) / t1  # draft cost per drafted token, in T_1
            # A round that drafted γ_s tokens verifies γ_s + 1 (γ_s = γ unless the draft length is adaptive): the
            # model charges each round its own block's measured cost, v = mean over rounds of T_{γ_s+1}/T_1, and the
            # mean draft length ḡ for the drafting (both exactly v(γ+1) and γ for a fixed chain).
            v = sum(costs.get(d + 1, costs[g + 1]) for d in drafted) / len(drafted) / t1
            g_mean = sum(drafted) / len(drafted)
            a_tok = token_acceptance(accepted, drafted)  # the model's α (per decided token), not α̂ = Σa/Σγ
            tau_pred = chain_tau(a_tok, g)
            # The time split the model leaves out (docs/sampler.md §8), in T_1: what a round costs beyond v + γc (acceptance,
            # rollback, bookkeeping, the in-loop forward against the bare one), and our AR loop's time per token.
            # The speedup after the first token (prefill excluded, pooled) = τ · ar_step / (v + γc + overhead).
            ar_flat = [r for p in ar_runs for r in p]
            ar_step = per_round(ar_flat) / t1
            overhead = per_round(flat) / t1 - v - g_mean * c
            row["leviathan"] = {
                "gamma": g, "alpha_token": a_tok, "c": c, "verify_cost": v, "measured_tau": row["tau"],
                "overhead": overhead, "ar_step": ar_step,
                "predicted_tau": tau_pred,  # a fixed chain of γ (an adaptive one drafts less: read the next column)
                "predicted_speedup": predicted_speedup(tau_pred, g_mean, c, v),
                # the cost side alone: the measured τ through the same model (α is rarely i.i.d. over positions)
                "predicted_speedup_measured_tau": predicted_speedup(row["tau"], g_mean, c, v),
                "predicted_speedup_unit_verify": tau_pred / (g_mean * c + 1),  # the paper's model: verify = 1 step
                "break_even_tau": v + g_mean * c,
                "measured_speedup": row["speedup_vs_ar"],
                # what the model describes, measured: decoding after the first token, pooled (the prefill, the same
                # for both, pulls the end-to-end ratio above towards 1 on short answers)
                "measured_speedup_decode": decode_s_per_token(ar_flat) / decode_s_per_token(flat),
            }
        rows.append(row)
    header = {
        "device": _device_name(base.device), "dtype": str(base.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "base": base.name, "temperature": sampler.temperature, "top_p": sampler.top_p,
        "acceptance": sampler.acceptance, "batch_size": f"{cfg.batch_size} (ours), 1 (HF)",
        "draft": _draft_desc(sampler), "max_new_tokens": sampler.max_new_tokens,
        "prompts": f"{len(items) // passes} ({', '.join(categories)})" + (f" × {passes} passes" if passes > 1 else ""),
        "identity_reference": reference["source"] if reference is not None else "none (n/a)",
        "best_ar": best_ar,
        "platform": platform.platform(),
        "date": datetime.date.today().isoformat(),  # (a table re-rendered later keeps the day it was measured)
        "drafters": {n: m.get("base_name") for n, m in metas.items()},
    }
    return {"header": header, "categories": categories, "rows": rows}


def render_markdown(report: dict, config_yaml: str) -> str:
    h, cats = report["header"], report["categories"]
    lines = ["# specdec evaluation", "", "```yaml", config_yaml.rstrip(), "```", ""]
    for k, v in h.items():
        if isinstance(v, dict) and k != "drafters":  # (the engine's paths: one line each)
            lines += [f"- **{k}**: {v.get('name', '')}"] + [f"  - {kind}: {path}" for kind, path in v.items()
                                                             if kind != "name"]
        elif k != "drafters":
            lines.append(f"- **{k}**: {v}")
    cat_cols = [f"{c} ×AR" for c in cats] if len(cats) > 1 else []
    best = h.get("best_ar", AR)
    hf = any(r["method"] == "hf_generate" for r in report["rows"])  # its column only where it ran
    lines += ["", f"| method | lossless | τ | draft len | α | tok/s | speedup vs AR (ours) | speedup vs best AR ({best}) "
              + ("| speedup vs HF generate " if hf else "") + "| greedy-identical |" + "".join(f" {c} |" for c in cat_cols),
              "|---" * (9 + hf + len(cat_cols)) + "|"]
    for r in report["rows"]:
        cells = [r["method"], lossless_cell(r), _f(r["tau"]), _f(r.get("draft_len")),
                 _f(r["alpha"]),
                 _f(r["tok_per_s"], 1), _f(r["speedup_vs_ar"]) + "×" + _pm(r.get("speedup_vs_ar_sd")),
                 _f(r.get("speedup_vs_best_ar", r["speedup_vs_ar"])) + "×" + _pm(r.get("speedup_vs_best_ar_sd"))]
        cells += [_f(r["speedup_vs_hf"]) + "×" + _pm(r.get("speedup_vs_hf_sd"))] if hf else []
        cells += [identity_cell(r)]
        if cat_cols:
            cells += [_f(r["per_category_speedup"][c]) + "×" for c in cats]
        lines.append("| " + " | ".join(cells) + " |")
    lev = [r for r in report["rows"] if "leviathan" in r]
    if lev:
        lines += ["", "Leviathan check (chain drafters): τ = (1 − α^{γ+1})/(1 − α) with α per token = accepted / "
                  "tokens the verifier decided on (each round's accepted ones and its first rejected one); "
                  "speedup = τ/(v(γ+1) + γc), with the verify cost v(γ+1) = T_{γ+1}/T_1 and c = draft time per "
                  "depth / T_1 measured in this run (τ/(γc + 1) assumes v = 1; with an adaptive draft length, γ in the costs "
                  "is the mean draft length and v the mean of each round's own v(γ_s+1)). The time split the model leaves "
                  "out, in T_1: o = a round's time beyond v + γc (acceptance, rollback, bookkeeping, the in-loop "
                  "forward against the bare one), a = our AR loop's time per token; so the speedup after the first "
                  "token (prefill excluded, pooled over prompts: the column after the first token) is "
                  "τ·a/(v + γc + o)", "",
                  "| method | γ | α per token | τ measured | τ predicted | c | v(γ+1) | break-even τ | "
                  "speedup measured | after the first token | speedup predicted | from measured τ | τ/(γc + 1) | o | "
                  "a |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in lev:
            v = r["leviathan"]
            lines.append(f"| {r['method']} | {v['gamma']} | {_f(v['alpha_token'])} | {_f(v['measured_tau'])} | "
                         f"{_f(v['predicted_tau'])} | {_f(v['c'])} | {_f(v['verify_cost'])} | {_f(v['break_even_tau'])} | "
                         f"{_f(v['measured_speedup'])}× | {_f(v.get('measured_speedup_decode'))}× | "
                         f"{_f(v['predicted_speedup'])}× | "
                         f"{_f(v['predicted_speedup_measured_tau'])}× | {_f(v['predicted_speedup_unit_verify'])}× | "
                         f"{_f(v.get('overhead'))} | {_f(v.get('ar_step'))} |")
    lines += ["", "τ: mean emitted tokens per base forward (bonus included); draft len: mean draft tokens verified "
              "per round (γ, less with an adaptive draft length); α: accepted / drafted tokens; "
              "speedup: mean over prompts of tok/s ÷ the same for the baseline, same run (± the standard deviation "
              "of that ratio over passes); best AR: the fastest plain decoder in the run; greedy-identical: every "
              "answer equals the reference greedy decode's (identity_reference), else how many answers do; a peer "
              "that computes another model (llama.cpp: 8-bit activations) is not expected to. Peers report no τ "
              "(llama.cpp's speculation its α)."]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, cfg: DictConfig, report: dict, methods: list[Method]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    md = render_markdown(report, config_yaml)
    write_text(out_dir / "report.md", md)
    write_text(out_dir / "results.json", json.dumps(report, indent=2, default=str))
    cols = ["method", "lossless", "tau", "draft_len", "alpha", "tok_per_s", "pooled_tok_per_s", "speedup_vs_ar",
            "speedup_vs_best_ar", "speedup_vs_hf", "pooled_speedup_vs_ar", "greedy_identical", "ttft_s", "tokens"]
    cat_cols = [f"speedup_vs_ar/{c}" for c in report["categories"]]
    csv = [",".join(cols + cat_cols)]
    for r in report["rows"]:
        csv.append(",".join([str(r[c]) for c in cols] + [str(v) for v in r["per_category_speedup"].values()]))
    write_text(out_dir / "results.csv", "\n".join(csv) + "\n")
    plots = _plot(out_dir, report)
    print(md)
    print(f"[specdec] report, CSV, JSON and plots in {out_dir}")
    _log_wandb(cfg, report, md, plots)


def _plot(out_dir: Path, report: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["alpha_i"]:
            ax.plot(range(1, len(r["alpha_i"]) + 1), r["alpha_i"], marker="o", label=r["method"])
    ax.set(xlabel="draft position i", ylabel="conditional acceptance α_i", ylim=(0, 1.05),
           title="Acceptance by draft position")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    acc = out_dir / "acceptance_by_position.png"
    fig.savefig(acc, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["method"] for r in rows]
    ax.bar(names, [r["speedup_vs_ar"] for r in rows], color=["#888" if n == AR else "#3a7" for n in names])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    bars = out_dir / "speedup.png"
    fig.savefig(bars, dpi=120)
    plt.close(fig)
    return [acc, bars]


def _log_wandb(cfg: DictConfig, report: dict, md: str, plots: list[Path]) -> None:
    if not cfg.wandb.enabled:
        return
    import wandb

    try:
        wandb.init(project=cfg.wandb.project, group=cfg.wandb.group, tags=list(cfg.tags), mode=cfg.wandb.mode,
                   dir=str(cfg.paths.output_dir), job_type="evaluate",
                   config=OmegaConf.to_container(cfg, resolve=True))
        cols = ["method", "lossless", "tau", "alpha", "tok_per_s", "speedup_vs_ar", "speedup_vs_best_ar", "speedup_vs_hf",
                "greedy_identical"]
        table = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in report["rows"]])
        pos = wandb.Table(columns=["method", "position", "alpha_i"],
                          data=[[r["method"], i + 1, a] for r in report["rows"] for i, a in enumerate(r["alpha_i"])])
        wandb.log({"eval/table": table, "eval/acceptance_by_position": pos,
                   **{f"eval/{p.stem}": wandb.Image(str(p)) for p in plots},
                   **{f"eval/{r['method']}/tau": r["tau"] for r in report["rows"]},
                   **{f"eval/{r['method']}/speedup_vs_ar": r["speedup_vs_ar"] for r in report["rows"]}})
    finally:
        wandb.finish()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()}, {platform.machine()}, {os.cpu_count()} cores)"


def _draft_desc(s: SamplerConfig) -> str:
    if s.tree == "chain":
        desc = f"chain γ={s.gamma}"
    elif s.tree == "static":
        desc = f"static tree ({len(s.paths or [])} paths)"
    else:
        budget = f"budget by verify cost, at most {s.dynamic_budget}" if s.dynamic_by_cost else f"budget {s.dynamic_budget}"
        desc = f"dynamic tree (depth {s.dynamic_depth}, top-{s.dynamic_topk}, {budget})"
    if s.lookup_tokens:
        desc += (f"; +lookup rows: n-gram lookup ({s.lookup_min_ngram}-{s.lookup_max_ngram}-grams, up to "
                 f"{s.lookup_tokens} tokens) takes the rounds it matches")
    return desc


def lossless_cell(r: dict) -> str:
    """yes (the acceptance rule keeps the base's distribution), no (typical acceptance), or not checked (a peer's own
    speculation: its identity column says what was measured)."""
    if r["lossless"] is None:
        return "not checked"
    return "yes" if r["lossless"] else "**no (lossy)**"


def identity_cell(r: dict) -> str:
    if r.get("is_reference"):
        return "(reference)"
    if r["greedy_identical"] is None:
        return "n/a"
    n, of = r["identical_prompts"], len(r["per_prompt_speedup_vs_ar"])  # (each prompt once a pass)
    if r.get("computes"):  # measured, but not a claim: the peer runs another computation
        return f"{'yes' if r['greedy_identical'] else 'no'}: {r['computes']} ({n}/{of} answers)"
    return "yes" if r["greedy_identical"] else f"**NO** ({n}/{of} answers)"


def _pm(sd: float | None) -> str:
    """' ± sd' where a spread over passes was measured."""
    return "" if sd is None or not math.isfinite(sd) else f" ± {sd:.2f}"


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _f(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"
