"""Local paths and gs:// URLs behind one small API (fsspec; gcsfs handles gs://).

Writes are atomic: a local file is written next to its target and renamed; a GCS object is
only visible once its upload completes. Nothing here deletes user data.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from workloads.common import errors


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


def _list_gcs_afresh() -> None:
    """Turns gcsfs's listings cache off in this process, for every gcsfs instance (fsspec's
    per-protocol defaults), Orbax's included (etils.epath opens its own through fsspec).

    gcsfs keeps every listing it made for the life of the process. The objects of a run are
    written by other processes, by TensorStore (Orbax's checkpoint data) and by other gcsfs
    instances, so a cached listing hides a step saved after it was made, or keeps a prefix alive
    that another instance deleted: Orbax then saves that step by first deleting the prefix, and
    the delete fails on objects that are gone.
    """
    import fsspec.config

    for protocol in ("gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


_list_gcs_afresh()

# A GCS request that sends or receives nothing for this long is abandoned and retried: with no
# bound (gcsfs's default) a stalled connection hangs the trainer forever. 20 s of silence is far
# beyond a healthy GCS answer, also for a large upload chunk (the clock restarts on every read).
GCS_CONNECT_TIMEOUT_S = 10.0
GCS_READ_TIMEOUT_S = 20.0
# gcsfs retries each request itself (6 tries, 5xx/408/429, dropped connections and the timeouts
# above) with backoff sleeps of 1, 2, 4, 8, 16 s plus < 1 s jitter each: a request gives up
# after at most 6 x 20 s + 36 s, about 2.5 minutes, and a refused connection after about 36 s.
GCS_GIVE_UP_S = 6 * GCS_READ_TIMEOUT_S + 36


def _bound_gcs_requests() -> None:
    """Sets gcsfs's per-request timeout for every gcsfs instance of this process (Orbax's too).

    It must be an aiohttp ClientTimeout of socket timeouts: a plain number becomes a total
    timeout, whose asyncio.TimeoutError gcsfs does not retry, and a total time would also cut
    a long healthy download short.
    """
    try:
        import aiohttp
        import fsspec.config
    except ImportError:  # no gs:// support installed: nothing to bound
        return
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=GCS_CONNECT_TIMEOUT_S, sock_read=GCS_READ_TIMEOUT_S
    )
    for protocol in ("gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("requests_timeout", timeout)


_bound_gcs_requests()

# TensorStore (Orbax's checkpoint writes to gs://) has no timeout of its own on a silent
# connection: a stalled request waits as long as the connection stays open (measured behind a
# proxy that stalls: the save waited the whole stall). libcurl's low-speed limit abandons a
# request that moves under 256 bytes/s for 60 s, and TensorStore retries it. These are the values
# JAX sets on a TPU VM (jax._src.cloud_tpu_init); set here too so every process of ours, a CPU
# rehearsal included, has them before TensorStore's first request reads them.
TENSORSTORE_STALL_S = 60
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(TENSORSTORE_STALL_S))
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "256")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextlib.contextmanager
def gcs_errors(path: str, doing: str) -> Iterator[None]:
    """Turns what a gs:// call raises once gcsfs has given up into one line naming the object.

    Missing objects (FileNotFoundError) and failed preconditions (FileExistsError) pass through:
    callers decide what they mean. A missing bucket on a write is also FileNotFoundError.

    Args:
        path: the URL the call was about (named in the message).
        doing: what the call did, for the message ("write", "read", "take the lock on").

    Raises:
        errors.UserError: access denied (HTTP 403), or GCS failed after gcsfs's retries.
    """
    try:
        yield
    except (FileNotFoundError, FileExistsError, IsADirectoryError):
        raise
    except errors.UserError:
        raise
    except Exception as exc:
        first = _first_line(exc)
        if first.startswith("Forbidden") or getattr(exc, "code", None) == 403:
            raise errors.UserError(
                f"{path}: access denied (HTTP 403) trying to {doing} it; give this machine's "
                "service account a storage role on the bucket"
            ) from None
        if _is_gcs_failure(exc):
            raise errors.UserError(
                f"{path}: could not {doing} it, GCS still failing after retries for up to "
                f"{GCS_GIVE_UP_S:.0f} s ({type(exc).__name__}: {first})"
            ) from None
        raise


def _is_gcs_failure(exc: BaseException) -> bool:
    """Whether exc is a server or network failure (retried by gcsfs until it gave up)."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    try:
        import aiohttp
        import gcsfs.retry
    except ImportError:
        return False
    return isinstance(exc, (gcsfs.retry.HttpError, aiohttp.ClientError))


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
    with gcs_errors(path, "look up"):
        return bool(fs.exists(p))


def read_bytes(path: str) -> bytes:
    """Reads a whole file.

    Raises:
        errors.UserError: the file does not exist, is a directory, sits under a file, or cannot
            be read.
    """
    if not is_remote(path):
        try:
            return pathlib.Path(path).read_bytes()
        except OSError as exc:
            raise errors.UserError(_cannot_read(path, exc)) from None
    fs, p = filesystem(path)
    try:
        with gcs_errors(path, "read"):
            return bytes(fs.cat_file(p))
    except FileNotFoundError:
        raise errors.UserError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise errors.UserError(f"{path}: is a directory, expected a file") from None


def read_text(path: str) -> str:
    """Reads a whole UTF-8 text file.

    Raises:
        errors.UserError: what read_bytes raises, and content that is not UTF-8 text (gzip or
            another encoding): the message names the first bad byte.
    """
    return decode_utf8(read_bytes(path), path)


GZIP_MAGIC = b"\x1f\x8b"


def decode_utf8(data: bytes, source: str, *, line: int | None = None) -> str:
    """`data` as UTF-8 text.

    Raises:
        errors.UserError: `source: [line N: ]not UTF-8 text (byte 0xFF at offset 7); ...`, or that
            it is gzip-compressed.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"{source}: line {line}:" if line is not None else f"{source}:"
        if line in (None, 1) and data.startswith(GZIP_MAGIC):
            raise errors.UserError(
                f"{where} is gzip-compressed; expected UTF-8 text (decompress it with gunzip)"
            ) from None
        raise errors.UserError(
            f"{where} not UTF-8 text (byte 0x{data[exc.start]:02X} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None


def _cannot_read(path: str, exc: OSError) -> str:
    """One line for a local file that cannot be opened for reading."""
    if isinstance(exc, FileNotFoundError):
        return f"{path}: file not found"
    if isinstance(exc, IsADirectoryError):
        return f"{path}: is a directory, expected a file"
    if isinstance(exc, NotADirectoryError):
        parent = errors.existing_ancestor(path)
        return f"{path}: file not found ({parent} is a file, not a directory)"
    return f"{path}: cannot read it ({exc.strerror or exc})"


def iter_lines(path: str) -> Iterator[str]:
    """Streams the UTF-8 text lines of a local or remote file (no full read for big JSONL). A
    gzip-compressed file (`.gz` or not: the content says) is decompressed on the fly.

    Raises:
        errors.UserError: the file is missing, a directory, unreadable, or a line is not UTF-8
            (the message names the line and the byte).
    """
    if not is_remote(path):
        try:
            handle = open(path, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise errors.UserError(_cannot_read(path, exc)) from None
    else:
        fs, p = filesystem(path)
        if not fs.exists(p):
            raise errors.UserError(f"{path}: file not found")
        if fs.isdir(p):
            raise errors.UserError(f"{path}: is a directory, expected a file")
        handle = fs.open(p, "rb")
    with handle:
        # Lines split on b"\n" only and are decoded one by one, so a bad byte is reported with
        # its line (a JSON line holds no raw newline, so nothing else can end one).
        raw: Any = handle
        magic = handle.read(len(GZIP_MAGIC))
        handle.seek(0)
        if magic == GZIP_MAGIC:
            raw = gzip.GzipFile(fileobj=handle)
        try:
            for number, line in enumerate(raw, start=1):
                yield decode_utf8(line, path, line=number)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise errors.UserError(f"{path}: damaged gzip data ({exc})") from None


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Writes a file so that readers see either the old or the complete new content."""
    if is_remote(path):
        fs, p = filesystem(path)
        try:
            with gcs_errors(path, "write"):
                fs.pipe_file(p, data)
        except FileNotFoundError:
            raise errors.UserError(f"{path}: bucket {p.split('/')[0]} not found") from None
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
        if root.is_file():
            raise errors.UserError(f"{path}: is a file, expected a directory")
        if not root.is_dir():
            raise errors.UserError(f"{path}: directory not found")
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    fs, p = filesystem(path)
    with gcs_errors(path, "list"):
        found = fs.find(p)
    prefix = p.rstrip("/") + "/"
    return sorted(f[len(prefix) :] for f in found if f.startswith(prefix))


def remove_tree(path: str) -> None:
    """Deletes a directory and everything under it; in a bucket every object under the prefix
    (GCS has no directories to delete: gcsfs's recursive rm also tries to delete the prefix
    itself as an object and reports the missing object)."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = filesystem(path)
    found = fs.find(p)
    if found:
        fs.rm(found)


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


def file_sizes(path: str, *, min_age_s: float = 0) -> dict[str, int]:
    """Relative path -> size of every file under a directory (local or URL); {} when there is no
    such directory. Local names starting with "." (partial downloads) are left out, and with
    `min_age_s` so are local files modified in the last N seconds (still being written). A
    remote listing is read fresh (a GCS listing cache can be stale)."""
    if not is_remote(path):
        root = pathlib.Path(path)
        if not root.is_dir():
            return {}
        newest = time.time() - min_age_s
        return {
            str(p.relative_to(root)): p.stat().st_size
            for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".") and p.stat().st_mtime <= newest
        }
    fs, root_path = filesystem(path)
    fs.invalidate_cache()
    try:
        found = fs.find(root_path, detail=True)
    except FileNotFoundError:
        return {}
    prefix = root_path.rstrip("/") + "/"
    return {
        name[len(prefix) :]: int(info.get("size") or 0)
        for name, info in found.items()
        if name.startswith(prefix) and info.get("type", "file") != "directory"
    }


def copy_tree(
    src: str,
    dest: str,
    *,
    files: Iterable[str] | None = None,
    min_age_s: float = 0,
    src_sizes: dict[str, int] | None = None,
) -> list[str]:
    """Copies the files of directory `src` that `dest` lacks or holds at another size, in one
    fsspec batch (gcsfs runs a batch's transfers concurrently), between a local directory and a
    URL in either direction. Files stream to and from disk (never whole in memory); a download
    lands under a hidden partial name and is renamed, so a stopped copy leaves no half file
    under a final name. Nothing is deleted on either side.

    Args:
        files: copy only these relative paths (when they differ); default every file of src.
        min_age_s: leave out local source files modified in the last N seconds.
        src_sizes: `file_sizes(src)` when the caller listed src already (not listed again).

    Returns:
        The relative paths copied, sorted.

    Raises:
        errors.UserError: both sides are URLs (not needed here, so not supported).
    """
    sizes = src_sizes if src_sizes is not None else file_sizes(src, min_age_s=min_age_s)
    there = file_sizes(dest)
    wanted = sizes if files is None else {f: sizes[f] for f in files if f in sizes}
    todo = sorted(rel for rel, size in wanted.items() if there.get(rel) != size)
    if not todo:
        return []
    if is_remote(src) and is_remote(dest):
        raise errors.UserError(f"{src} -> {dest}: copying between two URLs is not supported")
    if is_remote(dest):
        fs, root = filesystem(dest)
        fs.put(
            [str(pathlib.Path(src, rel)) for rel in todo],
            [f"{root.rstrip('/')}/{rel}" for rel in todo],
        )
        return todo
    targets = [pathlib.Path(dest, rel) for rel in todo]
    partials = [t.with_name(f".{t.name}.partial") for t in targets]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(src):
        fs, root = filesystem(src)
        fs.get([f"{root.rstrip('/')}/{rel}" for rel in todo], [str(p) for p in partials])
    else:
        for rel, partial in zip(todo, partials, strict=True):
            shutil.copyfile(pathlib.Path(src, rel), partial)
    for partial, target in zip(partials, targets, strict=True):
        os.replace(partial, target)
    return todo


def stage_directory(src: str, dest: str) -> str:
    """A local copy of a directory: a URL is copied into `dest` (files already there at the same
    size are kept, so a re-run after a reboot is cheap); a local directory is used in place.

    Returns:
        The local directory (src itself when it is already local).

    Raises:
        errors.UserError: the URL holds no files.
    """
    if not is_remote(src):
        return src
    sizes = file_sizes(src)
    if not sizes:
        raise errors.UserError(f"{src}: no files to stage")
    copy_tree(src, dest, src_sizes=sizes)
    return dest
