"""Shared test setup: fake CPU devices and a persistent JAX compilation cache.

XLA_FLAGS must be set before JAX is imported anywhere, so it is set here at collection time.
Shared fixtures live in tests/fixtures/<area>.py and are listed in `pytest_plugins`.
"""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# JAX's CPU client runs a program on another thread than the caller's (async dispatch), and
# programs dispatched op by op on a multi-device mesh can wait on each other forever (JAX issue
# 25861): once in CI a test's eager backward pass on 2 devices never returned. Synchronous
# dispatch costs nothing measurable here (test_training + test_resume: 137 s against 134 s).
os.environ.setdefault("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins: list[str] = [
    "tests.fixtures.tiny_model",
    "tests.fixtures.sshd",
    "tests.fixtures.gcs_server",
    "tests.fixtures.gcs_faults",
    "tests.fixtures.localcloud",
    "tests.fixtures.tpu_api",
]


def pytest_collection_modifyitems(config, items):
    """In an xdist worker run with `--no-loadscope-reorder` (CI's waiting slow tests): the test
    files heaviest first (tests/scheduling.py), so that the longest files start first and the
    workers end close together. Without the option xdist sorts the files by their number of
    tests whatever this order is; in one process the order does not change the time."""
    if not hasattr(config, "workerinput") or config.getoption("loadscopereorder", True):
        return
    from tests import scheduling

    items[:] = scheduling.heaviest_files_first(items, scheduling.load())
