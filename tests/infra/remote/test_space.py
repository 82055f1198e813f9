"""A full disk on a worker: one line naming the host, the path and the free space; nothing
half-activated; the next deploy converges once there is room.

The disk is real: a small tmpfs mounted over the worker's releases directory (the tests need
root for the mount and are skipped without it), filled with a file to the byte count a case
wants, before the deploy or in the middle of `pip install`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

import pytest

from infra import remote
from infra.remote import space
from infra.vm import workloads_wheel
from tests.fixtures.sshd import Worker
from tests.infra.conftest import (
    Steps,
    assert_converged,
    deploy,
    host,
    installed,
    make_bundle,
    make_run_config,
)

DISK_BYTES = 24 << 20


def _free(path: pathlib.Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


class SmallDisk:
    """A tmpfs of DISK_BYTES at `path`, and a filler file that leaves a chosen free space."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.filler = path / ".filler"

    def leave_free(self, free: int) -> None:
        self.filler.unlink(missing_ok=True)
        size = _free(self.path) - free
        with open(self.filler, "wb") as handle:
            os.posix_fallocate(handle.fileno(), 0, size)

    def make_room(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def small_disk(worker: Worker) -> Iterator[SmallDisk]:
    releases = worker.root / "opt/gemma4/releases"
    releases.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0755", "tmpfs", str(releases)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield SmallDisk(releases)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["umount", "-l", str(releases)], check=True, capture_output=True)


def _one_line(error: BaseException) -> str:
    assert isinstance(error, remote.DeployError)
    (line,) = [str(e) for e in error.errors]
    assert "\n" not in line
    return line


@pytest.mark.sshd
def test_a_full_disk_refuses_before_writing_and_the_deploy_converges_once_there_is_room(
    worker: Worker, wheel: workloads_wheel.Wheel, small_disk: SmallDisk
) -> None:
    bundle = make_bundle(worker.root, wheel)
    small_disk.leave_free(1 << 20)
    hook = Steps()
    with pytest.raises(remote.DeployError) as caught:
        deploy([worker], bundle, hook)

    line = _one_line(caught.value)
    assert line.startswith(f"{host(worker)}: step 'space' failed (disk full): {small_disk.path} ")
    assert "has 1.0 MiB free, this deploy needs about" in line
    assert "upload" not in hook.steps()  # refused before anything was written
    assert installed(worker)["releases"] == [".filler"]
    assert worker.systemctl_calls() == []

    small_disk.make_room()
    deploy([worker], bundle, Steps())
    assert_converged(worker, bundle)


@pytest.mark.sshd
def test_a_disk_that_fills_during_the_install_keeps_the_old_version_running(
    worker: Worker, wheel: workloads_wheel.Wheel, small_disk: SmallDisk
) -> None:
    old = make_bundle(worker.root, wheel, make_run_config(run_name="old"))
    new = make_bundle(worker.root, wheel, make_run_config(run_name="new", merge=False))
    deploy([worker], old, Steps())
    worker.clear_calls()

    # Another writer takes the disk once the space check passed: pip hits ENOSPC.
    hook = Steps()
    hook.actions[(host(worker), "install")] = lambda: small_disk.leave_free(256 << 10)
    with pytest.raises(remote.DeployError) as caught:
        deploy([worker], new, hook)

    line = _one_line(caught.value)
    assert line.startswith(f"{host(worker)}: step 'install' failed (disk full): {small_disk.path} ")
    free_now = _free(small_disk.path) / (1 << 20)
    assert f"has {free_now:.1f} MiB free" in line
    # The old version runs on, whole: its release active, its units and config, nothing stopped.
    found = installed(worker)
    assert found["active"] == f"releases/{old.release}"
    assert found["state"]["fingerprint"] == old.fingerprint
    assert worker.systemctl_calls() == []
    for name, text in old.units.items():
        assert (worker.root / "etc/systemd/system" / name).read_text() == text
    assert (worker.root / "etc/gemma4/run.yaml").read_text() == old.run_config_yaml

    small_disk.make_room()
    deploy([worker], new, Steps())
    assert_converged(worker, new, previous=old)


def test_df_output_is_read_per_path_with_mount_points_that_hold_spaces() -> None:
    text = (
        "Filesystem     1-blocks      Used Available Capacity Mounted on\n"
        "/dev/sda1   10000000000 100000000  52428800      99% /\n"
        "tmpfs          25165824         0  25165824       0% /mnt/my disk\n"
    )
    found = space._parse_df(text, ["/var/lib/gemma4/incoming", "/mnt/my disk/releases"])
    assert found == [
        space.Free("/var/lib/gemma4/incoming", "/", 52428800),
        space.Free("/mnt/my disk/releases", "/mnt/my disk", 25165824),
    ]
    with pytest.raises(ValueError, match="2 rows for 1 paths"):
        space._parse_df(text, ["/"])
