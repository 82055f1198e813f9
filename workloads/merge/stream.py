"""Streams a base checkpoint into merged, sharded HF safetensors in bounded memory, shards in
parallel.

Every output shard is planned from the base headers before any data moves (names, shapes, offsets,
so the shard's header is known first); with several workers each shard is cut into parts of about
equal size (parts.py), and each part is written at its offset by a job (shard_worker.py) that
streams its tensors from the base files: a LoRA target block of rows by block of rows, any other
tensor (vision tower included) as raw bytes. The jobs run in threads of this process, as many as
the host has cores (and memory for), with numpy's BLAS on one thread each, so the float32
products, the checksums and the writes run side by side, and no thread idles while another ends a
large shard.
A shard is fsynced, its checksum combined from its parts' and (gs://) uploaded as soon as its
last part is written, while the threads write the next ones. Memory is a few blocks of rows per
thread on top of the LoRA factors, whatever the model or shard size.

Completion is atomic: a local output is written into a hidden sibling directory and renamed into
place at the end; a gs:// output gets its shards first and `model.safetensors.index.json` last, so
an output with an index is complete. A non-empty output is refused unless `overwrite`. Nothing
of a merge outlives its process, however it dies.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pathlib
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from workloads.common import digest, disk_space, errors, logs, processes, storage
from workloads.contract import runconfig
from workloads.merge import blas, mapping, parts, shard_worker
from workloads.merge import safetensors_io as st
from workloads.merge.parts import ShardPart, ShardPlan
from workloads.merge.shard_worker import BLOCK_BYTES

SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
METADATA_FILE = "merge_metadata.json"
_TMP_MARK = ".merge-tmp-"
_OLD_MARK = ".merge-old-"
# Base files that are not carried over: weights in any format and index/metadata of their own.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = {st.INDEX_FILE, METADATA_FILE, "pytorch_model.bin.index.json"}

Log = logs.Say
_SAY = logs.say("merge")


def _entry_bound(info: st.TensorInfo, limit: int) -> int:
    """Upper bound of the bytes a tensor adds to a header (offsets are at most `limit`)."""
    entry = {
        info.name: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [limit, limit]}
    }
    return len(json.dumps(entry, separators=(",", ":"))) + 1


def plan_shards(
    layout: st.Layout, shard_size: int, metadata: dict[str, str], log: Log = _SAY
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

    def show(self, nbytes: int, tensors: int) -> None:
        """Moves the bar to `nbytes` written and `tensors` finished (totals over all workers)."""
        if self._bar is not None and (nbytes, tensors) != (self._bar.n, self._tensors):
            self._tensors = tensors
            self._bar.set_postfix_str(f"{tensors}/{self._total} tensors", refresh=False)
            self._bar.update(nbytes - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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
                if pid.isdigit() and not processes.alive(int(pid)):
                    self._log(f"removing {path} left by an interrupted merge")
                    shutil.rmtree(path, ignore_errors=True)

    def path(self, name: str) -> pathlib.Path:
        return self.dir / name

    def finish(self, name: str) -> None:
        pass

    def commit(self, index_text: str) -> None:
        _write_synced(self.dir / st.INDEX_FILE, index_text.encode("utf-8"))
        _fsync_path(self.dir)
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
        _fsync_path(self.out.parent)

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


def _write_synced(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_path(path: pathlib.Path) -> None:
    """fsync of a file or a directory, by path."""
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


# ---------------------------------------------------------------------------------------------
# Running the shard jobs: threads of this process.


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _thread_bytes(part: ShardPart) -> int:
    """About what a thread adds to hold for `part`: four blocks of rows in float32 (read block,
    sum, and the writer's two buffers). The LoRA factors are the process's, held once."""
    blocks = [
        shard_worker.block_rows(d.shape[1], d.row_block, part.block_bytes) * d.shape[1] * 4
        for d in part.deltas.values()
    ]
    return 4 * max([part.block_bytes, *blocks])


# Threads a merge starts by default, at most. Each block's own Python (a few tens of microseconds
# under the GIL against milliseconds of released arithmetic and I/O) is under 1% of a thread's
# time, so 16 threads leave the GIL mostly free; and at about 0.5 GB/s per thread, 16 outrun any
# disk or upload a TPU host writes to.
MAX_DEFAULT_WORKERS = 16


def default_workers(jobs: list[ShardPart]) -> int:
    """One worker per core, at most MAX_DEFAULT_WORKERS, no more than there are jobs, and no more
    than half the available memory holds."""
    workers = min(host_cores(), MAX_DEFAULT_WORKERS, len(jobs))
    available = _available_memory()
    if available is not None and jobs:
        workers = min(workers, available // 2 // max(_thread_bytes(j) for j in jobs))
    return max(1, workers)


# With several workers, each shard is cut into parts of about total / (workers x this), so the
# last parts to finish are small against each worker's share ...
PARTS_PER_WORKER = 8
# ... but no smaller than this: a part costs a few system calls and a pipeline start (its first
# block is computed before anything is written), against ~0.1 s of work for 64 MiB.
MIN_PART_BYTES = 64 * 1024 * 1024


def part_size(total_bytes: int, workers: int, shard_size: int) -> int | None:
    """The size parts are cut to for `workers` (None: whole shards). One worker, or a checksum
    that cannot be combined from the parts' (sha256, without google-crc32c's C extension), keeps
    whole shards."""
    if workers <= 1 or digest.default_algorithm() != digest.CRC32C:
        return None
    share = -(-total_bytes // (workers * PARTS_PER_WORKER))
    return min(shard_size, max(MIN_PART_BYTES, share))


class _CancelledError(Exception):
    pass


class _CancellableProgress(shard_worker.ThreadProgress):
    """Progress of the shard jobs that stops every job at its next block once cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    def add(self, nbytes: int, tensors: int) -> None:
        if self.cancelled.is_set():
            raise _CancelledError("merge cancelled")
        super().add(nbytes, tensors)


class _ThreadRunner:
    """Shard jobs in `workers` threads of this process, which stays free to upload.

    Threads, not processes: every heavy step of a job releases the GIL (numpy's casts and
    min/max, the BLAS call through ctypes, the checksum, the reads and writes), so two threads
    merge side by side (measured on 2 cores: 1.7 GB/s of merge arithmetic in two threads against
    0.9 in one), without spawning interpreters, pickling the LoRA factors to them or keeping
    their imports twice in memory; a killed merge takes them with it. Every BLAS call runs on
    the calling thread (the pass holds numpy's BLAS at one thread), so a delta has the same bits
    in any thread. Each job opens its own handles on the base files (and a thread keeps its
    buffers from job to job); a gs:// base is read by one thread through one shared Source,
    which holds one downloaded base file at a time.
    """

    def __init__(self, workers: int, source: st.Source | None = None):
        if source is not None and workers != 1:
            raise ValueError("a shared Source is read by one thread")
        self._source = source
        self._local = threading.local()
        self.progress = _CancellableProgress()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="merge-shard"
        )

    def _workspace(self) -> shard_worker.Workspace:
        workspace = getattr(self._local, "workspace", None)
        if workspace is None:
            workspace = self._local.workspace = shard_worker.Workspace()
        return workspace

    def _run(self, part: ShardPart) -> tuple[str, str, int]:
        """The part's checksum, its algorithm and its size (shard_worker.write_part)."""
        source = self._source or st.Source(part.layout)
        try:
            return shard_worker.write_part(part, source, self.progress, self._workspace())
        finally:
            if source is not self._source:
                source.close()

    def submit(self, part: ShardPart) -> concurrent.futures.Future[Any]:
        return self._pool.submit(self._run, part)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def kill(self) -> None:
        """Stops every job at its next block and waits for them (their partial shards are the
        sink's to drop)."""
        self.progress.cancelled.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _finish_shard(
    plan: ShardPlan,
    done: list[tuple[ShardPart, tuple[str, str, int]]],
    sink: _LocalSink | _RemoteSink,
) -> shard_worker.ShardResult:
    """A shard whose parts are all written (each its planned size, which _run_parts checked, so
    the shard is its planned size too): made durable, its checksum combined from its parts' in
    file order and handed to the sink (a gs:// upload)."""
    results = [result for _, result in sorted(done, key=lambda pair: pair[0].index)]
    _fsync_path(sink.path(plan.name))
    algorithm = results[0][1]
    checksum = digest.combine(algorithm, [(hexdigest, size) for hexdigest, _, size in results])
    sink.finish(plan.name)
    return shard_worker.ShardResult(plan.name, checksum, algorithm, plan.size)


def _interleaved(jobs: list[ShardPart], width: int) -> list[ShardPart]:
    """The parts of `width` shards at a time, taken in turn (s1 p0, s2 p0, s1 p1, s2 p1, ...), so
    that parallel jobs write different files."""
    by_shard: dict[str, list[ShardPart]] = {}
    for job in jobs:
        by_shard.setdefault(job.shard, []).append(job)
    shards = list(by_shard.values())
    ordered = []
    for first in range(0, len(shards), width):
        group = shards[first : first + width]
        for i in range(max(len(g) for g in group)):
            ordered += [g[i] for g in group if i < len(g)]
    return ordered


def _run_parts(
    plans: list[ShardPlan],
    jobs: list[ShardPart],
    runner: _ThreadRunner,
    workers: int,
    sink: _LocalSink | _RemoteSink,
    bar: _Progress,
) -> dict[str, shard_worker.ShardResult]:
    """Runs the parts in order, `workers` at a time plus one queued (so no worker waits for this
    loop), and finishes every shard (_finish_shard) as soon as its last part is written, while
    the workers write the next parts; so only the shards of the parts in flight, and those being
    uploaded, sit in the staging directory. A shard's file is created empty before its first
    part is handed out."""
    by_name = {p.name: p for p in plans}
    pending = list(reversed(jobs))
    left = collections.Counter(j.shard for j in jobs)
    written: dict[str, list[tuple[ShardPart, tuple[str, str, int]]]] = {p.name: [] for p in plans}
    running: dict[concurrent.futures.Future[Any], ShardPart] = {}
    results: dict[str, shard_worker.ShardResult] = {}

    def fill() -> None:
        while pending and len(running) <= workers:
            part = pending.pop()
            if part.index == 0:
                sink.path(part.shard).open("wb").close()
            running[runner.submit(part)] = part

    while pending or running:
        fill()
        done, _ = concurrent.futures.wait(
            running, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED
        )
        bar.show(*runner.progress.read())
        finished = [(running.pop(future), future.result()) for future in done]
        fill()  # keep the workers busy during the fsyncs and uploads
        for part, result in finished:
            if result[2] != part.size:  # the header promised these offsets
                raise RuntimeError(
                    f"{part.shard}: part {part.index} wrote {result[2]} bytes, planned {part.size}"
                )
            written[part.shard].append((part, result))
            left[part.shard] -= 1
            if left[part.shard] == 0:
                results[part.shard] = _finish_shard(by_name[part.shard], written[part.shard], sink)
    bar.show(*runner.progress.read())
    return results


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """What the streaming pass wrote and how fast.

    Attributes:
        workers: parts of shards written at once (threads of this process).
        cpu_seconds: user + system CPU time of the pass, all threads together.
    """

    shards: dict[str, dict[str, Any]]
    tensor_bytes: int
    merged_tensors: int
    copied_tensors: int
    seconds: float
    workers: int = 1
    cpu_seconds: float = 0.0


def _named_path(exc: BaseException) -> str | None:
    """The file named by the first OSError in `exc`'s chain that names one (a write of the shard
    writer names none)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.filename is not None:
            return os.fsdecode(current.filename)
        current = current.__cause__ or current.__context__
    return None


def _disk_full_error(
    exc: BaseException, sink: _LocalSink | _RemoteSink, staging: pathlib.Path | None
) -> errors.UserError:
    """The one line for a full disk during the merge (ENOSPC or EDQUOT in a part, a copy or a
    download), naming the directory that filled and its free space, as training does."""
    named = _named_path(exc)
    in_staging = staging is not None and (
        isinstance(sink, _RemoteSink)
        or (named is not None and pathlib.Path(named).is_relative_to(staging))
    )
    if in_staging and staging is not None:
        # staging is this merge's own temporary directory: name where it was made.
        return errors.UserError(
            f"{staging.parent}: disk full while staging the merge "
            f"({disk_space.free_space_text(str(staging))}); the staged files were removed; free "
            "space there or stage on a larger disk (staging_dir, default $TMPDIR)"
        )
    assert isinstance(sink, _LocalSink)  # a remote sink writes only into staging
    return errors.UserError(
        f"{sink.out}: disk full while writing the merged checkpoint "
        f"({disk_space.free_space_text(str(sink.dir))}); the partial output was removed and "
        f"{sink.out} left as it was; free space or choose another output directory"
    )


def _cpu_seconds() -> float:
    """CPU time of this process, all its threads (the jobs') together."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


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
    workers: int | None = None,
    log: Log = _SAY,
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
        workers: parts of shards written at once, each by a thread of this process; None = one
            per core, at most MAX_DEFAULT_WORKERS. A gs:// base is always read by one (one base
            file staged at a time).
        log: where notes go (workloads.common.logs: `merge: ...` on stderr).

    Raises:
        errors.UserError: a target without base tensor or with another shape, a non-empty output,
            workers < 1.
    """
    check_targets(layout, deltas)
    if workers is not None and workers < 1:
        raise errors.UserError(f"--workers {workers}: must be at least 1")
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

        def cut(part_bytes: int | None) -> list[ShardPart]:
            return [
                job
                for plan in plans
                for job in parts.plan_parts(
                    plan, str(sink.path(plan.name)), layout, deltas, part_bytes, block_bytes
                )
            ]

        count = workers or default_workers(
            cut(part_size(layout.total_bytes, host_cores(), shard_size))
        )
        if remote_in and count > 1:
            if workers is not None:
                log(f"note: a gs:// base is merged by one worker, not {workers}")
            count = 1
        # One worker: whole shards, in order (part_size gives None).
        jobs = _interleaved(cut(part_size(layout.total_bytes, count, shard_size)), count)
        count = min(count, len(jobs))
        bar = _Progress(layout.total_bytes, len(layout.tensors), progress)
        stack.callback(bar.close)
        started, cpu = time.monotonic(), _cpu_seconds()
        runner: _ThreadRunner | None = None
        try:
            # One BLAS thread for the whole pass: the jobs' threads are the parallelism, and a
            # delta's bits must not depend on a thread count (blas.py).
            stack.enter_context(blas.single_threaded())
            shared = None
            if remote_in:
                shared = st.Source(layout, str(staging) if staging is not None else None)
                stack.callback(shared.close)
            runner = _ThreadRunner(count, shared)
            results = _run_parts(plans, jobs, runner, count, sink, bar)
            runner.close()
            files = {
                p.name: digest.record(
                    results[p.name].algorithm, results[p.name].digest, results[p.name].bytes
                )
                for p in plans
            }
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
        except BaseException as exc:
            if runner is not None:
                runner.kill()  # no worker may write into what abort removes
            # Measured before abort frees the partial output, which is what filled the disk.
            full = _disk_full_error(exc, sink, staging) if disk_space.is_disk_full(exc) else None
            sink.abort()
            if full is not None:
                raise full from None
            raise
        seconds = time.monotonic() - started
    cpu = _cpu_seconds() - cpu
    return StreamStats(
        files,
        layout.total_bytes,
        len(deltas),
        len(layout.tensors) - len(deltas),
        seconds,
        count,
        cpu,
    )
