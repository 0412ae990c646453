"""The methods an evaluation times, each a Method that answers a batch of prompts: our sampler (the AR loop, each
drafter alone and with n-gram lookup rounds, lookup alone) and the peers on the same base: HF `generate` (plain, its
prompt lookup, its early-exit and assisted generation) and llama.cpp's server on the same GGUF file."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig

from specdec.base import SMOLLM2, Base, smollm2_gguf_path
from specdec.drafters.drafter import Drafter
from specdec.evaluation.runs import AR, LOOKUP, Method, Run, cut_at_eos, sync_time
from specdec.export import export, formats_of, gguf
from specdec.peers import llama_cpp
from specdec.sampling.decode import SamplerConfig, generate
from specdec.sampling.engine import Engine
from specdec.sampling.lookup import fresh_counts

HF_PEERS = ("hf_generate", "hf_prompt_lookup", "hf_early_exit", "hf_assisted")
LLAMA_CPP_PEERS = ("llama_cpp", "llama_cpp_lookup", "llama_cpp_draft")


def build_methods(cfg: DictConfig, base: Base, drafters: dict[str, Drafter], sampler: SamplerConfig,
                  engine: Engine, servers: ExitStack) -> list[Method]:
    ar_cfg = replace(sampler, tree="chain", lookup_tokens=0)
    methods = [Method(AR, ours(base, None, ar_cfg, cfg.seed, engine), True, batch=cfg.batch_size)]
    # With n-gram lookup on (sampler.lookup_tokens), each drafter runs with and without it, and lookup alone is a
    # method of its own: what the trained drafter adds to free lookup, and the reverse, side by side.
    plain = replace(sampler, lookup_tokens=0)
    for name, d in drafters.items():
        gamma = sampler.gamma if sampler.tree == "chain" else None
        methods.append(Method(name, ours(base, d, plain, cfg.seed, engine), sampler.lossless, gamma, cfg.batch_size))
        if sampler.lookup_tokens:
            methods.append(Method(f"{name}+lookup", ours(base, d, sampler, cfg.seed, engine), sampler.lossless,
                                  batch=cfg.batch_size))
    if sampler.lookup_tokens:
        methods.append(Method(LOOKUP, ours(base, None, sampler, cfg.seed, engine), sampler.lossless,
                              batch=cfg.batch_size))
    hf_settings = {
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
        extra = _assistant(drafters, cfg.hf.get("assisted_tokens")) if peer == "hf_assisted" else hf_settings[peer]
        # HF's speculation reports no rounds; its base forwards are them (early exit drafts with the base itself)
        methods.append(Method(peer, hf(base, sampler, extra, count_rounds=peer != "hf_early_exit"), True, peer=True))
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


def ours(base: Base, drafter: Drafter | None, sampler: SamplerConfig, seed: int, engine: Engine) -> Callable:
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


def hf(base: Base, sampler: SamplerConfig, extra: dict, count_rounds: bool = False) -> Callable:
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
                t0 = sync_time(base.device)
                seq = base.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=sampler.max_new_tokens, eos_token_id=eos,
                                          pad_token_id=base.tokenizer.pad_token_id or 0, **sampling, **extra)
                out.append(Run(cut_at_eos(seq[0, len(p):].tolist(), eos), sync_time(base.device) - t0,
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
            out.append(Run(cut_at_eos(c.tokens, eos), c.seconds, ttft_s=c.prompt_ms / 1e3,
                           peer_drafted=c.drafted, peer_accepted=c.accepted))
        return out

    # Its greedy tokens are its own model's: weights in Q4_1 as ours, but activations rounded to 8 bits before every
    # product (ggml's q8_1 dot products), so they part from float32's where two logits are near. Its speculation
    # (lookup, a draft model) is its own code: whether it keeps llama.cpp's plain answers is not checked here, so its
    # row claims no losslessness (None); the identity column still says how many answers match the reference.
    lossless = True if peer == "llama_cpp" else None
    return Method(peer, run, lossless, peer=True, computes="llama.cpp's own: 8-bit activations")


def _export_gguf(drafters: dict[str, Drafter], out: Path) -> Path | None:
    """The first drafter with a GGUF form, written by llama.cpp's converter into `out`; None if none has one."""
    for name, d in drafters.items():
        if "gguf" in formats_of(d):
            print(f"[specdec] llama_cpp_draft: {name} as GGUF -> {out}")
            return export(d, "gguf", out, source=name)
    return None
