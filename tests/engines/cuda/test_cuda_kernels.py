"""The CUDA products and attention chosen by measurement (cuda_kernels.py), on the CPU: the Triton kernel through
Triton's interpreter (a subprocess with TRITON_INTERPRET=1), the table, the patching and the fallbacks. Their speed
is measured on a GPU (experiments/profile_verify.py, cuda_check.sh), never here."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from specdec.engines.cuda import fused as cuda_fused
from specdec.engines.cuda import graphs
from specdec.engines.cuda import kernels as cuda_kernels
from specdec.engines.cuda import layer as cuda_layer
from specdec.engines.cuda.kernels import CudaTable, math_attention
from specdec.engines.eager.lean import NO_UNITS, lean_layers

from conftest import ROOT

needs_triton = pytest.mark.skipif(not cuda_kernels.available(), reason="triton is not installed")

# for the interpreted tests of a recorded forward: run() = a verify of 5 tokens and the step after it through a graph
# pool's static forward (eager on the CPU) of `base` (its lean layers `fast`) -> (the two outputs, the last layer's keys)
RECORDED_RUN = """
    import torch
    from specdec.engines.cuda import graphs
    from specdec.sampling.cache import SlotCache

    def run():
        pool = graphs.GraphPool(base, "base", 1, 32)
        pool.adopt(SlotCache(32), fast)  # the buffers in place, as a decode's first eager forward leaves them
        x = torch.randint(0, base.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
        verify, _, _ = pool.forward(fast, x, torch.tensor([3]), torch.arange(5), torch.arange(5),
                                    torch.ones(5, 5, dtype=torch.bool).tril(), embed=True)
        step, _, _ = pool.forward(fast, x[:, :1], torch.tensor([8]), torch.arange(1), torch.arange(1),
                                  torch.ones(1, 1, dtype=torch.bool), embed=True)
        return verify, step, pool.cache.layers[-1].keys.clone()
"""


# the Triton kernels through Triton's CPU interpreter: minutes here, the GPU runs them in experiments/cuda_check.sh
pytestmark = pytest.mark.long


def interpreted(*code: str) -> str:
    """Run the `code` parts, one after the other, in a fresh Python with Triton's interpreter on (kernels run on CPU
    tensors); its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", "".join(map(textwrap.dedent, code))], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_triton
def test_small_m_kernel_is_the_product_for_every_config_and_row_count():
    out = interpreted("""
        import torch
        from specdec.engines.cuda.kernels import CONFIGS, small_m_linear
        torch.manual_seed(0)
        worst = 0.0
        for o, i in [(40, 70), (96, 160), (33, 100)]:  # ragged: outputs and inputs not multiples of the blocks
            w = torch.randn(o, i)
            for m in (1, 2, 5, 16):
                x = torch.randn(m, i)
                ref = x @ w.T
                for name in CONFIGS:
                    y = small_m_linear(x, w, name)
                    assert y.shape == ref.shape and y.is_contiguous(), (name, y.shape)
                    worst = max(worst, float((y - ref).abs().max() / ref.abs().max()))
        print(worst)
    """)
    assert float(out) < 1e-5  # float32 sums in another order


@needs_triton
def test_measured_forms_decode_as_pytorch_does(tmp_path):
    """A tiny base with the table measured (Triton configs offered, interpreted) and forced to the Triton kernels:
    the same greedy tokens and (to float32 rounding) the same logits as with PyTorch's own kernels."""
    out = interpreted(f"""
        import torch
        from specdec.base import tiny_base
        from specdec.engines.cuda import fused as cuda_fused
        from specdec.engines.cuda import kernels as cuda_kernels
        from specdec.engines.cuda import layer as cuda_layer
        from specdec.engines.cuda.kernels import CONFIGS, CudaTable, measured
        from specdec.engines.config import EngineConfig
        from specdec.engines.cuda.engine import CudaEngine
        from specdec.sampling.decode import SamplerConfig, generate

        # the CUDA engine on the CPU, op by op: its layers take the forms `measured` chose (its own install measures
        # nothing for CPU weights, so the table given here is the one in use)
        engine = CudaEngine(EngineConfig(cuda_graphs=False))

        cuda_kernels.CONFIGS = {{k: cuda_kernels.CONFIGS[k] for k in ("triton_o16_k64_s2", "triton_o32_k64")}}  # brief
        cuda_fused.CONFIGS = {{"fused_o8_k128": cuda_fused.CONFIGS["fused_o8_k128"]}}
        cuda_layer.FORMS = {{"triton_last64": (64, "last")}}  # (interpreted: ~20 s, not ~50)
        cuda_kernels.ATTENTION_WIDTH = 64
        base = tiny_base()
        table = CudaTable(torch.device("cpu"), path={str(tmp_path / "t.json")!r}, rows=(1, 5))
        cfg = SamplerConfig(max_new_tokens=6, eos_token_id=[])
        stock = generate(base, [[1, 2, 3, 4]], None, cfg, engine=engine).tokens
        with measured(base, table=table):
            assert table.choice and all(set(c) == {{1, 5}} for c in table.choice.values())
            assert "linear" in next(iter(table.timings.values()))[1]
        for shape in table.choice:  # every product through one Triton config, the attention as matmul + softmax
            table.choice[shape] = {{r: "triton_o16_k64_s2" for r in table.rows}}
        for g in table.attention:
            table.attention[g] = {{r: "math" for r in table.rows}}
        with measured(base, table=table):
            assert cuda_kernels.active() is not None
            ours = generate(base, [[1, 2, 3, 4]], None, cfg, engine=engine).tokens
        assert cuda_kernels.active() is None
        print(torch.equal(stock, ours))
    """)
    assert out.strip() == "True"


def test_measured_patches_and_restores_linears_and_attention(tiny, tmp_path):
    table = CudaTable(torch.device("cpu"), path=tmp_path / "t.json", rows=(1, 2), triton=False)
    fast = lean_layers(tiny.model)
    with measured_tables(tiny, table) as t:
        assert t is table and cuda_kernels.active() is not None
        assert all(len(cuda_kernels.units(f).attention) == 3 for f in fast)  # one form (or SDPA's None) per query count 0..2
        assert all(cuda_kernels.units(f).rope == [None] * 3 for f in fast)  # without Triton: the PyTorch ops at every count
        assert set(table.candidates()) == {"linear"}  # without Triton: PyTorch's product only, so nothing patched
        assert not any("forward" in lin.__dict__ for lin in (f.qkv for f in fast))
    assert all(cuda_kernels.units(f) is NO_UNITS for f in fast) and cuda_kernels.active() is None
    # measured once, then read back from the cache file (same machine, same candidates)
    again = CudaTable(torch.device("cpu"), path=tmp_path / "t.json", rows=(1, 2), triton=False)
    assert again.choice == table.choice and again.attention == table.attention and again.rope == table.rope
    assert again.fused == table.fused == {cuda_kernels._block(fast[0]): {}}  # (without Triton nothing fuses)
    assert again.eager == table.eager and set(next(iter(table.eager.values())).values()) <= {"sdpa", "math"}


def measured_tables(tiny, table):
    return cuda_kernels.measured(tiny.model, table=table)


def test_a_failing_candidate_is_left_out_and_linear_stays(tiny, tmp_path, monkeypatch):
    """The fallback: a Triton configuration that fails to build (or triton missing) is not offered; F.linear always
    is, so every shape still has a choice."""
    def broken(x, w, config):
        raise RuntimeError("no such kernel on this build")

    monkeypatch.setattr(cuda_kernels, "small_m_linear", broken)
    table = CudaTable(torch.device("cpu"), path=None, rows=(1, 3), triton=True)
    w = tiny.model.model.layers[0].mlp.down_proj.weight
    times = table._time_products([w], 3)
    assert set(times) == {"linear"}
    table.prepare([w], [])
    assert set(table.choice[cuda_kernels._shape_key(w)].values()) == {"linear"}
    assert table.plan(w) == [None, None, None, None]  # F.linear at every row count: nothing to patch


def test_a_wrong_candidate_is_left_out(tiny, monkeypatch):
    monkeypatch.setattr(cuda_kernels, "small_m_linear", lambda x, w, config: F.linear(x, w) * 1.01)
    table = CudaTable(torch.device("cpu"), path=None, rows=(2,), triton=True)
    assert set(table._time_products([tiny.model.model.layers[0].mlp.up_proj.weight], 2)) == {"linear"}


@needs_triton
def test_one_kernel_attention_and_rope_write_compute_what_pytorch_does():
    """cuda_layer's kernels (interpreted) on ragged shapes and 1-40 queries: the attention to float32 rounding, with
    and without a mask, over a window of a longer buffer, its output [B, h, n, d] a view of [B, n, h, d], the split
    form joined by its last block bitwise the one joined by a second kernel; the rotary and K/V write bitwise the lean
    forward's PyTorch ops, at scattered slots."""
    out = interpreted("""
        import torch
        from specdec.engines.cuda import layer as cuda_layer
        from specdec.engines.cuda.kernels import math_attention
        g = torch.Generator().manual_seed(0)
        worst, exact = 0.0, True
        for b, h, kv, n, d, w in [(1, 9, 3, 5, 64, 300), (2, 4, 2, 16, 16, 70), (1, 6, 6, 1, 24, 40),
                                  (1, 4, 2, 40, 16, 90)]:  # (40 queries: a tree's verify, the 64-row variant)
            q = torch.randn(b, h, n, d, generator=g)
            k, v = (torch.randn(b, kv, w + 20, d, generator=g)[:, :, :w] for _ in range(2))
            mask = torch.zeros(b, 1, n, w).masked_fill_(torch.rand(b, 1, n, w, generator=g) > 0.5, -3.4e38)
            mask[..., 0] = 0  # every query sees a key
            for m in (mask, None):
                for form in cuda_layer.FORMS:
                    ref, got = math_attention(q, k, v, m, 0.125), cuda_layer.attention(q, k, v, m, 0.125, form)
                    assert got.shape == ref.shape and got.transpose(1, 2).is_contiguous()
                    worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
                # the last block's join is the join kernel's, in the same order, and leaves its counters zero
                for width in (64, 128):
                    exact &= torch.equal(cuda_layer.attention(q, k, v, m, 0.125, f"triton_last{width}"),
                                         cuda_layer.attention(q, k, v, m, 0.125, f"triton_split{width}"))
                exact &= not cuda_layer.counters(q.device).any()
            qkv = torch.randn(b, n, (h + 2 * kv) * d, generator=g)
            angle = torch.randn(b, 1, n, d, generator=g)
            slots = torch.stack([torch.randperm(w, generator=g)[:n] for _ in range(b)])  # [B, n]
            keys, values = (torch.randn(b, kv, w, d, generator=g) for _ in range(2))
            stores = [[keys.clone(), values.clone()] for _ in range(2)]
            q1 = cuda_layer.rope_write_torch(qkv, angle.cos(), angle.sin(), slots, *stores[0], h)
            q2 = cuda_layer.rope_write(qkv, angle.cos(), angle.sin(), slots, *stores[1], h)
            exact &= torch.equal(q1, q2) and all(map(torch.equal, stores[0], stores[1])) and q2.is_contiguous()
        print(worst, exact)
    """)
    worst, exact = out.split()
    assert float(worst) < 1e-5 and exact == "True"


@needs_triton
def test_recorded_forward_with_the_one_kernel_forms_is_the_pytorch_one():
    """The static forward a CUDA graph records (run eagerly on the CPU, Triton interpreted) with cuda_layer's attention
    and rotary + K/V write forced at every query count: a verify of 5 tokens and the step after it give the hidden
    states and keys of PyTorch's forms to float32 rounding, and both kernels ran in every layer."""
    out = interpreted(RECORDED_RUN, """
        from specdec.base import tiny_base
        from specdec.engines.cuda import kernels as cuda_kernels
        from specdec.engines.cuda import layer as cuda_layer
        from specdec.engines.eager.lean import lean_layers

        calls = {"attention": 0, "rope_write": 0}
        for name in calls:
            def counted(*a, _f=getattr(cuda_layer, name), _n=name, **k):
                calls[_n] += 1
                return _f(*a, **k)
            setattr(cuda_layer, name, counted)
        base = tiny_base(hidden_size=64)  # head_dim 16
        fast = lean_layers(base.model)
        table = cuda_kernels.CudaTable(torch.device("cpu"), path=None, rows=(1, 5), triton=False)
        with cuda_kernels.measured(base.model, table=table):  # (products: F.linear only)
            pass
        table.triton = True
        for g in table.attention:
            table.attention[g] = {r: "triton_w64" for r in table.rows}
            table.rope[g] = {r: "triton" for r in table.rows}


        stock = run()
        with cuda_kernels.measured(base.model, table=table):
            ours = run()
        print(max(float((s - o).abs().max() / s.abs().max()) for s, o in zip(stock, ours)), calls["attention"],
              calls["rope_write"])
    """)
    worst, attention, rope = out.split()
    layers = 2
    assert float(worst) < 1e-5 and int(attention) == int(rope) == 2 * layers


def test_the_one_kernel_forms_are_left_out_where_they_fail_or_differ(tiny, monkeypatch):
    """The fallback: without Triton's interpreter the kernels cannot run on CPU tensors (as where Triton fails to
    build), and a rotary that writes other numbers is refused: the PyTorch forms stay at every query count."""
    table = CudaTable(torch.device("cpu"), path=None, rows=(1, 3), triton=True)
    layer = lean_layers(tiny.model)[0]
    choice, eager = table._measure_attention(layer)
    assert set(choice.values()) <= {"sdpa", "math"} and set(eager.values()) <= {"sdpa", "math"}
    assert table._measure_rope(layer) == {1: "torch", 3: "torch"}

    def off_by_one_ulp(qkv, cos, sin, slots, keys, values, heads):
        q = cuda_layer.rope_write_torch(qkv, cos, sin, slots, keys, values, heads)
        return torch.nextafter(q, torch.full_like(q, float("inf")))

    monkeypatch.setattr(cuda_layer, "rope_write", off_by_one_ulp)
    assert table._measure_rope(layer) == {1: "torch", 3: "torch"}
    assert CudaTable(torch.device("cpu"), path=None, rows=(1,), triton=False)._measure_rope(layer) == {}


def test_a_triton_attention_launched_op_by_op_falls_back_to_the_faster_pytorch_form(tiny, monkeypatch):
    """Outside a graph recording the plan's Triton form runs the PyTorch form measured faster at that count (an op by
    op decode, a dynamic tree's drafting), not always SDPA."""
    table = CudaTable(torch.device("cpu"), path=None, rows=(1, 4), triton=True)
    layer = lean_layers(tiny.model)[0]
    g = cuda_kernels._geometry(layer)
    table.attention[g], table.eager[g] = {1: "triton_split64", 4: "triton_w64"}, {1: "math", 4: "sdpa"}
    monkeypatch.setattr(cuda_layer, "launchable", lambda t: False)  # as on a GPU, launched from Python
    plan = table.attention_plan(layer)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8, generator=gen), torch.randn(1, 2, 7, 8, generator=gen), torch.randn(1, 2, 7, 8)
    assert torch.equal(plan[1](q, k, v, None, 0.3), math_attention(q, k, v, None, 0.3))
    assert torch.equal(plan[3](q, k, v, None, 0.3), cuda_kernels._sdpa(q, k, v, None, 0.3))
    assert len(plan) == 5 and plan[0] is None


def test_math_attention_is_sdpa_with_grouped_heads():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)
    mask = torch.zeros(2, 1, 5, 20).masked_fill_(torch.rand(2, 1, 5, 20, generator=g) > 0.6, float("-inf"))
    mask[..., 0] = 0  # every query sees a key
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert torch.allclose(math_attention(q, k, v, mask, 0.25), ref, atol=1e-5)
    assert torch.allclose(math_attention(q, k, v, None, 0.25),
                          F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True), atol=1e-5)


def test_graph_keys_name_the_forms_in_use(tiny, tmp_path):
    """A recorded forward replays the kernels it was recorded with: under other forms a pool records its own."""
    pool = graphs.GraphPool(tiny, "base", 1, 32)  # on the CPU its static forward runs eagerly, keyed as a graph
    fast = lean_layers(tiny.model)
    x = torch.randint(0, tiny.vocab_size, (1, 2))
    args = (torch.tensor([3]), torch.arange(2), torch.arange(2), torch.ones(2, 2, dtype=torch.bool).tril())
    pool.forward(fast, x, *args, embed=True)
    with measured_tables(tiny, CudaTable(torch.device("cpu"), path=tmp_path / "t.json", rows=(1, 2), triton=False)):
        pool.forward(fast, x, *args, embed=True)
    assert len(pool.graphs) == 2 and {k[-1] is None for k in pool.graphs} == {True, False}


@needs_triton
def test_fused_products_compute_the_unfused_ops():
    """cuda_fused's kernel (interpreted) for every configuration on ragged shapes and 1-16 rows, in row groups where
    the configuration has them: the RMSNorm before the product, the SiLU·up after it, the residual add, each to float32
    rounding of the PyTorch ops."""
    out = interpreted("""
        import torch
        import torch.nn.functional as F
        from specdec.engines.cuda.fused import CONFIGS, product
        g = torch.Generator().manual_seed(0)
        worst = 0.0
        # outputs and inputs not multiples of the blocks (3 and 16 rows: one row group or several); 600 inputs: the
        # norm's prologue loads 16 rows in three steps
        for o, i, counts in [(10, 70, (1, 3)), (36, 160, (16,)), (12, 600, (16,))]:
            for m in counts:
                x, nw, r = torch.randn(m, i, generator=g), torch.randn(i, generator=g), torch.randn(m, o, generator=g)
                w, w2 = torch.randn(o, i, generator=g), torch.randn(2 * o, i, generator=g)
                xn = F.rms_norm(x, (i,), nw, 1e-5)
                for c in CONFIGS:
                    for got, ref in [(product(x, w, c), x @ w.T), (product(x, w, c, norm=(nw, 1e-5)), xn @ w.T),
                                     (product(x, w2, c, norm=(nw, 1e-5), gated=True),
                                      F.silu(xn @ w2[:o].T) * (xn @ w2[o:].T)),
                                     (product(x, w, c, residual=r), r + x @ w.T)]:
                        assert got.shape == ref.shape, (c, got.shape)
                        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
        print(worst)
    """)
    assert float(out) < 1e-5


@needs_triton
def test_front_rope_is_the_front_unit_then_the_rotary_and_the_write():
    """cuda_fused.front_rope (interpreted) for configurations of 1, 2 and 8 output pairs a program, one of them in row
    groups: q and the K/V buffers written at scattered slots as the input norm, the q|k|v product and cuda_layer's
    rotary + write in PyTorch ops give them, to float32 rounding; on SmolLM2's heads (9 + 3 + 3 of 64) and on heads
    of 24, where a program's 8 pairs straddle two heads."""
    out = interpreted("""
        import torch
        import torch.nn.functional as F
        from specdec.engines.cuda import layer as cuda_layer
        from specdec.engines.cuda.fused import front_rope
        from specdec.sampling.rotary import lean_rope
        g = torch.Generator().manual_seed(0)
        worst = 0.0
        for b, n, heads, kv, d, i in [(1, 2, 9, 3, 64, 70), (2, 3, 4, 2, 24, 40)]:
            x, w, nw = torch.randn(b, n, i, generator=g), torch.randn((heads + 2 * kv) * d, i, generator=g), \
                torch.randn(i, generator=g)
            angle = torch.randn(b, n, d, generator=g)
            rope = lean_rope(angle.cos(), angle.sin())
            slots = torch.stack([torch.randperm(40, generator=g)[:n] for _ in range(b)])  # [B, n]
            buffers = [torch.randn(b, kv, 40, d, generator=g) for _ in range(2)]
            want = [t.clone() for t in buffers]
            q_want = cuda_layer.rope_write_torch(F.rms_norm(x, (i,), nw, 1e-5) @ w.T, *rope, slots, *want, heads)
            for c in ("fused_o1_k128_w4", "fused_o2_k256_r2", "fused_o8_k128"):
                got = [t.clone() for t in buffers]
                q = front_rope(x, w, c, (nw, 1e-5), rope, slots, *got, heads)
                assert q.shape == q_want.shape and q.is_contiguous()
                worst = max(worst, *(float((a - r).abs().max() / r.abs().max()) for a, r in zip([q, *got],
                                                                                                [q_want, *want])))
        print(worst)
    """)
    assert float(out) < 1e-5


@needs_triton
def test_recorded_forward_with_fused_units_is_the_pytorch_one():
    """The static forward a CUDA graph records (eager on the CPU, Triton interpreted) with every cuda_fused unit forced
    (front_rope at 5 rows, front and the rotary's PyTorch ops at 1): a verify of 5 tokens and the step after it give
    PyTorch's hidden states and keys to float32 rounding, each unit ran in every layer, and the table measured every
    unit at 1 and 5 rows and found it computing what the unfused ops compute."""
    out = interpreted(RECORDED_RUN, """
        from specdec.base import tiny_base
        from specdec.engines.cuda import fused as cuda_fused
        from specdec.engines.cuda import kernels as cuda_kernels
        from specdec.engines.eager.lean import lean_layers

        calls = []
        def counted(x, w, config, norm=None, gated=False, residual=None, _f=cuda_fused.product):
            calls.append((norm is not None, gated, residual is not None))
            return _f(x, w, config, norm=norm, gated=gated, residual=residual)
        def counted_rope(*a, _f=cuda_fused.front_rope):
            calls.append("front_rope")
            return _f(*a)
        base = tiny_base(hidden_size=64)
        fast = lean_layers(base.model)
        cuda_fused.CONFIGS = {"fused_o8_k128": cuda_fused.CONFIGS["fused_o8_k128"]}  # (interpreted: brief)
        table = cuda_kernels.CudaTable(torch.device("cpu"), path=None, rows=(1, 5), triton=True)
        table.choice = {s: {r: "linear" for r in table.rows}  # products F.linear: only the fused units differ
                        for s in map(cuda_kernels._shape_key, (m.weight for m in cuda_kernels.decode_linears(base)))}
        g = cuda_kernels._geometry(fast[0])  # the attention and rotary PyTorch's (not measured: interpreted, slow)
        table.attention[g], table.eager[g], table.rope[g] = ({r: f for r in table.rows}
                                                             for f in ("sdpa", "sdpa", "torch"))
        timed = cuda_kernels._best_of  # (each pass run, then every form that passed the check taken as the faster)
        cuda_kernels._best_of = lambda passes, device: {k: float(k == "torch") for k in timed(passes, device)}
        with cuda_kernels.measured(base.model, table=table):
            pass
        measured = all(units == {u: "fused_o8_k128" for u in cuda_fused.UNITS}
                       for c in table.fused.values() for units in c.values())
        for block in table.fused:
            table.fused[block] = {r: {u: "fused_o8_k128" for u in cuda_fused.UNITS if r == 5 or u != "front_rope"}
                                  for r in table.rows}
        cuda_fused.product, cuda_fused.front_rope = counted, counted_rope


        stock = run()
        assert not calls
        with cuda_kernels.measured(base.model, table=table):
            ours = run()
        kinds = {c: calls.count(c) for c in set(calls)}
        print(max(float((s - o).abs().max() / s.abs().max()) for s, o in zip(stock, ours)), measured,
              kinds == {"front_rope": 2, (True, False, False): 2, (True, True, False): 4, (False, False, True): 8})
    """)
    worst, measured, each = out.split()
    # 2 layers × 2 forwards (× 2: o and down), of which the verify's front is front_rope
    assert float(worst) < 1e-5 and measured == "True" and each == "True"


def test_fused_units_are_offered_only_for_the_layers_own_math():
    """A product with a bias (the kernel adds none) is not offered fused, nor one after a norm F.rms_norm does not
    reproduce, nor gated after another activation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    plain = lean_layers(LlamaForCausalLM(config).model)[0]
    assert cuda_fused.units(plain) == ("front", "front_rope", "gated", "o", "down")
    biased = LlamaConfig(**{**config.to_dict(), "attention_bias": True, "mlp_bias": True})
    assert cuda_fused.units(lean_layers(LlamaForCausalLM(biased).model)[0]) == ()
    gelu = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "hidden_act": "gelu"})).model
    assert cuda_fused.units(lean_layers(gelu)[0]) == ("front", "front_rope", "o", "down")


def test_fused_units_are_left_out_where_they_fail_or_differ(tiny, monkeypatch):
    """The fallback: without Triton's interpreter the fused kernel cannot run on CPU tensors (as where Triton fails to
    build), and one that computes other numbers is refused: every unit stays unfused; without Triton none is measured
    and the plan runs every layer unfused."""
    layers = lean_layers(tiny.model)
    table = CudaTable(torch.device("cpu"), path=None, rows=(1, 3, 24), triton=True)
    assert table._measure_fused(layers) == {r: {u: "torch" for u in cuda_fused.UNITS} for r in (1, 3)}  # (24 > 16)
    monkeypatch.setattr(cuda_fused, "product", lambda x, w, c, norm=None, gated=False, residual=None: 1.01 * (
        residual + F.linear(x, w)) if residual is not None else None)
    assert {u for c in table._measure_fused(layers).values() for u in c.values()} == {"torch"}
    off = CudaTable(torch.device("cpu"), path=None, rows=(1, 3), triton=False)
    assert off._measure_fused(layers) == {} and set(off.fused_plan(layers[0])) == {None}


@needs_triton
def test_fused_units_report_times_every_configuration(tmp_path):
    """experiments/fused_units.py (interpreted, tiny shapes): every unit at each row count has the unfused time and
    each configuration's, and a configuration that computes something else is marked, not timed."""
    out = interpreted(f"""
        import json, runpy, sys
        from specdec.engines.cuda import fused as cuda_fused
        cuda_fused.CONFIGS["fused_wrong"] = (2, 64, 4, 0)
        real, real_rope = cuda_fused.product, cuda_fused.front_rope
        twice = lambda c: 2 if c == "fused_wrong" else 1
        cuda_fused.product = lambda x, w, c, **kw: real(x, w, "fused_o2_k64_w4", **kw) * twice(c)
        cuda_fused.front_rope = lambda x, w, c, *a: real_rope(x, w, "fused_o2_k64_w4", *a) * twice(c)
        sys.argv = ["fused_units.py", "--device", "cpu", "--rows", "1", "3", "--layers", "1", "--hidden", "64",
                    "--qkv", "96", "--heads", "4", "2", "12", "--mlp", "80", "--configs", "fused_o1_k128_w4",
                    "fused_wrong", "--out", {str(tmp_path)!r}]
        runpy.run_path("experiments/fused_units.py", run_name="__main__")
        print(json.dumps(json.load(open({str(tmp_path / "fused_units.json")!r}))["us_per_call"]))
    """)
    times = json.loads(out.splitlines()[-1])
    assert set(times) == set(cuda_fused.UNITS) and all(set(rows) == {"1", "3"} for rows in times.values())
    for rows in times.values():
        for row in rows.values():
            assert row["torch"] > 0 and row["fused_o1_k128_w4"] > 0 and row["fused_wrong"] == "!"


def test_a_row_group_as_large_as_the_call_is_measured_once():
    """cuda_fused.distinct: at 1-2 rows a group of 2 or 4 rows launches as its configuration without groups (left out),
    at 3-4 a group of 2 differs, at 5-16 every configuration does."""
    groups = {c for c, (*_, group) in cuda_fused.CONFIGS.items() if group}
    assert {2, 4} <= {cuda_fused.CONFIGS[c][3] for c in groups}
    assert set(cuda_fused.distinct(1)) == set(cuda_fused.distinct(2)) == set(cuda_fused.CONFIGS) - groups
    assert set(cuda_fused.CONFIGS) - set(cuda_fused.distinct(3)) == {c for c in groups if cuda_fused.CONFIGS[c][3] == 4}
    assert all(cuda_fused.distinct(n) == list(cuda_fused.CONFIGS) for n in (5, 9, 16))
