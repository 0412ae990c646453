"""Their side of `make interop`, run by .interop/speculators-venv/bin/python: our EAGLE-3 export loaded by the
speculators package's own `Eagle3DraftModel.from_pretrained`, in float32 on CPU, replaying the inputs
experiments/interop/make_inputs.py wrote (that file's docstring gives the layout):

(a) its logits (read off its lm_head by a forward hook, one call per TTT step) against ours, at every entry whose
    teacher-forced token exists (i + j <= L - 1): max |diff| / max |ours| <= 1e-5, at step 0 and over all steps,
    and the draft tokens its forward returns (argmaxes) equal to ours at every one of them;
(b) its greedy chain from the root entry: k runs of its forward, run j with its own tokens c_1..c_j fed back (its
    forward teacher-forces step j on token i + j of input_ids), its step-j argmax mapped to a base id by its d2t,
    equal to ours.

In each attention backend its forward builds masks for: flex attention (its default, what it trains with; a block
mask), sdpa (a boolean mask) and eager (an additive float mask). Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import platform
import sys
from pathlib import Path

import torch
from safetensors import safe_open

TOL = 1e-5
VERSIONS = ("speculators", "torch", "transformers", "pydantic", "safetensors", "huggingface_hub")


def load_inputs(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def load_model(export: str, verifier: str, attn: str | None):
    """Its own loader; the verifier (whose embeddings, lm_head rows and norm it reads) pointed at the local copy
    instead of the hub name our export names."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(export)
    config.speculators_config.verifier.name_or_path = verifier
    if attn is not None:  # None: its own default (it sets simple_flex_attention where the config names none)
        config.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel.from_pretrained(export, config=config, dtype=torch.float32)
    return model.float().eval()


class Logits:
    """The lm_head's outputs, one per TTT step of a forward."""

    def __init__(self, model):
        self.steps: list[torch.Tensor] = []
        model.lm_head.register_forward_hook(lambda _m, _i, out: self.steps.append(out.detach()[0]))

    def run(self, model, hidden, input_ids, steps: int):
        self.steps = []
        tokens = model(hidden_states=hidden, input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                       ttt_steps=steps)
        return tokens, self.steps


@torch.no_grad()
def check(model, inp: dict[str, torch.Tensor]) -> dict:
    hidden, input_ids, ours, chain = inp["hidden"], inp["input_ids"], inp["logits"], inp["chain"].tolist()
    root, k, slots = int(inp["root"]), len(chain), input_ids.shape[1]
    logits = Logits(model)

    # (a) entries 1..L-1 (entry 0 is the sink, which ours does not score); step j only where i + j <= L - 1 (past
    # that, theirs embeds pad token 0 and ours a zero vector). Its returned draft tokens (draft-vocab argmaxes, one
    # per entry and step) against our argmaxes too: many distinct tokens, where the chain may repeat one
    drafted, theirs = logits.run(model, hidden, input_ids, k)
    errs, margins, agree, total = [], [], 0, 0
    for j in range(k):
        n = slots - 1 - j
        a, b = theirs[j][1 : 1 + n], ours[:n, j]
        errs.append(((a - b).abs().max() / b.abs().max()).item())
        agree += int((drafted[j][0, 1 : 1 + n] == b.argmax(-1)).sum())
        total += n
    # (b) its own greedy chain, fed back one token per run
    mine: list[int] = []
    d2t = model.d2t
    for j in range(k):
        ids = input_ids.clone()
        ids[0, root + 1 :] = torch.tensor(mine + [0] * (k - 1 - len(mine)))[: slots - root - 1]
        tokens, steps = logits.run(model, hidden, ids, j + 1)
        idx = int(tokens[j][0, root])
        mine.append(idx + int(d2t[idx]))
        top2 = steps[j][root].topk(2).values
        margins.append((top2[0] - top2[1]).item())
    return {"step0": errs[0], "all": max(errs), "per_step": errs, "chain": mine, "ours": chain,
            "equal": mine == chain, "margin": min(margins), "agree": agree, "total": total}


def versions() -> str:
    return ", ".join(f"{p} {md.version(p)}" for p in VERSIONS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--verifier", default=None, help="local verifier dir (default: the one the inputs name)")
    ap.add_argument("--report", default=None, help="markdown file to write the result to")
    ap.add_argument("--command", default="make interop")
    args = ap.parse_args()
    torch.manual_seed(0)
    inp, meta = load_inputs(args.inputs)
    verifier = args.verifier or meta["verifier_dir"]

    results = {}
    for name, attn in (("flex attention (its default)", None), ("sdpa", "sdpa"), ("eager", "eager")):
        model = load_model(args.export, verifier, attn)
        results[name] = r = check(model, inp)
        r["attn"] = model.config.transformer_layer_config._attn_implementation
        ok = r["step0"] <= TOL and r["all"] <= TOL and r["equal"] and r["agree"] == r["total"]
        r["ok"] = ok
        print(f"{name} [{r['attn']}]: max rel error step 0 {r['step0']:.2e}, all {len(r['per_step'])} steps "
              f"{r['all']:.2e}; chain {r['chain']} vs ours {r['ours']}: {'equal' if r['equal'] else 'DIFFERENT'} "
              f"(smallest top-2 margin {r['margin']:.3f}); its draft tokens = our argmax at {r['agree']}/{r['total']} "
              f"entry-steps -> {'ok' if ok else 'FAIL'}")
    passed = all(r["ok"] for r in results.values())
    print(f"interop with speculators ({versions()}): {'PASS' if passed else 'FAIL'}")
    if args.report:
        write_report(Path(args.report), args, meta, inp, results, passed, verifier)
    return 0 if passed else 1


def write_report(path: Path, args, meta: dict, inp, results: dict, passed: bool, verifier: str) -> None:
    slots, k, when = inp["input_ids"].shape[1], len(inp["chain"]), datetime.datetime.now(datetime.timezone.utc)
    lines = [
        "# EAGLE-3 interop: our speculators export through the speculators package", "",
        f"Command: `{args.command}` ({when:%Y-%m-%d %H:%M} UTC, {platform.machine()} CPU, float32, offline). "
        f"Result: **{'PASS' if passed else 'FAIL'}** (tolerance: max relative error <= {TOL:g}).", "",
        f"- theirs: {versions()} (Python {platform.python_version()}, .interop/speculators-venv); the verifier it "
        f"reads (embeddings, final norm) pointed at the local base `{verifier}`, HF_HUB_OFFLINE=1",
        f"- ours: {meta.get('ours', '?')}; drafter: {meta.get('drafter', '?')}, k = {k} TTT steps, draft vocab "
        f"{inp['logits'].shape[-1]}",
        f"- input: {meta.get('prompt', '?')} in the chat template ({meta.get('prompt_tokens', '?')} tokens) and the "
        f"base's greedy answer, L = {slots} entries (our sink first, our chain's tokens last)",
        "- (a) `Eagle3DraftModel.from_pretrained(<export>)`'s lm_head outputs (a forward hook) on our fused base "
        "hidden states and tokens, against our `Eagle3.unroll`: max |diff| / max |ours logit|, at step 0 and over "
        "every TTT step (teacher-forced, every entry whose token exists)",
        "- (b) its greedy chain from the sequence's last entry (its forward run once per step, its own tokens fed "
        "back, mapped to base ids by its d2t) against ours", "",
        "| attention | max rel error, step 0 | max rel error, all steps | its draft tokens = our argmax | our chain "
        "| its chain | equal | smallest top-2 margin |",
        "|---|---|---|---|---|---|---|---|",
    ] + [f"| {name} (`{r['attn']}`) | {r['step0']:.2e} | {r['all']:.2e} | {r['agree']}/{r['total']} | {r['ours']} "
         f"| {r['chain']} | "
         f"{'yes' if r['equal'] else 'no'} | {r['margin']:.3f} |" for name, r in results.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
