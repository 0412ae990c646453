"""Their side of `make interop`, run by .interop/speculators-venv/bin/python: each of our exports (EAGLE-3, P-EAGLE,
DFlash) loaded by the speculators package's own model class (`Eagle3DraftModel`, `PEagleDraftModel`,
`DFlashDraftModel`, each by its `from_pretrained`), in float32 on CPU, replaying the inputs
experiments/interop/make_inputs.py wrote (that file's docstring gives each family's layout), in each attention
backend its forward builds masks for: flex attention (its default, what it trains with; a block mask), sdpa (a
boolean mask) and eager (an additive float mask). Its logits are read off its lm_head by a forward hook.

- eagle3: its forward on the hidden states, tokens and document ids (no verifier states: no loss), one call per TTT
  step count. (a) Its logits against ours at every entry whose teacher-forced token exists (i + j <= L - 1), per
  TTT step, and the draft tokens its forward returns equal to our argmaxes; (b) its greedy chain from the root
  entry: k runs of its forward, run j with its own tokens c_1..c_j fed back (its forward teacher-forces step j on
  token i + j of input_ids), its step-j argmax mapped to a base id by its d2t, equal to ours.
- peagle: its forward as its trainer calls it (the batch's keys, `get_trainer_kwargs` with the eager loss), COD
  left with nothing to drop (below), one call. Its logits at every entry (anchor i, depth k), 1 <= i <= N, against
  ours at (t = i - 1, depth k), per depth; its drafts from the root anchor N (argmax, through its d2t) equal to ours.
- dflash: its forward as its trainer calls it, with max_anchors L - b (every anchor its selection allows: 0..N,
  sorted), one call. Its block at anchor a, slots 1..b-1, against ours at a, per block position; its drafts from the
  root anchor N equal to ours.

Each family passes where every max |diff| / max |ours| is <= 1e-5, its argmaxes equal ours at every compared entry
and its drafts from the root equal ours. "One entry off" is the same error against ours one entry later: what a
misalignment would show. Exit 1 on any failure.

No runtime patch of speculators' code: the verifier path each config names is pointed at the local copy, the
attention backend is set on its transformer_layer_config, and everything else is its own.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import os
import platform
import sys
from pathlib import Path

import torch
from safetensors import safe_open

TOL = 1e-5
VERSIONS = ("speculators", "torch", "transformers", "pydantic", "safetensors", "huggingface_hub")
ATTENTION = (("flex attention (its default)", None), ("sdpa", "sdpa"), ("eager", "eager"))
TITLES = {"eagle3": "EAGLE-3", "peagle": "P-EAGLE", "dflash": "DFlash"}
# COD's sample size at depth d is int((n - d) · max(r^d, r_min)) against a pool of up to n entries; at r = r_min = 1
# depth 1's pool (which counts target 0, anchor -1) is one larger and one entry would be dropped at random. Any
# r_min >= n / (n - K) keeps every pool whole, by its own "pool too small" branch, without a draw.
PEAGLE_COD = {"down_sample_ratio": 1.0, "down_sample_ratio_min": 2.0}


def load_inputs(path: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """inputs.safetensors -> ({family: {name: tensor}}, metadata)."""
    families: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            fam, name = key.split(".", 1)
            families.setdefault(fam, {})[name] = f.get_tensor(key)
        return families, f.metadata() or {}


def model_class(family: str):
    if family == "eagle3":
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        return Eagle3DraftModel, Eagle3SpeculatorConfig
    if family == "peagle":
        from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

        return PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    return DFlashDraftModel, DFlashSpeculatorConfig


def load_model(family: str, export: Path, verifier: str, attn: str | None):
    """Its own loader; the verifier (whose embeddings, lm_head rows and norm it reads) pointed at the local copy
    instead of the hub name our export names."""
    cls, config_cls = model_class(family)
    config = config_cls.from_pretrained(export)
    config.speculators_config.verifier.name_or_path = verifier
    if attn is not None:  # None: its own default (it sets simple_flex_attention where the config names none)
        config.transformer_layer_config._attn_implementation = attn
    model = cls.from_pretrained(export, config=config, dtype=torch.float32)
    return model.float().eval()


class Logits:
    """The lm_head's outputs, one per call (EAGLE-3: one per TTT step of a forward)."""

    def __init__(self, model):
        self.calls: list[torch.Tensor] = []
        model.lm_head.register_forward_hook(lambda _m, _i, out: self.calls.append(out.detach()[0]))

    def take(self) -> list[torch.Tensor]:
        calls, self.calls = self.calls, []
        return calls


def rel(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def base_id(model, index: int) -> int:
    """A draft-vocab index -> the base id, by its d2t (offsets) where it has one."""
    return index + int(model.d2t[index]) if model.d2t is not None else index


def margin(logits: torch.Tensor) -> float:
    """The smallest top-2 gap over rows [n, V_d]: how far the root drafts are from a tie."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min().item()


def trainer_batch(inp: dict[str, torch.Tensor], hidden_size: int) -> dict[str, torch.Tensor]:
    """The keys its trainer's batch hands the forward (one sequence, one document, every token in the loss); the
    verifier's last hidden states feed only its loss's targets, which the check does not read."""
    ids = inp["input_ids"]
    n = ids.shape[1]
    return {"hidden_states": inp["hidden"], "input_ids": ids, "loss_mask": torch.ones_like(ids),
            "verifier_last_hidden_states": inp["hidden"].new_zeros(1, n, hidden_size),
            "document_ids": torch.zeros_like(ids), "position_ids": torch.arange(n)[None]}


@torch.no_grad()
def check_eagle3(model, inp: dict[str, torch.Tensor]) -> dict:
    hidden, input_ids, ours, chain = inp["hidden"], inp["input_ids"], inp["logits"], inp["chain"].tolist()
    root, k, slots = int(inp["root"]), len(chain), input_ids.shape[1]
    logits = Logits(model)

    def run(ids, steps):
        tokens = model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
        return tokens, logits.take()

    # (a) entries 1..L-1 (entry 0 is the sink, which ours does not score); step j only where i + j <= L - 1 (past
    # that, theirs embeds pad token 0 and ours a zero vector). Its returned draft tokens (draft-vocab argmaxes, one
    # per entry and step) against our argmaxes too: many distinct tokens, where the chain may repeat one
    drafted, theirs = run(input_ids, k)
    errs, agree, total = [], 0, 0
    for j in range(k):
        n = slots - 1 - j
        errs.append(rel(theirs[j][1 : 1 + n], ours[:n, j]))
        agree += int((drafted[j][0, 1 : 1 + n] == ours[:n, j].argmax(-1)).sum())
        total += n
    off = rel(theirs[0][2:slots], ours[: slots - 2, 0])
    # (b) its own greedy chain, fed back one token per run
    mine: list[int] = []
    tops = []
    for j in range(k):
        ids = input_ids.clone()
        ids[0, root + 1 :] = torch.tensor(mine + [0] * (k - 1 - len(mine)))[: slots - root - 1]
        tokens, steps = run(ids, j + 1)
        mine.append(base_id(model, int(tokens[j][0, root])))
        tops.append(steps[j][root])
    return {"errors": errs, "agree": agree, "total": total, "off": off, "ours": chain, "theirs": mine,
            "margin": margin(torch.stack(tops))}


@torch.no_grad()
def check_peagle(model, inp: dict[str, torch.Tensor]) -> dict:
    from speculators.models.peagle.data import generate_cod_sample_indices

    ours, root, k = inp["logits"], int(inp["root"]), len(inp["chain"])
    batch = trainer_batch(inp, model.hidden_size)
    _, kwargs = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager", num_depths=k,
                                               **PEAGLE_COD)
    # the entries its forward runs, in its order: its own COD, with no draw left to make (PEAGLE_COD)
    anchor, depth = generate_cod_sample_indices(seq_length=batch["input_ids"].shape[1], loss_mask=batch["loss_mask"],
                                                num_depths=k, max_anchors=kwargs["max_anchors"], **PEAGLE_COD)
    logits = Logits(model)
    model(**batch, **kwargs)
    (theirs,) = logits.take()  # [S, V_d]
    errs, agree, total = [], 0, 0
    for d in range(k):
        sel = (depth == d) & (anchor >= 1) & (anchor <= root)  # anchor 0 is our sink's, -1 and > N padding's
        assert int(sel.sum()) == root, f"its COD kept {int(sel.sum())} of depth {d}'s {root} anchors"
        a, b = theirs[sel], ours[anchor[sel] - 1, d]  # anchors ascending within a depth
        errs.append(rel(a, b))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(a)
    first = (depth == 0) & (anchor >= 2) & (anchor <= root)
    off = rel(theirs[first], ours[: root - 1, 0])
    at_root = torch.stack([theirs[(depth == d) & (anchor == root)][0] for d in range(k)])  # [K, V_d]
    mine = [base_id(model, int(i)) for i in at_root.argmax(-1)]
    return {"errors": errs, "agree": agree, "total": total, "off": off, "ours": inp["chain"].tolist(),
            "theirs": mine, "margin": margin(at_root)}


@torch.no_grad()
def check_dflash(model, inp: dict[str, torch.Tensor]) -> dict:
    ours, root = inp["logits"], int(inp["root"])  # [N+1, b-1, V_d]
    b, slots = model.block_size, inp["input_ids"].shape[1]
    _, kwargs = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager", max_anchors=slots - b)
    logits = Logits(model)
    model(**trainer_batch(inp, model.hidden_size), **kwargs)
    (theirs,) = logits.take()  # [(N+1)·b, V_d]: anchors 0..N (its selection sorts them), b slots each
    theirs = theirs.view(root + 1, b, -1)[:, 1:]  # [N+1, b-1, V_d]: the masked slots
    errs = [rel(theirs[:, j], ours[:, j]) for j in range(b - 1)]
    agree = int((theirs.argmax(-1) == ours.argmax(-1)).sum())
    off = rel(theirs[1:, 0], ours[:-1, 0])
    mine = [base_id(model, int(i)) for i in theirs[root].argmax(-1)]
    return {"errors": errs, "agree": agree, "total": ours[..., 0].numel(), "off": off, "ours": inp["chain"].tolist(),
            "theirs": mine, "margin": margin(theirs[root])}


CHECKS = {"eagle3": check_eagle3, "peagle": check_peagle, "dflash": check_dflash}


def versions() -> str:
    return ", ".join(f"{p} {md.version(p)}" for p in VERSIONS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="the exports' dir, one subdir per family (make_inputs.py's)")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--report", default=None, help="markdown file to write the result to")
    ap.add_argument("--command", default="make interop")
    args = ap.parse_args()
    torch.manual_seed(0)
    families, meta = load_inputs(args.inputs)

    results: dict[str, dict[str, dict]] = {}
    for fam in (f for f in CHECKS if f in families):
        results[fam] = {}
        for name, attn in ATTENTION:
            model = load_model(fam, Path(args.export) / fam, meta[f"{fam}.verifier_dir"], attn)
            r = CHECKS[fam](model, families[fam])
            r["attn"] = model.config.transformer_layer_config._attn_implementation
            r["ok"] = max(r["errors"]) <= TOL and r["agree"] == r["total"] and r["ours"] == r["theirs"]
            results[fam][name] = r
            print(f"{fam}, {name} [{r['attn']}]: max rel error {max(r['errors']):.2e} "
                  f"({' '.join(f'{e:.1e}' for e in r['errors'])}; one entry off {r['off']:.2f}); argmax = ours at "
                  f"{r['agree']}/{r['total']}; drafts from the root {r['theirs']} vs ours {r['ours']} "
                  f"(smallest top-2 margin {r['margin']:.3g}) -> {'ok' if r['ok'] else 'FAIL'}")
    passed = bool(results) and all(r["ok"] for fam in results.values() for r in fam.values())
    print(f"interop with speculators ({versions()}): {'PASS' if passed else 'FAIL'}")
    if args.report:
        write_report(Path(args.report), args, meta, families, results, passed)
    return 0 if passed else 1


def section(fam: str, inp: dict[str, torch.Tensor], meta: dict, results: dict[str, dict]) -> list[str]:
    ok = all(r["ok"] for r in results.values())
    slots, k = inp["input_ids"].shape[1], len(inp["chain"])
    vocab, shape = inp["logits"].shape[-1], tuple(inp["logits"].shape)
    drafter, verifier, seq = meta.get(f"{fam}.drafter", "?"), meta.get(f"{fam}.verifier_dir", "?"), \
        meta.get(f"{fam}.sequence", "?")
    what = {
        "eagle3": [
            f"- loaded: `Eagle3DraftModel.from_pretrained(<export>/eagle3)`, our {drafter}, k = {k} TTT steps, draft "
            f"vocab {vocab}; the verifier it reads (embeddings, final norm) at the local base `{verifier}`",
            f"- input: {meta.get('prompt', '?')} in the chat template and the base's greedy answer ({seq}), L = "
            f"{slots} entries (our sink first, our chain's tokens last)",
            "- compared: its lm_head's outputs on our fused base hidden states and tokens against our "
            "`Eagle3.unroll`, per TTT step (teacher-forced, every entry whose token exists); its greedy chain from the "
            "sequence's last entry (its forward run once per step, its own tokens fed back, mapped to base ids by "
            "its d2t) against ours",
        ],
        "peagle": [
            f"- loaded: `PEagleDraftModel.from_pretrained(<export>/peagle)`, our {drafter}, K = {k} depths, draft "
            f"vocab {vocab}, mask token {meta.get('peagle.mask_token_id', '?')}; verifier `{verifier}`",
            f"- input: the same sequence as EAGLE-3's ({seq}), L = {slots} entries (our sink first, {k - 1} padding "
            f"entries last)",
            "- compared: its forward as its trainer calls it (`get_trainer_kwargs`, eager loss; COD at "
            f"down_sample_ratio {PEAGLE_COD['down_sample_ratio']:g}, down_sample_ratio_min "
            f"{PEAGLE_COD['down_sample_ratio_min']:g}, which keeps every entry), its logits at every (anchor, depth) "
            f"with a real anchor ({shape[0]} × {k}) against our `PEagle.forward_train`, per depth; its drafts from "
            "the root anchor (argmax through its d2t) against ours",
        ],
        "dflash": [
            f"- loaded: `DFlashDraftModel.from_pretrained(<export>/dflash)`, our {drafter}, block size {k + 1}, draft "
            f"vocab {vocab}; verifier: a tiny random Qwen3 (4 layers, hidden 64, byte-level tokenizer) that "
            f"make_inputs.py saved to `{os.path.relpath(verifier)}`, from which it reads its embeddings",
            f"- input: {meta.get('prompt', '?')} in the chat template, {seq}, L = {slots} entries ({k + 1} padding "
            "entries last: its anchor selection leaves the last block out)",
            "- compared: its forward as its trainer calls it (`get_trainer_kwargs`, eager loss, max_anchors "
            f"L - b), its block at every anchor 0..{shape[0] - 1}, masked slots 1..{k}, against our "
            "`DFlash.forward_train`, per block position; its drafts from the root anchor (argmax through its d2t) "
            "against ours",
        ],
    }[fam]
    unit = {"eagle3": "TTT step", "peagle": "depth", "dflash": "block position"}[fam]
    lines = [f"## {TITLES[fam]}: **{'PASS' if ok else 'FAIL'}**", "", *what, "",
             f"| attention | max rel error per {unit} | max | argmax = ours | one entry off | our drafts from the "
             "root | its drafts | smallest top-2 margin | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} (`{r['attn']}`) | {' · '.join(f'{e:.1e}' for e in r['errors'])} | "
                     f"{max(r['errors']):.2e} | {r['agree']}/{r['total']} | {r['off']:.2f} | {r['ours']} | "
                     f"{r['theirs']} | {r['margin']:.3g} | {'pass' if r['ok'] else 'FAIL'} |")
    return lines + [""]


def write_report(path: Path, args, meta: dict, families: dict, results: dict, passed: bool) -> None:
    when = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        "# Interop: our speculators exports through the speculators package's own model classes", "",
        f"Command: `{args.command}` ({when:%Y-%m-%d %H:%M} UTC, {meta.get('machine', platform.machine())}, CPU, "
        f"float32, offline). Result: **{'PASS' if passed else 'FAIL'}** (tolerance: max relative error <= {TOL:g}, "
        f"max |theirs − ours| / max |ours| per step, depth or block position).", "",
        f"- theirs: {versions()} (Python {platform.python_version()}, .interop/speculators-venv), HF_HUB_OFFLINE=1; "
        "no runtime patch of their code (the verifier path pointed at the local copy, the attention backend set on "
        "its transformer_layer_config)",
        f"- ours: {meta.get('ours', '?')}; drafters random (seed 0), every trainable weight perturbed so that each "
        "one moves the logits", "",
    ]
    for fam, res in results.items():
        lines += section(fam, families[fam], meta, res)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")


if __name__ == "__main__":
    sys.exit(main())
