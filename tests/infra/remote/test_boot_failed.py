"""A failed first boot is seen in seconds and a later deploy runs the startup script again,
against a real OpenSSH server (tests/fixtures/sshd.py) playing the worker."""

from __future__ import annotations

import pathlib
import time

import pytest

from infra import remote
from infra.remote import ssh
from infra.remote.errors import BootFailed
from tests.fixtures.sshd import Worker

pytestmark = pytest.mark.sshd

LINE = "stage python failed (exit 1) at 2026-01-01T00:00:00Z on w0; log /var/log/gemma4-startup.log"


def _layout(worker: Worker) -> remote.RemoteLayout:
    layout = remote.RemoteLayout(str(worker.root))
    pathlib.Path(layout.ready_marker).unlink(missing_ok=True)  # the fixture's worker is ready
    return layout


def _write(path: str, text: str, mode: int = 0o644) -> None:
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(mode)


def test_a_boot_that_failed_during_the_wait_ends_it_in_one_line(worker: Worker) -> None:
    layout = _layout(worker)
    conn = ssh.connect(worker.host, worker.settings)
    _write(layout.boot_failed_marker, LINE + "\n")
    started = time.monotonic()
    with pytest.raises(BootFailed) as caught:
        remote.wait_ready(conn, layout, timeout_s=3600, rerun_failed=False)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "\n" not in message
    assert "stage python failed (exit 1)" in message and layout.startup_log in message


def test_the_copy_in_ram_alone_ends_the_wait(worker: Worker) -> None:
    # A boot disk full to the last byte: only the line in /run could be written.
    layout = _layout(worker)
    conn = ssh.connect(worker.host, worker.settings)
    _write(layout.boot_failed_note, LINE + "\n")
    with pytest.raises(BootFailed, match=r"stage python failed \(exit 1\)"):
        remote.wait_ready(conn, layout, timeout_s=3600, rerun_failed=False)


def test_a_later_deploy_runs_the_startup_script_again_instead_of_waiting(worker: Worker) -> None:
    layout = _layout(worker)
    conn = ssh.connect(worker.host, worker.settings)
    _write(layout.boot_failed_marker, LINE + "\n")
    _write(layout.boot_failed_note, LINE + "\n")
    # The kept copy of the startup script: this time the boot gets to ready.
    _write(
        layout.startup_script_copy,
        f"#!/bin/bash\nsleep 1\necho again >> {worker.root}/runs\ndate > {layout.ready_marker}\n",
        0o700,
    )
    remote.wait_ready(conn, layout, timeout_s=60, initial_delay_s=0.5, max_delay_s=1)
    assert (worker.root / "runs").read_text() == "again\n"
    assert not pathlib.Path(layout.boot_failed_marker).exists()
    assert not pathlib.Path(layout.boot_failed_note).exists()


def test_no_copy_to_run_again_is_one_line(worker: Worker) -> None:
    layout = _layout(worker)
    conn = ssh.connect(worker.host, worker.settings)
    _write(layout.boot_failed_marker, LINE + "\n")
    with pytest.raises(BootFailed, match=r"could not run .*startup\.sh again"):
        remote.wait_ready(conn, layout, timeout_s=60)
