"""Pinning numpy's BLAS to one thread, which the merge's bit-identity rests on."""

from workloads.merge import blas


def threads() -> list[int]:
    return [int(getter()) for _, getter in blas._openblas_calls()]


def test_numpy_openblas_is_found_pinned_to_one_thread_and_restored():
    before = threads()
    assert before, "numpy's OpenBLAS was not found in this process"
    with blas.single_threaded() as pinned:
        assert pinned and threads() == [1] * len(before)
    assert threads() == before


def test_the_accumulating_sgemm_is_numpy_s_matmul_plus_the_base_bit_for_bit():
    """The merge's product accumulated into the base (cblas_sgemm with beta = 1 from numpy's own
    OpenBLAS) is the bits of numpy's float32 matmul followed by the add; operands it cannot take
    are refused rather than read with wrong strides."""
    import numpy as np
    import pytest

    assert blas.has_sgemm(), "numpy's OpenBLAS exports no cblas_sgemm: the merge adds separately"
    rng = np.random.default_rng(0)
    left = rng.standard_normal((300, 64), dtype=np.float32) * 0.01
    right = rng.standard_normal((64, 5376), dtype=np.float32)
    base = rng.standard_normal((300, 5376), dtype=np.float32) * 0.02
    with blas.single_threaded():
        expected = base + np.matmul(left, right)
        got = base.copy()
        blas.sgemm_accumulate(left, right, got)
    assert got.tobytes() == expected.tobytes()
    with pytest.raises(ValueError, match="C-contiguous float32"):
        blas.sgemm_accumulate(np.asfortranarray(left), right, base.copy())
    with pytest.raises(ValueError, match="C-contiguous float32"):
        blas.sgemm_accumulate(left, right, base[:, :100].copy())
