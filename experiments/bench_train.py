"""Training throughput of a drafter vs the frozen base's forward alone, on the same batches, interleaved in
one run (these machines are noisy: only the ratio is meaningful). With `precisions=32-true,bf16-mixed` the training
step runs under each (bf16-mixed: the autocast Lightning's bf16-mixed applies), again interleaved batch by batch.

    .venv/bin/python experiments/bench_train.py drafter=medusa [steps=6] [data=cached] [any train.py override ...]
    .venv/bin/python experiments/bench_train.py experiment=recipe/prophet precisions=32-true,bf16-mixed steps=5
"""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.utilities import move_data_to_device

from specdec.training import DraftTrainer

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith(("steps=", "precisions="))}
    steps = int(opts.get("steps", 6))
    precisions = opts.get("precisions", "32-true").split(",")
    overrides = [a for a in argv if not a.startswith(("steps=", "precisions="))]
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["paths.output_dir=/tmp/specdec-bench", *overrides])
    torch.manual_seed(cfg.seed)
    base = hydra.utils.instantiate(cfg.base)
    drafter = hydra.utils.instantiate(cfg.drafter)(base=base).to(base.device)
    module: DraftTrainer = hydra.utils.instantiate(cfg.module)(base=base, drafter=drafter)
    dm = hydra.utils.instantiate(cfg.data)(tokenizer=base.tokenizer)
    dm.setup()
    opt = module.optimizer(params=[p for p in drafter.parameters() if p.requires_grad])
    module.log = lambda *a, **k: None  # no trainer attached: logging is not what we time
    batches = iter(dm.train_dataloader())

    def base_only(batch):  # what a training step pays for the frozen base, whatever the data module
        module._inputs({"input_ids": batch["input_ids"]})

    def train_step(batch, precision):  # with data=cached the batch carries the base's features: the base does not run
        cast = (torch.autocast(base.device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext())
        with cast:
            loss = module._step(batch, "train")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = {"base": base_only, **{p: (lambda b, p=p: train_step(b, p)) for p in precisions}}
    t = dict.fromkeys(runs, 0.0)
    batch = move_data_to_device(next(batches), base.device)
    for fn in runs.values():  # warm-up
        fn(batch)
    tokens = 0
    for _ in range(steps):
        batch = move_data_to_device(next(batches), base.device)
        ids = batch["input_ids"]
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn(batch)
            if base.device.type == "cuda":
                torch.cuda.synchronize()
            t[name] += time.perf_counter() - t0
        tokens += ids.numel()
    n_train = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    print("| drafter | trainable params | precision | base forward tok/s | training tok/s | s a step | ratio |")
    print("|---|---|---|---|---|---|---|")
    for p in precisions:
        print(f"| {cfg.drafter._target_.rsplit('.', 1)[-1]} | {n_train:,} | {p} | {tokens / t['base']:.0f} | "
              f"{tokens / t[p]:.0f} | {t[p] / steps:.2f} | {t['base'] / t[p]:.2f} |")
    print(f"({steps} batches of {ids.shape[0]}x{ids.shape[1]} tokens, {torch.get_num_threads()} threads, "
          f"{base.device}, {base.dtype})")


if __name__ == "__main__":
    main(sys.argv[1:])
