"""The workloads wheel a deploy ships: built from this checkout once per source state, cached in
.whl/, and identified by a content hash that ignores timestamps.

It holds the `workloads` package only: the VMs never import infra/ (the Pulumi program, which
runs on the laptop and on the recovery controller from its source tree, `pip install -e
src[infra]`), so editing the program neither rebuilds the wheel nor restarts a VM's jobs.
pyproject's packages.find still names infra for those editable installs."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import shutil
import tempfile
import zipfile

from infra.errors import WheelBuildError
from infra.vm import wheel_build

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_WHEEL_CACHE = REPO_ROOT / ".whl"
# The top-level packages the VMs run: nothing else goes into the wheel.
VM_PACKAGES = ("workloads",)
# The files the wheel is built from (their hash is the build cache key).
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", *VM_PACKAGES)


@dataclasses.dataclass(frozen=True)
class Wheel:
    """A built wheel: its path and its content hash (see wheel_hash)."""

    path: str
    sha256: str


def _source_files(source_dir: pathlib.Path) -> list[pathlib.Path]:
    files = []
    for entry in WHEEL_SOURCES:
        path = source_dir / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
            ]
    return sorted(files)


def source_hash(source_dir: pathlib.Path = REPO_ROOT) -> str:
    """Hash of every file that goes into the wheel build (the cache key)."""
    digest = hashlib.sha256()
    for path in _source_files(source_dir):
        digest.update(path.relative_to(source_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def wheel_hash(wheel_path: str | pathlib.Path) -> str:
    """Content hash of a wheel: member names and bytes, independent of zip timestamps.

    RECORD is left out: it only restates the other members' hashes.
    """
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel_path) as archive:
        for name in sorted(archive.namelist()):
            if name.endswith(".dist-info/RECORD"):
                continue
            digest.update(name.encode() + b"\0")
            digest.update(hashlib.sha256(archive.read(name)).digest())
    return digest.hexdigest()


def build_wheel(
    source_dir: pathlib.Path = REPO_ROOT, cache_dir: pathlib.Path = DEFAULT_WHEEL_CACHE
) -> Wheel:
    """Builds the VM wheel of this checkout, `workloads` only (infra.vm.wheel_build: no pip, no
    setuptools, offline), cached by source hash.

    The same source files give the same members on any machine (a clone or the recovery
    controller's copy from the source archive), hence the same wheel_hash and fingerprint.

    Raises:
        WheelBuildError: pyproject.toml cannot be built (the message names the key or file).
    """
    key = source_hash(source_dir)[:20]
    target = cache_dir / key
    found = sorted(target.glob("*.whl")) if target.is_dir() else []
    if len(found) == 1:
        return Wheel(str(found[0]), wheel_hash(found[0]))
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".build-") as tmp:
        staged = pathlib.Path(tmp) / key
        try:
            wheel_build.build(source_dir, staged, top_level=VM_PACKAGES)
        except wheel_build.WheelBuildError as exc:
            raise WheelBuildError(f"building the wheel of {source_dir}: {exc}") from None
        try:
            # Atomic: a concurrent build of the same source wins or loses whole.
            staged.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    _prune(cache_dir, keep=target)
    wheel = sorted(target.glob("*.whl"))[0]
    return Wheel(str(wheel), wheel_hash(wheel))


def _prune(cache_dir: pathlib.Path, keep: pathlib.Path, entries: int = 5) -> None:
    """Keeps the newest few builds in the cache (only directories this module created)."""
    builds = sorted(
        (p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[entries - 1 :]:
        if all(f.suffix == ".whl" for f in old.iterdir()):
            shutil.rmtree(old, ignore_errors=True)
