"""One LightningModule for every drafter family: frozen base features -> drafter logits -> KL/CE losses ->
offline acceptance metrics; and `train(cfg)`, the top-to-bottom training recipe that train.py wraps."""

from __future__ import annotations

import json
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf
from torchmetrics import MeanMetric

from specdec.base import Base, Features, resolve_device
from specdec.calibration import SamplerProbe
from specdec.checkpoint import META, save_drafter, write_json
from specdec.drafters.drafter import Drafter, TrainOutput
from specdec.engines import build
from specdec.losses import topk_kl
from specdec.precision import AUTO, choose_precision
from specdec.sweeps import RESULT, ConfigError


@dataclass
class Targets:
    """The base's next-token distribution at every position of a [B, T] batch: dense logits [B, T, V], or its
    top-k (top_idx, top_logp: [B, T, k], log-probs of the full softmax) with the remaining mass as one bucket."""

    logits: torch.Tensor | None = None
    top_idx: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None


class DraftTrainer(L.LightningModule):
    """Trains `drafter` against the frozen `base`. The base is kept outside the module registry, so Lightning
    checkpoints, optimizers and DDP see only the drafter."""

    def __init__(
        self,
        base: Base,
        drafter: Drafter,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        kl_weight: float = 1.0,
        ce_weight: float = 0.0,
        head_decay: float = 0.8,
        base_autocast: str | None = None,
        target_topk: int | None = None,
        loss_on: str = "all",
    ):
        super().__init__()
        self._frozen = {"base": base}
        self.drafter = drafter
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.kl_weight, self.ce_weight, self.head_decay = kl_weight, ce_weight, head_decay
        if loss_on not in ("all", "answers"):
            raise ValueError(f"loss_on must be all or answers, got {loss_on!r}")
        # answers: only the positions whose target token is one of the base's own answer tokens (the data's
        # loss_mask) count, in the loss and in the validation metrics; all: every position
        self.loss_on = loss_on
        self.base_autocast = getattr(torch, base_autocast) if base_autocast else None
        # online: train on the base's top-k, exactly as from a feature cache. A reduced draft vocab always trains
        # on top-k targets (its tokens outside the draft vocab join the rest bucket): 64 unless set.
        self.target_topk = target_topk or (64 if drafter.draft_vocab is not None else None)
        # Entry j predicting token t+1+offset_j is weighted decay^offset_j (Medusa's 0.8^k).
        self.entry_weights = [head_decay**o for o in drafter.target_offsets]
        k = len(drafter.target_offsets)
        self.val_top1 = torch.nn.ModuleList(MeanMetric() for _ in range(k))
        self.val_accept = torch.nn.ModuleList(MeanMetric() for _ in range(k))
        self._step_start: float | None = None
        self._batch_tokens = 0  # tokens of one training batch on this rank (set by the first training step)

    @property
    def base(self) -> Base:
        return self._frozen["base"]

    def on_fit_start(self) -> None:
        self.base.to(self.device)

    def on_validation_start(self) -> None:
        self.base.to(self.device)

    # -- one step ----------------------------------------------------------------------------
    def _inputs(self, batch: dict) -> tuple[Features, Targets]:
        """Base features and targets of a batch: read from a feature cache (the base does not run), or computed by
        one frozen base forward."""
        dtype = next(self.drafter.parameters()).dtype  # drafters train in their own precision
        if "hidden" in batch:  # data=cached
            hidden = {l: batch["hidden"][l].to(dtype) for l in self.drafter.feature_layers}
            feats, targets = Features(hidden, logits=None), Targets(top_idx=batch["top_idx"], top_logp=batch["top_logp"].float())
        else:
            cast = (torch.autocast(self.device.type, dtype=self.base_autocast) if self.base_autocast else nullcontext())
            with cast:
                feats = self.base.features(batch["input_ids"], layers=self.drafter.feature_layers)
            feats = Features({l: h.to(dtype) for l, h in feats.hidden.items()}, feats.logits.float())
            if self.target_topk is None:
                return feats, Targets(logits=feats.logits)
            top_logp, top_idx = F.log_softmax(feats.logits, -1).topk(self.target_topk, dim=-1)  # what a cache stores
            targets = Targets(top_idx=top_idx, top_logp=top_logp)
        vocab = self.drafter.draft_vocab
        if vocab is not None:  # base ids -> draft indices; tokens outside the draft vocab (−1) join the rest bucket
            idx = vocab.from_base(targets.top_idx)
            targets = Targets(top_idx=idx, top_logp=targets.top_logp.masked_fill(idx < 0, float("-inf")))
        return feats, targets

    def _entry_losses(self, out: TrainOutput, targets: Targets, input_ids: torch.Tensor, metrics: bool,
                      mask: torch.Tensor | None = None):
        """Per entry j (offset o): draft logits at t vs the base's distribution at t+o and the data token t+1+o.
        Yields (j, loss_j, kl_j, top1_j, accept_j, w_j); top1/accept are [B, n] per-position tensors (None unless
        `metrics`), w_j [B, n] their weights (1 where the token t+1+o counts under `mask` [B, T], else 0; all ones
        without a mask). These [B, n, V] passes dominate a step's cost after the matmuls: keep them few and fused."""
        T = input_ids.shape[1]
        offsets = self.drafter.target_offsets
        dense = targets.logits is not None
        if dense:
            p_logp = F.log_softmax(targets.logits, -1)  # [B, T, V], once for every entry
            p = p_logp.exp()
            neg_entropy = (p * p_logp).sum(-1)  # [B, T] Σ p log p, so KL(p || q) = CE(q; p) + Σ p log p
        else:
            # top-k targets: the k tokens plus one bucket for the rest of the mass (specdec/losses.py), every
            # entry's KL and its gradient in one fused pass over the logits
            kls = topk_kl(out.logits, targets.top_idx, targets.top_logp, offsets, mask)  # [K]
        # unbind once: slicing entries out of [B, T, K, V] one by one would make autograd zero-fill a full
        # [B, T, K, V] gradient per entry
        for j, (o, q) in enumerate(zip(offsets, out.logits.unbind(2))):
            n = T - 1 - o  # positions t with both a target distribution (t+o) and a data label (t+1+o)
            q = q[:, :n]  # [B, n, V] (V = the draft vocab's size when the drafter has one)
            w = (mask[:, 1 + o : 1 + o + n].to(q.dtype) if mask is not None  # [B, n] weight of the token t+1+o
                 else q.new_ones(q.shape[:2]))
            if dense:
                q = q.float()
                pt = p[:, o : o + n]  # [B, n, V]
                # soft-target cross-entropy  lse(q) − Σ_v p·q  as a batched dot: no [B, n, V] temporaries
                cross = (pt.unsqueeze(-2) @ q.unsqueeze(-1))[..., 0, 0]  # [B, n]
                per = torch.logsumexp(q, -1) - cross + neg_entropy[:, o : o + n]  # [B, n] KL(p || q)
                kl = (per * w).sum() / w.sum().clamp_min(1)
            else:
                kl = kls[j]
            loss = self.kl_weight * kl
            if self.ce_weight:
                labels = input_ids[:, 1 + o : 1 + o + n]  # [B, n]
                if self.drafter.draft_vocab is not None:  # in draft indices; tokens outside it (−1) are skipped
                    labels = self.drafter.draft_vocab.from_base(labels)
                labels = labels.masked_fill(w == 0, -1)  # (and the ones the mask leaves out)
                loss = loss + self.ce_weight * F.cross_entropy(q.reshape(-1, q.shape[-1]).float(), labels.reshape(-1),
                                                               ignore_index=-1)
            top1 = accept = None
            if metrics:
                with torch.no_grad():
                    q = q.float()
                    if dense:
                        top1 = (q.argmax(-1) == targets.logits[:, o : o + n].argmax(-1)).float()
                        accept = torch.minimum(q.softmax(-1), pt).sum(-1)  # Σ_v min(p, q)
                    else:  # Σ over the top-k only: a lower bound of Σ_v min(p, q)
                        idx = targets.top_idx[:, o : o + n]  # [B, n, k]
                        top1 = (q.argmax(-1) == idx[..., 0]).float()  # −1 (outside a draft vocab) never matches
                        lq = q.log_softmax(-1).gather(-1, idx.clamp_min(0))
                        accept = torch.minimum(lq.exp(), targets.top_logp[:, o : o + n].exp()).sum(-1)
            yield j, loss, kl.detach(), top1, accept, w.float()

    def _mask(self, batch: dict) -> torch.Tensor | None:
        """[B, T] bool: the positions whose token is the base's own answer (loss_on=answers), else None."""
        if self.loss_on == "all":
            return None
        if "loss_mask" not in batch:
            raise ValueError("module.loss_on=answers needs blocks with an answer mask: chat-message data (the "
                             "distilled answers), or a feature cache built from it since the mask exists (rebuild "
                             "an older cache: python -m specdec.data.features ...)")
        return batch["loss_mask"].bool()

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        input_ids = batch["input_ids"]
        feats, targets = self._inputs(batch)
        out = self.drafter.forward_train(feats, input_ids)
        total = torch.zeros((), device=self.device)
        names = self.drafter.head_names
        val = stage == "val"
        mask = self._mask(batch)
        for j, loss, kl, top1, accept, w in self._entry_losses(out, targets, input_ids, metrics=val, mask=mask):
            total = total + self.entry_weights[j] * loss
            self.log(f"{stage}/{names[j]}_kl", kl, on_step=not val, on_epoch=True)
            if val:
                self.val_top1[j].update(top1, w)
                self.val_accept[j].update(accept, w)
        if out.aux_loss is not None:
            total = total + out.aux_loss
        for name, value in (out.aux_metrics or {}).items():
            self.log(f"{stage}/{name}", value, on_step=not val, on_epoch=True)
        self.log(f"{stage}/loss", total, prog_bar=True, on_step=not val, on_epoch=True)
        return total

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, "train")
        self._batch_tokens = batch["input_ids"].numel()
        now = time.perf_counter()
        if self._step_start is not None:  # tokens/s of the previous full step (forward, backward, optimizer)
            self.log("train/tokens_per_s", batch["input_ids"].numel() / (now - self._step_start), prog_bar=True)
        self._step_start = now
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        accept = torch.stack([m.compute() for m in self.val_accept])  # [K]
        top1 = torch.stack([m.compute() for m in self.val_top1])  # [K]
        # the greedy analogue of expected_tau (T = 0 accepts a draft token iff it is the base's argmax)
        self.log("val/expected_tau_greedy", self.drafter.expected_tau(top1))
        # training tokens seen so far: the x axis of a learning curve
        self.log("val/train_tokens", float(self.global_step * self._batch_tokens * self.trainer.world_size))
        for j, name in enumerate(self.drafter.head_names):
            self.log(f"val/{name}_top1", self.val_top1[j].compute())
            self.log(f"val/{name}_accept", accept[j])
            self.val_top1[j].reset()
            self.val_accept[j].reset()
        self.log("val/expected_tau", self.drafter.expected_tau(accept), prog_bar=True)
        self._step_start = None  # validation time is not training throughput

    def val_metric_names(self) -> list[str]:
        """Every validation metric this module logs (what a sweeper may optimise)."""
        per_entry = [f"val/{n}_{m}" for n in self.drafter.head_names for m in ("kl", "top1", "accept")]
        return ["val/loss", "val/expected_tau", "val/expected_tau_greedy", "val/train_tokens", *per_entry, *(f"val/{n}" for n in self.drafter.aux_metric_names)]

    def configure_optimizers(self):
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        optimizer = self.optimizer(params=params)
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler(optimizer=optimizer), "interval": "step"}}


class SaveDrafter(L.Callback):
    """Writes the trained drafter (safetensors + json, no base weights) when training ends."""

    def __init__(self, dirpath: str, train_config: dict | None = None):
        self.dirpath = dirpath
        self.train_config = train_config

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, module: DraftTrainer) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        save_drafter(module.drafter, self.dirpath, train_config=self.train_config, metrics=metrics)


def train(cfg: DictConfig) -> dict[str, float]:
    """seed -> base -> drafter -> module -> data -> callbacks/loggers -> trainer -> fit -> metrics.

    A run dir that already holds a finished run with the same config returns its metrics without training (a
    rerun of a sweep or table only trains what is missing); one with a checkpoint resumes from it."""
    out_dir = Path(cfg.paths.output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    finished = _finished_run(out_dir, config)
    if finished is not None:
        return finished
    L.seed_everything(cfg.seed, workers=True)
    base: Base = hydra.utils.instantiate(cfg.base)
    drafter: Drafter = hydra.utils.instantiate(cfg.drafter)(base=base)
    if not any(p.requires_grad for p in drafter.parameters()):  # nothing to train by gradient (layer skip)
        return calibrate(cfg, base, drafter, out_dir, config)
    module = hydra.utils.instantiate(cfg.module)(base=base, drafter=drafter)
    check_metric_name(cfg.get("optimized_metric"), module)
    datamodule = hydra.utils.instantiate(cfg.data)(tokenizer=base.tokenizer)
    if hasattr(datamodule, "check"):  # a feature cache: refuse another base or missing layers before training
        datamodule.check(base, drafter)
    if module.loss_on == "answers" and not getattr(datamodule, "answer_mask", True):  # (text blocks: checked per batch)
        raise ValueError(f"module.loss_on=answers needs a feature cache with the answer mask: {datamodule.path} (or a "
                         f"data.mix cache) was built without one; rebuild it from chat-message data "
                         f"(python -m specdec.data.features ...)")
    ckpt_path = resume_path(cfg.get("ckpt_path"), out_dir)
    if drafter.draft_vocab is not None and ckpt_path is None:  # (a resumed run loads it)
        _set_draft_vocab(drafter, datamodule)

    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    saver = SaveDrafter(str(out_dir / "drafter"), config)
    callbacks.append(saver)
    loggers = [hydra.utils.instantiate(c, **_sweep_grouping(c)) for c in (cfg.get("logger") or {}).values()]
    precision = cfg.trainer.get("precision")
    if precision == AUTO:  # timed on this machine: bf16 autocast where its products are faster, else fp32
        vocab = drafter.draft_vocab.size if drafter.draft_vocab is not None else base.vocab_size
        precision, why = choose_precision(_train_device(cfg.trainer), base.hidden_size, vocab)
        print(f"[specdec] trainer.precision=auto -> {precision}: {why}")
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers, precision=precision)
    for lg in loggers:
        lg.log_hyperparams(config)
    n_train = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    print(f"[specdec] base {base.name} | drafter {type(drafter).__name__} | trainable params {n_train:,}")
    if ckpt_path is not None:
        print(f"[specdec] resuming from {ckpt_path}")

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    except SIGTERMException:  # Lightning stopped after the current step and ModelCheckpoint saved it
        print(f"[specdec] SIGTERM: stopped at step {trainer.global_step}, checkpoint in {out_dir / 'checkpoints'}; "
              f"rerun the same command to resume")
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        _finish_wandb()
    if trainer.global_rank == 0 and not trainer.interrupted and not trainer.fast_dev_run:
        if not (out_dir / "drafter" / META).exists():
            # a resumed run whose time budget the checkpoint had already spent stops before the training loop, so
            # Lightning never called the saver's on_train_end: the checkpoint's weights are the run's drafter
            saver.on_train_end(trainer, module)
        write_json(out_dir / RESULT, {"status": "completed", "metrics": metrics, "config": config,
                                      "trainable_params": n_train, "global_step": trainer.global_step,
                                      "precision": str(precision)})
    _print_val_table(metrics, drafter.head_names)
    return metrics


def _train_device(trainer_cfg: DictConfig) -> torch.device:
    """The device Lightning will train on: what trainer.accelerator names ("gpu" is CUDA), "auto" as the base resolves it."""
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    return resolve_device({"gpu": "cuda"}.get(accelerator, accelerator))


def calibrate(cfg: DictConfig, base: Base, drafter: Drafter, out_dir: Path, config: dict) -> dict[str, float]:
    """train() for a drafter with no trainable parameters: data -> loggers -> drafter.calibrate on the validation
    blocks (the layer-skip search) -> <run>/drafter, calibration.json (how it was found), result.json."""
    if not drafter.calibration_metrics:
        drafter.calibrate((), lambda metrics, step: None)  # raises the drafter's own one-line reason
    name = cfg.get("optimized_metric")
    if name is not None and name not in drafter.calibration_metrics:
        raise ConfigError(f"optimized_metric {name!r} is never returned by {type(drafter).__name__}'s calibration; "
                          f"pick one of {', '.join(drafter.calibration_metrics)}")
    datamodule = hydra.utils.instantiate(cfg.data)(tokenizer=base.tokenizer)
    if hasattr(datamodule, "check"):
        datamodule.check(base, drafter)
    datamodule.setup("fit")
    if drafter.draft_vocab is not None:
        _set_draft_vocab(drafter, datamodule)
    loggers = [hydra.utils.instantiate(c, **_sweep_grouping(c)) for c in (cfg.get("logger") or {}).values()]
    for lg in loggers:
        lg.log_hyperparams(config)

    def log(metrics: dict[str, float], step: int) -> None:
        for lg in loggers:
            lg.log_metrics(metrics, step=step)

    print(f"[specdec] base {base.name} | drafter {type(drafter).__name__} | no trainable parameters: calibrating")
    try:
        # the search decodes and times on the engine evaluate.py would run it on
        probe = SamplerProbe(base, build(hydra.utils.instantiate(cfg.engine) if "engine" in cfg else None, base.device))
        metrics, detail = drafter.calibrate((batch["input_ids"] for batch in datamodule.val_dataloader()), log, probe)
        for lg in loggers:
            lg.log_metrics(metrics, step=len(detail.get("trials", [])))
            lg.finalize("success")
    finally:
        _finish_wandb()
    save_drafter(drafter, out_dir / "drafter", train_config=config, metrics=metrics)
    write_json(out_dir / "calibration.json", detail)
    if not cfg.trainer.get("fast_dev_run"):
        write_json(out_dir / RESULT, {"status": "completed", "metrics": metrics, "config": config,
                                      "trainable_params": 0, "global_step": 0})
    print("\n".join(f"{k}: {v:.4g}" for k, v in metrics.items()))
    print(f"[specdec] {type(drafter).__name__} {drafter.hparams} -> {out_dir / 'drafter'}")
    return metrics


def _set_draft_vocab(drafter: Drafter, datamodule) -> None:
    counts = datamodule.train_token_counts(drafter.base.vocab_size)  # [V]
    top = counts.topk(drafter.draft_vocab.size)
    drafter.set_draft_vocab(top.indices)
    print(f"[specdec] draft vocab: {drafter.draft_vocab.size:,} most frequent tokens, "
          f"{top.values.sum() / counts.sum():.1%} of the training tokens")


def _finished_run(out_dir: Path, config: dict) -> dict[str, float] | None:
    path = out_dir / RESULT
    if not path.exists():
        return None
    done = json.loads(path.read_text())
    if done.get("status") != "completed":
        return None
    if _comparable(done["config"]) != _comparable(config):
        diff = sorted(k for k in set(done["config"]) | set(config) if done["config"].get(k) != config.get(k))
        raise ValueError(f"{out_dir} holds a finished run with another config (differs in {', '.join(diff)}); "
                         f"pick another hydra.run.dir or delete {path}")
    print(f"[specdec] {out_dir} already holds this finished run; its metrics are returned (delete {RESULT} to retrain)")
    return done["metrics"]


def _comparable(config: dict) -> dict:
    """What decides a run's result: everything but where it resumes from, how it logs and where the project sits
    (`paths`: a table's run sets PROJECT_ROOT, a hand run does not; data and drafter paths are compared resolved)."""
    return {k: v for k, v in config.items() if k not in ("ckpt_path", "logger", "callbacks", "tags", "paths")}


def resume_path(ckpt_path: str | None, out_dir: Path) -> str | None:
    """`last` (the default): the newest of this run dir's last.ckpt and Lightning's SLURM requeue checkpoints
    (hpc_ckpt_*.ckpt), or None when there is none yet; null: start fresh; anything else: that file."""
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).exists():
            raise FileNotFoundError(f"ckpt_path {ckpt_path} does not exist")
        return ckpt_path
    found = [*out_dir.glob("checkpoints/last*.ckpt"), *out_dir.glob("hpc_ckpt_*.ckpt")]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def check_metric_name(name: str | None, module: DraftTrainer) -> None:
    """A sweep optimises `optimized_metric`: refuse, before training, a name the module never logs."""
    if name is None:
        return
    logged = module.val_metric_names()
    if name not in logged:
        raise ConfigError(f"optimized_metric {name!r} is never logged by {type(module.drafter).__name__}; "
                         f"pick one of {', '.join(logged)}")


def _sweep_grouping(logger_cfg: DictConfig) -> dict:
    """In a Hydra multirun, wandb groups the runs by sweep (group = <the configured group, task_name by
    default>/<sweep dir name>) and names and tags each run by its own overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if "WandbLogger" not in str(logger_cfg.get("_target_", "")) or not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return {}
    overrides = list(hc.overrides.task)
    group = logger_cfg.get("group")
    sweep = Path(hc.sweep.dir).name
    return {"group": f"{group}/{sweep}" if group else sweep,
            "name": logger_cfg.get("name") or hc.job.override_dirname or str(hc.job.num),
            "tags": [*(logger_cfg.get("tags") or []), *overrides][:64]}


def _finish_wandb() -> None:
    """Close the wandb run even on failure, so the next job of a multirun starts its own run. A run that never logged
    to wandb (logger=csv) needs no wandb installed."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def _print_val_table(metrics: dict[str, float], names: list[str]) -> None:
    if not any(k.startswith("val/") for k in metrics):
        return
    rows = ["| entry | top-1 | Σmin(p,q) |", "|---|---|---|"]
    for name in names:
        top1, acc = metrics.get(f"val/{name}_top1", float("nan")), metrics.get(f"val/{name}_accept", float("nan"))
        rows.append(f"| {name} | {top1:.3f} | {acc:.3f} |")
    rows.append(f"\npredicted τ (val/expected_tau): {metrics.get('val/expected_tau', float('nan')):.3f}")
    print("\n".join(rows))
