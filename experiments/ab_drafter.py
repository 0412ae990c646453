"""A/B a drafter family's code against another git revision of it, or a sampler setting against the default, in one
process: the same trained drafter (same weights) runs through its class as it is now (A) and as it was at REV, or with
the sampler setting KEY=VALUE (B), interleaved with our AR loop on the same HumanEval prompts, so a change meant to make
drafting cheaper is measured as a ratio on one machine state.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_drafter.py logs/recipe/prophet_fused/drafter --rev HEAD~1 --gamma 1
    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_drafter.py logs/recipe/prophet_fused/drafter --set draft_precision=fp32
    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_drafter.py DRAFTER --with draft_precision=q4a8 --gamma 4 \
        --set gamma=1 --set adaptive_threshold=0.5

--with KEY=VALUE applies to every variant (the one as it is now included); each --set is one more variant.

Prints, per variant: tok/s (and × our AR), τ, drafting and verify time per round, and whether every output equals
our AR loop's (greedy: whatever either revision drafts, a lossless round emits the base's own tokens)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.base import load_base  # noqa: E402
from specdec.checkpoint import load_drafter  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.engines import EngineConfig, build  # noqa: E402
from specdec.engines.measure import cpu_model  # noqa: E402
from specdec.sampling.cost import wall_clock  # noqa: E402
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402


def class_at(cls: type, rev: str) -> type:
    """`cls` as its module defined it at git revision `rev` (the module's source at rev, imported apart)."""
    path = Path(inspect.getfile(cls)).resolve().relative_to(ROOT)
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return class_from(cls, source, rev.replace("~", "_"))


def class_from(cls: type, source: str, tag: str) -> type:
    """`cls` as the module source `source` defines it, imported apart under the name <its module>_at_<tag>."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"{cls.__module__}_at_{tag}", f.name)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        Path(f.name).unlink()
    return getattr(module, cls.__name__)


def configured(cfg: SamplerConfig, engine: EngineConfig, setting: str) -> tuple[SamplerConfig, EngineConfig]:
    """KEY=VALUE applied to whichever of the two configs has the field KEY."""
    key, _, value = setting.partition("=")
    value = yaml.safe_load(value)
    if key in {f.name for f in fields(EngineConfig)}:
        return cfg, replace(engine, **{key: value})
    return replace(cfg, **{key: value}), engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", help="a trained drafter's directory")
    ap.add_argument("--rev", help="a git revision of the drafter's module to compare against")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a SamplerConfig or EngineConfig setting to compare against the default (repeatable)")
    ap.add_argument("--with", dest="common", action="append", default=[], metavar="KEY=VALUE",
                    help="a SamplerConfig or EngineConfig setting for every variant (repeatable)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=2, help="interleaved passes over the prompts")
    args = ap.parse_args()

    base = load_base()
    drafter = load_drafter(args.drafter, base)
    if not args.rev and not args.set:
        ap.error("give --rev and/or --set: what to compare the code as it is now against")
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": p["turns"][0]}])
               for p in humaneval(limit=args.prompts, split="tune")]  # settings are chosen on the tuning split
    cfg, engine = SamplerConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma), EngineConfig()
    for setting in args.common:
        cfg, engine = configured(cfg, engine, setting)
    # name -> (the drafter's class, the sampler settings, the engine)
    variants = {"now": (type(drafter), cfg, build(engine, base.device))}
    if args.rev:
        variants[f"@ {args.rev}"] = (class_at(type(drafter), args.rev), cfg, variants["now"][2])
    for setting in args.set:
        vcfg, veng = configured(cfg, engine, setting)
        variants[setting] = (type(drafter), vcfg, variants["now"][2] if veng == engine else build(veng, base.device))
    for _, vcfg, veng in variants.values():
        generate(base, prompts[:1], drafter, vcfg, engine=veng)  # warm-up: kernel table, lean layers, native build
    totals = {name: {"tokens": 0, "rounds": 0, "s": 0.0, "draft_s": 0.0, "verify_s": 0.0} for name in ["ar", *variants]}
    outputs: dict[str, list[list[int]]] = {name: [] for name in totals}
    for _ in range(args.passes):
        for name in totals:
            vcfg, veng = cfg, variants["now"][2]
            if name != "ar":
                cls, vcfg, veng = variants[name]
                drafter.__class__ = cls  # the same weights through that revision's code
            for prompt in prompts:
                t = wall_clock(base.device)
                r = generate(base, [prompt], None if name == "ar" else drafter, vcfg, engine=veng)
                tot = totals[name]
                tot["s"] += wall_clock(base.device) - t
                tot["tokens"] += r.num_generated[0]
                tot["rounds"] += len(r.step_verify_s)
                tot["draft_s"] += sum(r.step_draft_s)
                tot["verify_s"] += sum(r.step_verify_s)
                outputs[name].append(r.tokens[0, : r.num_generated[0]].tolist())
    print(f"{args.drafter}, chain γ={args.gamma}{''.join(', ' + c for c in args.common)}, {args.prompts} HumanEval prompts × {args.max_new_tokens} tokens, "
          f"{args.passes} passes · " + (torch.cuda.get_device_name(base.device) if base.device.type == "cuda" else
                                          f"cpu {cpu_model()}, {torch.get_num_threads()} threads") + "\n")
    print("| variant | tok/s | × AR (ours) | τ | draft ms / round | verify ms / round | output = AR's |")
    print("|---|---|---|---|---|---|---|")
    ar_rate = totals["ar"]["tokens"] / totals["ar"]["s"]
    for name, tot in totals.items():
        rate = tot["tokens"] / tot["s"]
        print(f"| {name if name == 'ar' else f'{type(drafter).__name__} {name}'} | {rate:.1f} | {rate / ar_rate:.3f} | "
              f"{tot['tokens'] / tot['rounds']:.2f} | {tot['draft_s'] / tot['rounds'] * 1e3:.2f} | "
              f"{tot['verify_s'] / tot['rounds'] * 1e3:.2f} | {'yes' if outputs[name] == outputs['ar'] else 'NO'} |")


if __name__ == "__main__":
    main()
