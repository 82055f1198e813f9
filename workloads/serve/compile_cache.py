"""The persistent XLA compilation cache between the serving host and GCS.

vLLM on TPU compiles one graph per token bucket at start-up (~8 minutes for Gemma 4 31B on v6e-8)
and writes each compiled executable as a file under VLLM_XLA_CACHE_PATH. Entries are write-once
files named by a hash of what was compiled, so syncing is "copy the files the other side lacks or
has at a different size"; nothing is ever deleted on either side.
"""

from __future__ import annotations

import pathlib

from workloads.common import storage


def restore(remote: str, local_dir: str) -> int:
    """Downloads cache entries that local_dir lacks. Returns how many were fetched (0 when the
    remote cache does not exist yet, e.g. on the first start)."""
    pathlib.Path(local_dir).mkdir(parents=True, exist_ok=True)
    return len(storage.copy_tree(remote, local_dir))


def push(local_dir: str, remote: str, *, min_age_s: float = 0) -> int:
    """Uploads cache entries the remote lacks. Returns how many were uploaded.

    Args:
        min_age_s: skip files modified in the last N seconds (while vLLM may still be writing
            them); the final sync after the container stopped uses 0.
    """
    return len(storage.copy_tree(local_dir, remote, min_age_s=min_age_s))
