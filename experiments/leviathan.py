"""Table `leviathan`: α and τ versus the chain length γ for one chain drafter, measured next to
Leviathan et al.'s τ = (1 − α^{γ+1})/(1 − α) and the walltime model with the real verify cost,
speedup = τ/(v(γ+1) + γc) (docs/sampler.md §8); v(γ+1) = T_{γ+1}/T_1 and c = draft time per depth / T_1 are measured in
the same run. The paper's τ/(γc + 1) (a verify costs one base step) is shown next to it.

    python experiments/leviathan.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]

The table trains the prophet recipe itself at 750 steps (~30 min on 2 Zen 4 cores in bf16); any trained chain
drafter can take its place:
    python evaluate.py experiment=leviathan/eval 'drafters=[logs/recipe/prophet/drafter]'   # the recipe's 3000 steps
    python experiments/leviathan.py --render"""

import math

from specdec.sampling.cost import chain_tau, predicted_speedup
from specdec.sampling.metrics import token_acceptance
from tables import SMOKE_FROM_RAW_CODE, Table, eval_reports, main, tau_and_speedup


def build(root):
    rows, names = [], set()
    for report in eval_reports(root).values():
        r = next(r for r in report["rows"] if "leviathan" in r)  # the drafter's row (AR and peers have none)
        names.add(r["method"])
        lev, g = r["leviathan"], r["leviathan"]["gamma"]
        alpha = lev.get("alpha_token")
        if alpha is None:  # a report from before evaluate.py recorded it: the same estimate from its rounds
            accepted = [int(a) for a, n in r["accept_hist"].items() for _ in range(n)]
            alpha = token_acceptance(accepted, [g] * len(accepted))
        tau_model = chain_tau(alpha, g)
        alpha_i = r["alpha_i"] + [float("nan")] * 2  # conditional acceptance at draft positions 1, 2, ...
        rows.append({"gamma": g, "alpha_rate": r["alpha"], "alpha": alpha, "alpha1": alpha_i[0],
                     "alpha2": alpha_i[1], "tau": lev["measured_tau"], "tau_model": tau_model, "c": lev["c"],
                     "speedup": lev["measured_speedup"], "speedup_decode": lev.get("measured_speedup_decode", math.nan),
                     "v": lev["verify_cost"],
                     "speedup_model": predicted_speedup(tau_model, g, lev["c"], lev["verify_cost"]),
                     "speedup_unit": tau_model / (g * lev["c"] + 1), "o": lev.get("overhead"),
                     "a": lev.get("ar_step")})
    rows.sort(key=lambda r: r["gamma"])

    def plot(fig):
        g = [r["gamma"] for r in rows]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        tau_and_speedup(fig, "γ",
                        [("measured", g, col("tau"), "o-"), ("(1 − α^(γ+1))/(1 − α)", g, col("tau_model"), "s--")],
                        [("measured", g, col("speedup"), "o-"),
                         ("measured after the first token", g, col("speedup_decode"), "o:"),
                         ("τ/(v(γ+1) + γc)", g, col("speedup_model"), "s--"),
                         ("τ/(γc + 1)", g, col("speedup_unit"), "^:")])

    return Table(f"Leviathan et al.: τ and speedup vs γ ({', '.join(sorted(names))}, chain)", rows,
                 {"gamma": "γ", "alpha_rate": "α̂ = Σa/Σγ", "alpha": "α per token", "alpha1": "α₁", "alpha2": "α₂",
                  "tau": "τ measured", "tau_model": "τ model", "c": "c", "v": "v(γ+1)", "speedup": "speedup measured",
                  "speedup_decode": "after the first token", "speedup_model": "speedup model",
                  "speedup_unit": "τ/(γc + 1)", "o": "o", "a": "a"}, plot,
                 ["α̂: accepted / drafted over the run at that γ (docs/sampler.md §4). α per token: accepted / tokens the "
                  "verifier decided on (each round's accepted ones and its first rejected one), the maximum-"
                  "likelihood α of Leviathan's i.i.d. model, which the τ model uses; α̂ counts the tokens after a "
                  "rejection, never tried, as failures, and would underpredict τ. "
                  "α₁, α₂: acceptance at draft positions 1 and 2 given the earlier ones were accepted. c: measured draft "
                  "time per depth / T_1; v(γ+1): one base forward over γ+1 tokens / over 1 token (same run). The model "
                  "column uses v; τ/(γc + 1) is the paper's, which charges a verify as one base step. o: what a "
                  "round costs beyond v + γc (acceptance, rollback, bookkeeping, the in-loop forward against the "
                  "bare one), a: our AR loop's time per token, both in T_1 and measured in the same job; the "
                  "speedup after the first token (prefill excluded, pooled over prompts; the column of that name) is "
                  "τ·a/(v + γc + o). Speedup measured: end to end, the mean over prompts of tok/s ÷ our AR loop's, "
                  "the prefill included."])


if __name__ == "__main__":
    main("leviathan", build, smoke_train=SMOKE_FROM_RAW_CODE)
