"""The cost model of this machine, in one run (docs/sampler.md §8): plain AR decoding in our loop (measured kernels and
native layers, the lean layers in PyTorch ops, PyTorch's stock kernels, and each decoder layer's own HF forward
instead of the lean one) vs HF `generate`; the
verify-cost curve v(n) = T_n / T_1 for n = 1..32; where a forward's time goes at each n (the products alone against
their roofline, and the rest); and the memory-bandwidth and compute roofs of this machine.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_ar.py            # what `make bench` runs
    .venv/bin/python experiments/bench_ar.py --prompts 2 --max-new-tokens 32   # quick look (< 5 min)
    python experiments/bench_ar.py --device cuda                              # the same on a GPU (bench_cuda/)

SmolLM2-135M (fp32, sdpa), HumanEval prompts rendered with the base's chat template, T = 0, batch 1. Each
prompt is decoded by every method (order rotating), after one warm-up of each that is not timed; the
speedup is mean tok/s ours / mean tok/s HF (docs/sampler.md §4) and the pooled ratio Σtok/Σt. Writes
experiments/results/bench/bench.{json,md,png}."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base, smollm2_gguf_path  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.engines import EngineConfig, build  # noqa: E402
from specdec.engines.cpu import (  # noqa: E402
    compact,  # noqa: E402
    native,
    native_layer,
)
from specdec.engines.cpu.kernels import default_table, measured_kernels  # noqa: E402
from specdec.engines.cuda import fused as cuda_fused  # noqa: E402
from specdec.engines.cuda import kernels as cuda_kernels  # noqa: E402
from specdec.engines.cuda.graphs import pools as graph_pools  # noqa: E402
from specdec.engines.eager.engine import EagerEngine  # noqa: E402
from specdec.engines.eager.lean import decode_linears, lean_layers  # noqa: E402
from specdec.engines.measure import machine_key  # noqa: E402
from specdec.peers import llama_cpp  # noqa: E402
from specdec.sampling.context import SamplingContext  # noqa: E402
from specdec.sampling.cost import forward_costs  # noqa: E402
from specdec.sampling.cost import wall_clock as sync
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise")


def verify_curve(costs: dict[int, float]) -> dict[int, float]:
    """v(n) = T_n / T_1."""
    return {n: t / costs[1] for n, t in costs.items()}


def run_ours(base, prompt: list[int], max_new: int, **settings) -> tuple[int, float, float]:
    """(tokens, total s, decode s) on the engine EngineConfig(**settings) names: decode = after the prefill and its
    first token, the part the bandwidth bound is about (llama.cpp's bench reports the two apart too, as pp and tg)."""
    r = generate(base, [prompt], None, SamplerConfig(max_new_tokens=max_new, eos_token_id=[]),
                 engine=build(EngineConfig(**settings), base.device))
    return r.num_generated[0], r.total_s, r.decode_s


def llama_cpp_runner(server):
    """(tokens, total s, decode s) of llama.cpp's server on the same prompt token ids: decode = after its prompt
    pass, which yields the first token, as ours is counted."""
    def run(base, prompt: list[int], max_new: int) -> tuple[int, float, float]:
        c = server.complete(prompt, max_new, ignore_eos=True)
        return len(c.tokens), c.seconds, max(c.seconds - c.prompt_ms / 1e3, 1e-9)
    return run


def run_hf(base, prompt: list[int], max_new: int) -> tuple[int, float, float]:
    """generate() does not report its prefill, so it is timed apart, as a 1-token generate of the same prompt."""
    ids = torch.tensor([prompt], device=base.device)

    def timed(n: int) -> tuple[int, float]:
        t0 = sync(ids.device)
        out = base.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=base.tokenizer.eos_token_id)
        return out.shape[1] - ids.shape[1], sync(ids.device) - t0

    first_s = timed(1)[1]
    n, total_s = timed(max_new)
    return n, total_s, max(total_s - first_s, 1e-9)


@torch.no_grad()
def diverges(base, prompt: list[int], ours: list[int], hf: list[int]) -> dict:
    """Where a path's greedy tokens leave HF generate's, and by how much HF's own forward prefers its token there: a
    float32 near-tie (a gap of ~1e-5 of a logit, summation order) reads differently from a wrong forward."""
    at = next(j for j, (a, b) in enumerate(zip(ours + [-1], hf + [-1])) if a != b)
    if at >= min(len(ours), len(hf)):
        return {"at": at, "ours": None, "hf": None, "logit_gap": float("nan")}
    logits = base.model(torch.tensor([prompt + hf[:at]], device=base.device)).logits[0, -1].float()
    return {"at": at, "ours": ours[at], "hf": hf[at], "logit_gap": float(logits[hf[at]] - logits[ours[at]])}


def read_bandwidth(device: torch.device, gib: float = 0.5, reps: int = 5) -> float:
    """Bytes/s of a streaming read of a buffer far larger than the caches, on all threads (filled first, so the
    pages are real memory and not the shared zero page)."""
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = sync(device)
        x.sum()
        best = min(best, sync(device) - t0)
    return x.numel() * 4 / best


@torch.no_grad()
def gemm_flops(device: torch.device, size: int = 2048, reps: int = 5) -> float:
    """FLOP/s of a large fp32 matrix product on all threads (or the GPU): the compute roof of this machine."""
    size = size if device.type == "cpu" else 8192  # a 2048² product leaves most of a GPU idle
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = sync(device)
        a @ b
        best = min(best, sync(device) - t0)
    return 2 * size**3 / best


@torch.no_grad()
def gemm_curve(base, ns: list[int], reps: int = 5) -> dict[int, float]:
    """Seconds of the products alone of one forward over n rows: every linear the decode forward multiplies with
    (fused q|k|v and gate|up, lm_head), in call order, through the measured kernels; best of `reps` passes."""
    with measured_kernels(base):
        linears = decode_linears(base)
        out = {}
        for n in ns:
            xs = {lin.in_features: torch.randn(n, lin.in_features, device=base.device) for lin in linears}
            best = float("inf")
            for _ in range(reps + 1):  # the first pass warms up
                t0 = sync(base.device)
                for lin in linears:
                    lin(xs[lin.in_features])
                best = min(best, sync(base.device) - t0)
            out[n] = best
    return out


def step_split(base, prompt: list[int], steps: int = 10) -> dict[str, float]:
    """Milliseconds per AR step (one token through the base + lm_head, measured kernels, the lean layers in PyTorch
    ops: a native layer is one opaque call to the profiler) in GEMM ops vs the rest, from torch.profiler's self CPU
    time."""
    from torch.profiler import profile

    with measured_kernels(base, native_layers=False):
        ctx = SamplingContext(base, 1, len(prompt) + steps + 8, EagerEngine())
        ctx.commit_layout(len(prompt))
        ctx.base_forward(torch.tensor([prompt]))
        ctx.commit(torch.tensor([len(prompt)]), [len(prompt)])
        tok = torch.tensor([[prompt[-1]]])

        def step():
            ctx.tree_layout(torch.arange(1), torch.arange(1), torch.ones(1, 1, dtype=torch.bool))
            hidden, _ = ctx.base_forward(tok)
            base.lm_head(hidden)

        for _ in range(3):
            step()
        with profile() as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / steps / 1e3
    return {"step_ms_profiled": round(wall * 1e3, 2), "gemm_ms": round(gemm, 2), "other_ms": round(total - gemm, 2),
            "gemm_share": round(gemm / total, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=32, help="verify-cost curve for n = 1..max_n")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: the same cost model on a GPU")
    ap.add_argument("--out", default=None, help="default experiments/results/bench (bench_cuda on a GPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_base(dtype="float32", device=args.device)
    dev = base.device
    cuda = dev.type == "cuda"  # CUDA: graphs vs op by op; CPU: native layers, lean layers, stock kernels
    args.out = args.out or ("experiments/results/bench" if dev.type == "cpu" else "experiments/results/bench_cuda")
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": it["turns"][0]}])
               for it in humaneval(args.prompts, split="report")]
    command = (f"OMP_NUM_THREADS={args.threads} .venv/bin/python experiments/bench_ar.py --prompts {args.prompts} "
               f"--max-new-tokens {args.max_new_tokens} --threads {args.threads}"
               + (f" --device {args.device}" if dev.type != "cpu" else ""))

    # Same greedy tokens from every path (a correctness check that costs nothing here).
    def tokens(**kw) -> list[int]:
        return generate(base, [prompts[0]], None, SamplerConfig(max_new_tokens=16, eos_token_id=[]),
                        engine=build(EngineConfig(**kw), dev)).tokens[0]

    t0 = time.perf_counter()
    ours_toks = tokens()
    kernel_setup_s = time.perf_counter() - t0  # includes measuring the kernels on a machine seen for the first time
    ids0 = torch.tensor([prompts[0]], device=dev)  # called as run_hf and evaluate.py call it
    hf_toks = base.model.generate(ids0, attention_mask=torch.ones_like(ids0), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=base.tokenizer.eos_token_id)[0, len(prompts[0]):]
    variants = ({"eager": {"cuda_graphs": False}, "unfused": {"cuda_kernels": "unfused"},  # name -> settings
                 "cublas": {"cuda_kernels": "stock"}} if cuda else
                {"float32": {"compact_weights": False}, "logits": {"greedy_shortlist": False},
                 "lean": {"native_layers": False}, "stock": {"cpu_kernels": "stock"}})
    variants["hf_layers"] = {"lean": False}
    hf_list = hf_toks.cpu().tolist()
    paths = {"measured_kernels" if not cuda else "cuda_graphs": ours_toks.tolist()}
    paths |= {"lean_layers" if name == "lean" else name: tokens(**kw).tolist() for name, kw in variants.items()}
    identical = {name: toks == hf_list for name, toks in paths.items()}
    divergence = {name: diverges(base, prompts[0], toks, hf_list) for name, toks in paths.items() if toks != hf_list}
    run_ours(base, prompts[0], 8), run_hf(base, prompts[0], 8)  # warm-up, not timed

    runners = {"ours": run_ours, "hf": run_hf}
    runners |= {f"ours_{name}": (lambda kw: lambda *a: run_ours(*a, **kw))(kw) for name, kw in variants.items()}
    # llama.cpp on the same GGUF and threads, where `make peers` built it: its server in the same rotation, and
    # llama-bench's own pp and tg (at the prompts' mean length as depth) for the wrapper check
    peer = llama_cpp.available() is None and not cuda and base.name == "smollm2_135m"
    with ExitStack() as stack:
        if peer:
            server = stack.enter_context(llama_cpp.LlamaServer(smollm2_gguf_path(), torch.get_num_threads()))
            runners["llama_cpp"] = llama_cpp_runner(server)
            runners["llama_cpp"](base, prompts[0], 8)  # warm-up, not timed
        rows = {name: [] for name in runners}
        for i, p in enumerate(prompts):
            names = list(runners)
            k = i % len(names)
            for name in names[k:] + names[:k]:  # rotate the order: drift on a noisy machine hits all alike
                rows[name].append(runners[name](base, p, args.max_new_tokens))
    depth = round(sum(map(len, prompts)) / len(prompts))
    llama_bench = llama_cpp.bench(smollm2_gguf_path(), torch.get_num_threads(), prompt=depth,
                                  tokens=args.max_new_tokens, depth=depth) if peer else None

    def stats(r):
        return sum(n / t for n, t, _ in r) / len(r), sum(n for n, _, _ in r) / sum(t for _, t, _ in r)

    def decode_rate(r):  # mean over prompts of the tokens after the first, per second after the first
        return sum((n - 1) / d for n, _, d in r) / len(r)

    (ours_mean, ours_pool), (hf_mean, hf_pool) = stats(rows["ours"]), stats(rows["hf"])
    ours_decode, hf_decode = decode_rate(rows["ours"]), decode_rate(rows["hf"])

    def prefill_rate(r):  # mean over prompts of prompt tokens per second of the prompt pass (with its first token)
        return sum(len(p) / (t - d) for p, (_, t, d) in zip(prompts, r)) / len(r)

    ns = list(range(1, args.max_n + 1))
    costs = forward_costs(base, ns, prompt_len=len(prompts[0]), engine=build(EngineConfig(), dev),
                          greedy=True)  # T = 0, as ours decodes
    variant_costs = {name: forward_costs(base, ns, prompt_len=len(prompts[0]), engine=build(EngineConfig(**kw), dev))
                     for name, kw in variants.items()}
    curve = verify_curve(costs)
    recorded = graph_pools(base)  # CUDA graphs recorded in this run (by every decode and curve above)
    gpu_table = cuda_kernels.default_table(dev) if cuda else None  # what cuda_kernels=measured chose (and its time)
    split = step_split(base, prompts[0]) if dev.type == "cpu" else None  # CPU time says little of a GPU's step
    bandwidth = read_bandwidth(dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters())  # tied weights once
    bound = bandwidth / weight_bytes
    # what a step of our loop streams where the weights hold exact compact forms (compact.py): each product's form
    streamed = streamed_bytes(base) if dev.type == "cpu" else weight_bytes
    # Where v(n) comes from: the products alone at n rows against their roofline, max(stream the weights once,
    # 2·n·(weights) flops at the compute roof); the rest of T_n is attention, norms, rotary and dispatch.
    # The compute roof: PyTorch's large product, or this CPU's FMA throughput where that is higher (MKL need not use
    # the CPU's widest vectors: on a Zen 5 EPYC 218 GFLOP/s against ~510)
    gemm_peak = gemm_flops(dev)
    fma = native.fma_peak(torch.get_num_threads()) if dev.type == "cpu" and native.available() else 0.0
    flops = max(gemm_peak, fma)
    gemm = gemm_curve(base, ns)
    roof = {n: max(streamed / bandwidth, 2 * n * weight_bytes / 4 / flops) for n in ns}

    report = {
        "cpu": machine_key(), "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "platform": platform.platform(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "base": base.name, "dtype": "float32",
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "greedy_identical": identical,
        "greedy_divergence": divergence,
        "ar_tok_s": round(ours_mean, 2),
        **{f"ar_{name}_tok_s": round(stats(rows[f"ours_{name}"])[0], 2) for name in variants},
        "hf_generate_tok_s": round(hf_mean, 2),
        "ar_pooled_tok_s": round(ours_pool, 2), "hf_generate_pooled_tok_s": round(hf_pool, 2),
        "ar_vs_hf_generate": round(ours_mean / hf_mean, 3),
        "ar_decode_tok_s": round(ours_decode, 2), "hf_generate_decode_tok_s": round(hf_decode, 2),
        "ar_decode_vs_hf_generate": round(ours_decode / hf_decode, 3),
        "ar_prefill_tok_s": round(prefill_rate(rows["ours"]), 1),
        **({"llama_cpp": {
            "tok_s": round(stats(rows["llama_cpp"])[0], 2), "decode_tok_s": round(decode_rate(rows["llama_cpp"]), 2),
            "prefill_tok_s": round(prefill_rate(rows["llama_cpp"]), 1),
            "ar_vs_llama_cpp": round(ours_mean / stats(rows["llama_cpp"])[0], 3),
            "ar_decode_vs_llama_cpp": round(ours_decode / decode_rate(rows["llama_cpp"]), 3),
            "ar_prefill_vs_llama_cpp": round(prefill_rate(rows["ours"]) / prefill_rate(rows["llama_cpp"]), 3),
            "llama_bench": llama_bench, "llama_bench_depth": depth,
            # the server peer's decode against llama-bench's tg at the same depth: within 10 % = not handicapped
            "server_vs_llama_bench_decode": round(decode_rate(rows["llama_cpp"]) / llama_bench["decode"], 3),
            "build": llama_cpp.build_flags()}} if peer else {}),
        "t1_ms": round(costs[1] * 1e3, 2),
        **{f"t1_{name}_ms": round(c[1] * 1e3, 2) for name, c in variant_costs.items()},
        "verify_cost": {n: round(v, 3) for n, v in curve.items()},
        **{f"verify_cost_{name}": {n: round(v, 3) for n, v in verify_curve(c).items()}
           for name, c in variant_costs.items()},
        "cuda_graphs": {"recorded": sum(p.captures for p in recorded),
                        "record_s": round(sum(p.capture_s for p in recorded), 2)} if cuda else None,
        "step_split": split,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "weight_bytes": weight_bytes,
        "bandwidth_bound_tok_s": round(bound, 2), "ar_share_of_bound": round(ours_mean / bound, 3),
        "streamed_bytes": streamed, "streamed_bound_tok_s": round(bandwidth / streamed, 2),
        "ar_decode_share_of_streamed_bound": round(ours_decode * streamed / bandwidth, 3),
        "ar_decode_share_of_bound": round(ours_decode / bound, 3),
        "gemm_gflop_s": round(gemm_peak / 1e9, 1), "fma_peak_gflop_s": round(fma / 1e9, 1),
        "compute_roof_gflop_s": round(flops / 1e9, 1),
        "reassociated_rows": native.reassociated_rows() if native.available() and dev.type == "cpu" else None,
        # how far ahead the compact kernels ask for their codes, per block height (native_layer.tune_prefetch's choice)
        "prefetch_bytes": {h: native.prefetch(h) for h in range(1, native.block_rows() + 1)}
        if dev.type == "cpu" and native.block_rows() else None,
        "gemm_ms": {n: round(t * 1e3, 2) for n, t in gemm.items()},
        "gemm_roofline_ms": {n: round(t * 1e3, 2) for n, t in roof.items()},
        "gemm_roofline_ratio": {n: round(roof[n] / roof[1], 3) for n in ns},
        # the lowest v(n) our loop's own T_1 allows here: the products alone at the roof, nothing else taking time (a
        # faster T_1 only raises it). On a 2-core Zen 5 EPYC, 4.41 ms of FMAs at n = 9 against T_1 = 2.66 ms: 1.66.
        "verify_cost_floor": {n: round(roof[n] / costs[1], 3) for n in ns},
        "rest_ms": {n: round((costs[n] - gemm[n]) * 1e3, 2) for n in ns},
        "kernel_setup_s": round(kernel_setup_s, 1), "kernel_measure_s": round(default_table().measure_s, 1),
        "kernel_check_s": round(default_table().check_s, 2), "kernel_remeasured": default_table().remeasured,
        "native_built": native.available(), "native_build_s": round(native.build_s, 2),
        "kernel_choice": default_table().choice,
        **({"cuda_kernels": {"measure_s": round(gpu_table.measure_s, 1), "choice": gpu_table.choice,
                             "attention": gpu_table.attention, "rope": gpu_table.rope,
                             "fused": gpu_table.fused}} if cuda else {}),
        # the base's 30 layers, one pass each way at n rows (native_layer.measure, as stored with the kernel table)
        "native_layer_ms": native_layers_ms(base),
        "command": command,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    md = render(report)
    (out / "bench.md").write_text(md)
    plot(report, out / "bench.png")
    print(md)


def native_layers_ms(base) -> dict[int, dict[str, float]]:
    """{rows: {"lean": ms, "native": ms, "compact": ms}}: one pass through the base's layer stack each way (the native
    layers over float32 weights and over their exact compact forms), as the sampler measures it to choose
    (native_layer.measure; empty where no native layer is built, e.g. on a GPU or without a compiler)."""
    if base.device.type != "cpu":
        return {}
    with measured_kernels(base, native_layers=False) as table:
        fasts = lean_layers(base)
        ways = {way: list(native_layer.stack(fasts, table, lambda f, form=form: form).values())
                for way, form in (("native", "exact"), ("compact", "compact"))}
        ways = {way: layers for way, layers in ways.items() if layers}
        times = native_layer.measure(ways) if ways else {}
    return {r: {way: round(t * 1e3, 2) for way, t in ways.items()} for r, ways in times.items()}


def streamed_bytes(base) -> int:
    """Bytes of the base's decode products (and lm_head) as our CPU loop holds them: each weight's exact compact form
    where it has one (compact.py), else its float32 copy."""
    weights = [lin.weight for lin in decode_linears(base)]
    return sum(f.nbytes if f is not None else w.numel() * w.element_size()
               for w in weights for f in [compact.form(w)])


def on_cpu(r: dict) -> bool:
    return r.get("device", "cpu") == "cpu"  # reports from before --device have no "device"


# variant -> its label: our loop with one setting changed (report keys ar_<name>_tok_s, t1_<name>_ms and
# verify_cost_<name>)
VARIANTS = {"float32": "compact_weights=false (every weight multiplied from its float32 copy)",
            "logits": "greedy_shortlist=false (the argmax of the lm_head's float32 logits)",
            "lean": "native_layers=false (the lean layers in PyTorch ops)", "stock": "cpu_kernels=stock",
            "eager": "cuda_graphs=false (op by op)", "hf_layers": "lean=false (each layer's HF forward)",
            "unfused": "cuda_kernels=unfused (the measured products and attention, no product fused with the ops "
                       "around it)",
            "cublas": "cuda_kernels=stock (cuBLAS and SDPA throughout, not the measured choice)"}


def spans(by_rows: dict) -> list[tuple[int, int, int]]:
    """{rows: value} (keys ints or, from JSON, strings) -> (first, last, value) over runs of consecutive rows alike."""
    out: list[list[int]] = []
    for rows, value in sorted((int(k), v) for k, v in by_rows.items()):
        if out and out[-1][2] == value and out[-1][1] == rows - 1:
            out[-1][1] = rows
        else:
            out.append([rows, rows, value])
    return [tuple(x) for x in out]


def render(r: dict) -> str:
    where = r["cpu"] if on_cpu(r) else f"{r['device']} (host: {r['cpu']})"
    ours = ("measured kernels, native layers" + (", compact weights" if "ar_float32_tok_s" in r else "")
            + (", argmax shortlist" if "ar_logits_tok_s" in r else "") if on_cpu(r) else "CUDA graphs")
    split = r["step_split"]
    lines = [f"# Cost model: {r['base']} ({r['dtype']}), {where}", "", f"`{r['command']}`", "",
             f"{r['prompts']} HumanEval prompts, {r['max_new_tokens']} new tokens, batch 1, T=0, torch {r['torch']}, "
             f"transformers {r['transformers']}. Greedy tokens identical to HF generate: "
             + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r["greedy_identical"].items()) + "."
             + "".join(f" {k.replace('_', ' ')}: first differs at new token {d['at']} (ours {d['ours']}, HF {d['hf']}; "
                       f"in HF's own forward there, HF's token leads ours by {d['logit_gap']:.2g} in logit)."
                       for k, d in r.get("greedy_divergence", {}).items()), "",
             "| method | tok/s (mean over prompts) | vs HF generate |", "|---|---|---|",
             f"| AR, our sampler ({ours}) | {r['ar_tok_s']:.1f} | {r['ar_vs_hf_generate']:.2f}× |",
             f"| … decode only (after the prefill and first token) | {r['ar_decode_tok_s']:.1f} | "
             f"{r['ar_decode_vs_hf_generate']:.2f}× (HF generate {r['hf_generate_decode_tok_s']:.1f}) |",
             *[f"| AR, our sampler, {label} | {r[f'ar_{name}_tok_s']:.1f} | "
               f"{r[f'ar_{name}_tok_s'] / r['hf_generate_tok_s']:.2f}× |"
               for name, label in VARIANTS.items() if f"ar_{name}_tok_s" in r],
             f"| AR, HF generate | {r['hf_generate_tok_s']:.1f} | 1.00× |", "", *llama_cpp_lines(r),
             f"Bandwidth bound: {r['read_bandwidth_gb_s']:.1f} GB/s streaming read / {r['weight_bytes'] / 1e6:.0f} MB of "
             f"weights per step = {r['bandwidth_bound_tok_s']:.1f} tok/s; our AR reaches {r['ar_share_of_bound']:.0%} of it "
             f"end to end and {r['ar_decode_share_of_bound']:.0%} in decode (the bound is per decode step; the prefill "
             "is compute-bound and not in it)."
             + (f" Our loop multiplies from the weights' exact compact forms where they have one "
                f"({r['streamed_bytes'] / 1e6:.0f} MB per step): streamed at that bandwidth, "
                f"{r['streamed_bound_tok_s']:.0f} tok/s, of which decode reaches "
                f"{r['ar_decode_share_of_streamed_bound']:.0%} (the compact kernels are compute-bound here)."
                if "streamed_bytes" in r and r["streamed_bytes"] != r["weight_bytes"] else ""),
             "", (f"One AR step (profiled, measured kernels, lean layers in PyTorch ops): "
                  f"{split['step_ms_profiled']:.1f} ms; GEMM "
                  f"{split['gemm_ms']:.1f} ms ({split['gemm_share']:.0%}), everything else {split['other_ms']:.1f} ms."
                  if split else "One AR step: not profiled on a GPU (CPU time would count kernel launches only)."), "",
             f"Verify-cost curve v(n) = T_n / T_1 (T_1 = {r['t1_ms']:.2f} ms {ours}, "
             + ", ".join(f"{r[f't1_{name}_ms']:.2f} ms {label}" for name, label in VARIANTS.items()
                         if f"t1_{name}_ms" in r)
             + "; one base forward over n chain tokens, lm_head included"
             + ("; native layers are measured up to 16 rows, past that the lean ones run" if on_cpu(r) else "") + "):",
             "",
             "| n | " + " | ".join(str(n) for n in r["verify_cost"]) + " |",
             "|---" * (len(r["verify_cost"]) + 1) + "|",
             "| v(n) | " + " | ".join(f"{v:.2f}" for v in r["verify_cost"].values()) + " |",
             *[f"| v(n), {label} | " + " | ".join(f"{v:.2f}" for v in r[f"verify_cost_{name}"].values()) + " |"
               for name, label in VARIANTS.items() if f"verify_cost_{name}" in r],
             "| GEMM ms | " + " | ".join(f"{v:.1f}" for v in r["gemm_ms"].values()) + " |",
             "| GEMM roofline ms | " + " | ".join(f"{v:.1f}" for v in r["gemm_roofline_ms"].values()) + " |",
             *(["| GEMM roofline / its n = 1 | " + " | ".join(f"{v:.2f}" for v in r["gemm_roofline_ratio"].values())
                + " |"] if "gemm_roofline_ratio" in r else []),
             *(["| v(n) floor: GEMM roofline / T_1 | " + " | ".join(f"{v:.2f}" for v in r["verify_cost_floor"].values())
                + " |"] if "verify_cost_floor" in r else []),
             "| rest ms | " + " | ".join(f"{v:.1f}" for v in r["rest_ms"].values()) + " |", "",
             f"GEMM ms: the forward's products alone (q|k|v, o, gate|up, down per layer, lm_head; measured kernels), "
             f"n rows each, called one by one from Python. GEMM roofline: max(the weights as held streamed once at the "
             + (f"read bandwidth, 2·n·params flops at {r['compute_roof_gflop_s']:.0f} GFLOP/s: this CPU's float32 FMA "
                f"throughput on all threads (smallm_fma_peak; a 2048² fp32 product: {r['gemm_gflop_s']:.0f}); its ratio "
                "to n = 1 is what v(n) would be if every product ran at the roof and nothing else took time. "
                if r.get("fma_peak_gflop_s") else  # (a GPU: its large product's rate)
                f"read bandwidth, 2·n·params flops at {r['gemm_gflop_s']:.0f} GFLOP/s, a 2048² fp32 product on all "
                "threads). ")
             + ("v(n) floor: the roofline over our loop's own T_1, the lowest v(n) it can have on this machine (the "
                "products alone at the roof, nothing else; a faster T_1 raises it). " if "verify_cost_floor" in r else "")
             + "rest = T_n − GEMM (below 0 where the native layers, calling the same products from C, take less than "
             "those calls from Python)."
             + (f" The compact kernels sum per group of 32 columns first for up to {r['reassociated_rows']} rows "
                "(12: every row count; smallm_calibrate's choice on this CPU)." if r.get("reassociated_rows") else "")
             + (" They ask for each group's codes " + ", ".join(
                 f"{ahead} bytes ahead at {lo}{'' if lo == hi else f'-{hi}'} row{'' if hi == 1 else 's'}"
                 for lo, hi, ahead in spans(r["prefetch_bytes"])) + " (native_layer.tune_prefetch's choice on this "
                "machine)." if r.get("prefetch_bytes") else ""),
             "",
             *([f"CUDA graphs: {r['cuda_graphs']['recorded']} recorded in this run (one per query count and feature "
                f"layers kept, each once per process), {r['cuda_graphs']['record_s']:.2f} s in all, warm-up runs "
                "included.", ""] if r.get("cuda_graphs") else []),
             *([f"CUDA kernels (cuda_kernels=measured): measured in {r['cuda_kernels']['measure_s']:.1f} s in this run "
                f"(0 when cached for this GPU); products chosen per shape and rows: "
                + "; ".join(f"{s} " + ", ".join(f"{n}: {k}" for n, k in c.items())
                            for s, c in r["cuda_kernels"]["choice"].items())
                + "; attention: " + "; ".join(f"{g} " + ", ".join(f"{n}: {k}" for n, k in c.items())
                                              for g, c in r["cuda_kernels"]["attention"].items())
                + "; rotary + K/V write: " + "; ".join(f"{g} " + ", ".join(f"{n}: {k}" for n, k in c.items())
                                                       for g, c in r["cuda_kernels"].get("rope", {}).items())
                + f"; fused units (cuda_fused: {', '.join(cuda_fused.UNITS)}): " + "; ".join(
                    f"{g} " + ", ".join(f"{n}: " + "/".join(u.get(k, "-").removeprefix("fused_")
                                                             for k in cuda_fused.UNITS)
                                        for n, u in c.items())
                    for g, c in r["cuda_kernels"].get("fused", {}).items()), ""]
               if r.get("cuda_kernels") else []),
             f"Kernel choice: measured in {r['kernel_measure_s']:.1f} s in this run (0 when cached for this machine and "
             f"its re-check held; re-check {r['kernel_check_s']:.2f} s, shapes measured again: "
             f"{', '.join(r['kernel_remeasured']) or 'none'}); first generate incl. that: {r['kernel_setup_s']:.1f} s. "
             f"Native small-M kernel (specdec/engines/cpu/smallm.c): "
             + (f"built, compiled in {r['native_build_s']:.2f} s in this run (0 when cached)."
                if r.get("native_built") else "not built on this machine (no compiler): a candidate fewer."), "",
             *native_layer_lines(r)]
    return "\n".join(lines)


def llama_cpp_lines(r: dict) -> list[str]:
    """Ours beside llama.cpp on the same GGUF and threads (where the run had it)."""
    lc = r.get("llama_cpp")
    if not lc:
        return ["llama.cpp: not in this run (`make peers` builds it).", ""]
    b = lc["llama_bench"]
    return [f"Beside llama.cpp on the same GGUF, {r['threads']} threads (llama-server from `make peers`, in the same "
            "rotation; `llama-bench` alone after it, at the prompts' mean length of "
            f"{lc['llama_bench_depth']} tokens):", "",
            "| | ours | llama.cpp server | ours ÷ llama.cpp | llama-bench |", "|---|---|---|---|---|",
            f"| tok/s, end to end | {r['ar_tok_s']:.1f} | {lc['tok_s']:.1f} | {lc['ar_vs_llama_cpp']:.2f}× | |",
            f"| decode tok/s | {r['ar_decode_tok_s']:.1f} | {lc['decode_tok_s']:.1f} | "
            f"{lc['ar_decode_vs_llama_cpp']:.2f}× | tg{r['max_new_tokens']} @ d{lc['llama_bench_depth']}: "
            f"{b['decode']:.1f} |",
            f"| prefill tok/s | {r['ar_prefill_tok_s']:.0f} | {lc['prefill_tok_s']:.0f} | "
            f"{lc['ar_prefill_vs_llama_cpp']:.2f}× | pp{lc['llama_bench_depth']}: {b['prefill']:.0f} |", "",
            f"The server's decode is {lc['server_vs_llama_bench_decode']:.0%} of llama-bench's tg (the peer is not "
            "handicapped by its wrapper where this is within 10 % of 100 %). llama.cpp's tokens are not the base's "
            "float32 greedy tokens: it rounds activations to 8 bits before its products (experiments/identity.py "
            f"counts the difference). Built with: {lc['build']}.", ""]


def native_layer_lines(r: dict) -> list[str]:
    layers = r.get("native_layer_ms")
    if not layers:
        return ["Native layers (specdec/engines/cpu/layer.c): none built here." if "native_layer_ms" in r else ""]
    return ["Native layers (specdec/engines/cpu/layer.c, one call per decoder layer): the base's layer stack, one pass "
            "each way over n new tokens after 128 cached ones (ms; `native_layer.measure`, what the sampler chooses "
            "by, per n):", "",
            "| n | " + " | ".join(str(n) for n in layers) + " |", "|---" * (len(layers) + 1) + "|",
            "| lean layers (PyTorch ops, measured kernels) | " + " | ".join(f"{t['lean']:.1f}" for t in layers.values())
            + " |",
            *[f"| native layers{label} | " + " | ".join(f"{t[way]:.1f}" for t in layers.values()) + " |"
              for way, label in (("native", ", float32 weights"), ("compact", ", exact compact weights"))
              if all(way in t for t in layers.values())], ""]


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [int(n) for n in r["verify_cost"]]
    ours = "native layers" if on_cpu(r) else "CUDA graphs"
    ax.plot(ns, list(r["verify_cost"].values()), "o-", label=f"{ours} (T_1 {r['t1_ms']:.2f} ms)")
    short = {"float32": "float32 weights", "logits": "fp32 logits", "lean": "lean layers", "stock": "stock", "eager": "op by op",
             "hf_layers": "HF layers"}
    for (name, label), style in zip(short.items(), ("*-", "x--", "d-.", "s--", "v-.", "^:")):
        if f"verify_cost_{name}" in r:
            ax.plot(ns, list(r[f"verify_cost_{name}"].values()), style, label=f"{label} (T_1 {r[f't1_{name}_ms']:.2f} ms)")
    if "verify_cost_floor" in r:  # where no kernel takes v(n) below, against this T_1
        ax.plot(ns, list(r["verify_cost_floor"].values()), "k:", label="floor: products at the roof / T_1")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="query tokens n", ylabel="v(n) = T_n / T_1", title=f"Verify cost, {r['cpu'].split(' | ')[0] if on_cpu(r) else r['device']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
