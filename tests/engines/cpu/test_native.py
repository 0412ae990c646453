"""The native small-M product (specdec/engines/cpu/smallm.c via native.py): it computes x·Wᵀ for every row count and
odd shape, is built once per machine and cached, and without a compiler it is simply a candidate fewer."""

from __future__ import annotations

import mmap
import shutil

import pytest
import torch
import torch.nn.functional as F

from specdec.engines.cpu import native
from specdec.engines.cpu.kernels import CANDIDATES, KernelTable

has_compiler = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """native.py with an empty build cache in tmp_path and nothing loaded yet."""
    monkeypatch.setattr(native, "CACHE", tmp_path / "native")
    native._load.cache_clear()
    yield tmp_path / "native"
    native._load.cache_clear()


@pytest.mark.skipif(not has_compiler, reason="no C compiler on this machine")
@pytest.mark.parametrize("threads", [1, 2])
def test_small_gemm_is_the_product(threads):
    """Every row count (blocks of up to 12 rows and what remains), inputs with a tail past the vector width, and
    output rows that do not split evenly over the threads."""
    assert native.available()
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, o in [(64, 48), (37, 7), (13, 130), (576, 960)]:
            w = torch.randn(o, i, generator=g)
            for m in [1, 2, 3, 5, 8, 11, 12, 13, 25]:
                x = torch.randn(m, i, generator=g)
                torch.testing.assert_close(native.small_gemm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    # a non-contiguous operand is multiplied as what it is, not as its storage
    w = torch.randn(40, 96, generator=g)[:, ::2]
    x = torch.randn(3, 48, generator=g)
    torch.testing.assert_close(native.small_gemm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        native.small_gemm(x.double(), w.double())


@pytest.mark.skipif(not has_compiler, reason="no C compiler on this machine")
def test_built_once_per_machine(fresh, monkeypatch):
    assert native.available()
    built = list(fresh.glob("smallm-*.so"))
    assert len(built) == 1
    native._load.cache_clear()
    monkeypatch.setattr(native.subprocess, "run", _no_compile(native.subprocess.run))
    assert native.available()  # loaded from the cache: the compiler was only asked its version
    assert list(fresh.glob("smallm-*.so")) == built


def _no_compile(run):
    def guarded(cmd, *args, **kwargs):
        if "--version" not in cmd:
            pytest.fail(f"compiled again: {cmd}")
        return run(cmd, *args, **kwargs)
    return guarded


@pytest.mark.parametrize("how", ["no compiler", "switched off"])
def test_without_the_library_the_candidate_is_left_out(fresh, monkeypatch, tmp_path, how):
    if how == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        monkeypatch.setenv("SPECDEC_NATIVE", "0")
    assert not native.available()
    with pytest.raises(RuntimeError):
        native.small_gemm(torch.randn(2, 8), torch.randn(4, 8))
    table = KernelTable(None, candidates={"linear": CANDIDATES["linear"], "native": CANDIDATES["native"]},
                        rows=(1, 2, 5))
    table.prepare([torch.randn(48, 16)])
    assert set(table.choice["48x16:float32"].values()) == {"linear"}
    assert set(table.timings["48x16:float32"][1]) == {"linear"}  # never timed


@pytest.mark.skipif(not has_compiler, reason="no C compiler on this machine")
def test_bf16_weights_are_the_product_of_the_rounded_weights():
    """A bfloat16 W: x (float32) times W's own bf16 values, summed in float32 (the drafters' BF16 candidate)."""
    assert native.available()
    g = torch.Generator().manual_seed(1)
    for i, o in [(64, 48), (37, 7), (576, 960)]:
        w = torch.randn(o, i, generator=g).bfloat16()
        for m in [1, 2, 5, 13]:
            x = torch.randn(m, i, generator=g)
            torch.testing.assert_close(native.small_gemm(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        native.small_gemm(x.bfloat16(), w)  # x stays float32


@pytest.mark.skipif(not has_compiler, reason="no C compiler on this machine")
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_product(threads):
    """The packed layout: every row count (passes of up to 12 rows and what remains), output rows that do not fill a
    block or split evenly over the threads, float32 and bfloat16 weights."""
    assert native.available()
    g = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, o in [(64, 48), (37, 7), (13, 130), (576, 960), (576, 33)]:
            w = torch.randn(o, i, generator=g)
            exact, rounded = native.pack(w), native.pack(w.bfloat16())
            for m in [1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 25]:
                x = torch.randn(m, i, generator=g)
                torch.testing.assert_close(native.packed_gemm(x, exact), F.linear(x, w), rtol=1e-5, atol=1e-4)
                torch.testing.assert_close(native.packed_gemm(x, rounded), F.linear(x, w.bfloat16().float()),
                                           rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError):
        native.packed_gemm(torch.randn(2, 63), native.pack(torch.randn(8, 64)))  # inputs do not match


@pytest.mark.skipif(not has_compiler, reason="no C compiler on this machine")
def test_a_flag_set_that_fails_says_why(fresh, monkeypatch, capsys):
    """Sources that do not compile with the first flag set build with the next one, and the build says so with the
    compiler's error: a library without -march=native runs the same products many times slower."""
    broken, other = fresh.parent / "broken.c", fresh.parent / "other.c"
    broken.write_text("#ifdef BREAK\n#error broken on purpose\n#endif\nint f(void) { return 1; }\n")
    other.write_text("int g(void) { return 2; }\n")
    monkeypatch.setattr(native, "SOURCES", (broken, other))
    monkeypatch.setattr(native, "FLAGS", (["-O1", "-DBREAK"], ["-O1"]))
    path = native._build(native.find_compiler())
    assert path is not None and path.name.endswith("-O1.so")
    said = capsys.readouterr().out
    assert "native kernels built with -O1: -O1 -DBREAK failed" in said and "broken on purpose" in said
    errors: list[str] = []
    assert native.compile_library(native.find_compiler(), ["-DBREAK"], [broken], fresh.parent / "x.so", errors) is False
    assert len(errors) == 1 and "broken on purpose" in errors[0]


def test_huge_page_copies_hold_the_same_numbers(monkeypatch):
    """Weight copies go to regions advised MADV_HUGEPAGE (each a huge page aligned, copies carved one after another);
    small tensors and a platform without the advice keep the tensor as it was."""
    monkeypatch.setattr(native, "_arena", [None, 0])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 576, generator=g), torch.randint(0, 255, (700_000,), generator=g).to(torch.uint8)
    ca, cb = native.huge_pages(a), native.huge_pages(b)
    assert torch.equal(ca, a) and torch.equal(cb, b) and ca.dtype == a.dtype and ca.shape == a.shape
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: both carved from one region, the first on its start
        assert ca.data_ptr() % native.HUGE_PAGE == 0 and ca.data_ptr() != a.data_ptr()
        assert cb.data_ptr() == ca.data_ptr() + (a.numel() * 4 + 63) // 64 * 64
    small = torch.randn(10, 10)
    assert native.huge_pages(small) is small
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    assert native.huge_pages(a) is a
    monkeypatch.delenv("SPECDEC_HUGE_PAGES")
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    monkeypatch.setattr(native, "_arena", [None, 0])
    assert native.huge_pages(a) is a
