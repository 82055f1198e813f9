"""The trainer's unit starts at the ready marker, not when the startup script's unit ends.

The guest agent's startup-script unit is a oneshot: its start job lasts until the whole script
exits, and on a new VM the script exits only once the weights are staged (tens of GB). systemd
holds every job ordered after such a unit, so a trainer with `After=google-startup-scripts.service`
prepared its data and compiled only after the download. Here a real systemd (a Debian 12
container) runs the rendered gemma4-train.service beside the local cloud's stand-in of the agent's
unit, whose script writes the ready marker and then "stages weights" for a while; the trainer must
start while that unit is still activating. A second boot shows the marker of the first is not
taken for the second's: it is in /run.
"""

from __future__ import annotations

import time

from infra.vm import layout, roles
from localcloud.cloud_vm import GUEST
from localcloud.machine import Machine
from tests.fixtures.localcloud import MachineFactory
from tests.infra.conftest import make_run_config

LAYOUT = layout.RemoteLayout("/")
RECORDS = "/var/lib/order"
# Long enough that a trainer held until the unit ends is told apart from one started at ready
# (the unit's ready wait polls every 5 s), short enough to keep the test cheap.
WEIGHTS_S = 12

# The startup script's shape: the venv (a few seconds), the environment file, the ready marker,
# then the weights, which the unit's start job waits for. Each boot is numbered on the disk (a
# container shares the host's boot id).
FAKE_STARTUP = f"""#!/bin/bash
set -eu
mkdir -p {RECORDS} /etc/gemma4 "$(dirname {LAYOUT.ready_marker})"
boot=$(( $(cat {RECORDS}/boots 2>/dev/null || echo 0) + 1 ))
echo "$boot" > {RECORDS}/boots
sleep 3
echo "ORDER_BOOT=$boot" > {LAYOUT.env_file}
echo "$boot $(date +%s.%N)" > {LAYOUT.ready_marker}
sleep {WEIGHTS_S}
echo "$boot $(date +%s.%N)" >> {RECORDS}/startup-ended
"""

# The trainer: records its start (the boot its environment file is from, the time, and the
# state of the startup script's unit), then runs on.
FAKE_TRAINER = f"""#!/bin/sh
echo "${{ORDER_BOOT:-none}} $(date +%s.%N) $(systemctl is-active google-startup-scripts.service)" \
  >> {RECORDS}/trainer-started
exec sleep infinity
"""


def _install(vm: Machine) -> None:
    startup = "google-startup-scripts.service"
    vm.write(f"/etc/systemd/system/{startup}", (GUEST / startup).read_text())
    vm.write(
        f"/etc/systemd/system/{startup}.d/fake.conf",
        "[Service]\nExecStart=\nExecStart=/usr/local/lib/fake-startup\n",
    )
    vm.write("/usr/local/lib/fake-startup", FAKE_STARTUP, 0o755)
    vm.write(LAYOUT.active_python, FAKE_TRAINER, 0o755)
    # The trainer's working directory: on a VM, there since its first boot's startup script.
    (vm.root / LAYOUT.state_dir.lstrip("/")).mkdir(parents=True, exist_ok=True)
    plan = roles.TRAIN.plan_units(make_run_config(merge=False), LAYOUT)
    for name in plan.enable:
        vm.write(f"/etc/systemd/system/{name}", plan.units[name])
    wants = vm.root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for name in (startup, *plan.enable):
        (wants / name).symlink_to(f"/etc/systemd/system/{name}")


def _lines(vm: Machine, name: str) -> list[list[str]]:
    text = vm.sh(f"cat {RECORDS}/{name} 2>/dev/null || true").stdout
    return [line.split() for line in text.splitlines() if line.strip()]


def _wait_lines(vm: Machine, name: str, count: int, timeout_s: float) -> list[list[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = _lines(vm, name)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(1)


def test_the_trainer_starts_at_ready_while_the_startup_script_still_stages_weights(
    debian_machine: MachineFactory,
) -> None:
    vm = debian_machine("vm-order", boot=False)
    _install(vm)
    # wait=False: systemd stays "starting" while the startup-script oneshot runs, as on a VM.
    vm.boot(wait=False)
    ended = _wait_lines(vm, "startup-ended", 1, timeout_s=120)
    assert ended, (
        "the startup script's stand-in never ended: " + vm.sh("journalctl -b", check=False).stdout
    )
    ready_at = float(vm.sh(f"cat {LAYOUT.ready_marker}").stdout.split()[1])
    started = _lines(vm, "trainer-started")
    assert len(started) == 1, (
        started,
        vm.sh("systemctl status gemma4-train.service", check=False).stdout,
    )
    boot, at, startup_state = started[0]
    # The environment file of this boot, read after the ready wait (EnvironmentFile= is read
    # when ExecStart runs), while the startup script's unit was still starting.
    assert boot == "1"
    assert startup_state == "activating"
    assert ready_at <= float(at) < float(ended[0][1])
    assert float(at) - ready_at < WEIGHTS_S - 2, "the trainer waited for more than the marker"

    # A restarted VM: the first boot's marker was in /run, so the trainer waits for this boot's
    # (the script writes it seconds after it starts) and reads this boot's environment.
    vm.preempt()
    vm.boot(wait=False)
    started = _wait_lines(vm, "trainer-started", 2, timeout_s=120)
    assert len(started) == 2, started
    ready = vm.sh(f"cat {LAYOUT.ready_marker}").stdout.split()
    assert ready[0] == "2" and started[1][0] == "2"
    assert float(started[1][1]) >= float(ready[1])
