"""Local paths and gs:// URLs behind one small API (fsspec; gcsfs handles gs://).

Writes are atomic: a local file is written next to its target and renamed; a GCS object is
only visible once its upload completes. Nothing here deletes user data.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

from workloads import errors


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def absolute(path: str) -> str:
    """A local path made absolute against the current working directory (`~` expanded).

    The one place relative paths are resolved: the command line's path options (their argparse
    `type`) and a run config's path fields when it is loaded (`runconfig.load`). URLs (gs://,
    hf://, file://, ...) and the empty string (an unset value) come back unchanged.
    """
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def filesystem(path: str) -> tuple[Any, str]:
    """The fsspec filesystem of a local path or URL and the path inside it.

    Raises:
        errors.UserError: no filesystem for this kind of path (gcsfs missing, unknown scheme).
    """
    import fsspec

    try:
        fs, stripped = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as exc:
        raise errors.UserError(
            f"{path}: cannot open this kind of path ({exc}); install the "
            "'workloads' extra for gs:// support"
        ) from None
    return fs, stripped


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return bool(fs.exists(p))


def read_bytes(path: str) -> bytes:
    """Reads a whole file.

    Raises:
        errors.UserError: the file does not exist.
    """
    if not is_remote(path):
        try:
            return pathlib.Path(path).read_bytes()
        except FileNotFoundError:
            raise errors.UserError(f"{path}: file not found") from None
        except IsADirectoryError:
            raise errors.UserError(f"{path}: is a directory, expected a file") from None
    fs, p = filesystem(path)
    try:
        return bytes(fs.cat_file(p))
    except FileNotFoundError:
        raise errors.UserError(f"{path}: file not found") from None


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def iter_lines(path: str) -> Iterator[str]:
    """Streams text lines of a local or remote file (no full read for big JSONL)."""
    if not is_remote(path):
        try:
            handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise errors.UserError(f"{path}: file not found") from None
        with handle:
            yield from handle
        return
    fs, p = filesystem(path)
    if not fs.exists(p):
        raise errors.UserError(f"{path}: file not found")
    with fs.open(p, "rt", encoding="utf-8") as handle:
        yield from handle


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Writes a file so that readers see either the old or the complete new content."""
    if is_remote(path):
        fs, p = filesystem(path)
        fs.pipe_file(p, data)
        return
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def list_files(path: str) -> list[str]:
    """Relative paths of all files under a directory (local or remote), sorted."""
    if not is_remote(path):
        root = pathlib.Path(path)
        if not root.is_dir():
            raise errors.UserError(f"{path}: directory not found")
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    fs, p = filesystem(path)
    found = fs.find(p)
    prefix = p.rstrip("/") + "/"
    return sorted(f[len(prefix) :] for f in found if f.startswith(prefix))


def upload_file(local: str, remote: str) -> None:
    fs, p = filesystem(remote)
    fs.put_file(local, p)


def download_file(remote: str, local: str) -> None:
    """Downloads to `local` atomically (a partial download never has the final name)."""
    target = pathlib.Path(local)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial")
    fs, p = filesystem(remote)
    fs.get_file(p, str(tmp))
    os.replace(tmp, target)


def stage_directory(src: str, dest: str, *, workers: int = 16) -> str:
    """Copies a directory (gs:// or local) into a local directory in parallel; files already
    present with the same size are skipped, so a re-run after a reboot is cheap.

    Returns:
        The local directory (src itself when it is already local).
    """
    if not is_remote(src):
        return src
    fs, root = filesystem(src)
    sizes = {
        f[len(root.rstrip("/")) + 1 :]: int(info["size"])
        for f, info in fs.find(root, detail=True).items()
    }
    if not sizes:
        raise errors.UserError(f"{src}: no files to stage")
    todo = [
        rel
        for rel, size in sizes.items()
        if not (
            pathlib.Path(dest, rel).is_file() and pathlib.Path(dest, rel).stat().st_size == size
        )
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        list(
            pool.map(
                lambda rel: download_file(f"{src.rstrip('/')}/{rel}", str(pathlib.Path(dest, rel))),
                todo,
            )
        )
    return dest
