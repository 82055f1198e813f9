"""Pinning numpy's and scipy's BLAS to one thread, which the merge's bit-identity rests on."""

import os
import subprocess
import sys

from workloads.merge import blas


def threads() -> list[int]:
    return [int(getter()) for _, getter in blas._openblas_calls()]


def test_numpy_openblas_is_found_pinned_to_one_thread_and_restored():
    before = threads()
    assert len(before) == 2, "numpy's and scipy's OpenBLAS were not both found in this process"
    with blas.single_threaded() as pinned:
        assert pinned and threads() == [1] * len(before)
    assert threads() == before


def test_children_start_with_one_blas_thread_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    probe = (
        "import numpy; from workloads.merge import blas; "
        "print([int(g()) for _, g in blas._openblas_calls()])"
    )
    with blas.single_threaded_children():
        seen = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout.strip()
    assert seen == "[1, 1]"  # numpy's OpenBLAS and scipy's (the merge's products), both pinned
    assert os.environ["OPENBLAS_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ
