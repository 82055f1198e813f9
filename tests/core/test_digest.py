"""The shards' checksum: CRC-32C by google-crc32c's C extension, sha256 where it is missing."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest

from workloads.common import digest


def hexdigest(algorithm: str, *chunks) -> str:
    running = digest.new(algorithm)
    for chunk in chunks:
        running.update(chunk)
    return running.hexdigest()


def crc(data: bytes) -> str:
    return hexdigest(digest.CRC32C, data)


def test_crc32c_is_castagnolis_and_runs_in_c_here():
    # The check value of CRC-32C (RFC 3720, appendix B.4), the checksum Cloud Storage keeps.
    assert hexdigest(digest.CRC32C, b"123456789") == "e3069283"
    assert digest.fast_crc32c(), "google-crc32c without its C extension: the merge falls back"
    assert digest.default_algorithm() == digest.CRC32C


def test_numpy_buffers_and_bytes_give_the_same_checksum_in_any_chunking():
    data = np.random.default_rng(0).integers(0, 256, 3 * 2**20 + 17, dtype=np.uint8)
    whole = hexdigest(digest.CRC32C, data.tobytes())
    assert hexdigest(digest.CRC32C, data) == whole
    assert hexdigest(digest.CRC32C, data[:1000], data[1000 : 2**21], data[2**21 :]) == whole
    assert hexdigest(digest.SHA256, data) == hashlib.sha256(data.tobytes()).hexdigest()


def test_an_unknown_algorithm_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown checksum 'md5'; known: crc32c, sha256"):
        digest.new("md5")


def test_an_entry_names_its_algorithm_and_crc32c_wins():
    assert digest.expected({"crc32c": "ab", "sha256": "cd", "bytes": 1}) == ("crc32c", "ab")
    assert digest.expected({"sha256": "cd", "bytes": 1}) == ("sha256", "cd")
    assert digest.expected({"md5": "cd", "bytes": 1}) is None
    assert digest.record("crc32c", "ab", 3) == {"crc32c": "ab", "bytes": 3}


def test_a_file_is_read_to_its_end(tmp_path):
    path = pathlib.Path(tmp_path / "f")
    data = b"x" * (3 * 16 * 2**20 + 5)  # more than one read chunk
    path.write_bytes(data)
    assert digest.of_file(path, digest.CRC32C) == (hexdigest(digest.CRC32C, data), len(data))


@pytest.mark.parametrize(
    "sizes", [(0, 0), (0, 7), (7, 0), (1, 1), (1000, 3), (4096, 65_537), (3, 5, 0, 1 << 20, 11)]
)
def test_pieces_checksums_combine_into_the_whole_files(sizes):
    """The merge's workers checksum adjacent parts of a shard; the combination is the CRC-32C of
    the concatenation, computed here by the C extension over the whole bytes."""
    rng = np.random.default_rng(sum(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    combined = digest.combine(digest.CRC32C, [(crc(p), len(p)) for p in pieces])
    assert combined == crc(b"".join(pieces))


def test_a_piece_of_five_gigabytes_combines_without_its_bytes():
    """The length enters only through x**(8 len) modulo the polynomial: a 5 GB shard's last part
    is combined in microseconds. Zeros extend a CRC the same way whatever came before, which
    gives an independent check: CRC(A + zeros) from the C extension is CRC(A) combined with
    CRC(zeros)."""
    head = b"header bytes"
    zeros = bytes(1 << 26)
    assert digest.combine(digest.CRC32C, [(crc(head), len(head)), (crc(zeros), len(zeros))]) == (
        crc(head + zeros)
    )
    assert digest.crc32c_combine("00000000", "00000000", 5 * 10**9) == "00000000"


def test_sha256_is_not_combined():
    with pytest.raises(ValueError, match="sha256 cannot combine 2 pieces"):
        digest.combine(digest.SHA256, [("a", 1), ("b", 1)])
    assert digest.combine(digest.SHA256, [("ab", 2)]) == "ab"
