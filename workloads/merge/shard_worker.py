"""Writes one part of an output shard of the merge (parts.py); stream.py runs these in its
threads.

A part is written in one pass at its offset in the shard's file: the shard's header if it is the
first part (planned from the base headers, so every offset is known), then its pieces of tensors
streamed from the base files. A tensor without a LoRA delta is a raw byte copy (never decoded); a
LoRA target goes block of rows by block of rows: float32(base) + delta, cast back to the tensor's
dtype (round to nearest even, as torch and ml_dtypes do). The part's checksum
(workloads.common.digest) is computed while it is written (HashingWriter); the merge combines the
parts' checksums into the shard's and fsyncs the shard once its last part is written.

Memory of one job: one block of rows in float32 and in the base dtype, the writer's two buffers
and the LoRA factors of the part's own targets, whatever the shard or model size.
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from workloads.common import errors
from workloads.merge import mapping
from workloads.merge import safetensors_io as st
from workloads.merge.parts import Piece, ShardPart

# The largest LoRA delta the merge accepts, in multiples of the largest |value| of the base rows
# it is added to. A fine-tune's delta is small next to the weights: for rank r, alpha a and
# Adam's steps of about lr per element, |delta| ~ a * |A| * |B| stays around 1e-3..1e-1 of a
# pretrained projection's largest value (aggressive runs come near 1); measured here, the
# training tests' tiny fine-tune (lr 5e-3, 8 steps) reaches 0.078 of its base rows' largest
# value and the merge tests' randomised adapters, larger on purpose, 0.41.
# A delta 100 times the largest base weight would overwrite the model rather than tune it;
# what gets there is damage (bit flips decoding to 1e30+, issue #33), refused whatever its
# source, with two orders of magnitude of margin for any real run.
DELTA_SCALE_LIMIT = 100.0
# Rows per slice of check_scale's exact measure: about this many bytes of float32.
SCALE_SLICE_BYTES = 256 * 1024
BLOCK_BYTES = 16 * 1024 * 1024  # float32 rows of a target processed at once (at least 512 rows)
COPY_CHUNK = 16 * 1024 * 1024  # raw bytes of a copied tensor moved at once


@dataclasses.dataclass(frozen=True)
class ShardResult:
    """A written shard: its checksum (and the checksum's algorithm) and its size."""

    name: str
    digest: str
    algorithm: str
    bytes: int


class Progress(Protocol):
    def add(self, nbytes: int, tensors: int) -> None: ...


class ThreadProgress:
    """Bytes and tensors written so far, for shard jobs running in threads of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = self.tensors = 0

    def add(self, nbytes: int, tensors: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tensors += tensors

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self.bytes, self.tensors


class Workspace:
    """Buffers reused from block to block and tensor to tensor.

    Fresh multi-megabyte arrays are fresh pages from the kernel: page faults cost more than the
    arithmetic, so a shard job allocates its buffers once and grows them only when a wider tensor
    needs it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self.writer_pool: list[np.ndarray] = []  # the shard writers' buffers (HashingWriter)

    def get(self, name: str, nbytes: int) -> np.ndarray:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._buffers[name] = np.empty(nbytes, np.uint8)
        return buffer[:nbytes]


def block_rows(cols: int, row_block: int, block_bytes: int) -> int:
    """Rows of a target processed at once: whole multiples of the delta's own blocks (so the
    delta's bits do not depend on it), as many as fit `block_bytes` of float32, at least one."""
    return row_block * max(1, block_bytes // (row_block * cols * 4))


def overflow_limit(dtype: np.dtype) -> np.float32:
    """The smallest float32 magnitude that rounds to Inf in `dtype` (round to nearest even): a
    float32 sum strictly inside (-limit, limit) is finite after the cast, and NaN is never
    inside."""
    import ml_dtypes

    if dtype == np.dtype(ml_dtypes.bfloat16):  # halfway from bf16's largest 0x7F7F to 0x7F80
        return np.uint32(0x7F7F8000).view(np.float32)
    if dtype == np.float16:  # halfway from 65504 to 65536
        return np.float32(65520.0)
    return np.float32(np.inf)


def check_scale(
    info: st.TensorInfo,
    delta: mapping.Delta,
    source: st.Source,
    merged: np.ndarray,
    start: int,
    merged_max: float,
    workspace: Workspace,
) -> None:
    """Refuses a block whose delta exceeds DELTA_SCALE_LIMIT times its base rows' largest value.

    From what the loop has: `merged_max` = max |base + delta| over the block (its non-finite
    check's min and max) and a bound D of max |delta| from the factors (Delta.magnitude_bound).
    Since max |base| >= merged_max - D, D * (K + 1) <= K * merged_max proves max |delta| <= K *
    max |base|: a real fine-tune's block ends here, at no cost. Otherwise (D overestimates, or
    the delta is huge) the base rows are read again and the delta measured exactly.

    Raises:
        errors.UserError: the delta exceeds the limit, naming the tensor, the rows and values.
    """
    n = merged.shape[0]
    bound = delta.magnitude_bound(start, start + n)
    if bound * (DELTA_SCALE_LIMIT + 1) <= DELTA_SCALE_LIMIT * merged_max:
        return
    dtype = st.float_dtype(info.dtype)
    assert dtype is not None  # stream.check_targets refused anything else
    cols = info.shape[1]
    # Measured in slices of rows: the exact path holds no block-sized buffer, so a merge whose
    # every block takes it (large but sane deltas) keeps the few-blocks memory of the pass.
    step = max(1, SCALE_SLICE_BYTES // max(1, cols * 4))
    raw = workspace.get("scale_raw", min(n, step) * cols * info.itemsize)
    base_max = delta_max = 0.0
    for begin in range(0, n, step):
        m = min(step, n - begin)
        chunk = raw[: m * cols * info.itemsize]
        source.readinto(info, (start + begin) * cols * info.itemsize, chunk.data)
        base = chunk.view(dtype).reshape(m, cols).astype(np.float32)
        base_max = max(base_max, float(np.max(np.abs(base))))
        np.subtract(merged[begin : begin + m], base, out=base)
        delta_max = max(delta_max, float(np.max(np.abs(base))))
    if delta_max > DELTA_SCALE_LIMIT * base_max:
        raise errors.UserError(
            f"{info.name}: the LoRA delta of {delta.source} reaches {delta_max:.3g} in rows "
            f"{start}-{start + n - 1}, where the base's largest value is {base_max:.3g} (a "
            f"fine-tune's delta stays below {DELTA_SCALE_LIMIT:g} times it); damaged adapters? "
            "nothing written"
        )


def merged_blocks(
    info: st.TensorInfo,
    delta: mapping.Delta,
    source: st.Source,
    writer: st.HashingWriter,
    block_bytes: int = BLOCK_BYTES,
    workspace: Workspace | None = None,
    rows: tuple[int, int] | None = None,
) -> Iterator[int]:
    """Submits rows [start, stop) of the merged tensor (`rows`; None: all of them) to `writer`,
    block of rows by block of rows: float32(base) + delta, cast back to the base dtype. Yields
    the bytes of each block as it is submitted. `start` must be a multiple of the delta's row
    block (parts.plan_parts cuts there), so the bits do not depend on the range.

    Per block: the base widened to float32 (exact), the delta's product accumulated into it by
    the BLAS (mapping.Delta.add_rows_to: no separate add pass), one min and one max over the sum
    (the non-finite check, and the scale check from the same two values: check_scale) and the
    cast back, written straight into the writer's buffer. A float32 tensor is read straight
    into that buffer and summed there.
    """
    dtype = st.float_dtype(info.dtype)
    assert dtype is not None  # stream.check_targets refused anything else
    workspace = workspace or Workspace()
    limit = overflow_limit(dtype)
    first, stop = rows if rows is not None else (0, info.shape[0])
    cols = info.shape[1]
    per = min(stop - first, block_rows(cols, delta.row_block, block_bytes))
    raw = workspace.get("raw", per * cols * info.itemsize)
    acc = workspace.get("acc", per * cols * 4).view(np.float32).reshape(per, cols)
    for start in range(first, stop, per):
        n = min(stop, start + per) - start
        nbytes = n * cols * info.itemsize
        out = writer.buffer(nbytes)
        if dtype == np.float32:  # sum in the buffer the writer will write
            source.readinto(info, start * cols * 4, out.data)
            block = out.view(np.float32).reshape(n, cols)
        else:
            source.readinto(info, start * cols * info.itemsize, raw[:nbytes].data)
            block = acc[:n]
            np.copyto(block, raw[:nbytes].view(dtype).reshape(n, cols), casting="unsafe")
        delta.add_rows_to(block, start)
        # A delta that overflows the tensor's dtype (or a base that holds NaN) would ship a
        # model that answers garbage: refuse it here, before the output can look complete.
        # min/max propagate NaN, and Inf or a value that rounds to Inf is outside the limit.
        high, low = (block.max(), block.min()) if block.size else (0.0, 0.0)
        if block.size and not (high < limit and low > -limit):
            raise errors.UserError(
                f"{info.name}: the merged values of rows {start}-{start + n - 1} are not finite "
                f"(NaN/Inf) after adding the LoRA delta of {delta.source}; nothing written"
            )
        check_scale(info, delta, source, block, start, max(float(high), -float(low)), workspace)
        if dtype != np.float32:
            np.copyto(out.view(dtype).reshape(n, cols), block, casting="unsafe")
        writer.submit(out)
        yield nbytes


def copied_chunks(
    info: st.TensorInfo,
    source: st.Source,
    writer: st.HashingWriter,
    chunk: int = COPY_CHUNK,
    span: tuple[int, int] | None = None,
) -> Iterator[int]:
    """Submits the tensor's raw bytes [start, stop) (`span`; None: all) to `writer` unchanged;
    yields the bytes of each chunk."""
    first, stop = span if span is not None else (0, info.nbytes)
    for start in range(first, stop, chunk):
        out = writer.buffer(min(chunk, stop - start))
        source.readinto(info, start, out.data)
        writer.submit(out)
        yield out.nbytes


def _piece_blocks(
    piece: Piece,
    delta: mapping.Delta | None,
    source: st.Source,
    writer: st.HashingWriter,
    block_bytes: int,
    workspace: Workspace,
) -> Iterator[int]:
    if delta is None:
        return copied_chunks(piece.info, source, writer, span=(piece.start, piece.stop))
    row_bytes = piece.info.shape[1] * piece.info.itemsize
    rows = (piece.start // row_bytes, piece.stop // row_bytes)
    return merged_blocks(piece.info, delta, source, writer, block_bytes, workspace, rows)


def write_part(
    part: ShardPart,
    source: st.Source,
    progress: Progress,
    workspace: Workspace | None = None,
) -> tuple[str, str, int]:
    """Writes `part` into its shard's file at its offset (the file exists; nothing else of it is
    touched); returns the part's checksum, the checksum's algorithm and its size. The file is
    not fsynced here: the merge does it once the shard's last part is written. A failure removes
    nothing (the caller owns the directory) but closes the file."""
    workspace = workspace or Workspace()
    writer = st.HashingWriter(pathlib.Path(part.path), part.offset, pool=workspace.writer_pool)
    try:
        if part.header:
            writer.write(part.header)
        for piece in part.pieces:
            delta = part.deltas.get(piece.info.name)
            for nbytes in _piece_blocks(piece, delta, source, writer, part.block_bytes, workspace):
                progress.add(nbytes, 0)
            if piece.last:
                source.done(piece.info)
                progress.add(0, 1)
    except BaseException:
        writer.abort()
        raise
    return writer.close(), writer.algorithm, writer.bytes
