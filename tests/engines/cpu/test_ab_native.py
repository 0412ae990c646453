"""experiments/ab_native.py: the native library built from other sources, swapped in for the products and back."""

import pytest
import torch

from specdec.engines.cpu import native

from conftest import experiment_script


@pytest.mark.skipif(native.find_compiler() is None or not native.available(), reason="no native kernel here")
def test_a_library_from_other_sources_is_the_one_that_runs(tmp_path):
    ab = experiment_script("ab_native")
    source = native.SOURCE.read_text()
    assert "#define QPREFETCH 4096" in source
    # another revision of smallm.c: its compiled-in prefetch distance differs, its products do not
    other = ab.library_from({"smallm.c": source.replace("#define QPREFETCH 4096", "#define QPREFETCH 12288"),
                             "layer.c": native.LAYER_SOURCE.read_text(), "chain.c": native.CHAIN_SOURCE.read_text()},
                            tmp_path, "a changed prefetch")
    assert other is not native._library() and other.smallm_prefetch(1) == 12288
    w, x = torch.randn(100, 48), torch.randn(5, 48)  # 100 rows: a partly filled last packed block
    with ab.using(other):
        assert native._library() is other
        y_other = native.packed_gemm(x, native.pack(w))
    assert native._library() is not other  # restored
    torch.testing.assert_close(y_other, x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native.packed_gemm(x, native.pack(w)), y_other, rtol=1e-5, atol=1e-5)
