"""The project's own source as one deterministic archive: what the recovery controller runs.

The controller (infra/components/recovery.py) runs `python -m infra.ops recover --watch` with
this checkout's program, stack file and compile-check results, so a recovery declares exactly
what the user's last `pulumi up` declared. The archive is byte-for-byte the same for the same
files on any machine: the controller's own `pulumi up` rebuilds it from its copy and Pulumi, which
compares the uploaded FileAsset by the SHA-256 of its bytes, finds nothing to change (the
controller may only read the training bucket: an upload would be refused with a 403).

What makes it machine-independent:
- no compressor: zlib's output depends on the machine (the OS byte of the gzip header: 3 on
  Linux, 19 on macOS; zlib-ng, Fedora's zlib, deflates differently). The tar is wrapped in a gzip
  container written here with deflate's *stored* blocks (the bytes as they are, 5 bytes of framing
  per 64 KiB) and a fixed header, so its bytes follow from the files alone (1.5 MB where zlib gave
  0.4 MB), and controllers already running, whose script unpacks `source.tar.gz` with `tar -xzf`,
  keep working;
- sorted members, zeroed times and owners;
- modes from a rule on the content (a `#!` script is 0755, all else 0644), not from the
  checkout's permission bits, which a umask or a copy can change.
"""

from __future__ import annotations

import hashlib
import io
import pathlib
import struct
import tarfile
import zlib

from infra.config.stack_config import ROOT, stack_file

# What the program needs to run (pip installs the project from pyproject.toml, which names the
# README) and every file the workloads wheel is built from (LICENSE is in the wheel: without it
# the controller's wheel, hence the deployment fingerprint, would differ from the laptop's); the
# stack's own Pulumi.<stack>.yaml is added per stack. Never .venv, .git, the
# wheel cache or the project-local known_hosts (the controller keeps its own).
ENTRIES = (
    "Pulumi.yaml",
    "pyproject.toml",
    "constraints.txt",
    "README.md",
    "LICENSE",
    "infra",
    "workloads",
    "templates",
    ".compile-check",
)
SKIPPED_PARTS = ("__pycache__",)
SKIPPED_SUFFIXES = (".pyc", ".pyo")


def source_files(stack: str, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files of the archive, relative to `root`, sorted.

    Raises:
        FileNotFoundError: the stack file or a required top-level file is missing.
    """
    files: list[pathlib.Path] = []
    for entry in (*ENTRIES, stack_file(stack)):
        path = root / entry
        if path.is_file():
            files.append(path.relative_to(root))
        elif path.is_dir():
            files += [
                p.relative_to(root)
                for p in path.rglob("*")
                if p.is_file()
                and not any(part in SKIPPED_PARTS for part in p.parts)
                and p.suffix not in SKIPPED_SUFFIXES
            ]
        elif entry != ".compile-check":  # no compile results yet is allowed
            raise FileNotFoundError(f"{path}: needed in the recovery controller's source archive")
    return sorted(files)


EXECUTABLE = 0o755
REGULAR = 0o644


def member_mode(data: bytes) -> int:
    """The mode a file gets in the archive: decided by its content alone (see the module doc)."""
    return EXECUTABLE if data.startswith(b"#!") else REGULAR


# gzip's header with no name, no time and OS 255 ("unknown"): the same from every machine.
_GZIP_HEADER = bytes([0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 255])
_STORED_BLOCK = 0xFFFF  # the largest stored deflate block


def stored_gzip(data: bytes) -> bytes:
    """`data` in a gzip file of stored (uncompressed) deflate blocks: any gunzip reads it, and its
    bytes depend on `data` alone, never on the machine's zlib (RFC 1951 3.2.4, RFC 1952)."""
    out = bytearray(_GZIP_HEADER)
    view = memoryview(data)
    starts = range(0, len(data), _STORED_BLOCK) if data else range(1)
    for start in starts:
        chunk = view[start : start + _STORED_BLOCK]
        final = start + _STORED_BLOCK >= len(data)
        out += bytes([1 if final else 0])  # BFINAL, BTYPE 00 (stored), byte-aligned
        out += struct.pack("<HH", len(chunk), len(chunk) ^ 0xFFFF) + chunk
    out += struct.pack("<II", zlib.crc32(data) & 0xFFFFFFFF, len(data) & 0xFFFFFFFF)
    return bytes(out)


def archive_bytes(stack: str, root: pathlib.Path = ROOT) -> bytes:
    """The tar.gz of source_files (stored_gzip): identical for identical files, on any machine.

    Args:
        stack: the stack whose Pulumi.<stack>.yaml is included.
        root: the checkout.

    Returns:
        The archive's bytes.

    Raises:
        FileNotFoundError: a required file is missing (source_files).
    """
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in source_files(stack, root):
            data = (root / rel).read_bytes()
            info = tarfile.TarInfo(rel.as_posix())
            info.size = len(data)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = member_mode(data)
            tar.addfile(info, io.BytesIO(data))
    return stored_gzip(raw.getvalue())


def write_archive(stack: str, dest_dir: pathlib.Path, root: pathlib.Path = ROOT) -> pathlib.Path:
    """Writes the archive as `<dest_dir>/source-<stack>-<sha12>.tar.gz` (atomically; an existing
    file of that name already holds these bytes) and returns its path.

    Raises:
        FileNotFoundError: a required file is missing (source_files).
    """
    data = archive_bytes(stack, root)
    digest = hashlib.sha256(data).hexdigest()[:12]
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"source-{stack}-{digest}.tar.gz"
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path
