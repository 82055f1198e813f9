"""The demo's terminal (workloads.cli.demo_console): stage lines, chosen step lines and the
summary on it; everything else, children's output written straight to fds 1 and 2 included, in
the log."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from workloads.cli import demo_console
from workloads.common import logs


def test_children_libraries_and_diagnostics_go_to_the_log(tmp_path, capfd) -> None:
    """capfd: the terminal is fd 1 itself here, as in a person's run."""
    log_path = tmp_path / "demo.log"
    with demo_console.captured(log_path, time.time()) as console:
        console.say("1/8 a stage line")
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import os; os.write(1, b'child out\\n'); "
                "os.write(2, b'nanobind: leaked 3 instances\\n')",
            ],
            check=True,
        )
        logs.get("data").info("240 rows read")
        print("WARNING:absl:read only", file=sys.stderr)
        print("Namespace(seed=0)")
        subprocess.run(
            [sys.executable, "-c", "print('handed stdout')"], stdout=sys.stdout, check=True
        )
        console.show("demo summary")
    captured = capfd.readouterr()
    out = captured.out
    assert captured.err == ""
    assert out.splitlines() == [out.splitlines()[0], "demo summary"]
    assert out.splitlines()[0].endswith("] 1/8 a stage line")
    log = log_path.read_text()
    for text in (
        "1/8 a stage line",
        "child out",
        "nanobind: leaked 3 instances",
        "data: 240 rows read",
        "read only",
        "Namespace(seed=0)",
        "handed stdout",
        "demo summary",
    ):
        assert text in log, text
    # Afterwards the process writes where it did before.
    print("after")
    assert capfd.readouterr().out == "after\n"


def test_a_run_shows_every_eighth_step_and_each_segments_first(tmp_path, capsys) -> None:
    with demo_console.captured(tmp_path / "demo.log", time.time()) as console:
        console.new_segment()
        for step in range(1, 21):
            print(f"step {step}/40  loss 1.0")
        console.new_segment()
        for step in range(21, 41):
            print(f"step {step}/40  loss 1.0")
    shown = [int(line.split()[1].split("/")[0]) for line in capsys.readouterr().out.splitlines()]
    assert shown == [1, 5, 10, 15, 20, 21, 25, 30, 35, 40]
    assert (tmp_path / "demo.log").read_text().count("step ") == 40


def test_the_trainer_s_stage_starts_and_details_stay_in_the_log(tmp_path, capsys) -> None:
    with demo_console.captured(tmp_path / "demo.log", time.time()) as console:
        for text in ("stage load started", "stage load: 3.5 s", "attention: dense", "model: 9"):
            console.trainer_say(text)
    out = capsys.readouterr().out
    assert "stage load: 3.5 s" in out and "model: 9" in out
    assert "started" not in out and "attention" not in out
    assert "attention: dense" in (tmp_path / "demo.log").read_text()


def test_a_failure_leaves_one_line_naming_the_log(tmp_path, capsys) -> None:
    log_path = tmp_path / "demo.log"
    with (
        pytest.raises(RuntimeError, match="bench failed"),
        demo_console.captured(log_path, time.time()),
    ):
        print("Traceback-ish noise of a tool", file=sys.stderr)
        raise RuntimeError("bench failed")
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    assert line.endswith(
        f"stopped (RuntimeError); the tools' and engines' own output is in {log_path}"
    )
    assert "noise" not in captured.out + captured.err
