"""evaluate(cfg): drafters against plain decoding and the peers on the same base, prompts and machine, in one run.
The methods take turns prompt by prompt, the verify-cost curve is timed between the turns, every answer is compared
with an independent greedy reference, and the report is written (docs/sampler.md §4, §5, §7)."""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdec.base import Base
from specdec.checkpoint import write_json
from specdec.data.prompts import render_chat
from specdec.drafters.draft_model import DraftModel
from specdec.engines import EngineConfig, build
from specdec.evaluation.methods import build_methods, hf
from specdec.evaluation.report import tabulate, write_report
from specdec.evaluation.runs import Method, Run, earlier_report, load_method, same_config, save_method
from specdec.export import describe
from specdec.export import load as load_drafter_dir
from specdec.sampling.cost import forward_times
from specdec.sampling.decode import SamplerConfig


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """base -> drafters (refused on a base mismatch) -> prompts -> methods -> warm-up -> timed runs -> report."""
    out_dir = Path(cfg.paths.output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    done = earlier_report(out_dir, config, cfg.overwrite)
    if done is not None:
        return done
    torch.manual_seed(cfg.seed)
    # Checkpoint metadata first: a drafter from another base fails here, before the base is even loaded.
    paths = drafter_names(list(cfg.drafters or []))
    metas = {name: describe(p) for name, p in paths.items()}
    base: Base = hydra.utils.instantiate(cfg.base)
    # a specdec checkpoint, or a drafter exported or trained elsewhere in a serving format (specdec.export)
    drafters = {name: load_drafter_dir(p, base) for name, p in paths.items()}
    for model in cfg.get("draft_models") or []:  # pretrained HF draft models (evaluate-only), tokenizer checked
        drafters[_unique(f"draft_model:{Path(model).name}", drafters)] = DraftModel(base, model=str(model))
    sampler: SamplerConfig = hydra.utils.instantiate(cfg.sampler)
    engine = build(hydra.utils.instantiate(cfg.engine) if "engine" in cfg else EngineConfig(), base.device)
    prompts: list[dict] = hydra.utils.instantiate(cfg.prompts)
    passes = int(cfg.get("passes", 1))
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    # every method answers every prompt once a pass; the passes take turns as the prompts do (_take_turns)
    items = [dict(it, passed=p) for p in range(passes) for it in prompts]
    with ExitStack() as servers:  # llama.cpp peers' server processes, stopped however the evaluation ends
        methods = build_methods(cfg, base, drafters, sampler, engine, servers)
        return _measure(cfg, out_dir, config, base, metas, sampler, engine, prompts, items, methods,
                        list(drafters.values()))


def _measure(cfg, out_dir, config, base, metas, sampler, engine, prompts, items, methods, drafters=()
             ) -> dict[str, Any]:
    """evaluate's timed part, with every method built: warm-up, the turns, the reference, the report."""
    passes = int(cfg.get("passes", 1))
    # Each method's runs are kept as soon as each of its prompts finishes: a killed evaluation rerun into the same
    # dir reads them back and runs only what is missing.
    runs: dict[str, list[list[Run]]] = {m.name: [] for m in methods}  # method -> prompt -> turns
    resumed = [] if cfg.overwrite else [m.name for m in methods if load_method(out_dir, m.name, config, runs)]
    if resumed:
        print(f"[specdec] resuming {out_dir}: " + ", ".join(f"{n} ({len(runs[n])}/{len(items)} prompts)"
                                                          for n in resumed) + " read back, not run again")
    todo = [m for m in methods if len(runs[m.name]) < len(items)]

    if cfg.warmup:  # compile, allocator and cache warm-up stay out of the timings
        first = render_chat(base.tokenizer, [{"role": "user", "content": items[0]["turns"][0]}])
        for m in todo:
            m.run([first] * m.batch)

    # The verify-cost curve at the chain's γ+1, same run: what the Leviathan check predicts from (docs/sampler.md §8). With an
    # adaptive draft length a round verifies γ_s + 1 ≤ γ + 1 tokens, so every block size up to γ + 1 is measured.
    # Timed before the methods and again after each of their turns, all timings pooled: T_1, which every cost ratio
    # divides by, then sees the same phases of a noisy machine as the runs it is compared with (timed only before,
    # our AR loop's time per token over T_1 read 0.79–1.27 across the jobs of one leviathan table).
    gammas = sorted({m.chain_gamma for m in methods if m.chain_gamma})
    sizes = {n for g in gammas for n in (range(2, g + 2) if sampler.adaptive else [g + 1])}
    prompt_len = len(render_chat(base.tokenizer, [{"role": "user", "content": items[0]["turns"][0]}]))
    cost_times: dict[int, list[float]] = {n: [] for n in [1, *sorted(sizes)]} if gammas else {}

    def time_costs(reps: int) -> None:
        for n, t in forward_times(base, list(cost_times), prompt_len=prompt_len, reps=reps, engine=engine,
                                  greedy=sampler.temperature == 0).items():
            cost_times[n].extend(t)

    if cost_times:
        time_costs(reps=5)
    _take_turns(base, items, todo, runs, lambda m: save_method(out_dir, m.name, config, runs[m.name]),
                after_turn=(lambda: time_costs(reps=2)) if cost_times else None)
    costs = {n: statistics.median(t) for n, t in cost_times.items()}
    reference = _reference(cfg, base, prompts, sampler, runs, out_dir, config)

    report = tabulate(cfg, base, items, methods, runs, sampler, metas, costs, reference, passes)
    # which path each kind of forward took here (what the engine measured by now: a newcomer can say what ran)
    report["header"]["engine"] = {"name": engine.name, **engine.paths(base, drafters)}
    report["config"] = config
    report["header"]["resumed"] = resumed  # timed in an earlier process: their ratios cross two runs
    write_report(out_dir, cfg, report, methods)
    return report


def _take_turns(base: Base, items: list[dict], methods: list[Method], runs: dict[str, list[list[Run]]],
                saved: Callable[[Method], None], after_turn: Callable[[], None] | None = None) -> None:
    """Run every method on every prompt it has not answered yet (runs[name] holds the answered ones, in order),
    taking turns: each method answers its next chunk of prompts before any method answers a later one, the order of
    our methods rotating from turn to turn. On a noisy machine a slow phase then falls on all methods alike, not on
    whichever method's block of prompts it hits (a slow phase over a few of our AR loop's prompts would make every
    drafter read faster against it). The HF peers go last in every turn, so that whatever state their long runs leave
    the machine in falls on each of our methods in turn (rotated with ours, HF `generate` would be followed by our AR
    loop in nearly every turn, and whatever it leaves behind would slow that one method). `saved(m)` follows each
    chunk, `after_turn()` each turn."""
    pending = [m for m in methods if len(runs[m.name]) < len(items)]
    left = sum(-(-(len(items) - len(runs[m.name])) // m.batch) for m in pending)
    with tqdm(total=left, unit="chunk", desc="methods x prompts", leave=False) as bar:
        turn = 0
        while pending:
            ours, peers = [m for m in pending if not m.peer], [m for m in pending if m.peer]
            k = turn % max(len(ours), 1)
            for m in ours[k:] + ours[:k] + peers:
                start = len(runs[m.name])
                runs[m.name].extend(_answer_turn_by_turn(base, m, items[start : start + m.batch]))
                saved(m)
                bar.set_postfix_str(m.name)
                bar.update()
            pending = [m for m in pending if len(runs[m.name]) < len(items)]
            turn += 1
            if after_turn is not None:
                after_turn()


def _answer_turn_by_turn(base: Base, m: Method, chunk: list[dict]) -> list[list[Run]]:
    """Multi-turn prompts: each turn sees the method's own earlier answers."""
    history: list[list[dict]] = [[] for _ in chunk]
    runs: list[list[Run]] = [[] for _ in chunk]
    for turn in range(max(len(it["turns"]) for it in chunk)):
        rows = [i for i, it in enumerate(chunk) if turn < len(it["turns"])]
        for i in rows:
            history[i].append({"role": "user", "content": chunk[i]["turns"][turn]})
        results = m.run([render_chat(base.tokenizer, history[i]) for i in rows])
        for i, r in zip(rows, results):
            runs[i].append(r)
            answer = base.tokenizer.decode(r.tokens, skip_special_tokens=True)
            history[i].append({"role": "assistant", "content": answer})
    return runs


def _reference(cfg: DictConfig, base: Base, prompts: list[dict], sampler: SamplerConfig,
               runs: dict[str, list[list[Run]]], out_dir: Path, config: dict) -> dict | None:
    """At T = 0, what "greedy-identical" compares every method with, our AR loop included: a reference greedy decode
    of each prompt (each turn after the reference's own earlier answers) by HF `generate` in float32, outside every
    engine (stock PyTorch, nothing patched or measured). The hf_generate peer's first pass is exactly that where it
    ran; otherwise it runs here once per prompt, untimed (`identity_reference=false` skips it: the column then reads
    n/a). -> {"source": ..., "tokens": [prompt][turn] token ids}, or None."""
    if sampler.temperature != 0:
        return None
    if "hf_generate" in runs:
        return {"source": "hf_generate", "tokens": [[r.tokens for r in p] for p in runs["hf_generate"][: len(prompts)]]}
    if not cfg.get("identity_reference", True):
        return None
    path = out_dir / "reference.json"  # (kept with the runs: a resumed evaluation reads it back)
    if not cfg.overwrite and path.exists() and json.loads(path.read_text()).get("config") == same_config(config):
        return json.loads(path.read_text())["reference"]
    ref = Method("reference", hf(base, sampler, {}), True, peer=True)
    print(f"[specdec] reference greedy decode of {len(prompts)} prompts (HF generate, float32, untimed)")
    done = {"source": "HF generate, float32, unpatched (untimed)",
            "tokens": [[r.tokens for r in p] for p in _answer_turn_by_turn(base, ref, prompts)]}
    write_json(path, {"config": same_config(config), "reference": done})
    return done


def drafter_names(paths: list[str]) -> dict[str, str]:
    """Method names from the drafter classes (medusa, prophet, ...), numbered when a class repeats."""
    names: dict[str, str] = {}
    for p in paths:
        meta = describe(p)
        name = meta["target"].rsplit(".", 1)[-1].lower() + (f" ({meta['format']})" if "format" in meta else "")
        names[_unique(name, names)] = p
    return names


def _unique(name: str, taken: dict) -> str:
    return name if name not in taken else f"{name}#{len(taken)}"
