"""Evaluate drafters against plain decoding and peers (HF generate, llama.cpp) on the same base, prompts and machine, in one run:
a Spec-Bench-style table (markdown, CSV, JSON), plots, and wandb logging (docs/sampler.md §4, §5, §7)."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdec.base import SMOLLM2, Base, smollm2_gguf_path
from specdec.checkpoint import write_json, write_text
from specdec.data.prompts import render_chat
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.drafter import Drafter
from specdec.engines import EngineConfig, build
from specdec.engines.measure import cpu_model
from specdec.export import describe, export, formats_of, gguf
from specdec.export import load as load_drafter_dir
from specdec.peers import llama_cpp
from specdec.sampling.cost import chain_tau, forward_times, predicted_speedup
from specdec.sampling.decode import SamplerConfig, generate
from specdec.sampling.engine import Engine
from specdec.sampling.lookup import fresh_counts
from specdec.sampling.metrics import prompt_metrics, token_acceptance

AR = "ar (ours)"
LOOKUP = "lookup (ours)"  # n-gram lookup alone, no drafter
HF_PEERS = ("hf_generate", "hf_prompt_lookup", "hf_early_exit", "hf_assisted")
LLAMA_CPP_PEERS = ("llama_cpp", "llama_cpp_lookup", "llama_cpp_draft")
PLAIN = (AR, "llama_cpp", "hf_generate")  # the plain decoders: "vs best AR" divides by the fastest of them in the run


@dataclass
class Run:
    """One method on one prompt turn."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)  # per round (our sampler only)
    drafted: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    t_draft_s: float = 0.0  # summed over rounds
    t_verify_s: float = 0.0
    rounds: int = 0
    peer_drafted: int = 0  # a peer's own speculation, per answer (llama.cpp reports no rounds)
    peer_accepted: int = 0
    peer_rounds: int = 0  # a peer's base forwards (HF assisted and prompt lookup: each verifies one draft)


@dataclass
class Method:
    name: str
    run: Callable[[list[list[int]]], list[Run]]  # a batch of prompts (token ids) -> one Run per prompt
    lossless: bool
    chain_gamma: int | None = None  # set for chain drafters: the Leviathan check applies
    batch: int = 1
    peer: bool = False  # a peer (HF, llama.cpp): takes its turn after ours (see _take_turns)
    computes: str | None = None  # a peer that computes another model than the reference's: what it is


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """base -> drafters (refused on a base mismatch) -> prompts -> methods -> warm-up -> timed runs -> report."""
    out_dir = Path(cfg.paths.output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    done = _earlier_report(out_dir, config, cfg.overwrite)
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
        methods = _methods(cfg, base, drafters, sampler, engine, servers)
        return _measure(cfg, out_dir, config, base, metas, sampler, engine, prompts, items, methods)


def _measure(cfg, out_dir, config, base, metas, sampler, engine, prompts, items, methods) -> dict[str, Any]:
    """evaluate's timed part, with every method built: warm-up, the turns, the reference, the report."""
    passes = int(cfg.get("passes", 1))
    # Each method's runs are kept as soon as each of its prompts finishes: a killed evaluation rerun into the same
    # dir reads them back and runs only what is missing.
    runs: dict[str, list[list[Run]]] = {m.name: [] for m in methods}  # method -> prompt -> turns
    resumed = [] if cfg.overwrite else [m.name for m in methods if _load_method(out_dir, m.name, config, runs)]
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
    _take_turns(base, items, todo, runs, lambda m: _save_method(out_dir, m.name, config, runs[m.name]),
                after_turn=(lambda: time_costs(reps=2)) if cost_times else None)
    costs = {n: statistics.median(t) for n, t in cost_times.items()}
    reference = _reference(cfg, base, prompts, sampler, runs, out_dir, config)

    report = _tabulate(cfg, base, items, methods, runs, sampler, metas, costs, reference, passes)
    report["config"] = config
    report["header"]["resumed"] = resumed  # timed in an earlier process: their ratios cross two runs
    _write(out_dir, cfg, report, methods)
    return report


# -- methods ---------------------------------------------------------------------------------------
def _methods(cfg: DictConfig, base: Base, drafters: dict[str, Drafter], sampler: SamplerConfig,
             engine: Engine, servers: ExitStack) -> list[Method]:
    ar_cfg = replace(sampler, tree="chain", lookup_tokens=0)
    methods = [Method(AR, _ours(base, None, ar_cfg, cfg.seed, engine), True, batch=cfg.batch_size)]
    # With n-gram lookup on (sampler.lookup_tokens), each drafter runs with and without it, and lookup alone is a
    # method of its own: what the trained drafter adds to free lookup, and the reverse, side by side.
    plain = replace(sampler, lookup_tokens=0)
    for name, d in drafters.items():
        gamma = sampler.gamma if sampler.tree == "chain" else None
        methods.append(Method(name, _ours(base, d, plain, cfg.seed, engine), sampler.lossless, gamma, cfg.batch_size))
        if sampler.lookup_tokens:
            methods.append(Method(f"{name}+lookup", _ours(base, d, sampler, cfg.seed, engine), sampler.lossless,
                                  batch=cfg.batch_size))
    if sampler.lookup_tokens:
        methods.append(Method(LOOKUP, _ours(base, None, sampler, cfg.seed, engine), sampler.lossless,
                              batch=cfg.batch_size))
    hf = {
        "hf_generate": {},
        "hf_prompt_lookup": {"prompt_lookup_num_tokens": cfg.hf.prompt_lookup_num_tokens},
        "hf_early_exit": {"assistant_early_exit": cfg.hf.early_exit_layer, "num_assistant_tokens": cfg.hf.num_assistant_tokens},
    }
    for peer in cfg.peers:
        if peer in LLAMA_CPP_PEERS:
            methods.append(_llama_cpp_method(cfg, base, sampler, peer, servers, drafters))
            continue
        if peer not in HF_PEERS:
            raise ValueError(f"unknown peer {peer!r}; known: {', '.join(HF_PEERS + LLAMA_CPP_PEERS)}")
        extra = _assistant(drafters, cfg.hf.get("assisted_tokens")) if peer == "hf_assisted" else hf[peer]
        # HF's speculation reports no rounds; its base forwards are them (early exit drafts with the base itself)
        methods.append(Method(peer, _hf(base, sampler, extra, count_rounds=peer != "hf_early_exit"), True, peer=True))
    return methods


def _assistant(drafters: dict[str, Drafter], tokens: int | None) -> dict:
    """HF generate(assistant_model=...) with the first evaluated drafter that is a standalone HF model (a draft
    model), so our sampler runs the same model beside it."""
    model = next((m for m in (d.hf_assistant() for d in drafters.values()) if m is not None), None)
    if model is None:
        raise ValueError("peer hf_assisted needs a draft model: drafters=[<a drafter=draft_model checkpoint>] or "
                         "draft_models=[<HF model name or dir>]")
    if tokens is not None:  # otherwise HF's own defaults: up to 20 drafts, ending below a 0.4 draft confidence
        model.generation_config.num_assistant_tokens = tokens
        model.generation_config.num_assistant_tokens_schedule = "constant"
        model.generation_config.assistant_confidence_threshold = 0.0
    return {"assistant_model": model}


def _ours(base: Base, drafter: Drafter | None, sampler: SamplerConfig, seed: int, engine: Engine) -> Callable:
    # the n-gram lookup's statistics, this method's own from its first prompt on (no method learns from another's)
    counts = fresh_counts(sampler.lookup_tokens, sampler.lookup_max_ngram) if sampler.lookup_tokens else None

    def run(prompts: list[list[int]]) -> list[Run]:
        gens = [torch.Generator(device=base.device).manual_seed(seed + i) for i in range(len(prompts))]
        r = generate(base, prompts, drafter, sampler, generator=gens, engine=engine, lookup_counts=counts)
        # a batch shares its wall time: each row is charged the whole of it, so tok/s per row is per-stream speed
        return [
            Run(r.tokens[b, : r.num_generated[b]].tolist(), r.total_s, r.accepted[b], r.drafted[b], r.ttft_s,
                sum(r.step_draft_s) / len(prompts), sum(r.step_verify_s) / len(prompts), len(r.accepted[b]))
            for b in range(len(prompts))
        ]

    return run


def _hf(base: Base, sampler: SamplerConfig, extra: dict, count_rounds: bool = False) -> Callable:
    """HF `generate` with `extra` (an assistant, prompt lookup, ...). count_rounds: each Run also says how many
    forwards of the base it took (a hook outside the timing's arithmetic: one counter increment per forward)."""
    eos = base.config.eos_token_id if sampler.eos_token_id is None else sampler.eos_token_id
    sampling = {"do_sample": True, "temperature": sampler.temperature, "top_p": sampler.top_p,
                "top_k": sampler.top_k or None} if sampler.temperature > 0 else {"do_sample": False}

    def run(prompts: list[list[int]]) -> list[Run]:
        out = []
        with _counting_forwards(base.model if count_rounds else None) as forwards:
            for p in prompts:  # HF assisted generation is batch 1
                ids = torch.tensor([p], device=base.device)
                before = forwards[0]
                t0 = _sync_time(base.device)
                seq = base.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=sampler.max_new_tokens, eos_token_id=eos,
                                          pad_token_id=base.tokenizer.pad_token_id or 0, **sampling, **extra)
                out.append(Run(_cut_at_eos(seq[0, len(p):].tolist(), eos), _sync_time(base.device) - t0,
                               peer_rounds=forwards[0] - before))
        return out

    return run


@contextmanager
def _counting_forwards(model: torch.nn.Module | None):
    """Yields [n]: how many times `model`'s forward has run inside the block (stays 0 for None)."""
    n = [0]
    hook = model.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1)) if model is not None else None
    try:
        yield n
    finally:
        if hook is not None:
            hook.remove()


def _llama_cpp_method(cfg: DictConfig, base: Base, sampler: SamplerConfig, peer: str, servers: ExitStack,
                      drafters: dict[str, Drafter]) -> Method:
    """A llama.cpp peer: its server on the base's GGUF (the embedded base's own file unless llama_cpp.gguf names
    one), our threads, plain (`llama_cpp`), with its n-gram speculation (`llama_cpp_lookup`) or with a GGUF draft
    model (`llama_cpp_draft`: llama_cpp.draft_gguf, else the first evaluated drafter that has a GGUF form, exported
    into this run's folder, so that llama.cpp drafts with the very model our sampler runs). Started here, outside
    every timing; `servers` stops it."""
    lc = cfg.llama_cpp
    base_file = lc.gguf or (smollm2_gguf_path() if base.name == SMOLLM2 else None)
    if base_file is None:
        raise ValueError(f"peer {peer} needs the base as a GGUF file: llama_cpp.gguf=<file> (convert it with llama.cpp's "
                         f"convert_hf_to_gguf.py, in .peers/llama.cpp after `make peers`)")
    args = list(lc.args)
    if peer == "llama_cpp_lookup":
        args += list(lc.lookup_args)
    elif peer == "llama_cpp_draft":
        draft = lc.draft_gguf or _export_gguf(drafters, Path(cfg.paths.output_dir) / "draft_gguf")
        if draft is None:
            raise ValueError("peer llama_cpp_draft needs a drafter as GGUF: a draft_model or eagle3 drafter in drafters=, "
                             "or llama_cpp.draft_gguf=<file or export dir> (python -m specdec.export <dir> --to gguf)")
        args += [*gguf.server_args(draft), *lc.draft_args]  # (an EAGLE-3 file: its speculation type)
    server = servers.enter_context(llama_cpp.LlamaServer(base_file, torch.get_num_threads(), args, ctx=lc.ctx))
    eos = base.config.eos_token_id if sampler.eos_token_id is None else sampler.eos_token_id

    def run(prompts: list[list[int]]) -> list[Run]:
        out = []
        for i, p in enumerate(prompts):
            c = server.complete(p, sampler.max_new_tokens, sampler.temperature, sampler.top_p, sampler.top_k,
                                seed=cfg.seed + i)
            # llama.cpp's speculation reports what it drafted and accepted per answer, not per round
            out.append(Run(_cut_at_eos(c.tokens, eos), c.seconds, ttft_s=c.prompt_ms / 1e3,
                           peer_drafted=c.drafted, peer_accepted=c.accepted))
        return out

    # Its greedy tokens are its own model's: weights in Q4_1 as ours, but activations rounded to 8 bits before every
    # product (ggml's q8_1 dot products), so they part from float32's where two logits are near.
    return Method(peer, run, True, peer=True, computes="llama.cpp's own: 8-bit activations")


def _export_gguf(drafters: dict[str, Drafter], out: Path) -> Path | None:
    """The first drafter with a GGUF form, written by llama.cpp's converter into `out`; None if none has one."""
    for name, d in drafters.items():
        if "gguf" in formats_of(d):
            print(f"[specdec] llama_cpp_draft: {name} as GGUF -> {out}")
            return export(d, "gguf", out, source=name)
    return None


def _take_turns(base: Base, items: list[dict], methods: list[Method], runs: dict[str, list[list[Run]]],
                saved: Callable[[Method], None], after_turn: Callable[[], None] | None = None) -> None:
    """Run every method on every prompt it has not answered yet (runs[name] holds the answered ones, in order),
    taking turns: each method answers its next chunk of prompts before any method answers a later one, the order of
    our methods rotating from turn to turn. On a noisy machine a slow phase then falls on all methods alike, not on
    whichever method's block of prompts it hits (one that slowed our AR loop on 4 of 10 prompts made every drafter
    read ~30 % faster against it). The HF peers go last in every turn, so that whatever state their long runs leave
    the machine in falls on each of our methods in turn. Rotated with ours, HF `generate` was followed by our AR loop
    in nearly every turn, and on a 2-core Zen 5 EPYC make demo's Hydra heads read 1.13-1.16× our AR loop with it in
    the run (3 runs; v(2) 1.15-1.19) against 1.19-1.23× with it last (2 runs; v(2) 1.06-1.08) and without it (5 runs;
    v(2) 1.04-1.07): the cause unknown, the bias plain. `saved(m)` follows each chunk,
    `after_turn()` each turn."""
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
    if not cfg.overwrite and path.exists() and json.loads(path.read_text()).get("config") == _same(config):
        return json.loads(path.read_text())["reference"]
    ref = Method("reference", _hf(base, sampler, {}), True, peer=True)
    print(f"[specdec] reference greedy decode of {len(prompts)} prompts (HF generate, float32, untimed)")
    done = {"source": "HF generate, float32, unpatched (untimed)",
            "tokens": [[r.tokens for r in p] for p in _answer_turn_by_turn(base, ref, prompts)]}
    write_json(path, {"config": _same(config), "reference": done})
    return done


# -- report ----------------------------------------------------------------------------------------
def _tabulate(cfg, base, items, methods, runs, sampler, metas, costs: dict[int, float], reference: dict | None = None,
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
            ar_step = _per_round(ar_flat) / t1
            overhead = _per_round(flat) / t1 - v - g_mean * c
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
                "measured_speedup_decode": _decode_s_per_token(ar_flat) / _decode_s_per_token(flat),
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
        "drafters": {n: m.get("base_name") for n, m in metas.items()},
    }
    return {"header": header, "categories": categories, "rows": rows}


def render_markdown(report: dict, config_yaml: str) -> str:
    h, cats = report["header"], report["categories"]
    lines = ["# specdec evaluation", "", "```yaml", config_yaml.rstrip(), "```", ""]
    lines += [f"- **{k}**: {v}" for k, v in h.items() if k != "drafters"]
    cat_cols = [f"{c} ×AR" for c in cats] if len(cats) > 1 else []
    best = h.get("best_ar", AR)
    hf = any(r["method"] == "hf_generate" for r in report["rows"])  # its column only where it ran
    lines += ["", f"| method | lossless | τ | draft len | α | tok/s | speedup vs AR (ours) | speedup vs best AR ({best}) "
              + ("| speedup vs HF generate " if hf else "") + "| greedy-identical |" + "".join(f" {c} |" for c in cat_cols),
              "|---" * (9 + hf + len(cat_cols)) + "|"]
    for r in report["rows"]:
        cells = [r["method"], "yes" if r["lossless"] else "**no (lossy)**", _f(r["tau"]), _f(r.get("draft_len")),
                 _f(r["alpha"]),
                 _f(r["tok_per_s"], 1), _f(r["speedup_vs_ar"]) + "×" + _pm(r.get("speedup_vs_ar_sd")),
                 _f(r.get("speedup_vs_best_ar", r["speedup_vs_ar"])) + "×" + _pm(r.get("speedup_vs_best_ar_sd"))]
        cells += [_f(r["speedup_vs_hf"]) + "×" + _pm(r.get("speedup_vs_hf_sd"))] if hf else []
        cells += [_identity_cell(r)]
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


def _write(out_dir: Path, cfg: DictConfig, report: dict, methods: list[Method]) -> None:
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


# -- small helpers ---------------------------------------------------------------------------------
def _cut_at_eos(tokens: list[int], eos) -> list[int]:
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]  # EOS counts as a generated token, as in our sampler
    return tokens


def _unique(name: str, taken: dict) -> str:
    return name if name not in taken else f"{name}#{len(taken)}"


def drafter_names(paths: list[str]) -> dict[str, str]:
    """Method names from the drafter classes (medusa, prophet, ...), numbered when a class repeats."""
    names: dict[str, str] = {}
    for p in paths:
        meta = describe(p)
        name = meta["target"].rsplit(".", 1)[-1].lower() + (f" ({meta['format']})" if "format" in meta else "")
        names[_unique(name, names)] = p
    return names


def _method_path(out_dir: Path, name: str) -> Path:
    return out_dir / "methods" / (re.sub(r"[^\w.-]+", "_", name) + ".json")


def _decode_s(runs: list[Run]) -> float:
    """Seconds after the first token (the prefill's), summed over runs of our sampler."""
    return sum(r.seconds - r.ttft_s for r in runs)


def _per_round(runs: list[Run]) -> float:
    """Seconds per decode round after the first token."""
    return _decode_s(runs) / max(sum(r.rounds for r in runs), 1)


def _decode_s_per_token(runs: list[Run]) -> float:
    """Seconds per token after the first."""
    return _decode_s(runs) / max(sum(len(r.tokens) - 1 for r in runs), 1)


def _same(config: dict) -> dict:
    """The parts of an evaluation config that decide its numbers (not `paths`, where the project sits: the drafters
    and prompts it reads are compared resolved)."""
    return {k: v for k, v in config.items() if k not in ("overwrite", "wandb", "tags", "paths")}


def _save_method(out_dir: Path, name: str, config: dict, runs: list[list[Run]]) -> None:
    _method_path(out_dir, name).parent.mkdir(parents=True, exist_ok=True)
    write_json(_method_path(out_dir, name), {"config": _same(config),
                                             "runs": [[asdict(r) for r in turns] for turns in runs]})


def _load_method(out_dir: Path, name: str, config: dict, runs: dict[str, list[list[Run]]]) -> bool:
    """Fill runs[name] with the prompts (in order) an earlier, interrupted evaluation of the same config answered;
    False if there is none."""
    path = _method_path(out_dir, name)
    if not path.exists():
        return False
    saved = json.loads(path.read_text())
    if saved["config"] != _same(config):
        return False
    runs[name] = [[Run(**r) for r in turns] for turns in saved["runs"]]
    return True


def _earlier_report(out_dir: Path, config: dict, overwrite: bool) -> dict | None:
    """A run dir with a report is never overwritten silently: the same config returns the earlier report (a rerun
    of a table re-measures nothing), another config is refused unless overwrite=true."""
    path = out_dir / "results.json"
    if overwrite or not path.exists():
        return None
    report = json.loads(path.read_text())
    if _same(report.get("config", {})) == _same(config):
        print(f"[specdec] {out_dir} already holds this evaluation; its report is returned (overwrite=true re-measures)")
        return report
    raise FileExistsError(f"{out_dir} already holds a report of another config; pick another hydra.run.dir or set "
                          f"overwrite=true")


def _sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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


def _identity_cell(r: dict) -> str:
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
