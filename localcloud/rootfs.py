"""Debian 12 root file systems built once with debootstrap and cached by their package list.

A build takes about a minute and 320 MB (measured on the project's 2-core machine); every boot
after that starts from a copy-on-write overlay of the cached tree, so the cache is read-only once
built. Builders of the same tree wait on a lock file rather than building it twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
from collections.abc import Iterator, Sequence

from localcloud.errors import CannotBoot

SUITE = "bookworm"
MIRROR = os.environ.get("GEMMA4_LOCALCLOUD_MIRROR", "http://deb.debian.org/debian")
CACHE_ENV = "GEMMA4_LOCALCLOUD_CACHE"

# What every machine needs to boot and be driven: systemd as PID 1, dbus (systemctl, systemd-run),
# curl and the CA list (GCE's Debian 12 image has both; the scripts read the metadata server with
# curl), iproute2, and the python3 a stock GCE image ships (with its venv module but without
# ensurepip: python3-venv is not installed there).
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "curl",
    "ca-certificates",
    "iproute2",
    "procps",
    "psmisc",
    "openssh-client",
)
# GCE's stock Debian 12 image, as far as the boot path sees it: no python3-venv.
STOCK_GCE = BASE_PACKAGES
# The same with python3-venv (what the recovery controller installs on first boot).
WITH_VENV = (*BASE_PACKAGES, "python3-venv")


def cache_root() -> pathlib.Path:
    """Where built trees are kept: $GEMMA4_LOCALCLOUD_CACHE, else ~/.cache/gemma4-tpu/rootfs."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path.home() / ".cache" / "gemma4-tpu" / "rootfs"


def key(packages: Sequence[str]) -> str:
    """The cache key of a tree: the suite, variant, mirror and sorted package list."""
    text = "\n".join([SUITE, "minbase", MIRROR, *sorted(set(packages))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(packages: Sequence[str] = STOCK_GCE, root: pathlib.Path | None = None) -> pathlib.Path:
    """The cached tree with `packages`, built with debootstrap if it is not there yet.

    Args:
        packages: Debian packages installed on top of debootstrap's minbase.
        root: the cache directory (default: cache_root()).

    Returns:
        The tree's directory (read it only: boots overlay it).

    Raises:
        CannotBoot: not root, debootstrap missing, or the build failed (its log's tail).
    """
    check_tools()
    root = root or cache_root()
    tree = root / key(packages)
    if (tree / ".gemma4-complete").exists():
        return tree
    with _locked(root / f"{tree.name}.lock"):
        if (tree / ".gemma4-complete").exists():
            return tree
        _build(tree, packages)
    return tree


def _build(tree: pathlib.Path, packages: Sequence[str]) -> None:
    tmp = tree.with_name(tree.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(
        [
            "nice",
            "-n",
            "10",
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(sorted(set(packages)))}",
            SUITE,
            str(tmp),
            MIRROR,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        shutil.rmtree(tmp, ignore_errors=True)
        raise CannotBoot(f"debootstrap {SUITE} into {tmp} failed: {' / '.join(tail)}")
    _prepare(tmp, packages)
    (tmp / ".gemma4-complete").write_text("\n".join(sorted(set(packages))) + "\n")
    shutil.rmtree(tree, ignore_errors=True)
    tmp.rename(tree)


def _prepare(tree: pathlib.Path, packages: Sequence[str]) -> None:
    """What a cloud image has and debootstrap does not: a machine id made at first boot, root's
    console login off (no password prompt waits), apt lists empty (as a fresh image's are)."""
    (tree / "etc/machine-id").write_text("")
    (tree / "etc/hostname").write_text("localcloud\n")
    for unit in ("console-getty.service", "getty@.service", "ssh.service", "ssh.socket"):
        link = tree / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")


def check_tools() -> None:
    """Raises CannotBoot (one line) when this machine cannot build or boot containers."""
    if os.geteuid() != 0:
        raise CannotBoot("local cloud: containers need root (run as root, as CI does)")
    for tool, package in (("debootstrap", "debootstrap"), ("systemd-nspawn", "systemd-container")):
        if shutil.which(tool) is None and not pathlib.Path(f"/usr/sbin/{tool}").exists():
            raise CannotBoot(f"local cloud: {tool} is missing (apt-get install -y {package})")
