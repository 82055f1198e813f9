"""Runs the BLAS on one thread, for reproducible merged weights and workers that do not fight.

The merge's products are scipy's sgemm (mapping.py); numpy and scipy each ship an OpenBLAS, and
both are pinned. A BLAS rounds a matrix product differently depending on how many threads share
it (measured with numpy's OpenBLAS: the same 512-row LoRA delta on 1 and on 2 threads differs
in the last bit of some elements, enough to flip the bf16 rounding of a merged weight). The merge
therefore computes every delta on one BLAS thread and gets its parallelism from worker processes
instead; a worker gets the setting from its environment before it loads its BLAS, this process
through the BLAS's own call (threadpoolctl does the same; it is not a dependency of the project).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

# Environment variables a BLAS reads once, when it is loaded.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# OpenBLAS's own calls, under the names its builds export (numpy's wheels: scipy_openblas64_).
_PREFIXES = ("openblas", "scipy_openblas")
_SUFFIXES = ("", "64_", "_64")


@functools.cache
def _openblas_calls() -> list[tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]]:
    """(set_num_threads, get_num_threads) of every OpenBLAS loaded in this process (numpy and
    scipy.linalg.blas load theirs when imported: both are imported first, so the answer does not
    change afterwards)."""
    import numpy  # noqa: F401 - loads the BLAS, so that it can be found
    import scipy.linalg.blas  # noqa: F401 - the merge's products (mapping.py)

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
    """numpy's and scipy's OpenBLAS on one thread inside the block (the previous counts are
    restored).

    Yields:
        False when no OpenBLAS was found to pin (another BLAS: its products may then depend on
        its thread count).
    """
    calls = _openblas_calls()
    saved = [int(getter()) for _, getter in calls]
    for setter, _ in calls:
        setter(1)
    try:
        yield bool(calls)
    finally:
        for (setter, _), count in zip(calls, saved, strict=True):
            setter(count)


@contextlib.contextmanager
def single_threaded_children() -> Iterator[None]:
    """Processes started inside the block load their BLAS with one thread (from the
    environment); this process's own BLAS, already loaded, is not affected."""
    saved = {name: os.environ.get(name) for name in THREAD_VARS}
    os.environ.update(dict.fromkeys(THREAD_VARS, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
