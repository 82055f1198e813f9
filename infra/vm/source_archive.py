"""The project's own source as one deterministic archive: what the recovery controller runs.

The controller (infra/components/recovery.py) runs `python -m infra.ops recover --watch` with
this checkout's program, stack file and compile-check results, so a recovery declares exactly
what the user's last `pulumi up` declared. The archive is byte-for-byte the same for the same
files (sorted members, zeroed times and owners, gzip without a timestamp): the controller's own
`pulumi up` rebuilds it from its copy and finds nothing to change.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pathlib
import tarfile

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


def archive_bytes(stack: str, root: pathlib.Path = ROOT) -> bytes:
    """The tar.gz of source_files, identical for identical files."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in source_files(stack, root):
            data = (root / rel).read_bytes()
            info = tarfile.TarInfo(rel.as_posix())
            info.size = len(data)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if os.access(root / rel, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)


def write_archive(stack: str, dest_dir: pathlib.Path, root: pathlib.Path = ROOT) -> pathlib.Path:
    """Writes the archive as `<dest_dir>/source-<stack>-<sha12>.tar.gz` (atomically; an existing
    file of that name already holds these bytes) and returns its path."""
    data = archive_bytes(stack, root)
    digest = hashlib.sha256(data).hexdigest()[:12]
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"source-{stack}-{digest}.tar.gz"
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path
