"""Cutting output shards into parts for the merge's workers: every byte in exactly one part, in
order, LoRA targets cut only between whole row blocks of their delta."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from workloads.common import digest
from workloads.merge import mapping, parts, stream
from workloads.merge import safetensors_io as st

HEADER = b"h" * 24


def info(name: str, shape: tuple[int, ...], dtype: str = "BF16", start: int = 0) -> st.TensorInfo:
    nbytes = int(np.prod(shape)) * st.ITEMSIZE[dtype]
    return st.TensorInfo(name, dtype, shape, "base.safetensors", start, nbytes)


def delta(name: str, rows: int, cols: int, row_block: int) -> mapping.Delta:
    return mapping.Delta(
        name, np.ones((rows, 2), np.float32), np.ones((2, cols), np.float32), name, row_block
    )


def shard() -> tuple[parts.ShardPlan, st.Layout, dict[str, mapping.Delta]]:
    tensors = (
        info("target", (40, 16)),  # 1,280 bytes: row blocks of 8 rows = 256 bytes
        info("copied", (300,), "F32", start=1280),  # 1,200 bytes
        info("small_target", (3, 16), start=2480),  # 96 bytes: less than one row block
    )
    layout = st.Layout("/base", ("base.safetensors",), {t.name: t for t in tensors}, {})
    deltas = {"target": delta("target", 40, 16, 8), "small_target": delta("small_target", 3, 16, 8)}
    return parts.ShardPlan("model-00001-of-00001.safetensors", tensors, HEADER), layout, deltas


def cut(part_bytes, copy_grain=100):
    plan, layout, deltas = shard()
    original, parts.COPY_GRAIN = parts.COPY_GRAIN, copy_grain
    try:
        return plan, parts.plan_parts(plan, "/out/shard", layout, deltas, part_bytes, 1 << 20)
    finally:
        parts.COPY_GRAIN = original


@pytest.mark.parametrize("part_bytes", [None, 1, 300, 700, 1000, 10_000])
def test_every_byte_is_in_one_part_in_file_order(part_bytes):
    plan, cuts = cut(part_bytes)
    assert cuts[0].header == HEADER and all(not p.header for p in cuts[1:])
    assert [p.index for p in cuts] == list(range(len(cuts)))
    offset = 0
    covered: dict[str, list[tuple[int, int]]] = {}
    for part in cuts:
        assert part.offset == offset and part.size > 0
        offset += part.size
        for piece in part.pieces:
            covered.setdefault(piece.info.name, []).append((piece.start, piece.stop))
            assert piece.info.name in part.layout.tensors
            assert (piece.info.name in part.deltas) == (piece.info.name != "copied")
    assert offset == plan.size
    for t in plan.tensors:  # each tensor's pieces tile it, in order
        spans = covered[t.name]
        assert spans[0][0] == 0 and spans[-1][1] == t.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert sum(p.last for part in cuts for p in part.pieces if p.info.name == t.name) == 1


def test_targets_are_cut_between_row_blocks_and_parts_keep_their_size():
    _, cuts = cut(300)
    for part in cuts:
        for piece in part.pieces:
            if piece.info.name == "target":  # 8 rows x 16 columns x 2 bytes
                assert piece.start % 256 == 0 and (piece.last or piece.stop % 256 == 0)
    # At most 300 bytes each, except where one grain alone is larger (the header's part here
    # takes one row block of 256 bytes beside its 24 header bytes: 280).
    assert max(p.size for p in cuts) <= 300
    assert len(cuts) > 5


def test_without_a_size_a_shard_is_one_part():
    plan, cuts = cut(None)
    assert len(cuts) == 1 and cuts[0].size == plan.size and cuts[0].offset == 0


def test_parts_are_sized_for_the_workers_and_sha256_keeps_whole_shards(monkeypatch):
    gb = 10**9
    assert stream.part_size(62 * gb, 1, 5 * gb) is None
    assert stream.part_size(62 * gb, 8, 5 * gb) == -(-62 * gb // 64)  # about a GB each
    assert stream.part_size(62 * gb, 8, gb // 2) == gb // 2  # never more than a shard
    assert stream.part_size(gb, 104, 5 * gb) == stream.MIN_PART_BYTES
    monkeypatch.setattr(digest, "fast_crc32c", lambda: False)
    assert stream.part_size(62 * gb, 8, 5 * gb) is None  # sha256 cannot be combined


def test_parallel_parts_come_from_different_shards():
    """Two workers take the parts of two shards in turn (two writers in one file cost more), and
    the next shards only after: a shard's first part always comes before its others."""
    plan, layout, deltas = shard()
    cuts = {
        name: parts.plan_parts(
            dataclasses.replace(plan, name=name), name, layout, deltas, 700, 1 << 20
        )
        for name in ("a", "b", "c")
    }
    order = [
        (p.shard, p.index) for p in stream._interleaved([*cuts["a"], *cuts["b"], *cuts["c"]], 2)
    ]
    n = len(cuts["a"])
    assert order[: 2 * n] == [(s, i) for i in range(n) for s in ("a", "b")]
    assert order[2 * n :] == [("c", i) for i in range(n)]


def test_a_large_host_gets_one_thread_per_core_up_to_the_cap(monkeypatch):
    """A 62.5 GB model cut for a 208-core host: more threads than the 13 shards of 5 GB, but no
    more than stream.MAX_DEFAULT_WORKERS (the GIL's share, and no disk keeps up beyond)."""
    plan, layout, deltas = shard()
    job = parts.plan_parts(plan, "x", layout, deltas, None, 1 << 20)[0]
    monkeypatch.setattr(stream, "_available_memory", lambda: 448 * 2**30)
    for cores, jobs, expected in [(208, 1000, 16), (208, 13, 13), (2, 1000, 2), (12, 1000, 12)]:
        monkeypatch.setattr(stream, "host_cores", lambda cores=cores: cores)
        assert stream.default_workers([job] * jobs) == expected
    monkeypatch.setattr(stream, "_available_memory", lambda: 3 * stream._thread_bytes(job))
    assert stream.default_workers([job] * 1000) == 1  # half the memory holds one job's blocks
