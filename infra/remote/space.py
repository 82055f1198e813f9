"""Free disk space on a worker: checked before a deploy writes, and named when a write failed.

A full disk must end in one line that names the host, the path and its free space, not in pip's
traceback: `check` refuses before anything is uploaded, and `explain` turns a step that failed
with ENOSPC (or whose disk is now short) into that line.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping

import fabric

from infra.remote.errors import DiskFull, RemoteError
from infra.remote.transport import CONNECTION_ERRORS, as_root, host_name, run

# What coreutils, pip and Python print for ENOSPC.
ENOSPC_TEXT = "No space left on device"


@dataclasses.dataclass(frozen=True)
class Free:
    """The free bytes of the file system that holds a path, and where it is mounted."""

    path: str
    mount: str
    free: int


def _parse_df(text: str, paths: list[str]) -> list[Free]:
    """`df -P -B1 PATH...` output -> one Free per path (mount points may contain spaces)."""
    rows = [line.split() for line in text.splitlines()[1:] if line.strip()]
    if len(rows) != len(paths):
        raise ValueError(f"df printed {len(rows)} rows for {len(paths)} paths")
    return [Free(p, " ".join(r[5:]), int(r[3])) for p, r in zip(paths, rows, strict=True)]


def free_space(conn: fabric.Connection, paths: list[str], *, sudo: bool) -> list[Free]:
    """The free space of each path's file system.

    Raises:
        RemoteError: df failed or the connection broke.
    """
    result = run(conn, "space", ["df", "-P", "-B1", *paths], sudo=sudo)
    try:
        return _parse_df(result.stdout, paths)
    except (ValueError, IndexError) as exc:
        raise RemoteError(
            host_name(conn), "space", None, None, f"cannot read df output: {exc}"
        ) from exc


def check(
    conn: fabric.Connection, needs: Mapping[str, int], *, sudo: bool, step: str = "space"
) -> None:
    """Refuses a deploy whose writes do not fit: `needs` maps a directory to the bytes it will
    take; directories on one file system add up.

    Raises:
        DiskFull: naming the first directory whose file system is short.
    """
    paths = list(needs)
    found = free_space(conn, paths, sudo=sudo)
    per_mount: dict[str, int] = {}
    for item in found:
        per_mount[item.mount] = per_mount.get(item.mount, 0) + needs[item.path]
    for item in found:
        if item.free < per_mount[item.mount]:
            raise DiskFull(host_name(conn), step, item.path, item.free, per_mount[item.mount])


def explain(
    conn: fabric.Connection,
    err: RemoteError,
    path: str,
    needed: int,
    *,
    sudo: bool,
    by_free_space: bool = False,
) -> RemoteError:
    """`err` as a DiskFull when the step ran out of space on `path`, else `err` itself.

    Out of space means ENOSPC in the step's output, or with `by_free_space` (SFTP, whose error
    does not say why) less than `needed` free now. Free space alone is no proof for a command:
    one that failed otherwise may have used the room it was given.
    """
    if isinstance(err, DiskFull):
        return err
    if ENOSPC_TEXT not in err.detail and not by_free_space:
        return err
    try:
        result = conn.run(
            shlex.join(as_root(["df", "-P", "-B1", path], sudo)),
            warn=True,
            hide=True,
            in_stream=False,
        )
        free = _parse_df(result.stdout, [path])[0].free if result.ok else None
    except (*CONNECTION_ERRORS, ValueError, IndexError):
        free = None
    if free is None:
        return err
    if ENOSPC_TEXT in err.detail or (by_free_space and free < needed):
        return DiskFull(err.host, err.step, path, free, needed)
    return err
