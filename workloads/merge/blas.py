"""Runs numpy's BLAS on one thread, for reproducible merged weights and workers that do not fight.

A BLAS may round a matrix product differently depending on how many threads share it (it may
split the work, and the kernel it picks, another way; numpy's OpenBLAS gave the same bits on 1 and
2 threads for the 31B model's shapes here, but does not promise it), and a last-bit difference
can flip the bf16 rounding of a merged weight. The merge therefore computes every delta on one
BLAS thread and gets its parallelism from its own threads instead, each of which calls the BLAS
on itself; the setting goes through the BLAS's own call (threadpoolctl does the same; it is not a
dependency of the project).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

# OpenBLAS's own calls, under the names its builds export (numpy's wheels: scipy_openblas64_).
_PREFIXES = ("openblas", "scipy_openblas")
_SUFFIXES = ("", "64_", "_64")


@functools.cache
def _openblas_calls() -> list[tuple[Callable[..., int], Callable[..., int]]]:
    """(set_num_threads, get_num_threads) of every OpenBLAS loaded in this process (numpy loads
    its BLAS when it is imported, so the answer does not change once numpy is in)."""
    paths = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1]
                if "openblas" in os.path.basename(path).lower() and ".so" in path:
                    paths.add(path)
    except OSError:
        return []
    calls = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    calls.append((setter, getter))
    return calls


@contextlib.contextmanager
def single_threaded() -> Iterator[bool]:
    """numpy's OpenBLAS on one thread inside the block (the previous count is restored).

    Yields:
        False when no OpenBLAS was found to pin (another BLAS: its products may then depend on
        its thread count).
    """
    import numpy  # noqa: F401 - loads the BLAS, so that it can be found

    calls = _openblas_calls()
    saved = [int(getter()) for _, getter in calls]
    for setter, _ in calls:
        setter(1)
    try:
        yield bool(calls)
    finally:
        for (setter, _), count in zip(calls, saved, strict=True):
            setter(count)


# cblas enums (cblas.h): row-major storage, no transpose.
_ROW_MAJOR, _NO_TRANS = 101, 111
# cblas_sgemm under the names OpenBLAS builds export it: (name, integer type of its sizes).
_SGEMM_NAMES = (
    ("scipy_cblas_sgemm64_", ctypes.c_int64),  # numpy's wheels: 64-bit integer interface
    ("cblas_sgemm64_", ctypes.c_int64),
    ("scipy_cblas_sgemm", ctypes.c_int32),
    ("cblas_sgemm", ctypes.c_int32),
)


@functools.cache
def _numpy_sgemm() -> tuple[Any, type[ctypes.c_int64] | type[ctypes.c_int32]] | None:
    """cblas_sgemm of numpy's own OpenBLAS (the library numpy's float32 matmul calls), or None."""
    import numpy  # noqa: F401 - loads the BLAS, so that it can be found

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = sorted(
                {
                    line.split()[-1]
                    for line in maps
                    if "openblas" in os.path.basename(line.split()[-1]).lower()
                    and ".so" in line.split()[-1]
                }
            )
    except OSError:
        return None
    for path in sorted(paths, key=lambda p: "numpy" not in p):  # numpy's before scipy's
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name, integer in _SGEMM_NAMES:
            function = getattr(lib, name, None)
            if function is not None:
                enum, real, pointer = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
                function.restype = None
                function.argtypes = [enum, enum, enum, integer, integer, integer, real]
                function.argtypes += [pointer, integer, pointer, integer, real, pointer, integer]
                return function, integer
    return None


def has_sgemm() -> bool:
    return _numpy_sgemm() is not None


def sgemm_accumulate(left: Any, right: Any, out: Any) -> None:
    """out += left @ right, float32 row-major arrays, by one call of numpy's cblas_sgemm with
    beta = 1: the call numpy's matmul makes (beta = 0), except that the finished sum of each
    element is added to `out` instead of stored (see mapping.FUSED_ADD_MAX_RANK).

    Raises:
        ValueError: an operand that is not a C-contiguous float32 matrix of matching shape.
        RuntimeError: numpy's OpenBLAS exports no cblas_sgemm (has_sgemm() is False).
    """
    import numpy as np

    found = _numpy_sgemm()
    if found is None:
        raise RuntimeError("numpy's BLAS exports no cblas_sgemm")
    function, _ = found
    (m, k), (k2, n) = left.shape, right.shape
    if (
        out.shape != (m, n)
        or k2 != k
        or any(
            a.dtype != np.float32 or not a.flags.c_contiguous or a.ndim != 2
            for a in (left, right, out)
        )
        or not out.flags.writeable
    ):
        raise ValueError(
            f"sgemm_accumulate: needs C-contiguous float32 (m, k) @ (k, n) into (m, n), got "
            f"{left.shape} @ {right.shape} into {out.shape}"
        )
    if m == 0 or n == 0:
        return
    function(
        _ROW_MAJOR,
        _NO_TRANS,
        _NO_TRANS,
        m,
        n,
        k,
        1.0,
        left.ctypes.data,
        max(k, 1),
        right.ctypes.data,
        n,
        1.0,  # beta: C = left @ right + C
        out.ctypes.data,
        n,
    )
