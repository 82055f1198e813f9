"""The CLI shell: help is instant, user errors are one line with exit status 2."""

import subprocess
import sys


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "workloads", "--help"], capture_output=True, text=True, check=True
    )
    for command in (
        "demo",
        "make-tiny-model",
        "train",
        "merge",
        "serve",
        "bench",
        "eval",
        "report",
    ):
        assert command in out.stdout


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("run_name: x\nmodle: {}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "workloads", "train", "--config", str(config)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{config}: modle: unknown key (did you mean model?)" in proc.stderr
