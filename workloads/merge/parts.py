"""What the merge's workers are handed: output shards cut into parts of about equal size.

A shard is planned whole from the base headers (its tensors, their order and offsets, its header
bytes), so any byte range of it can be written by anyone who knows the plan. With several workers
the shards are cut into parts of roughly `part_bytes`, each a run of consecutive bytes of one shard
(a tensor may be split between parts), and the workers take parts in turn: none waits at the end
while another finishes a large last shard, and a host can keep more workers busy than the model
has shards. Measured on 2 cores, 1.23 GB in three shards (0.5, 0.5 and 0.23 GB), two threads:
1.07-1.12 GB/s in parts against 0.95-1.05 GB/s whole shards, where one thread wrote the last
shard alone. Parallel parts are taken from different shards where there are enough of them
(stream._interleaved): two threads writing one file cost more CPU per GB.

A LoRA target is cut only at multiples of its delta's row blocks (mapping.ROW_BLOCK rows), so its
bits do not depend on the cut; a copied tensor anywhere. Each part's checksum covers its own bytes
and the shard's is their CRC-32C combination (workloads.common.digest.combine); sha256, which cannot
be combined, keeps one part per shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from workloads.merge import mapping
from workloads.merge import safetensors_io as st

# A copied (non-LoRA) tensor is cut at multiples of this many bytes: any offset would do.
COPY_GRAIN = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One output file: its name, its tensors in write order and its header bytes."""

    name: str
    tensors: tuple[st.TensorInfo, ...]
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes [start, stop) of one tensor's data."""

    info: st.TensorInfo
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        """Whether the tensor ends with this piece."""
        return self.stop == self.info.nbytes


@dataclasses.dataclass(frozen=True)
class ShardPart:
    """Everything a job needs to write one part of a shard.

    Attributes:
        shard: the shard's name.
        path: the shard's local file (created empty by the merge before any part is written).
        index: the part's number within the shard, from 0.
        offset: where in the file the part's bytes start (0 for the first part).
        header: the shard's header for the first part, else empty.
        pieces: the tensor bytes that follow, in file order.
        layout: the base checkpoint, reduced to the part's tensors.
        deltas: the deltas of the part's LoRA targets only.
        block_bytes: float32 bytes of a target tensor processed at once.
    """

    shard: str
    path: str
    index: int
    offset: int
    header: bytes
    pieces: tuple[Piece, ...]
    layout: st.Layout
    deltas: dict[str, mapping.Delta]
    block_bytes: int

    @property
    def size(self) -> int:
        return len(self.header) + sum(p.nbytes for p in self.pieces)


def _grain(info: st.TensorInfo, delta: mapping.Delta | None) -> int:
    """Where a tensor may be cut: whole row blocks of its delta, or anywhere on a copy grain."""
    if delta is None:
        return COPY_GRAIN
    return delta.row_block * info.shape[1] * info.itemsize


def _restricted(layout: st.Layout, names: set[str]) -> st.Layout:
    """`layout` restricted to `names` (and the files that hold them)."""
    tensors = {name: info for name, info in layout.tensors.items() if name in names}
    files = tuple(f for f in layout.files if any(t.file == f for t in tensors.values()))
    return st.Layout(layout.root, files, tensors, layout.metadata)


def plan_parts(
    plan: ShardPlan,
    path: str,
    layout: st.Layout,
    deltas: Mapping[str, mapping.Delta],
    part_bytes: int | None,
    block_bytes: int,
) -> list[ShardPart]:
    """Cuts a shard into parts of at most `part_bytes` (None: one part, the whole shard), each
    at least one grain of tensor data: a part holds more only where one row block of a target is
    larger than `part_bytes`. Every byte of the shard is in exactly one part, in order."""
    limit = part_bytes if part_bytes is not None else plan.size
    parts: list[ShardPart] = []
    pieces: list[Piece] = []
    size = len(plan.header)

    def close() -> None:
        nonlocal pieces, size
        names = {p.info.name for p in pieces}
        offset = parts[-1].offset + parts[-1].size if parts else 0
        parts.append(
            ShardPart(
                plan.name,
                path,
                len(parts),
                offset,
                b"" if parts else plan.header,
                tuple(pieces),
                _restricted(layout, names),
                {name: deltas[name] for name in names if name in deltas},
                block_bytes,
            )
        )
        pieces, size = [], 0

    for info in plan.tensors:
        grain = _grain(info, deltas.get(info.name))
        start = 0
        while start < info.nbytes:
            left, room = info.nbytes - start, max(0, limit - size)
            take = left if left <= room else room // grain * grain
            if take == 0:
                if pieces:
                    close()
                    continue
                take = min(left, grain)  # an empty part takes at least one grain
            pieces.append(Piece(info, start, start + take))
            size += take
            start += take
            if size >= limit:
                close()
    if pieces or not parts:
        close()
    return parts
