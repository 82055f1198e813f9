"""Logging of the workloads commands: one setup in the CLI, levels, `name: message` on stderr."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from workloads import cli
from workloads.common import logs


def test_lines_name_their_command_and_warnings_say_so(capsys):
    logs.configure("info")
    logs.get("serve").info("staged %d file(s)", 4)
    logs.get("bench").warning("server not ready")
    assert capsys.readouterr().err == "serve: staged 4 file(s)\nbench: warning: server not ready\n"


def test_the_level_filters_and_configuring_again_does_not_double_lines(capsys):
    logs.configure("info")
    logs.configure("warning")
    logs.get("eval").info("hidden")
    logs.get("eval").error("shown")
    assert capsys.readouterr().err == "eval: error: shown\n"
    logs.configure("debug")
    logs.get("eval").debug("detail")
    assert capsys.readouterr().err == "eval: detail\n"
    logs.configure("info")


def test_a_bad_level_is_refused():
    with pytest.raises(ValueError, match="log level 'loud': one of debug, info, warning, error"):
        logs.configure("loud")
    proc = subprocess.run(
        [sys.executable, "-m", "workloads", "--log-level", "loud", "report", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "invalid choice: 'loud'" in proc.stderr


def test_the_cli_sets_the_level_from_the_option_or_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text("run_name: x\n")  # invalid: the command stops after the setup
    assert cli.main(["--log-level", "error", "train", "--config", str(config)]) == 2
    assert logging.getLogger(logs.ROOT).level == logging.ERROR
    monkeypatch.setenv("WORKLOADS_LOG_LEVEL", "DEBUG")
    assert cli.main(["train", "--config", str(config)]) == 2
    assert logging.getLogger(logs.ROOT).level == logging.DEBUG
    logs.configure("info")


def test_a_process_nobody_configures_still_speaks():
    """A Pulumi dynamic provider's process never reaches the CLI that configures the level: its
    progress must reach stderr all the same (an unconfigured `logging` drops info)."""
    script = "from workloads.common import logs; logs.say('deploy')('w0: upload 100%')"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (0, "deploy: w0: upload 100%\n")


def test_say_prints_the_message_as_it_is(capsys):
    logs.say("train")("loss 2.5 (100% of steps)")
    assert capsys.readouterr().err == "train: loss 2.5 (100% of steps)\n"
