"""Faults at boot, on the local cloud: the dev stack's training VM (the program's own startup
script, under the guest agent's unit, deployed to by the SshDeployment provider's code) while
the metadata server answers 503, /dev/shm cannot hold what the stack stages, or the boot disk is
full. Each ends in a working VM, or in one line naming the cause within seconds: never in an
hour of waiting while the TPU bills. (A VM killed or cut off from its bucket mid-boot:
test_boot_interrupted.py.)

Every case boots a real Debian 12 container (about a minute each: apt, the venv by uv), so they
are slow tests; CI runs them (`.ci/run`'s slow phase). The cases are in two files so that CI's
workers share them out (a file stays in one worker).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import threading
import time

import pytest

from infra.remote.errors import DeployError
from localcloud import rehearse
from tests.fixtures.tmpfs import mount_tmpfs
from tests.localcloud.boot_log import wait_for_log

pytestmark = pytest.mark.slow


def test_a_slow_metadata_server_answering_503_at_boot_is_waited_out(cloud):
    training = rehearse.prepare_training(cloud)
    vm = cloud.new_vm(training.train, training.tree)
    vm.metadata.fail_for(20)
    vm.metadata.delay_s = 1.0  # and every answer slow
    vm.boot(wait=False)
    training.deploy(vm)  # waits for the ready marker, then deploys

    assert vm.metadata.refused > 0  # the boot met the 503s and went on
    assert "ready: /run/gemma4/ready" in vm.startup_log()
    # The boot stage is the VM's (the container's) uptime, not the host kernel's: the 503s'
    # 20 s and the slow answers, not hours.
    boot_s = float(re.search(r"stage boot: ([0-9.]+) s", vm.startup_log()).group(1))
    assert 10 <= boot_s < 300, boot_s


def test_a_dev_shm_too_small_for_the_stack_is_one_line_naming_the_key(cloud):
    # The container's host has far less RAM than a v5p host: the stack's working set cannot fit.
    training = rehearse.prepare_training(cloud, {"training": {"shmWorkingSetGb": 200}})
    vm = cloud.new_vm(training.train, training.tree)
    vm.boot(wait=False)
    started = time.monotonic()
    with pytest.raises(DeployError) as caught:
        training.deploy(vm)
    took = time.monotonic() - started

    message = str(caught.value)
    assert "failed at boot" in message
    assert "training.shmWorkingSetGb" in message  # the cause, on the deploy's own line
    assert took < 120  # seconds, not the hour the ready wait allows


def keep_full(path: pathlib.Path, stop: threading.Event) -> None:
    """Keeps the file system of `path` full to the last byte (a runaway log, say): whatever a
    failing step frees is taken again within a fifth of a second."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while not stop.is_set():
            for block in (1 << 20, 4096):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * block):
                        pass
            stop.wait(0.2)
    finally:
        os.close(fd)


def test_a_boot_disk_full_to_the_last_byte_is_one_line_naming_it(cloud):
    # The VM's disk is a 400 MB tmpfs, kept full from the venv stage on: the boot-failed marker
    # on it cannot be written either; its copy in /run (RAM) ends the wait.
    training = rehearse.prepare_training(cloud)
    vm = cloud.new_vm(training.train, training.tree)
    if not mount_tmpfs(vm.machine.workdir, "400m"):
        pytest.fail("cannot mount a tmpfs for the VM's disk (needs root)", pytrace=False)
    stop = threading.Event()
    try:
        vm.boot(wait=False)
        started = time.monotonic()
        wait_for_log(vm, "stage venv started")
        filler = threading.Thread(target=keep_full, args=(vm.machine.disk / "filler", stop))
        filler.start()
        with pytest.raises(DeployError) as caught:
            training.deploy(vm)
        took = time.monotonic() - started
        on_disk = vm.machine.run(["cat", "/var/lib/gemma4/boot-failed"], check=False)
    finally:
        stop.set()
        cloud.close()
        subprocess.run(["umount", "-l", str(vm.machine.workdir)], check=False)

    message = str(caught.value)
    assert "failed at boot" in message
    assert re.search(r"the boot disk is full \(0 MiB free on /\)", message), message
    assert on_disk.stdout == ""  # the disk had no room for the marker: RAM's copy was read
    assert took < 300
