"""EAGLE-3 trained by speculators' own trainer (vLLM's drafter trainer) beside ours, on the same features and budget,
both judged by our sampler in one evaluation.

1. the demo's feature cache (600 blocks of 256 tokens of the shipped completion-format answers; the inputs of base
   layers 2, 15 and 29 and the last state), exported as a speculators offline run dir
   (specdec.data.speculators_offline);
2. ours: the EAGLE-3 recipe (configs/experiment/recipe/eagle3.yaml) with the budget below;
3. theirs: `speculators train` in its own venv (.interop/speculators-venv) through
   experiments/interop/train_speculators_cpu.py (their code, patched only where it assumes a GPU), with the same
   budget and ours' draft vocab (their --d2t-path / --t2d-path);
4. their trainer again, started from our EAGLE-3's untrained initialisation (exported to the speculators layout,
   their --from-pretrained) with their own run's data order: what is left between it and ours is the trainer;
5. their last checkpoints read back by specdec.export (their save is the speculators layout vLLM loads: config.json
   and model.safetensors, in bfloat16); the three drafters in ONE evaluate.py run on HumanEval's reporting split,
   then again on the project's non-code questions (prompts=question) for τ off the training domain.

What both trainings share: the 600 training blocks (31 validate), 4 blocks of 256 tokens a step (their packed
sequence of 1,024), `--steps` steps, one layer over base layers 2, 15 and 29, 3 TTT steps weighted 0.8^j, a draft
vocab of 8,192 (ours' choice, handed to theirs), the loss on the answer tokens only (the cache's answer mask: their
loss_mask), AdamW at lr 2e-3 without weight decay, 10 warm-up steps then cosine to zero, gradient norm clipped at 1,
bf16 autocast over fp32 weights. Every step is resumable: a finished cache, export, training or evaluation is kept.
Reports land in experiments/results/speculators_trainer/<cpu>/:

    python experiments/speculators_trainer.py [--steps 150] [--passes 2] [--prompts 10] [--gamma 3] [--cpu zen5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
THEIR_PY = ROOT / ".interop" / "speculators-venv" / "bin" / "python"
# what `speculators train` imports beyond what setup_speculators.sh installs for their model code (within
# speculators 0.9.0's own requirements)
THEIR_TRAIN_DEPS = ("pydantic-settings>=2.0.0", "httpx")
TORCH = "torch==2.13.0"  # setup_speculators.sh's pin: pip keeps the CPU wheel

LAYERS = (2, 15, 29)
TTT, DECAY, VOCAB = 3, 0.8, 8192
BLOCKS, BLOCK = 4, 256  # a step: 4 blocks of 256 tokens (theirs: one packed sequence of 1,024)
LR, WARMUP = 2e-3, 10
EPOCH = 150  # steps in one pass over the 600 training blocks


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), cwd=ROOT, check=True, env={**os.environ, **(env or {})})


def ours(train: Path, cache: Path, steps: int) -> Path:
    """The EAGLE-3 recipe under the shared budget -> its drafter dir (train.py keeps a finished run and resumes a
    killed one)."""
    run([sys.executable, "train.py", "experiment=recipe/eagle3", f"data.path={cache}",
         f"data.batch_size={BLOCKS}", f"trainer.max_steps={steps}", "trainer.max_time=null",
         f"trainer.val_check_interval={min(75, steps)}", "trainer.limit_val_batches=1.0", "trainer.log_every_n_steps=5",
         "trainer.precision=bf16-mixed", f"drafter.ttt_steps={TTT}", f"drafter.draft_vocab_size={VOCAB}",
         f"drafter.aux_layers=[{','.join(map(str, LAYERS))}]", f"module.head_decay={DECAY}",
         "module.loss_on=answers", f"module.optimizer.lr={LR}", "module.optimizer.weight_decay=0.0",
         f"module.scheduler.num_warmup_steps={WARMUP}", f"hydra.run.dir={train}"])
    return train / "drafter"


def shared_vocab(drafter: Path, out: Path) -> tuple[Path, Path]:
    """Ours' draft vocab (the most frequent tokens of the training blocks) as their d2t / t2d .npy files: d2t [V_d]
    int64 offsets (base id of draft index i = i + d2t[i]), t2d [V] bool."""
    tokens = np.sort(load_file(str(drafter / "drafter.safetensors"))["draft_vocab.tokens"].astype(np.int64))
    size = json.loads((drafter / "drafter.json").read_text())["base"]["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    t2d = np.zeros(size, dtype=bool)
    t2d[tokens] = True
    np.save(out / "d2t.npy", tokens - np.arange(len(tokens)))
    np.save(out / "t2d.npy", t2d)
    return out / "d2t.npy", out / "t2d.npy"


def their_venv() -> None:
    """Their venv with what their trainer imports (setup_speculators.sh is a no-op where it is up to date)."""
    run(["bash", "experiments/interop/setup_speculators.sh"])
    if subprocess.run([THEIR_PY, "-c", "import speculators.train.cli"], capture_output=True).returncode:
        run([THEIR_PY, "-m", "pip", "install", "-q", TORCH, *THEIR_TRAIN_DEPS])


def theirs(out: Path, run_dir: Path, d2t: Path, t2d: Path, steps: int, init: Path | None = None) -> Path:
    """`speculators train` under the shared budget -> the checkpoint of its last epoch. The architecture is EAGLE-3
    as ours and our reader take it: their eagle3 defaults add norm_before_residual and norm_before_fc (which our
    sampler does not run) and norm_output (EAGLE-3.1), so all three are off; the layer attends to the whole context
    (--full-attention-indices 0) as ours does. init: a speculators checkpoint to start from (their
    --from-pretrained, which brings its own layer config) instead of their fresh initialisation."""
    done = out / "done.json"
    ckpts = out / "checkpoints"
    if not done.exists():
        info = json.loads((run_dir / "specdec_export.json").read_text())
        epochs = math.ceil(steps / EPOCH)  # their loop steps once more per epoch after --max-steps: end inside the last
        model = (["--from-pretrained", init] if init else
                 ["--num-layers", 1, "--full-attention-indices", 0, "--no-norm-before-residual", "--no-norm-before-fc",
                  "--no-norm-output"])
        run([THEIR_PY, "experiments/interop/train_speculators_cpu.py", out / "metrics.jsonl",
             "--verifier-name-or-path", info["verifier_name_or_path"], "--data-path", run_dir,
             "--target-layer-ids", *LAYERS, "--train-data-ratio", repr(info["train_data_ratio"]),
             "--on-missing", "raise", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
             "--num-workers", 0, "--total-seq-len", BLOCKS * BLOCK, "--d2t-path", d2t, "--t2d-path", t2d,
             "--draft-vocab-size", VOCAB, *model, "--ttt-steps", TTT, "--ttt-step-loss-decay", DECAY,
             "--loss-fn", "kl_div", "--optimizer", "adamw", "--lr", LR, "--weight-decay", 0.0,
             "--scheduler-type", "cosine", "--scheduler-warmup-steps", WARMUP, "--scheduler-total-steps", steps,
             "--epochs", epochs, "--max-steps", steps, "--hidden-states-dtype", "bfloat16", "--seed", 0,
             "--save-path", ckpts, "--log-dir", out / "logs"], env={"HF_HUB_OFFLINE": "1"})
        last = max(int(p.name) for p in ckpts.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit())
        state = json.loads((ckpts / str(last) / "training_state.json").read_text())
        if state["global_step"] != steps:
            raise SystemExit(f"{ckpts / str(last)}: their training stopped at step {state['global_step']} of {steps}")
        done.write_text(json.dumps(state) + "\n")
    last = ckpts / str(json.loads(done.read_text())["epoch"])
    drafter = out / "drafter"  # the checkpoint's model files alone: no optimizer state beside what evaluate reads
    if not (drafter / "model.safetensors").exists():
        drafter.mkdir(exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(last / f, drafter / f)
    return drafter


def our_init(out: Path, d2t: Path, verifier: str) -> Path:
    """Our EAGLE-3's starting point (Eagle3._init_from_base: the layer a copy of base layer 29, fc passing its input
    through, the lm_head the base's rows) with the shared draft vocab, untrained, in the speculators layout: their
    trainer's --from-pretrained starts from it. Its verifier is named by the local base dir their trainer reads
    (offline), not by the hub name our export writes."""
    if not (out / "model.safetensors").exists():
        import torch

        from specdec.base import load_base
        from specdec.drafters.eagle3 import Eagle3
        from specdec.export import export

        base = load_base("smollm2_135m", device="cpu")
        d = Eagle3(base, ttt_steps=TTT, draft_vocab_size=VOCAB, aux_layers=list(LAYERS))
        offsets = np.load(d2t)
        d.set_draft_vocab(torch.from_numpy(offsets + np.arange(len(offsets))))
        export(d, "speculators", out, source="the EAGLE-3 recipe's initialisation, untrained")
        config = json.loads((out / "config.json").read_text())
        config["speculators_config"]["verifier"]["name_or_path"] = verifier
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def evaluate(drafters: list[Path], out: Path, prompts: list[str], gamma: int, passes: int) -> dict:
    """One evaluation of every drafter with our AR loop -> its results.json (beside its report.md in `out`). The
    drafts run at full precision (engine.draft_precision=fp32): τ is the trained weights', not a rounded copy's."""
    if not (out / "results.json").exists():
        run([sys.executable, "evaluate.py", f"drafters=[{','.join(map(str, drafters))}]", *prompts, "sampler=chain",
             f"sampler.gamma={gamma}", "sampler.max_new_tokens=128", "engine.draft_precision=fp32", "peers=[]",
             f"passes={passes}", "wandb.enabled=false", f"hydra.run.dir={out}"])
    return json.loads((out / "results.json").read_text())


def their_results(out: Path, name: str, dest: Path) -> dict:
    """A run of their trainer -> dest/<name>_train_metrics.jsonl (every step and validation),
    <name>_train_command.txt (their record of the command) and <name>_val_metrics.json (the validation at the end,
    returned)."""
    shutil.copy(out / "metrics.jsonl", dest / f"{name}_train_metrics.jsonl")
    shutil.copy(out / "checkpoints" / "train_command.txt", dest / f"{name}_train_command.txt")
    last = out / "checkpoints" / str(json.loads((out / "done.json").read_text())["epoch"])
    shutil.copy(last / "val_metrics.json", dest / f"{name}_val_metrics.json")
    return json.loads((last / "val_metrics.json").read_text())


def cpu_name() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: info.get(k, "").strip() for k in ("Model name", "CPU family", "Model", "CPU(s)")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=EPOCH)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--gamma", type=int, default=TTT)
    p.add_argument("--cpu", default="this_cpu", help="the results folder's name for this machine, e.g. zen5")
    a = p.parse_args()
    logs = ROOT / "logs" / "speculators_trainer"
    cache = CACHE / "features" / "demo_dflash"  # dflash_vs_lookup's cache: the same command finds it built
    run([sys.executable, "-m", "specdec.data.features", "max_train_blocks=600", "data.source.kinds=[complete]",
         "layers=[-1,2,15,29]", f"out_dir={cache}", f"hydra.run.dir={logs / 'features'}"])
    run_dir = logs / "run_dir"
    if not (run_dir / "specdec_export.json").exists():  # (export writes the dir whole or not at all)
        run([sys.executable, "-m", "specdec.data.speculators_offline", "export", cache, run_dir,
             "--layers", *LAYERS, "--dtype", "float32"])
    train = logs / f"ours_{a.steps}"
    mine = ours(train, cache, a.steps)
    their_venv()
    d2t, t2d = shared_vocab(mine, logs / "vocab")
    their_dir = logs / f"theirs_{a.steps}"
    yours = theirs(their_dir, run_dir, d2t, t2d, a.steps)
    # their trainer from our initialisation, same data order as theirs: beside theirs it isolates the start, beside
    # ours the trainer
    verifier = json.loads((run_dir / "specdec_export.json").read_text())["verifier_name_or_path"]
    mixed_dir = logs / f"theirs_from_our_init_{a.steps}"
    mixed = theirs(mixed_dir, run_dir, d2t, t2d, a.steps, init=our_init(logs / "our_init", d2t, verifier))
    drafters = [mine, yours, mixed]  # evaluate names them eagle3, eagle3 (speculators), eagle3 (speculators)#2
    code = evaluate(drafters, logs / f"report_{a.steps}_g{a.gamma}", ["prompts.split=report",
                    f"prompts.limit={a.prompts}"], a.gamma, a.passes)
    questions = evaluate(drafters, logs / f"question_{a.steps}_g{a.gamma}", ["prompts=question",
                         f"prompts.limit={a.prompts}"], a.gamma, 1)
    dest = ROOT / "experiments" / "results" / "speculators_trainer" / a.cpu
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("report.md", "results.json"):
        shutil.copy(logs / f"report_{a.steps}_g{a.gamma}" / f, dest / f)
        shutil.copy(logs / f"question_{a.steps}_g{a.gamma}" / f, dest / f"question_{f}")
    shutil.copy(train / "result.json", dest / "ours_train_result.json")  # validation metrics at the end
    shutil.copy(next((train / "csv").rglob("metrics.csv")), dest / "ours_train_metrics.csv")
    val = {"ours": {k: v for k, v in json.loads((train / "result.json").read_text())["metrics"].items()
                    if k.startswith("val/")},
           "theirs": their_results(their_dir, "theirs", dest),
           "theirs_from_our_init": their_results(mixed_dir, "theirs_from_our_init", dest)}
    rows = {name: [{k: r[k] for k in ("method", "tau", "tok_per_s", "speedup_vs_ar")} for r in res["rows"]]
            for name, res in (("humaneval_report", code), ("question", questions))}
    summary = {"steps": a.steps, "gamma": a.gamma, "cpu": cpu_name(), "device": code["header"]["device"],
               "rows": rows, "val": val}
    (dest / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, rs in rows.items():
        for r in rs:
            print(f"{name:<17} {r['method']:<22} tau {r['tau']:.2f}  {r['tok_per_s']:.1f} tok/s  "
                  f"{r['speedup_vs_ar']:.2f}x our AR loop")


if __name__ == "__main__":
    main()
