"""The local cloud's machines are real Debian 12 boots: systemd as PID 1, their own disks, and a
preemption that kills everything at once."""

from __future__ import annotations

import time

from tests.fixtures.localcloud import MachineFactory


def test_a_machine_boots_debian_12_with_systemd_and_survives_a_preemption_with_its_disk(
    debian_machine: MachineFactory,
) -> None:
    vm = debian_machine("vm-a")
    facts = vm.sh(
        "cat /proc/1/comm; . /etc/os-release; echo $VERSION_ID; hostname; "
        "systemctl is-system-running; systemctl is-enabled apt-daily.timer"
    ).stdout.split()
    assert facts == ["systemd", "12", "vm-a", "running", "enabled"]
    vm.sh("echo kept > /var/lib/on-disk; sleep 300 >/dev/null 2>&1 & echo $! > /run/sleeper")

    started = time.monotonic()
    vm.preempt()
    assert not vm.running()
    assert time.monotonic() - started < 10
    vm.boot()
    assert vm.sh("cat /var/lib/on-disk").stdout == "kept\n"
    # /run is a tmpfs of the boot that was killed: gone, as on a VM.
    assert vm.run(["test", "-e", "/run/sleeper"], check=False).returncode == 1


def test_machines_do_not_share_a_disk(debian_machine: MachineFactory) -> None:
    one, two = debian_machine("vm-one"), debian_machine("vm-two")
    one.sh("echo one > /etc/mine")
    assert two.run(["test", "-e", "/etc/mine"], check=False).returncode == 1
    assert one.sh("cat /etc/machine-id").stdout != two.sh("cat /etc/machine-id").stdout
