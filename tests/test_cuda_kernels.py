"""The CUDA products and attention chosen by measurement (cuda_kernels.py), on the CPU: the Triton kernel through
Triton's interpreter (a subprocess with TRITON_INTERPRET=1), the table, the patching and the fallbacks. Their speed
is measured on a GPU (experiments/profile_verify.py, cuda_check.sh), never here."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from specdec.sampling import cuda_kernels, graphs
from specdec.sampling.cuda_kernels import CudaTable, math_attention
from specdec.sampling.lean import lean_layers

needs_triton = pytest.mark.skipif(not cuda_kernels.available(), reason="triton is not installed")


def interpreted(code: str) -> str:
    """Run `code` in a fresh Python with Triton's interpreter on (kernels run on CPU tensors); its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_triton
def test_small_m_kernel_is_the_product_for_every_config_and_row_count():
    out = interpreted("""
        import torch
        from specdec.sampling.cuda_kernels import CONFIGS, small_m_linear
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
        from specdec.sampling import cuda_kernels
        from specdec.sampling.cuda_kernels import CONFIGS, CudaTable, measured
        from specdec.sampling.decode import SamplerConfig, _generate

        cuda_kernels.CONFIGS = {{k: cuda_kernels.CONFIGS[k] for k in ("triton_o16_k64_s2", "triton_o32_k64")}}  # brief
        base = tiny_base()
        table = CudaTable(torch.device("cpu"), path={str(tmp_path / "t.json")!r}, rows=(1, 5))
        cfg = SamplerConfig(max_new_tokens=6, eos_token_id=[])
        stock = _generate(base, [[1, 2, 3, 4]], None, cfg, None).tokens
        with measured(base, table=table):
            assert table.choice and all(set(c) == {{1, 5}} for c in table.choice.values())
            assert "linear" in next(iter(table.timings.values()))[1]
        for shape in table.choice:  # every product through one Triton config, the attention as matmul + softmax
            table.choice[shape] = {{r: "triton_o16_k64_s2" for r in table.rows}}
        for g in table.attention:
            table.attention[g] = {{r: "math" for r in table.rows}}
        with measured(base, table=table):
            assert cuda_kernels.active() is not None
            ours = _generate(base, [[1, 2, 3, 4]], None, cfg, None).tokens
        assert cuda_kernels.active() is None
        print(torch.equal(stock, ours))
    """)
    assert out.strip() == "True"


def test_measured_patches_and_restores_linears_and_attention(tiny, tmp_path):
    table = CudaTable(torch.device("cpu"), path=tmp_path / "t.json", rows=(1, 2), triton=False)
    fast = lean_layers(tiny.model)
    with measured_tables(tiny, table) as t:
        assert t is table and cuda_kernels.active() is not None
        assert all(len(f.attention_rows) == 3 for f in fast)  # one form (or SDPA's None) per query count 0..2
        assert set(table.candidates()) == {"linear"}  # without Triton: PyTorch's product only, so nothing patched
        assert not any("forward" in lin.__dict__ for lin in (f.qkv for f in fast))
    assert all(f.attention_rows == [] for f in fast) and cuda_kernels.active() is None
    # measured once, then read back from the cache file (same machine, same candidates)
    again = CudaTable(torch.device("cpu"), path=tmp_path / "t.json", rows=(1, 2), triton=False)
    assert again.choice == table.choice and again.attention == table.attention


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
