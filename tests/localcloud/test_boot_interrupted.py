"""A VM killed or cut off mid-boot, on the local cloud: the dev stack's training VM killed
during its venv install or as the deploy switches releases, or its bucket unreachable while the
weights stage. Each converges on the next boot or deploy (or names the bucket in one line).
(Other faults at boot: test_boot_faults.py.)

Every case boots a real Debian 12 container (about a minute each: apt, the venv by uv), so they
are slow tests; CI runs them (`.ci/run`'s slow phase).
"""

from __future__ import annotations

import threading
import time

import pytest

from infra.remote.errors import DeployError
from localcloud import rehearse
from tests.localcloud.boot_log import wait_for_log

pytestmark = pytest.mark.slow


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
