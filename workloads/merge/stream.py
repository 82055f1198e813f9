"""Streams a base checkpoint into merged, sharded HF safetensors in bounded memory.

Every output shard is planned from the base headers before any data moves (names, shapes, offsets,
so the shard's header is written first); then each tensor is streamed from the base file into the
shard: a LoRA target block of rows by block of rows (base rows + delta rows in float32, cast back to
the tensor's dtype), any other tensor (vision tower included) as raw bytes. Memory is therefore one
block of rows and one copy buffer on top of the LoRA factors, whatever the model or shard size.

Completion is atomic: a local output is written into a hidden sibling directory and renamed into
place at the end; a gs:// output gets its shards first and `model.safetensors.index.json` last, so
an output with an index is complete. A non-empty output is refused unless `overwrite`.

One module on purpose (~500 lines): the streaming pass (read a shard, merge its tensors, write the
output shard, record its hash) is one loop whose resumability depends on all of its parts; the LoRA
math is in workloads/merge/__init__.py and the file format in safetensors_io.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from workloads import errors, runconfig, storage
from workloads.merge import mapping
from workloads.merge import safetensors_io as st

SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
METADATA_FILE = "merge_metadata.json"
BLOCK_BYTES = 64 * 1024 * 1024  # float32 rows of a target tensor processed at once
COPY_CHUNK = 16 * 1024 * 1024  # raw bytes of a copied tensor moved at once
_TMP_MARK = ".merge-tmp-"
_OLD_MARK = ".merge-old-"
# Base files that are not carried over: weights in any format and index/metadata of their own.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = {st.INDEX_FILE, METADATA_FILE, "pytorch_model.bin.index.json"}

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One output file: its name, its tensors in write order and its header bytes."""

    name: str
    tensors: tuple[st.TensorInfo, ...]
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def _entry_bound(info: st.TensorInfo, limit: int) -> int:
    """Upper bound of the bytes a tensor adds to a header (offsets are at most `limit`)."""
    entry = {
        info.name: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [limit, limit]}
    }
    return len(json.dumps(entry, separators=(",", ":"))) + 1


def plan_shards(
    layout: st.Layout, shard_size: int, metadata: dict[str, str], log: Log = _stderr
) -> list[ShardPlan]:
    """Packs the base tensors, in base order, into files of at most `shard_size` bytes (header
    included). A tensor larger than `shard_size` gets a file of its own. Inside a file, wider
    dtypes come first so every tensor stays aligned to its item size."""
    fixed = 8 + len(json.dumps({"__metadata__": metadata}, separators=(",", ":"))) + 8
    groups: list[list[st.TensorInfo]] = [[]]
    used = fixed
    for info in layout.tensors.values():
        cost = info.nbytes + _entry_bound(info, shard_size)
        if groups[-1] and used + cost > shard_size:
            groups.append([])
            used = fixed
        groups[-1].append(info)
        used += cost
        if used > shard_size:
            log(
                f"note: {info.name} ({info.nbytes} bytes) alone exceeds the shard size "
                f"{shard_size}; it gets a shard of its own"
            )
    plans = []
    for i, group in enumerate(groups):
        ordered = sorted(group, key=lambda t: -t.itemsize)  # stable: base order within a dtype
        entries = [(t.name, t.dtype, t.shape, t.nbytes) for t in ordered]
        plans.append(
            ShardPlan(
                SHARD_NAME.format(i + 1, len(groups)),
                tuple(ordered),
                st.header_bytes(entries, metadata),
            )
        )
    return plans


def check_targets(layout: st.Layout, deltas: Mapping[str, mapping.Delta]) -> None:
    """Every delta must land on a floating base tensor of exactly its shape.

    Raises:
        errors.UserError: naming the tensor (and the LoRA module it comes from).
    """
    for name, delta in deltas.items():
        info = layout.tensors.get(name)
        if info is None:
            raise errors.UserError(
                f"LoRA target {name} (from {delta.source}) has no tensor in the base checkpoint "
                f"{layout.root}"
            )
        if info.shape != delta.shape:
            raise errors.UserError(
                f"{name}: base tensor has shape {list(info.shape)} but the LoRA delta from "
                f"{delta.source} has shape {list(delta.shape)}"
            )
        if info.dtype not in ("F32", "F16", "BF16"):
            raise errors.UserError(
                f"{name}: LoRA target has dtype {info.dtype}; only F32, F16 and "
                "BF16 tensors can be merged"
            )


class Workspace:
    """Buffers reused from block to block and tensor to tensor.

    Fresh multi-megabyte arrays are fresh pages from the kernel: page faults cost more than the
    arithmetic, so the merge allocates its buffers once and grows them only when a wider tensor
    needs it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, nbytes: int) -> np.ndarray:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._buffers[name] = np.empty(nbytes, np.uint8)
        return buffer[:nbytes]


def merged_blocks(
    info: st.TensorInfo,
    delta: mapping.Delta,
    source: st.Source,
    writer: st.HashingWriter,
    block_bytes: int = BLOCK_BYTES,
    workspace: Workspace | None = None,
) -> Iterator[int]:
    """Submits the merged tensor to `writer`, block of rows by block of rows: float32(base) +
    delta, cast back to the base dtype (round to nearest even, as torch and ml_dtypes do).
    Yields the bytes of each block as it is submitted."""
    dtype = st.float_dtype(info.dtype)
    assert dtype is not None  # check_targets refused anything else
    workspace = workspace or Workspace()
    rows, cols = info.shape
    per = min(rows, max(1, block_bytes // (cols * 4)))
    raw = workspace.get("raw", per * cols * info.itemsize)
    acc = workspace.get("acc", per * cols * 4).view(np.float32).reshape(per, cols)
    for start in range(0, rows, per):
        n = min(rows, start + per) - start
        nbytes = n * cols * info.itemsize
        source.readinto(info, start * cols * info.itemsize, memoryview(raw[:nbytes]))
        out = writer.buffer(nbytes)
        if dtype == np.float32:  # compute straight into the buffer the writer will write
            block = delta.rows(start, start + n, out=out.view(np.float32).reshape(n, cols))
            block += raw[:nbytes].view(dtype).reshape(n, cols)
        else:
            block = delta.rows(start, start + n, out=acc[:n])
            block += raw[:nbytes].view(dtype).reshape(n, cols)
            np.copyto(out.view(dtype).reshape(n, cols), block, casting="unsafe")
        # A delta that overflows the tensor's dtype (or a base that holds NaN) would ship a
        # model that answers garbage: refuse it here, before the output can look complete.
        if not np.isfinite(out.view(dtype)).all():
            raise errors.UserError(
                f"{info.name}: the merged values of rows {start}-{start + n - 1} are not finite "
                f"(NaN/Inf) after adding the LoRA delta of {delta.source}; nothing written"
            )
        writer.submit(out)
        yield nbytes


def copied_chunks(
    info: st.TensorInfo, source: st.Source, writer: st.HashingWriter, chunk: int = COPY_CHUNK
) -> Iterator[int]:
    """Submits the tensor's raw bytes to `writer` unchanged; yields the bytes of each chunk."""
    for start in range(0, info.nbytes, chunk):
        out = writer.buffer(min(chunk, info.nbytes - start))
        source.readinto(info, start, memoryview(out))
        writer.submit(out)
        yield out.nbytes


class _Progress:
    """tqdm over bytes, with the tensor count alongside; silent when disabled."""

    def __init__(self, total_bytes: int, total_tensors: int, enabled: bool):
        self._bar = None
        self._tensors, self._total = 0, total_tensors
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="merge",
                mininterval=1.0,
                file=sys.stderr,
            )

    def bytes(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def tensor(self) -> None:
        self._tensors += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._tensors}/{self._total} tensors", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _write_shard(
    plan: ShardPlan,
    path: pathlib.Path,
    source: st.Source,
    deltas: Mapping[str, mapping.Delta],
    progress: _Progress,
    block_bytes: int,
    workspace: Workspace,
) -> tuple[str, int]:
    writer = st.HashingWriter(path)
    try:
        writer.write(plan.header)
        for info in plan.tensors:
            delta = deltas.get(info.name)
            blocks = (
                copied_chunks(info, source, writer)
                if delta is None
                else merged_blocks(info, delta, source, writer, block_bytes, workspace)
            )
            for nbytes in blocks:
                progress.bytes(nbytes)
            source.done(info)
            progress.tensor()
    except BaseException:
        writer.abort()
        raise
    return writer.close(), writer.bytes


# ---------------------------------------------------------------------------------------------
# Output sinks: where finished files go, and how the output becomes visible.


def _is_nonempty_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and any(path.iterdir())


class _LocalSink:
    """Files go into a hidden sibling directory that is renamed to `out` when complete."""

    def __init__(self, out: str, overwrite: bool, log: Log):
        self.out = pathlib.Path(out).absolute()
        self._overwrite, self._log = overwrite, log
        if self.out.exists() and not self.out.is_dir():
            raise errors.UserError(f"{out}: exists and is not a directory")
        if _is_nonempty_dir(self.out) and not overwrite:
            raise errors.UserError(
                f"{out}: output directory is not empty; pass --overwrite to replace it"
            )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        host = socket.gethostname()
        self.dir = self.out.parent / f".{self.out.name}{_TMP_MARK}{host}-{os.getpid()}"
        self.dir.mkdir()

    def _remove_stale(self) -> None:
        """Removes temporary directories left by merges into the same output that crashed (their
        process is gone) so that a restarted merge does not fill /dev/shm."""
        host = socket.gethostname()
        for marker in (_TMP_MARK, _OLD_MARK):
            for path in self.out.parent.glob(f".{self.out.name}{marker}{host}-*"):
                pid = path.name.rsplit("-", 1)[-1]
                if pid.isdigit() and not _alive(int(pid)):
                    self._log(f"removing {path} left by an interrupted merge")
                    shutil.rmtree(path, ignore_errors=True)

    def path(self, name: str) -> pathlib.Path:
        return self.dir / name

    def finish(self, name: str) -> None:
        pass

    def commit(self, index_text: str) -> None:
        _write_synced(self.dir / st.INDEX_FILE, index_text.encode("utf-8"))
        _fsync_dir(self.dir)
        if _is_nonempty_dir(self.out):
            if not self._overwrite:
                raise errors.UserError(
                    f"{self.out}: became non-empty during the merge; not replacing it"
                )
            old = (
                self.out.parent / f".{self.out.name}{_OLD_MARK}{socket.gethostname()}-{os.getpid()}"
            )
            os.rename(self.out, old)
            os.rename(self.dir, self.out)
            shutil.rmtree(old)  # the user asked for --overwrite
        else:
            if self.out.is_dir():
                self.out.rmdir()
            os.rename(self.dir, self.out)
        _fsync_dir(self.out.parent)

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class _RemoteSink:
    """Files are staged locally one at a time and uploaded; the index is uploaded last."""

    def __init__(self, out: str, overwrite: bool, staging: pathlib.Path, log: Log):
        self.out, self._staging, self._log = out.rstrip("/"), staging, log
        self._existing = set(storage.list_files(self.out))
        if self._existing and not overwrite:
            raise errors.UserError(f"{out}: output is not empty; pass --overwrite to replace it")
        self._written: set[str] = set()
        if st.INDEX_FILE in self._existing:
            # First of all, the old output must stop looking complete.
            self._rm([st.INDEX_FILE])

    def _rm(self, names: list[str]) -> None:
        fs, root = storage.filesystem(self.out)
        for name in names:
            fs.rm_file(f"{root}/{name}")

    def path(self, name: str) -> pathlib.Path:
        return self._staging / name

    def finish(self, name: str) -> None:
        local = self.path(name)
        storage.upload_file(str(local), runconfig.join(self.out, name))
        local.unlink()
        self._written.add(name)

    def commit(self, index_text: str) -> None:
        stale = sorted(self._existing - self._written - {st.INDEX_FILE})
        if stale:
            self._log(f"removing {len(stale)} file(s) of the previous output: {', '.join(stale)}")
            self._rm(stale)
        storage.write_text_atomic(runconfig.join(self.out, st.INDEX_FILE), index_text)

    def abort(self) -> None:
        pass  # uploaded shards without an index are not a complete-looking output


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_synced(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def aux_files(base: str) -> list[str]:
    """Top-level base files carried over unchanged: config.json, generation_config.json, tokenizer
    and processor files, chat template... (not weights, nor the base's own index)."""
    names = [f for f in storage.list_files(base) if "/" not in f]
    return [
        f
        for f in names
        if f not in _NOT_COPIED and not f.endswith(_WEIGHT_SUFFIXES) and not f.startswith(".")
    ]


def _copy_in(src: str, dest: pathlib.Path) -> None:
    if storage.is_remote(src):
        storage.download_file(src, str(dest))
    else:
        shutil.copyfile(src, dest)


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """What the streaming pass wrote and how fast."""

    shards: dict[str, dict[str, Any]]
    tensor_bytes: int
    merged_tensors: int
    copied_tensors: int
    seconds: float


def stream_merge(
    layout: st.Layout,
    deltas: Mapping[str, mapping.Delta],
    out: str,
    *,
    shard_size: int,
    overwrite: bool,
    metadata: dict[str, Any],
    staging_dir: str | None = None,
    progress: bool = True,
    block_bytes: int = BLOCK_BYTES,
    log: Log = _stderr,
) -> StreamStats:
    """Writes the merged checkpoint of `layout` + `deltas` to `out` (local dir or gs://).

    Args:
        layout: the base checkpoint's tensors (`safetensors_io.read_layout`).
        deltas: HF tensor name -> delta (`mapping.build_deltas`).
        out: output directory; must be empty or absent unless `overwrite`.
        shard_size: largest output file in bytes.
        overwrite: replace a non-empty output.
        metadata: fields of merge_metadata.json besides "files" and "merged_tensors".
        staging_dir: local scratch for gs:// input or output (default: $TMPDIR).
        progress: show a progress bar on stderr.
        block_bytes: float32 bytes of a target tensor processed at once.
        log: where notes go (stderr).

    Raises:
        errors.UserError: a target without base tensor or with another shape, a non-empty output.
    """
    check_targets(layout, deltas)
    if "config.json" not in aux_files(layout.root):
        raise errors.UserError(
            f"{layout.root}: no config.json; is this a Hugging Face model directory?"
        )
    shard_metadata = layout.metadata or {"format": "pt"}
    plans = plan_shards(layout, shard_size, shard_metadata, log)
    remote_in, remote_out = storage.is_remote(layout.root), storage.is_remote(out)
    with contextlib.ExitStack() as stack:
        staging = None
        if remote_in or remote_out:
            staging = pathlib.Path(
                stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="merge-staging-", dir=staging_dir)
                )
            )
        sink: _LocalSink | _RemoteSink = (
            _RemoteSink(out, overwrite, staging, log)
            if remote_out and staging is not None
            else _LocalSink(out, overwrite, log)
        )
        source = st.Source(layout, str(staging) if staging is not None else None)
        stack.callback(source.close)
        bar = _Progress(layout.total_bytes, len(layout.tensors), progress)
        stack.callback(bar.close)
        started = time.monotonic()
        try:
            files: dict[str, dict[str, Any]] = {}
            workspace = Workspace()
            for plan in plans:
                sha, size = _write_shard(
                    plan, sink.path(plan.name), source, deltas, bar, block_bytes, workspace
                )
                if size != plan.size:  # the header promised these offsets
                    raise RuntimeError(f"{plan.name}: wrote {size} bytes, planned {plan.size}")
                sink.finish(plan.name)
                files[plan.name] = {"sha256": sha, "bytes": size}
            for name in aux_files(layout.root):
                _copy_in(runconfig.join(layout.root, name), sink.path(name))
                sink.finish(name)
            merge_metadata = {**metadata, "files": files, "merged_tensors": sorted(deltas)}
            _write_synced(sink.path(METADATA_FILE), json.dumps(merge_metadata, indent=2).encode())
            sink.finish(METADATA_FILE)
            index = {
                "metadata": {"total_size": layout.total_bytes},
                "weight_map": {t.name: p.name for p in plans for t in p.tensors},
            }
            sink.commit(json.dumps(index, indent=2, sort_keys=True))
        except BaseException:
            sink.abort()
            raise
        seconds = time.monotonic() - started
    return StreamStats(
        files, layout.total_bytes, len(deltas), len(layout.tensors) - len(deltas), seconds
    )
