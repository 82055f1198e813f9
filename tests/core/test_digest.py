"""The shards' checksum: CRC-32C by google-crc32c's C extension, sha256 where it is missing."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest

from workloads import digest


def hexdigest(algorithm: str, *chunks) -> str:
    running = digest.new(algorithm)
    for chunk in chunks:
        running.update(chunk)
    return running.hexdigest()


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
