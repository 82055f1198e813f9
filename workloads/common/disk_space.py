"""A full disk, told apart and described: what the trainer's checkpoint saves and the merge's
writers both report in one line when a write finds no space."""

from __future__ import annotations

import errno
import os
import shutil

from workloads.common import storage


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is ENOSPC / EDQUOT, as an OSError or
    as the message of a wrapped error (Orbax and TensorStore re-raise I/O errors as
    ValueError/RuntimeError with the OS text)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(current)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def free_space_text(path: str) -> str:
    """`12.3 MiB free` for the filesystem holding a local `path` (its nearest existing parent);
    `free space unknown` for a URL."""
    if storage.is_remote(path):
        return "free space unknown"
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free"
    return f"{free} bytes free"
