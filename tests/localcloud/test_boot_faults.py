"""Faults at boot, on the local cloud: the dev stack's training VM (the program's own startup
script, under the guest agent's unit, deployed to by the SshDeployment provider's code) while
the metadata server answers 503, the VM is killed in the middle of its startup script, /dev/shm
cannot hold what the stack stages, the bucket is unreachable, or the boot disk is full. Each
ends in a working VM after the next boot or deploy, or in one line naming the cause within
seconds: never in an hour of waiting while the TPU bills.

Every case boots a real Debian 12 container (about a minute each: apt, the venv by uv), so they
are slow tests; CI runs them (`.ci/run`'s slow phase).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from infra.remote.errors import DeployError
from localcloud import rehearse
from localcloud.errors import CannotBoot
from tests.fixtures.tmpfs import mount_tmpfs

pytestmark = pytest.mark.slow


@pytest.fixture
def cloud(tmp_path: pathlib.Path) -> Iterator[rehearse.Rehearsal]:
    r = rehearse.Rehearsal("dev", tmp_path, print)
    try:
        rehearse.rootfs.check_tools()
    except CannotBoot as exc:
        pytest.fail(str(exc), pytrace=False)
    yield r
    r.close()


def wait_for_log(vm, text: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in vm.startup_log():
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in the startup log: {vm.startup_log()[-2000:]}")


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


def test_a_vm_killed_during_its_venv_install_is_whole_after_the_next_boot(cloud):
    training = rehearse.prepare_training(cloud)
    vm = cloud.new_vm(training.train, training.tree)
    vm.boot(wait=False)
    wait_for_log(vm, "stage venv started")
    time.sleep(4)  # uv is downloading and unpacking
    vm.machine.preempt()
    assert "ready:" not in vm.startup_log()

    vm.machine.boot(wait=False)  # the same disk: the VM restarted
    training.deploy(vm)

    log = vm.startup_log()
    assert log.count("stage boot started") == 2
    assert "venv /opt/gemma4/venv installed" in log.split("stage boot started")[-1]
    python = vm.machine.run(["/opt/gemma4/venv/bin/python", "-c", "import jax, orbax"])
    assert python.returncode == 0


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


def test_a_bucket_unreachable_while_the_weights_stage_is_retried_or_named(cloud):
    training = rehearse.prepare_training(cloud)
    cloud.storage.kill()
    vm = cloud.new_vm(training.train, training.tree)
    vm.boot(wait=False)
    back = threading.Timer(25, cloud.storage.start)
    back.start()
    try:
        training.deploy(vm)
    except DeployError as exc:
        # Either the retries outlasted the outage, or the boot stopped naming the stage; then
        # the next deploy re-runs the startup script (the bucket is back) and converges.
        assert "failed at boot" in str(exc)
        back.join()
        training.deploy(vm)
    back.join()
    assert "ready: /run/gemma4/ready" in vm.startup_log()


def test_a_vm_killed_during_the_deploys_switch_converges_on_the_next_deploy(cloud, monkeypatch):
    from infra.resources import ssh_deployment

    training = rehearse.prepare_training(cloud)
    # Without the release `pulumi up` pushes to the bucket: a VM that finds it installs it at
    # boot, and the deploy then has nothing to switch (the case is the deploy's own switch).
    for uri in training.plan.objects:
        if uri.endswith("-release.tar.gz"):
            cloud.gcs.delete(uri)
    vm = cloud.new_vm(training.train, training.tree)
    vm.boot(wait=False)
    real = ssh_deployment.progress

    def kill_at_switch(name: str):
        report = real(name)

        def hook(host: str, step: str) -> None:
            report(host, step)
            if step == "switch":
                vm.machine.preempt()  # the VM goes as the release is switched to

        return hook

    monkeypatch.setattr(ssh_deployment, "progress", kill_at_switch)
    with pytest.raises(DeployError):
        training.deploy(vm)
    monkeypatch.setattr(ssh_deployment, "progress", real)

    vm.machine.boot(wait=False)  # it comes back on the same disk
    training.deploy(vm)  # `pulumi up` again

    active = vm.machine.run(["systemctl", "is-active", "gemma4-train.service"], check=False)
    assert active.stdout.strip() in ("active", "activating")
    current = vm.machine.run(["readlink", "-f", "/opt/gemma4/current"], check=False).stdout
    assert "/releases/" in current


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
