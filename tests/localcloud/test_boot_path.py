"""The startup scripts' first steps on a real Debian 12 machine (systemd 252, apt 2.6, the stock
GCE package set: python3 without python3-venv), where the fakes of tests/infra/vm and
tests/infra/components cannot tell: ensurepip missing, apt's lists lock held by apt-daily."""

from __future__ import annotations

import pathlib
import time

import pytest

from infra.components import recovery as recovery_mod
from tests.fixtures.localcloud import MachineFactory
from tests.infra.components.test_recovery import controller_args

REPO = pathlib.Path(__file__).resolve().parents[2]
GOLDEN_TRAIN = REPO / "tests/golden/startup/dev-train.sh"
# Holds apt's lists lock as `apt-get update` does (an fcntl lock: flock(1) would not conflict
# with apt), for as long as apt-daily's first-boot update can take.
HOLD_LISTS_LOCK = """
import fcntl, os, sys, time
fd = os.open("/var/lib/apt/lists/lock", os.O_RDWR | os.O_CREAT, 0o640)
fcntl.lockf(fd, fcntl.LOCK_EX)
open("/run/lock-held", "w").close()
time.sleep(float(sys.argv[1]))
"""


def _recover_script() -> str:
    args = controller_args()
    script = recovery_mod.render_startup(args, "gs://b/recovery/source-dev.tar.gz")
    return script.replace('\nmain "$@"\n', "\n")  # sourced: the test calls the steps


def test_the_controller_gets_a_working_venv_on_stock_debian_12(
    debian_machine: MachineFactory,
) -> None:
    vm = debian_machine("controller")
    # What the old script left on such a machine: `python3 -m venv` stopped without pip.
    made = vm.sh(
        "mkdir -p /opt/gemma4-recover && python3 -m venv /opt/gemma4-recover/venv", check=False
    )
    assert made.returncode != 0 and "ensurepip is not" in made.stdout + made.stderr
    vm.write("/root/recover.sh", _recover_script(), mode=0o700)

    packages = vm.sh("source /root/recover.sh && ensure_packages", timeout_s=600, check=False)
    assert packages.returncode == 0, (packages.stdout + packages.stderr)[-2000:]
    # The old test (`python3 -m venv --help`) passed here and skipped apt.
    assert vm.run(["python3", "-c", "import ensurepip"], check=False).returncode == 0

    done = vm.sh("source /root/recover.sh && ensure_user && ensure_venv", check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    pip = vm.sh("runuser -u gemma4-recover -- /opt/gemma4-recover/venv/bin/pip --version")
    assert pip.stdout.startswith("pip ")
    # A second boot keeps the venv (it has its pip).
    inode = vm.sh("stat -c %i /opt/gemma4-recover/venv/bin/pip").stdout
    vm.sh("source /root/recover.sh && ensure_packages && ensure_venv")
    assert vm.sh("stat -c %i /opt/gemma4-recover/venv/bin/pip").stdout == inode


@pytest.mark.slow
def test_apt_waits_for_the_lists_lock_apt_daily_holds_at_first_boot(
    debian_machine: MachineFactory,
) -> None:
    vm = debian_machine("worker")
    vm.write("/root/hold.py", HOLD_LISTS_LOCK)
    vm.write("/root/train.sh", GOLDEN_TRAIN.read_text().replace('\nmain "$@"\n', "\n"), 0o700)
    vm.run(["systemd-run", "--unit=apt-daily-standin", "python3", "/root/hold.py", "60"])
    vm.sh("until [ -e /run/lock-held ]; do sleep 0.1; done", timeout_s=30)

    started = time.monotonic()
    done = vm.sh("source /root/train.sh && apt_install jq", timeout_s=600, check=False)
    took = time.monotonic() - started

    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    assert "waiting for apt's lock" in done.stdout + done.stderr
    assert took >= 50  # it waited for the holder rather than failing around it
    assert vm.sh("jq --version").stdout.startswith("jq-")
