"""What the boot-fault tests share: waiting for a line of a VM's startup log."""

from __future__ import annotations

import time


def wait_for_log(vm, text: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in vm.startup_log():
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in the startup log: {vm.startup_log()[-2000:]}")
