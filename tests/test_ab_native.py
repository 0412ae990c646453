"""experiments/ab_native.py: the packed product built from smallm.c at a git revision, next to the one built now."""

import importlib.util
from pathlib import Path

import pytest
import torch

from specdec.sampling import native

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("ab_native", ROOT / "experiments" / "ab_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(native.find_compiler() is None or not native.available(), reason="no native kernel here")
def test_library_at_a_revision_multiplies_like_the_current_one(tmp_path):
    ab = _script()
    old = ab.library_at("HEAD", tmp_path)
    assert old is not native._library()
    w, x = torch.randn(100, 48), torch.randn(5, 48)  # 100 rows: a partly filled last packed block
    with ab.using(old):
        y_old = native.packed_gemm(x, native.pack(w))
    assert native._library() is not old  # restored
    y_now = native.packed_gemm(x, native.pack(w))
    torch.testing.assert_close(y_old, x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_now, y_old, rtol=1e-5, atol=1e-5)
