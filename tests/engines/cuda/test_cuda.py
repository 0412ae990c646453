"""The CUDA path on tiny bases: the sampler's losslessness (greedy identity, Monte-Carlo law), every drafter family,
n-gram lookup, the CUDA graphs of the decode, the continuous batch of distillation, training (online, from a feature
cache, bf16) and evaluate.py, each run on the GPU. Skipped where no GPU is visible (CI's machines have none); experiments/cuda_check.sh runs this
file on a lent GPU, then the real base."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.base import Base, tiny_base
from specdec.checkpoint import save_drafter
from specdec.data.stream import stream
from specdec.drafters.medusa import Medusa
from specdec.drafters.prophet import Prophet
from specdec.engines.cuda import draft_graph, graphs
from specdec.engines.cuda import fused as cuda_fused
from specdec.engines.cuda import kernels as cuda_kernels
from specdec.engines.cuda import layer as cuda_layer
from specdec.engines.cuda.kernels import _block
from specdec.engines.eager.lean import lean_layers
from specdec.sampling.decode import SamplerConfig, generate

from conftest import CONFIGS, ROOT, auto_engine, compose_train
from sampling_stubs import Oracle, Table, micro_base
from test_sampling_decode import (  # noqa: F401
    NEW,
    TREE,
    assert_family_lossless,
    cfg,
    drafter_configs,
    family_drafter,
    perturb,
    prompts,
    reference,
)
from test_sampling_mc import PROMPT, chi_square_pvalue, exact_joint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def base():
    return tiny_base(device="cuda")


def test_tiny_base_is_on_the_gpu(base):
    assert base.device.type == "cuda"


def test_plain_decoding_matches_no_cache_greedy_and_hf_generate(base, prompts):
    r = generate(base, prompts, None, cfg(), engine=auto_engine("cuda"))
    assert r.tokens.tolist() == reference(base, prompts)
    for p, row in zip(prompts, r.tokens.tolist()):
        hf = base.model.generate(torch.tensor([p], device=CUDA), max_new_tokens=NEW, do_sample=False,
                                 min_new_tokens=NEW, pad_token_id=0)
        assert hf[0, len(p):].tolist() == row


@pytest.mark.parametrize("kw", [dict(gamma=4), dict(tree="static", paths=TREE),
                                dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6),
                                dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6,
                                     dynamic_by_cost=True)])  # the verify-cost curve timed on the GPU
@pytest.mark.parametrize("right_for", [0, 2, [0, 2, 4]])  # none / partial / ragged across the batch
def test_chain_and_tree_greedy_identity(base, prompts, kw, right_for):
    r = generate(base, prompts, Oracle(base, right_for), cfg(**kw), engine=auto_engine("cuda"))
    assert r.tokens.tolist() == reference(base, prompts)


@pytest.mark.parametrize("path", drafter_configs(), ids=lambda p: p.stem)
def test_every_drafter_family_is_greedy_lossless(base, prompts, path):
    drafter = family_drafter(base, path)
    depth = min(3, drafter.max_depth or 3)
    assert_family_lossless(base, prompts, drafter, dict(gamma=depth, lookup_tokens=4, lookup_min_ngram=1),
                           engine=auto_engine("cuda"))


@pytest.mark.parametrize("kw", [dict(), dict(gamma=4), dict(tree="static", paths=TREE),
                                dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)])
@pytest.mark.parametrize("rows", [1, 3])
def test_cuda_graphs_are_recorded_replayed_and_greedy_identical(prompts, kw, rows):
    """Every decode above runs through CUDA graphs (the CUDA engine's default); here: that they were recorded, for
    the base and a drafter's own layers, and give the tokens of the same decode op by op."""
    base = tiny_base(device="cuda")  # its own: a base's graph pools live as long as it does
    drafter = Prophet(base).to(CUDA).eval() if kw else None
    if drafter is not None:
        perturb(drafter)
    on = generate(base, prompts[:rows], drafter, cfg(**kw), engine=auto_engine("cuda"))
    off = generate(base, prompts[:rows], drafter, cfg(**kw), engine=auto_engine("cuda", cuda_graphs=False))
    assert on.tokens.tolist() == off.tokens.tolist() == reference(base, prompts[:rows])
    eager_drafts = generate(base, prompts[:rows], drafter, cfg(**kw),
                            engine=auto_engine("cuda", cuda_graph_draft=False))
    assert on.accepted == eager_drafts.accepted  # a whole draft replayed (chain, static tree) drafts the eager tokens
    recorded = {p.store: p.graphs for p in graphs.pools(base) if p.graphs}
    assert set(recorded) == ({"base", "prophet"} if kw else {"base"})
    assert all(g.graph is not None for found in recorded.values() for g in found.values())
    assert sum(p.captures for p in graphs.pools(base)) == sum(len(g) for g in recorded.values())
    drafts = draft_graph.recorded(drafter) if drafter is not None else []
    assert len(drafts) == (1 if kw and kw.get("tree") != "dynamic" else 0)
    assert all(d.graph is not None for d in drafts)


@pytest.mark.parametrize("kw, attention, fused", [(dict(), "math", False), (dict(gamma=4), "math", False),
                                                  (dict(), "triton_w64", True), (dict(gamma=4), "triton_last64", True)])
def test_measured_cuda_kernels_decode_as_pytorch_does(prompts, kw, attention, fused, tmp_path):
    """The table measured on this GPU (Triton's configurations offered where it imports), then every product forced
    through a Triton kernel and every attention through matmul + softmax or cuda_layer's one kernel (with its rotary
    and K/V write), and with `fused` every cuda_fused unit of the base's layers: the tokens of PyTorch's own kernels,
    through the recorded graphs."""
    base = tiny_base(device="cuda")
    drafter = Prophet(base).to(CUDA).eval() if kw else None
    if drafter is not None:
        perturb(drafter)
    stock = generate(base, prompts, drafter, cfg(**kw), engine=auto_engine("cuda", cuda_kernels="stock"))
    table = cuda_kernels.CudaTable(CUDA, path=tmp_path / "t.json")
    with cuda_kernels.measured(base.model, *([drafter] if drafter else []), table=table):
        pass
    assert table.choice and table.attention
    if cuda_kernels.available():
        small = [r for r in table.rows if r <= cuda_kernels.MAX_ROWS]  # (more rows: F.linear, the only candidate)
        assert all("triton_o16_k64" in c[r] for c in table.timings.values() for r in small)
        for i, shape in enumerate(table.choice):  # both kinds of kernel, split-K in each
            table.choice[shape] = {r: ("triton_o16_k64_s2", "rows_o8_k64_s4")[i % 2] if r in small else "linear"
                                   for r in table.rows}
    if attention != "math" and not cuda_kernels.available():
        pytest.skip("triton is not installed")
    for g in table.attention:
        table.attention[g] = {r: attention for r in table.rows}
        table.rope[g] = {r: "torch" if attention == "math" else "triton" for r in table.rows}
    if fused:
        # every unit measured that the layers offer: o and down (a Llama's have no bias), front and gated where
        # F.rms_norm is bitwise the layer's RMSNorm on this GPU (SmolLM2's on an H200, not the tiny base's: there the
        # bench's greedy check covers them)
        offered = {_block(f): set(cuda_fused.units(f)) for f in lean_layers(base.model)}
        assert table.fused and all(set(c) == offered[block] and {"o", "down"} <= set(c)
                                   for block, units in table.fused.items() if block in offered for c in units.values())
        config = next(iter(cuda_fused.CONFIGS))
        for block, units in table.fused.items():
            table.fused[block] = {r: {u: config for u in cuda_fused.UNITS} for r in units}
    key = str(base.lm_head.weight.device)
    cuda_kernels._TABLES[key] = table  # what generate's cuda_kernels=measured uses
    try:
        forced = generate(base, prompts, drafter, cfg(**kw), engine=auto_engine("cuda"))
    finally:
        cuda_kernels._TABLES.pop(key)
    assert forced.tokens.tolist() == stock.tokens.tolist() == reference(base, prompts)


def test_measured_products_run_in_graph_recordings_only(base):
    """A patched linear launches its Triton kernel only while a CUDA graph records (where it was timed); called from
    Python it is F.linear itself, bit for bit."""
    if not cuda_kernels.available():
        pytest.skip("triton is not installed")
    lin = base.lm_head
    table = cuda_kernels.CudaTable(CUDA, path=None, rows=(1, 2))
    table.choice = {cuda_kernels._shape_key(lin.weight): {1: "rows_o16_k64", 2: "rows_o16_k64"}}
    x = torch.randn(2, lin.in_features, device=CUDA)
    triton = cuda_kernels.small_m_linear(x, lin.weight, "rows_o16_k64")  # (built here, outside the recording)
    with cuda_kernels.measured(lin, table=table):
        assert "forward" in lin.__dict__
        eager = lin(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recorded = lin(x)
        graph.replay()
        with cuda_layer.warming():  # the eager runs before a recording launch what it will record
            warmed = lin(x)
    assert torch.equal(eager, torch.nn.functional.linear(x, lin.weight))
    assert torch.equal(recorded, triton) and torch.equal(warmed, triton)


def test_a_table_from_the_disk_cache_decodes_in_a_fresh_process(prompts, tmp_path):
    """A process that reads the measured table from the disk cache (no kernel compiled or loaded in it yet) records
    its graphs with Triton's products, attention and rotary + K/V write, and decodes PyTorch's tokens. (Before the
    warm-up runs launched them, the first load of a Triton module happened inside a recording and invalidated it.)"""
    if not cuda_kernels.available():
        pytest.skip("triton is not installed")
    base = tiny_base(device="cuda")
    table = cuda_kernels.CudaTable(CUDA, path=tmp_path / "kernels_cuda.json", rows=(1, 2, 5))
    with cuda_kernels.measured(base.model, table=table):
        pass
    for shape in table.choice:
        table.choice[shape] = {r: "rows_o8_k64_s4" for r in table.rows}
    for g in table.attention:
        table.attention[g] = {r: "triton_last128" for r in table.rows}  # (its counters made in the new process)
        table.rope[g] = {r: "triton" for r in table.rows}
    table.save()
    code = ("from specdec.base import tiny_base; from specdec.sampling.decode import SamplerConfig, generate; "
            f"print(generate(tiny_base(device='cuda'), {prompts!r}, None, "
            f"SamplerConfig(max_new_tokens={NEW}, eos_token_id=[])).tokens.tolist())")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # (keep where deps were put)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SPECDEC_CACHE": str(tmp_path), "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    assert eval(done.stdout.strip().splitlines()[-1]) == reference(base, prompts)


@pytest.mark.parametrize("kw", [dict(gamma=2), dict(tree="static", paths=[[0, 0], [1, 0], [2]])])
def test_monte_carlo_law_on_the_gpu(kw):
    """10^5 rows at T = 1 through the real loop on the GPU against the exact joint (test_sampling_mc's check)."""
    micro = micro_base()
    base = Base(micro.model.to(CUDA), None, micro.name)
    cfg = SamplerConfig(max_new_tokens=3, temperature=1.0, eos_token_id=[], **kw)
    tokens = generate(base, [PROMPT] * 100_000, Table(base), cfg, torch.Generator(device=CUDA).manual_seed(0),
                      engine=auto_engine("cuda")).tokens
    assert chi_square_pvalue(tokens, exact_joint(Base(micro.model.cpu(), None, micro.name))) > 1e-3


def test_a_cpu_generator_seeds_a_gpu_decode_as_it_seeds_a_cpu_one(prompts):
    c = cfg(gamma=3, temperature=1.0, top_k=20)
    cpu = tiny_base()
    torch.manual_seed(0)
    heads = Medusa(cpu, num_heads=3)
    gpu = tiny_base(device="cuda")
    on_gpu = Medusa(gpu, num_heads=3).to(CUDA)
    on_gpu.load_state_dict(heads.state_dict())
    a = generate(gpu, prompts, on_gpu, c, torch.Generator().manual_seed(5), engine=auto_engine("cuda"))
    b = generate(cpu, prompts, heads, c, torch.Generator().manual_seed(5), engine=auto_engine("cuda"))
    # the same uniforms; the logits differ by float rounding between devices, so most tokens, not all, agree
    same = sum(x == y for ra, rb in zip(a.tokens.tolist(), b.tokens.tolist()) for x, y in zip(ra, rb))
    assert same >= 0.8 * a.tokens.numel()


def test_continuous_batch_rows_equal_each_prompt_alone(base):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (4, 7, 2, 5, 6, 3, 8)]
    c = SamplerConfig(max_new_tokens=10, eos_token_id=[], temperature=1.0)
    gens = lambda: [torch.Generator(device=CUDA).manual_seed(i) for i in range(len(prompts))]  # noqa: E731
    alone = [generate(base, [p], None, c, [g],
                      engine=auto_engine("cuda")).tokens[0].tolist() for p, g in zip(prompts, gens())]
    assert dict(stream(base, prompts, c, batch_size=3, generators=gens(),
                       engine=auto_engine("cuda"))) == dict(enumerate(alone))


@pytest.mark.parametrize("drafter", ["medusa", "hydra", "prophet", "early_exit"])
def test_training_on_the_gpu(drafter, corpus, tmp_path):
    """train.py's path on the GPU: the tiny base and the drafter on cuda, Lightning's gpu accelerator, precision
    auto (bf16-mixed where supported), a drafter saved that decodes losslessly on the GPU."""
    from specdec.checkpoint import load_drafter
    from specdec.training import train

    extra = {"early_exit": ["drafter.exit_layers=[1]"]}.get(drafter, [])
    tcfg = compose_train(["base=tiny", "base.device=cuda", "trainer.accelerator=gpu", "trainer.precision=auto",
                          "data=text", f"data.source.path={corpus}/*.txt", "data.block_size=32", "data.batch_size=2",
                          "data.val_fraction=0.2", f"drafter={drafter}", "trainer.max_steps=4",
                          "trainer.val_check_interval=2", "callbacks.progress_bar.refresh_rate=0", "logger=csv", *extra],
                         tmp_path)
    metrics = train(tcfg)
    assert all(math.isfinite(metrics[k]) for k in ("train/loss", "val/loss", "val/expected_tau"))  # validation ran
    gpu = tiny_base(device="cuda")
    trained = load_drafter(tmp_path / "run" / "drafter", gpu).to(CUDA).eval()
    ps = [[5, 6, 7, 8], [9, 10, 11]]
    assert generate(gpu, ps, trained, cfg(gamma=2), engine=auto_engine("cuda")).tokens.tolist() == reference(gpu, ps)


def test_feature_cache_and_training_from_it_on_the_gpu(corpus, tmp_path):
    from specdec.data import features as features_mod
    from specdec.training import train

    out = tmp_path / "feat"
    fcfg = compose_train(["base=tiny", "base.device=cuda", "data=text", f"data.source.path={corpus}/*.txt",
                          "data.block_size=32", "data.val_fraction=0.2", "layers=[-1,1]", "topk=8", f"out_dir={out}"],
                         tmp_path, config_name="features")
    features_mod.main.__wrapped__(fcfg)
    cfg = compose_train(["base=tiny", "base.device=cuda", "trainer.accelerator=gpu", "data=cached", f"data.path={out}",
                         "data.batch_size=2", "drafter=prophet", "trainer.max_steps=4", "trainer.val_check_interval=2",
                         "callbacks.progress_bar.refresh_rate=0", "logger=csv"], tmp_path)
    metrics = train(cfg)
    assert all(math.isfinite(metrics[k]) for k in ("train/loss", "val/loss", "val/expected_tau"))  # validation ran


def test_evaluate_on_the_gpu(tmp_path):
    import json

    from specdec.evaluation import evaluate

    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in
            enumerate([("coding", "def add(a, b):"), ("writing", "a haiku about GPUs")])]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    save_drafter(Medusa(tiny_base(), num_heads=3), tmp_path / "medusa")
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        ecfg = compose("evaluate", overrides=[
            "base=tiny", "base.device=cuda", f"paths.output_dir={tmp_path}/eval", f"paths.cache_dir={tmp_path}/cache",
            "prompts=jsonl", f"prompts.path={questions}", f"drafters=[{tmp_path}/medusa]", "sampler.gamma=3",
            "sampler.max_new_tokens=12", "sampler.eos_token_id=[]", "sampler.lookup_tokens=4",
            "hf.early_exit_layer=1", "wandb.enabled=false"])
    report = evaluate(ecfg)
    assert report["rows"] and all(r["greedy_identical"] for r in report["rows"])
    assert "cuda" in json.dumps(report["header"]).lower() or "nvidia" in json.dumps(report["header"]).lower()
