"""The local cloud's errors have one root, LocalCloudError, under infra's InfraError; what reaches
`python -m localcloud` is one line and a non-zero exit status, as `python -m infra.ops` does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infra.errors import InfraError
from localcloud import __main__ as localcloud_main
from localcloud import rehearse
from localcloud.errors import CannotBoot, LocalCloudError, MachineError, RehearsalError


@pytest.mark.parametrize("error", [CannotBoot, MachineError, RehearsalError])
def test_every_error_of_the_local_cloud_is_a_local_cloud_error(error):
    assert issubclass(error, LocalCloudError) and issubclass(LocalCloudError, InfraError)
    assert rehearse.RehearsalError is RehearsalError  # its old home still names it


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (MachineError("train-1: not running"), 1),
        (RehearsalError("stage deploy: train-1 stopped"), 1),
        (CannotBoot("local cloud: containers need root (run as root, as CI does)"), 2),
        (InfraError("infra's own: a key names the file"), 1),
    ],
)
def test_an_error_that_reaches_the_command_is_one_line(monkeypatch, capsys, error, status):
    def fails(_argv):
        raise error

    monkeypatch.setattr(rehearse, "main", fails)
    monkeypatch.delenv("WORKLOADS_TRACEBACK", raising=False)
    assert localcloud_main.main(["rehearse", "--stack", "dev"]) == status
    captured = capsys.readouterr()
    assert captured.err == f"error: {error}\n"
    assert captured.out == ""


def test_a_command_other_than_rehearse_is_the_usage_and_status_2():
    proc = subprocess.run(
        [sys.executable, "-m", "localcloud", "nosuch"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [localcloud_main.USAGE]
