"""experiments/ab_native.py: the packed product built from smallm.c at a git revision, next to the one built now."""

import pytest
import torch

from conftest import experiment_script
from specdec.sampling import native


@pytest.mark.skipif(native.find_compiler() is None or not native.available(), reason="no native kernel here")
def test_library_at_a_revision_multiplies_like_the_current_one(tmp_path):
    ab = experiment_script("ab_native")
    old = ab.library_at("HEAD", tmp_path)
    assert old is not native._library()
    w, x = torch.randn(100, 48), torch.randn(5, 48)  # 100 rows: a partly filled last packed block
    with ab.using(old):
        y_old = native.packed_gemm(x, native.pack(w))
    assert native._library() is not old  # restored
    y_now = native.packed_gemm(x, native.pack(w))
    torch.testing.assert_close(y_old, x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_now, y_old, rtol=1e-5, atol=1e-5)
