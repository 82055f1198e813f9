"""The checksum of a merged shard: written by the merge, checked by `merge --verify` and by staging
on the serving host.

CRC-32C (Castagnoli), the checksum Cloud Storage keeps for every object, through google-crc32c's C
extension (SSE4.2/ARMv8 CRC instructions): about 0.04-0.08 CPU s per GB here, where sha256 (OpenSSL
with SHA-NI) costs 0.55, a quarter of the merge's whole CPU budget per GB on a 2-core host.

What it guarantees is what this project needs from it: a shard damaged or replaced by accident (a
truncated or interrupted copy, a flipped bit on disk or on the wire, a stale shard of another
merge under the same name and size) does not match. CRC-32C detects every error burst of up to 32
bits and any other accidental change except with probability 2^-32 per file. It is not a
defence against someone who can write the bucket, and sha256 was not one either: that someone can
rewrite merge_metadata.json beside the shards. Without the C extension (the pure-Python fallback
hashes at a few MB/s) the merge records sha256 instead; readers accept either, so a model merged
by an earlier version, with sha256, still stages and verifies.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any, BinaryIO, Protocol

CRC32C = "crc32c"
SHA256 = "sha256"
ALGORITHMS = (CRC32C, SHA256)
_CHUNK = 16 * 1024 * 1024


class Digest(Protocol):
    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32c:
    """hashlib's interface over google-crc32c's C extension; `update` takes any contiguous buffer
    without a copy (numpy arrays and bytes) and releases the GIL from 1 MB on."""

    def __init__(self) -> None:
        from google_crc32c import cext

        self._extend = cext.extend
        self._crc = 0

    def update(self, data: Any, /) -> None:
        self._crc = self._extend(self._crc, data)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


def fast_crc32c() -> bool:
    """Whether google-crc32c has its C extension here (else the merge records sha256)."""
    try:
        import google_crc32c
    except ImportError:
        return False
    return bool(google_crc32c.implementation == "c")


def default_algorithm() -> str:
    return CRC32C if fast_crc32c() else SHA256


def new(algorithm: str) -> Digest:
    """A running checksum of `algorithm` (one of ALGORITHMS)."""
    if algorithm == CRC32C:
        if fast_crc32c():
            return _Crc32c()
        import google_crc32c  # the pure-Python fallback: slow, but a reader still gets an answer

        return _HexCrc(google_crc32c.Checksum())
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r}; known: {', '.join(ALGORITHMS)}")


class _HexCrc:
    def __init__(self, checksum: Any) -> None:
        self._checksum = checksum

    def update(self, data: Any, /) -> None:
        self._checksum.update(bytes(data))

    def hexdigest(self) -> str:
        return str(self._checksum.digest().hex())


# CRC-32C's polynomial, bit-reflected (the order in which the CRC consumes bits).
_CRC32C_POLY = 0x82F63B78


def _crc_multiply(a: int, b: int) -> int:
    """a * b modulo CRC-32C's polynomial, both reflected 32-bit polynomials."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return product


def _x_to_the(bits: int) -> int:
    """x**bits modulo the polynomial (reflected), by squaring: O(log bits) multiplications."""
    result, power = 1 << 31, 1 << 30  # x**0 and x**1
    while bits:
        if bits & 1:
            result = _crc_multiply(power, result)
        power = _crc_multiply(power, power)
        bits >>= 1
    return result


def crc32c_combine(first: str, second: str, second_bytes: int) -> str:
    """The CRC-32C of A followed by B, from CRC(A), CRC(B) and len(B) (hex digests), without the
    data: the merge's workers checksum adjacent pieces of one shard in parallel, and the shard's
    checksum is their combination. CRC(A + B) = CRC(A) * x**(8 len B) + CRC(B) modulo the
    polynomial, for CRC-32C's initial value and final inversion alike (they cancel out)."""
    shifted = _crc_multiply(_x_to_the(8 * second_bytes), int(first, 16))
    return f"{shifted ^ int(second, 16):08x}"


def combine(algorithm: str, pieces: list[tuple[str, int]]) -> str:
    """The checksum of a file from the checksums of its consecutive pieces, (hex, bytes) in file
    order. sha256 cannot be combined: a sha256 file is checksummed in one piece.

    Raises:
        ValueError: no pieces, or several for an algorithm that cannot combine them.
    """
    if not pieces:
        raise ValueError("no pieces to combine")
    if algorithm != CRC32C and len(pieces) > 1:
        raise ValueError(f"{algorithm} cannot combine {len(pieces)} pieces' checksums")
    total = pieces[0][0]
    for hexdigest, size in pieces[1:]:
        total = crc32c_combine(total, hexdigest, size)
    return total


def record(algorithm: str, hexdigest: str, size: int) -> dict[str, Any]:
    """The entry merge_metadata.json keeps for a shard: {"crc32c" or "sha256": hex, "bytes": n}."""
    return {algorithm: hexdigest, "bytes": size}


def expected(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a metadata entry, crc32c first; None when it names neither."""
    for algorithm in ALGORITHMS:
        value = entry.get(algorithm)
        if isinstance(value, str):
            return algorithm, value
    return None


def of_stream(handle: BinaryIO, algorithm: str) -> tuple[str, int]:
    """(hex digest, size) of what is left to read in `handle`, read in chunks."""
    digest, size = new(algorithm), 0
    while block := handle.read(_CHUNK):
        digest.update(block)
        size += len(block)
    return digest.hexdigest(), size


def of_file(path: str | os.PathLike[str], algorithm: str) -> tuple[str, int]:
    """(hex digest, size) of a local file."""
    with open(path, "rb") as handle:
        return of_stream(handle, algorithm)


def matches(path: str | os.PathLike[str], entry: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the file has the entry's checksum; also the digest found ("" when the entry names no
    known checksum)."""
    want = expected(entry)
    if want is None:
        return False, ""
    got, _ = of_file(path, want[0])
    return got == want[1], got
