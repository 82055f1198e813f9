"""Reading safetensors checkpoints tensor by tensor, and writing shards one tensor at a time.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length, a
JSON header `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}` and the
tensors' bytes back to back. Knowing every offset up front lets the merge write a shard's header
first and then stream the tensors into it, so no shard (and no whole tensor) is ever held in
memory, and a copied tensor is the same bytes as in the base checkpoint by construction.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import pathlib
import queue
import struct
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from workloads.common import digest, errors, storage
from workloads.contract import runconfig

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # what the safetensors library itself accepts

ITEMSIZE = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def float_dtype(dtype: str) -> np.dtype | None:
    """The numpy dtype of a floating safetensors dtype (None for integers, bool and fp8)."""
    import ml_dtypes

    return {
        "F64": np.dtype(np.float64),
        "F32": np.dtype(np.float32),
        "F16": np.dtype(np.float16),
        "BF16": np.dtype(ml_dtypes.bfloat16),
    }.get(dtype)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a checkpoint.

    Attributes:
        name: the tensor's key.
        dtype: safetensors dtype string (`BF16`, `F32`, ...).
        shape: the tensor's shape.
        file: file name relative to the checkpoint directory.
        start: absolute byte offset of the data in the file.
        nbytes: size of the data.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The tensors of a safetensors checkpoint directory, in file order then offset order."""

    root: str
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def parse_header(handle: BinaryIO, where: str) -> tuple[dict[str, Any], int]:
    """Reads a safetensors header; returns (header, offset of the data).

    Raises:
        errors.UserError: the file is not a safetensors file.
    """
    raw = handle.read(8)
    if len(raw) != 8:
        raise errors.UserError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", raw)
    if length > _MAX_HEADER:
        raise errors.UserError(f"{where}: not a safetensors file (header length {length})")
    try:
        header = json.loads(handle.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise errors.UserError(f"{where}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise errors.UserError(f"{where}: corrupt safetensors header (not a JSON object)")
    return header, 8 + length


def _open(path: str) -> BinaryIO:
    if storage.is_remote(path):
        import fsspec

        if not storage.exists(path):
            raise errors.UserError(f"{path}: file not found")
        return fsspec.open(path, "rb").open()
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise errors.UserError(f"{path}: file not found") from None


def _file_tensors(root: str, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
    path = runconfig.join(root, file)
    with _open(path) as handle:
        header, data_start = parse_header(handle, path)
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for name, entry in header.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            tensors.append(
                TensorInfo(
                    name,
                    str(entry["dtype"]),
                    tuple(int(s) for s in entry["shape"]),
                    file,
                    data_start + begin,
                    end - begin,
                )
            )
        except (KeyError, TypeError, ValueError):
            raise errors.UserError(f"{path}: corrupt header entry for tensor {name}") from None
    tensors.sort(key=lambda t: t.start)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_layout(root: str) -> Layout:
    """Reads every header of a checkpoint directory (local or gs://); no tensor data is read.

    The files are those of `model.safetensors.index.json` when there is one, else every
    top-level `*.safetensors` file.

    Raises:
        errors.UserError: no weights, an index naming a missing tensor, a tensor in two files.
    """
    index_path = runconfig.join(root, INDEX_FILE)
    weight_map: dict[str, str] | None = None
    if storage.exists(index_path):
        try:
            weight_map = dict(json.loads(storage.read_text(index_path))["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise errors.UserError(f"{index_path}: malformed index ({exc})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = [f for f in storage.list_files(root) if "/" not in f and f.endswith(".safetensors")]
    if not files:
        raise errors.UserError(f"{root}: no *.safetensors files")
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for file in files:
        found, file_metadata = _file_tensors(root, file)
        metadata = metadata or file_metadata
        for info in found:
            if info.name in tensors:
                raise errors.UserError(
                    f"{root}: tensor {info.name} is in both {tensors[info.name].file} and {file}"
                )
            tensors[info.name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors or tensors[name].file != file:
                raise errors.UserError(
                    f"{index_path}: lists {name} in {file}, which does not hold it"
                )
    return Layout(root, tuple(files), tensors, metadata)


def header_bytes(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]
) -> bytes:
    """The header of a file holding `entries` (name, dtype, shape, nbytes) back to back, padded
    with spaces to a multiple of 8 bytes (as the safetensors library writes it)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


# write(2) in slices of this size. On hosts that hand free memory back to their hypervisor
# (a virtio balloon with free page reporting, as on the 2-core VM of the README's merge table), a
# large write lets the kernel's page cache take 2 MiB folios, which come from blocks already given
# back: the hypervisor faults each of their pages in again, and the copy into the page cache cost
# 2.2 CPU s per GB there (16 MiB writes) against 0.2 with 256 KiB writes, which take small folios
# from recently freed memory. Elsewhere 64 syscalls per 16 MiB block cost nothing measurable.
WRITE_SLICE = 256 * 1024
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Starts writing a block just written to disk, without waiting for it (Linux's
    sync_file_range with SYNC_FILE_RANGE_WRITE). The fsync that ends a shard then waits for its
    last blocks, not for the whole shard: 0.2-0.4 s per 1 GB shard that a worker spent idle here,
    about 8% of the pass with two workers on 2 cores. Elsewhere (no such call, a file system that
    ignores it) the fsync does it all, as before: durability never depends on this call."""
    call = _sync_file_range()
    if call is not None and nbytes > 0:
        call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class HashingWriter:
    """Writes bytes into an existing file from `offset` on while computing their checksum
    (workloads.common.digest; no second read of a 5 GB shard). Other writers may fill the rest of
    the file; whoever owns it fsyncs it once all of them are done.

    Checksumming and writing run in a background thread (both release the GIL), overlapping with
    the caller computing the next block. The caller fills buffers the writer lends it
    (`buffer`), hands them back with `submit`, and never touches a submitted buffer again; a
    small pool of buffers is reused, so memory stays a few blocks whatever the file size.
    """

    def __init__(
        self,
        path: pathlib.Path,
        offset: int = 0,
        buffers: int = 2,
        pool: list[np.ndarray] | None = None,
    ):
        """`pool`: buffers to lend (a job's earlier writer's; fresh pages cost page faults),
        refilled with the writer's buffers when it closes."""
        # Closed by close()/abort(). Never truncated: other threads may be writing other parts.
        self._handle = open(path, "r+b", buffering=0)  # noqa: SIM115
        self._start = offset
        self._handle.seek(offset)
        self.algorithm = digest.default_algorithm()
        self._hash = digest.new(self.algorithm)
        self.bytes = 0
        self._pool = pool if pool is not None else []
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for i in range(buffers):
            self._free.put(self._pool[i] if i < len(self._pool) else np.empty(0, np.uint8))
        self._todo: queue.Queue[np.ndarray | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="shard-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (item := self._todo.get()) is not None:
            try:
                if self._error is None:
                    view = item.data
                    self._hash.update(item)
                    start = self.bytes
                    while view:
                        written = self._handle.write(view[:WRITE_SLICE])
                        view = view[written:]
                        self.bytes += written
                    _start_writeback(self._handle.fileno(), self._start + start, self.bytes - start)
            except BaseException as exc:  # re-raised in the caller's thread
                self._error = exc
            finally:
                self._free.put(item.base if item.base is not None else item)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of `nbytes` to fill and `submit` (blocks while all buffers are queued)."""
        self._check()
        pooled = self._free.get()
        if pooled.nbytes < nbytes:
            pooled = np.empty(nbytes, np.uint8)
        return pooled[:nbytes]

    def submit(self, buffer: np.ndarray) -> None:
        """Queues a filled buffer from `buffer` for hashing and writing, in submission order."""
        self._todo.put(buffer)

    def write(self, data: bytes) -> None:
        buffer = self.buffer(len(data))
        buffer[:] = np.frombuffer(data, np.uint8)
        self.submit(buffer)

    def _stop(self) -> None:
        self._todo.put(None)
        self._thread.join()
        self._pool[:] = [self._free.get_nowait() for _ in range(self._free.qsize())]

    def close(self) -> str:
        """Waits for the queue and returns the hex checksum of the bytes written (not fsynced:
        the file's owner does that once)."""
        self._stop()
        try:
            self._check()
        finally:
            self._handle.close()
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._stop()
        self._handle.close()


def file_digest(path: str, algorithm: str) -> tuple[str, int]:
    """Checksum (workloads.common.digest) and size of a local or remote file, read in chunks."""
    with _open(path) as handle:
        return digest.of_stream(handle, algorithm)


class Source:
    """Reads tensor bytes from a checkpoint's files, opened on demand.

    A gs:// checkpoint is read by downloading one file at a time into `staging_dir`; a downloaded
    file is deleted as soon as its last tensor has been read (`done`), so local disk holds about
    one file, not the whole model.
    """

    def __init__(self, layout: Layout, staging_dir: str | None = None):
        self._layout = layout
        self._remote = storage.is_remote(layout.root)
        if self._remote and staging_dir is None:
            raise ValueError("a gs:// checkpoint needs a staging_dir")
        self._staging = pathlib.Path(staging_dir) if staging_dir else None
        self._handles: dict[str, BinaryIO] = {}
        self._left: dict[str, int] = {}
        for info in layout.tensors.values():
            self._left[info.file] = self._left.get(info.file, 0) + 1

    def _fd(self, file: str) -> int:
        handle = self._handles.get(file)
        if handle is None:
            path = runconfig.join(self._layout.root, file)
            if self._remote and self._staging is not None:
                local = self._staging / file
                storage.download_file(path, str(local))
                path = str(local)
            handle = self._handles[file] = _open(path)
        return handle.fileno()

    def readinto(self, info: TensorInfo, offset: int, out: memoryview) -> None:
        """Fills `out` with the tensor's bytes starting `offset` bytes into its data."""
        fd = self._fd(info.file)
        position, view = info.start + offset, out.cast("B")
        while view:
            got = os.preadv(fd, [view], position)
            if got <= 0:
                path = runconfig.join(self._layout.root, info.file)
                raise errors.UserError(f"{path}: truncated while reading {info.name}")
            view, position = view[got:], position + got

    def chunks(self, info: TensorInfo, buffer: bytearray) -> Iterator[memoryview]:
        """The tensor's raw bytes in chunks of at most len(buffer) (the buffer is reused)."""
        done = 0
        while done < info.nbytes:
            n = min(len(buffer), info.nbytes - done)
            view = memoryview(buffer)[:n]
            self.readinto(info, done, view)
            yield view
            done += n

    def done(self, info: TensorInfo) -> None:
        """Marks a tensor as read; a downloaded file goes away after its last tensor."""
        self._left[info.file] -= 1
        if self._left[info.file] == 0 and info.file in self._handles:
            self._handles.pop(info.file).close()
            if self._remote and self._staging is not None:
                (self._staging / info.file).unlink(missing_ok=True)

    def close(self) -> None:
        for file, handle in self._handles.items():
            handle.close()
            if self._remote and self._staging is not None:
                (self._staging / file).unlink(missing_ok=True)
        self._handles.clear()
