"""Exact compact forms of float32 weights (specdec/engines/cpu/compact.py): found only where they reproduce every weight
bit for bit, decoded by the kernels to those very numbers, used by the kernel table and the native layers where
measurement picks them, greedy-identical decoding, and the float32 kernels wherever a form or its kernel is missing."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.base import load_base, tiny_base
from specdec.drafters.early_exit import EarlyExit
from specdec.engines import measure
from specdec.engines.cpu import compact, kernels, native, native_layer
from specdec.engines.cpu.kernels import COMPACT_KEY, Candidate, KernelTable, _shape_key, measured_kernels
from specdec.engines.eager.lean import decode_linears, lean_layers
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                    reason="no C compiler on this machine")


def gguf_like(o: int, i: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A float32 weight [o, i] as dequantising a GGUF block format gives it: per 32 weights of a row, Q4_1 fp32(d·q + m)
    or Q8_0 d·q, with float16 d (and m)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i // 32, 32, generator=g, dtype=torch.float64) * 0.05
    if kind == "q4":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d, m = ((hi - lo) / 15).half().double(), lo.half().double()
        q = ((w - m) / d).round().clamp(0, 15)
        out = d * q + m  # exact in float64; the float32 cast is the one rounding dequantisation makes
    else:
        d = (w.abs().amax(-1, keepdim=True) / 127).half().double()
        out = d * (w / d).round().clamp(-127, 127)
    return out.float().view(o, i)


@needs_compiler
@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
def test_a_form_is_found_only_where_it_reproduces_every_weight(kind):
    w = gguf_like(64, 96, kind) if kind != "bf16" else torch.randn(64, 96).to(torch.bfloat16).float()
    c = compact.form(w)
    assert c is not None and c.kind == kind and (c.out_features, c.in_features) == (64, 96)
    assert c.nbytes <= w.numel() * {"bf16": 2, "q8": 1.0625, "q4": 0.625}[kind]  # of float32's 4 bytes per weight
    assert compact.form(w) is c  # found once per weight
    w[3, 5] = w[3, 5] + 1e-3  # one weight off its grid (changed in place): found again, and now the form is gone
    assert compact.form(w) is None or compact.form(w).kind != kind
    assert compact.form(torch.randn(64, 96)) is None  # a trained float32 weight has none
    with pytest.raises(ValueError):
        compact.pack(torch.randn(64, 96))  # the kernel table's operand raises: the candidate is left out


@pytest.fixture(params=[6, 12], ids=["reassociated_to_6_rows", "reassociated_always"])
def reassociated(request):
    """smallm.c's compact kernels with its reassociated blocks serving up to 6 rows (the plain ones past that) or every
    row count, whichever the calibration chose, restored after (without AVX-512 neither exists: the plain ones)."""
    if not native.available():
        pytest.skip("no native library")
    lib = native._library()
    before = lib.smallm_reassociated_rows()
    lib.smallm_set_reassociated_rows(request.param)
    yield request.param
    lib.smallm_set_reassociated_rows(before)


@needs_compiler
@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 6, 8, 13, 25])
def test_the_kernels_multiply_with_the_weights_own_numbers(kind, rows, reassociated):
    """One-hot rows pick single weights out: their products are the float32 weights themselves, bit for bit (so the
    kernel decodes every weight to the number the model holds), for an output count that is not a whole number of
    packed blocks and more rows than one pass takes; any rows: the float32 product to rounding. Both ways the compact
    kernels may serve more than 6 rows."""
    o, i = 70, 96
    w = gguf_like(o, i, kind, seed=1) if kind != "bf16" else torch.randn(o, i).to(torch.bfloat16).float()
    c = compact.form(w)
    picks = torch.randint(0, i, (rows,), generator=torch.Generator().manual_seed(rows))
    onehot = torch.zeros(rows, i)
    onehot[torch.arange(rows), picks] = 1.0
    assert torch.equal(compact.gemm(onehot, c), w[:, picks].T)
    x = torch.randn(rows, i)
    torch.testing.assert_close(compact.gemm(x, c), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_builds_without_avx512_read_the_same_numbers_from_the_float16_scales(kind, tmp_path):
    """The layouts hold d (and m) as float16, widened by one instruction with AVX-512 or AVX2's F16C and in plain C
    elsewhere: a library built without -march=native (plain C) and one for AVX2 (where this CPU runs it), each reading
    the layout packed for its own block rows, decode every weight to the model's number, bit for bit."""
    o, i = 70, 96
    w = gguf_like(o, i, kind, seed=2)
    blocks = compact.q4_blocks(w) if kind == "q4" else compact.q8_blocks(w)
    builds = [["-O3"]]
    if {"avx2", "fma", "f16c"} <= set(measure.cpu_fields().get("flags", "").split()):
        builds.append(["-O3", "-mavx2", "-mfma", "-mf16c"])
    for n, flags in enumerate(builds):
        built = tmp_path / f"smallm_{n}.so"
        assert native.compile_library(native.find_compiler(), flags, native.SOURCES, built)
        lib = native.open_library(built)
        packed = getattr(compact, f"pack_{kind}")(*blocks, r=lib.smallm_pack_rows())
        for rows in (1, 5):
            onehot = torch.zeros(rows, i)
            onehot[torch.arange(rows), torch.arange(rows) * 17] = 1.0
            got = torch.empty(rows, o)
            getattr(lib, f"smallm_packed_{kind}")(onehot.data_ptr(), packed.data_ptr(), got.data_ptr(), rows, i, o, 1)
            assert torch.equal(got, w[:, torch.arange(rows) * 17].T), (flags, rows)


@needs_compiler
def test_which_blocks_serve_more_than_six_rows_is_measured_where_the_library_loads():
    lib = native._library()
    chosen = native.reassociated_rows()
    assert chosen in (0, 6, 12)  # 0: no AVX-512 (the plain blocks only), else the calibration's choice
    assert lib.smallm_calibrate() in (0, 6, 12)
    lib.smallm_set_reassociated_rows(chosen)


@needs_compiler
def test_the_prefetch_distance_changes_no_product_and_is_set_per_block_height():
    heights = native.block_rows()
    assert heights in (4, 12)  # AVX2's plain blocks, or AVX-512's
    held = [native.prefetch(r) for r in range(1, 13)]
    with native.prefetch_kept():
        w, x = gguf_like(96, 64, "q4"), torch.randn(5, 64)
        c = compact.form(w)
        before = compact.gemm(x, c)
        native.set_prefetch(0, 16384)
        assert [native.prefetch(r) for r in range(1, 13)] == [16384] * 12
        native.set_prefetch(3, 2048)
        assert (native.prefetch(2), native.prefetch(3)) == (16384, 2048)
        native.set_prefetch(4, 1 << 30)  # clamped to 64 KB
        assert native.prefetch(4) == 65536
        assert torch.equal(compact.gemm(x, c), before)  # only where the codes are asked for from: the same sums
    assert [native.prefetch(r) for r in range(1, 13)] == held  # prefetch_kept restored every height


@needs_compiler
def test_the_prefetch_distance_is_measured_per_block_height_once_per_machine_and_stack(compact_wins, monkeypatch):
    """native_layer.tune_prefetch: per block height, the distance at which a pass through a base's compact native
    stack is fastest, if it beats the compiled default by PREFETCH_MARGIN; skipped for a stack that would not stream
    from memory and where the library cannot set it; attach (through measured_kernels) measures it once per machine and
    stack, caches it with the table and sets it in the library."""
    base = quantised("q4")
    held = [native.prefetch(r) for r in range(1, 13)]
    best = {1: 8192, 2: 4096, 3: 16384}  # the fastest distance at some heights (the default elsewhere)
    win = {1: 0.5, 2: 0.5, 3: 0.99}  # by how much: at 3 rows within the margin
    timed = []

    def fake_time(layers, hidden, *inputs):
        rows = hidden.shape[1]
        timed.append(rows)
        return win.get(rows, 1.0) if native.prefetch(rows) == best.get(rows, 4096) else 1.0

    table = KernelTable(None, rows=(1, 2))
    layers = list(native_layer.stack(lean_layers(base.model), table, lambda f: "compact").values())
    assert {l.form for l in layers} == {"compact"}
    monkeypatch.setattr(native_layer, "_stack_time", fake_time)
    with native.prefetch_kept():
        assert native_layer.tune_prefetch(layers) == {}  # a tiny stack fits the caches: nothing streams, nothing timed
        assert not timed
        monkeypatch.setattr(native_layer, "STREAM_BYTES", 1)
        found = native_layer.tune_prefetch(layers)
        assert found == {r: 8192 if r == 1 else 4096 for r in range(1, native.block_rows() + 1)}
        assert [native.prefetch(r) for r in range(1, 13)] == held  # measuring leaves the library as it was
        with monkeypatch.context() as m:
            m.setattr(native, "block_rows", lambda: 0)  # a library without the setting: its default stays
            assert native_layer.tune_prefetch(layers) == {}
        with measured_kernels(base, table=table):  # attach: measured, cached with the table, set
            assert native.prefetch(1) == 8192 and native.prefetch(2) == 4096
        assert list(table.prefetch.values()) == [found]
        timed.clear()
        with measured_kernels(base, table=table):
            assert native.prefetch(1) == 8192
        assert not timed  # cached: not timed again


@needs_compiler
def test_the_cpus_fma_throughput_is_measured_for_the_compute_roof():
    peak = native.fma_peak(1)  # make bench's compute roof (FLOP/s); its size is the machine's, not asserted here
    assert 0 < peak < float("inf")


@needs_compiler
def test_the_kernel_table_offers_the_compact_kernel_only_to_weights_with_a_form():
    q4, plain = gguf_like(64, 64, "q4"), torch.randn(64, 64)
    assert COMPACT_KEY + "q4" in _shape_key(q4, compact_ok=True) and COMPACT_KEY not in _shape_key(q4)
    assert COMPACT_KEY not in _shape_key(plain, compact_ok=True)
    table = KernelTable(None, rows=(1, 2))
    table.prepare([q4, plain], compact=True)
    assert "native_compact" in table.timings[_shape_key(q4, compact_ok=True)][1]  # measured beside the others
    assert "native_compact" not in table.timings[_shape_key(plain, compact_ok=True)][1]


@needs_compiler
def test_a_missing_compact_kernel_falls_back_to_the_others():
    def missing(x, operand):
        raise RuntimeError("this build has no smallm_packed_q4")

    q4 = gguf_like(64, 64, "q4")
    table = KernelTable(None, rows=(1, 2), compact={"native_compact": Candidate(missing, compact.pack)})
    table.prepare([q4], compact=True)
    timings = table.timings[_shape_key(q4, compact_ok=True)]
    assert "native_compact" not in timings[1] and table.choice[_shape_key(q4, compact_ok=True)][1] in table.candidates
    x = torch.randn(2, 64)
    kernel = table.plan(q4, compact=True)[2]
    torch.testing.assert_close(x @ q4.T if kernel is None else kernel[0](x, kernel[1]), x @ q4.T)


def quantised(kind: str = "q4"):
    """A tiny Llama base (head_dim 16, as layer.c takes) whose decode weights hold GGUF-like numbers, like SmolLM2's."""
    base = tiny_base(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=3)
    with torch.no_grad():
        for k, lin in enumerate(decode_linears(base.model.model)):
            lin.weight.copy_(gguf_like(*lin.weight.shape, kind, seed=k))
    return base


@pytest.fixture
def compact_wins(monkeypatch):
    """Measurement always picks the compact forms: the native layers' (over the lean and the float32 ones) and the
    kernel table's (over every other candidate, for the products outside the layers: the lm_head)."""

    def fake_time(self, weights, rows, passes, offered):
        return {name: 0.5 if name == "native_compact" else 1.0 for name in offered}

    monkeypatch.setattr(native_layer, "measure", lambda ways, reps=3, counts=native_layer.ROWS: {
        r: {"lean": 3.0, **{way: 1.0 if way == "compact" else 2.0 for way in ways}} for r in counts})
    monkeypatch.setattr(KernelTable, "_time", fake_time)


@pytest.fixture
def compact_forced(monkeypatch):
    """The forms of the native layers that ran as a stack (what the sampler calls for a batch of one), one entry per
    layer; the tables below and the engines (cpu_kernels=native) take the compact forms wherever a weight has one."""
    ran = []
    run_stack = native_layer._run_stack

    def counted_stack(layers, *args, **kwargs):
        ran.extend(layer.form for layer in layers)
        return run_stack(layers, *args, **kwargs)

    monkeypatch.setattr(native_layer, "_run_stack", counted_stack)
    return ran


@needs_compiler
@pytest.mark.parametrize("kw", [dict(), dict(gamma=3), dict(tree="dynamic", dynamic_depth=2, dynamic_topk=2,
                                                          dynamic_budget=4)])
def test_decoding_from_compact_forms_is_greedy_identical(compact_forced, kw):
    """Plain decoding, a chain and a tree over a base whose weights have q4 forms (its lm_head a q8 one), its layers
    and lm_head multiplied from them: the tokens of PyTorch's own float32 forward, and of compact_weights=false."""
    base = quantised()
    with torch.no_grad():
        base.lm_head.weight.copy_(gguf_like(*base.lm_head.weight.shape, "q8", seed=99))
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1).eval() if kw else None
    prompts = [list(range(30, 49))]
    cfg = SamplerConfig(max_new_tokens=12, eos_token_id=[], **kw)
    stock = generate(base, prompts, drafter, cfg, engine=auto_engine(name="eager"))
    with measured_kernels(base, *([drafter] if drafter else []), table=KernelTable(None, rows=(1, 2, 4, 8, 16), forced=True)):
        assert all(native_layer.rows_of(f)[1].form == "compact" for f in lean_layers(base))
        assert compact.form(base.lm_head.weight).kind == "q8"
        got = generate(base, prompts, drafter, cfg, engine=auto_engine())
    assert "compact" in compact_forced  # ran from the compact forms
    assert got.tokens.tolist() == stock.tokens.tolist() and got.accepted == stock.accepted
    compact_forced.clear()
    plain = generate(base, prompts, drafter, cfg, engine=auto_engine(compact_weights=False))
    assert "compact" not in compact_forced and plain.tokens.tolist() == stock.tokens.tolist()


@pytest.mark.slow
@pytest.mark.long  # (20-40 s: HF generate in float32 beside ours on the real base)
@needs_compiler
def test_smollm2_holds_its_gguf_blocks_and_decodes_greedy_identical_to_hf(compact_forced):
    """The embedded SmolLM2: every decode weight has the q4 form of its GGUF's Q4_1 blocks and the tied lm_head the
    q8 form of its Q8_0 ones; decoding from them gives HF generate's tokens."""
    base = load_base(device="cpu")
    assert {compact.form(lin.weight).kind for lin in decode_linears(base.model.model)} == {"q4"}
    assert compact.form(base.lm_head.weight).kind == "q8"
    ids = base.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                         return_tensors="pt").input_ids
    hf = base.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    with measured_kernels(base, table=KernelTable(None, rows=(1, 2, 4, 8, 16), forced=True)):
        ours = generate(base, ids.tolist(), None, SamplerConfig(max_new_tokens=24, eos_token_id=[]),
                        engine=auto_engine())
    assert compact_forced and set(compact_forced) == {"compact"}
    assert ours.tokens[0].tolist() == hf.tolist()


@needs_compiler
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_block_rounding_for_a_drafter_moves_each_weight_by_at_most_half_a_step(kind):
    """draft_precision=q8 / q4 (compact.quantize_q8 / quantize_q4): a drafter's trained weight, which has no exact form,
    rounded to Q8_0 / Q4_1 blocks; each weight within d/2 of itself (d = its group's largest magnitude / 127, or its
    range / 15), and the kernel multiplies with exactly the rounded numbers (compact.rounded). Only a drafter's weights
    get it: the kernel table offers it under its draft_precision (q4 offers Q8_0 too) and never to an exact weight."""
    w = torch.randn(40, 96)
    w[1, :32] = 0  # an all-zero group rounds to zeros, not NaNs
    c = getattr(compact, f"quantize_{kind}")(w)
    r = native._library().smallm_pack_rows()  # rows are packed in blocks of r, the last one zero-padded
    per_weight = {"q8": 1.0625, "q4": 0.625}[kind]
    assert c.kind == kind and (c.out_features, c.in_features) == (40, 96)
    assert c.nbytes <= -(-40 // r) * r * 96 * per_weight
    rounded = compact.gemm(torch.eye(96), c).T  # one-hot rows read the rounded weights back: [40, 96]
    groups = w.view(40, 3, 32)
    step = (groups.abs().amax(-1, keepdim=True) / 127 if kind == "q8"
            else (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15)
    # half a step, and a hair more: the scales are float16 numbers (llama.cpp's), d and m each off by up to 2^-11
    assert bool(((rounded - w).view(40, 3, 32).abs() <= step * (0.5 + 2**-10) + 1e-6).all())
    assert bool((rounded[1, :32] == 0).all()) and bool(torch.isfinite(rounded).all())
    torch.testing.assert_close(rounded, compact.rounded(w, kind), rtol=0, atol=1e-6)
    x = torch.randn(5, 96)
    torch.testing.assert_close(compact.gemm(x, c), x @ rounded.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        getattr(compact, f"quantize_{kind}")(torch.randn(8, 40))  # not whole groups
    assert f"~{kind}" in _shape_key(w, bf16=True, quant=kind)
    assert f"~{kind}" not in _shape_key(w, bf16=False, quant=kind)  # an exact weight never
    table = KernelTable(None, rows=(1, 2))
    offered = table._offered(_shape_key(w, bf16=True, quant=kind))
    assert "native_q8" in offered and ("native_q4" in offered) == (kind == "q4")
    assert not {"native_q8", "native_q4"} & set(table._offered(_shape_key(w, bf16=True)))


def q4a8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """smallm_q4a8's sums in float64: x [M, I] rounded per group of 32 as the kernel rounds it (xq = rint(x·127/most),
    s = most/127, in float32), the codes' integer dot products with xq, then Σ_g d·s·(Σ q·xq) + m·Σ x."""
    d, m, q = compact._q4_rounded(w)  # [O, G, 1], [O, G, 1], [O, G, 32]
    rows, i = x.shape
    g = x.view(rows, i // 32, 32)
    most = g.abs().amax(-1, keepdim=True)
    inv = torch.where(most > 0, 127 / most, torch.zeros_like(most))
    xq = (g * inv).round()  # [M, G, 32], float32 as the kernel's; exact integers
    s = (most / 127).double()
    dots = torch.einsum("mgc,ogc->mog", xq.double(), q.double())  # [M, O, G], exact
    return (dots * d.double().squeeze(-1) * s.squeeze(-1)[:, None]
            + m.double().squeeze(-1) * g.double().sum(-1)[:, None]).sum(-1).float()


@needs_compiler
def test_q4a8_products_are_the_codes_times_int8_inputs(tmp_path):
    """draft_precision=q4a8 (compact.quantize_q4a8, smallm_q4a8): a drafter's weight rounded to Q4_1 blocks with float16
    scales (0.625 bytes per weight), each input row rounded to int8 per group of 32, multiplied as integers: the kernel
    gives those sums (q4a8_reference) at every row count and block height, for a partial last block of 16 rows, an
    all-zero input group and an all-zero weight group; the plain C build and the AVX2 one (a CPU without VNNI; the latter
    where this CPU runs AVX2) give them too. The kernel table offers it only under q4a8, never to q4's or q8's keys, and
    by default only where it sums with SIMD dot products."""
    torch.manual_seed(0)
    w = torch.randn(40, 96) * 0.05
    w[3, 32:64] = 0
    c = compact.quantize_q4a8(w)
    assert c.kind == "q4a8" and c.nbytes == 3 * 16 * 96 * 5 // 8  # 3 blocks of 16 rows (the last padded), 0.625 B
    groups = w.view(40, 3, 32)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    # each weight within half a step of itself (and float16's rounding of the scales)
    assert bool(((compact.rounded(w, "q4a8") - w).view(40, 3, 32).abs() <= step / 2 * 1.01 + 1e-6).all())
    builds = {0: ["-O3"]}  # smallm.c alone, without -march=native: the plain C sums; and AVX2's where it runs here
    if {"avx2", "fma", "f16c"} <= set(measure.cpu_fields().get("flags", "").split()):
        builds[1] = ["-O3", "-mavx2", "-mfma", "-mf16c"]
    others = []
    for simd, flags in builds.items():
        built = tmp_path / f"smallm_{simd}.so"
        assert native.compile_library(native.find_compiler(), flags, native.SOURCES, built)
        others.append(native.open_library(built))
        assert others[-1].smallm_q4a8_simd() == simd
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 96)
        x[0, :32] = 0
        want = q4a8_reference(x, w)
        torch.testing.assert_close(compact.gemm(x, c), want, rtol=1e-5, atol=1e-5)
        for lib in others:
            got = torch.empty(rows, 40)
            lib.smallm_q4a8(x.data_ptr(), c.blocks.data_ptr(), got.data_ptr(), rows, 96, 40, 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # against the float32 product of the rounded weights: off by x's rounding only (~1 % of the largest output)
    x = torch.randn(4, 96)
    exact = x @ compact.rounded(w, "q4a8").T
    assert float((compact.gemm(x, c) - exact).abs().max()) < kernels.TOLERANCE["a8"] * float(exact.abs().max())
    with pytest.raises(ValueError):
        compact.quantize_q4a8(torch.randn(8, 40))  # not whole groups
    # offered by default only where the library sums with SIMD dot products (its plain C form never wins); given,
    # everywhere
    assert ("native_q4a8" in KernelTable(None, rows=(1, 2)).quant) == native.int8_dots() == bool(
        native._library().smallm_q4a8_simd())
    table = KernelTable(None, rows=(1, 2), quant=kernels.QUANT)
    assert {"native_q8", "native_q4", "native_q4a8"} <= set(table._offered(_shape_key(w, bf16=True, quant="q4a8")))
    for other in ("q4", "q8"):
        assert "native_q4a8" not in table._offered(_shape_key(w, bf16=True, quant=other))
