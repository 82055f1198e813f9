"""The shard writer: checksum and write in a thread, in slices, writeback started early."""

from __future__ import annotations

import hashlib

import numpy as np

from workloads.common import digest
from workloads.merge import safetensors_io as st


def crc(data: bytes) -> str:
    running = digest.new(digest.CRC32C)
    running.update(data)
    return running.hexdigest()


def write_blocks(path, data: np.ndarray, block: int) -> str:
    path.write_bytes(b"")  # the merge creates each shard's file before its parts are written
    writer = st.HashingWriter(path)
    writer.write(b"header")
    for start in range(0, data.size, block):
        piece = data[start : start + block]
        out = writer.buffer(piece.size)
        out[:] = piece
        writer.submit(out)
    return writer.close()


def test_the_writer_records_sha256_when_the_c_extension_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "fast_crc32c", lambda: False)
    (tmp_path / "f").write_bytes(b"")
    writer = st.HashingWriter(tmp_path / "f")
    writer.write(b"abc")
    assert writer.algorithm == "sha256"
    assert writer.close() == hashlib.sha256(b"abc").hexdigest()


def test_writes_in_slices_keep_every_byte_and_the_checksum(tmp_path, monkeypatch):
    """The writer hands the kernel a block a slice at a time (st.WRITE_SLICE): with slices that
    do not divide the blocks, the file and its checksum are still the bytes submitted."""
    monkeypatch.setattr(st, "WRITE_SLICE", 4099)
    data = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8)
    checksum = write_blocks(tmp_path / "f", data, 30_001)
    written = (tmp_path / "f").read_bytes()
    assert written == b"header" + data.tobytes()
    assert checksum == crc(written)
    assert st.file_digest(str(tmp_path / "f"), "crc32c") == (checksum, len(written))


def test_every_block_is_handed_to_writeback_as_it_is_written(tmp_path, monkeypatch):
    """sync_file_range(SYNC_FILE_RANGE_WRITE) over exactly the bytes of each block, in order, so
    the final fsync has only the last ones left; without the call (another OS) nothing changes."""
    calls = []
    monkeypatch.setattr(st, "_sync_file_range", lambda: lambda *args: calls.append(args))
    data = np.random.default_rng(2).integers(0, 256, 70_000, dtype=np.uint8)
    write_blocks(tmp_path / "f", data, 30_000)
    ranges = [(offset, nbytes, flags) for _, offset, nbytes, flags in calls]
    assert ranges == [(0, 6, 2), (6, 30_000, 2), (30_006, 30_000, 2), (60_006, 10_000, 2)]
    monkeypatch.setattr(st, "_sync_file_range", lambda: None)
    write_blocks(tmp_path / "g", data, 30_000)
    assert (tmp_path / "g").read_bytes() == (tmp_path / "f").read_bytes()


def test_the_real_sync_file_range_is_found_on_linux(tmp_path):
    st._sync_file_range.cache_clear()
    assert st._sync_file_range() is not None
    data = np.arange(1 << 20, dtype=np.uint8)
    assert write_blocks(tmp_path / "f", data, 1 << 18) == crc(b"header" + data.tobytes())


def test_a_writer_at_an_offset_fills_its_range_and_checksums_only_it(tmp_path, monkeypatch):
    """The merge's parts: two writers fill one file, each from its offset, neither truncating
    what the other wrote; each checksum is its own range's, and their combination the file's."""
    calls = []
    monkeypatch.setattr(st, "_sync_file_range", lambda: lambda *args: calls.append(args))
    path = tmp_path / "shard"
    path.write_bytes(b"")
    data = np.random.default_rng(3).integers(0, 256, 50_000, dtype=np.uint8)
    second = st.HashingWriter(path, offset=20_000)  # the later part may start first
    second.write(data[20_000:].tobytes())
    late = second.close()
    first = st.HashingWriter(path, offset=0)
    first.write(data[:20_000].tobytes())
    early = first.close()
    assert path.read_bytes() == data.tobytes()
    assert (early, late) == (crc(data[:20_000].tobytes()), crc(data[20_000:].tobytes()))
    assert digest.combine("crc32c", [(early, 20_000), (late, 30_000)]) == crc(data.tobytes())
    assert [(offset, nbytes) for _, offset, nbytes, _ in calls] == [(20_000, 30_000), (0, 20_000)]
