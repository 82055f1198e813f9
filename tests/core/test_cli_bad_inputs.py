"""Every subcommand against every class of bad input: one line on stderr, exit status 2.

The table crosses the subcommands (train, merge, serve, eval, bench, report, release, demo) with
the input classes a user gets wrong: a config or dataset that is not UTF-8 text (another
encoding, gzip), a directory where a file belongs and a file where a directory belongs, a lone
surrogate in a dataset, and an output location that cannot be written. Each case runs the real
command line in process (`cli.main`, the code `python -m workloads` runs; a few run as a real
subprocess too) and asserts the whole of stderr is one `error: ...` line naming the path, with
no traceback.
"""

from __future__ import annotations

import errno
import gzip
import json
import pathlib
import re
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from workloads import cli
from workloads.common import errors
from workloads.data import synthetic

# Writing anywhere under /sys fails for every user, root included (sysfs refuses new entries),
# so it stands for "a location this process cannot write" in CI containers that run as root,
# where a chmod-ed directory would still be writable.
UNWRITABLE = pathlib.Path("/sys/gemma4-tpu-test")
NOT_UTF8 = "naïve: ".encode("latin-1") + b"\xff\xfe\n"


@pytest.fixture
def world(tmp_path, tiny_model_dir) -> dict[str, Any]:
    """A valid run (tiny model, small dataset) that each case breaks in one place."""
    dataset = tmp_path / "data.jsonl"
    synthetic.write_synthetic_codev(str(dataset), 12, seed=0)
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a directory\n")
    a_dir = tmp_path / "a_dir"
    a_dir.mkdir()
    config = {
        "run_name": "bad-inputs",
        "model": {"base": str(tiny_model_dir), "dtype": "float32"},
        "data": {"dataset": str(dataset), "max_seq_len": 512},
        "lora": {"rank": 4, "alpha": 8.0},
        "train": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 1,
            "grad_accum": 1,
            "micro_batch": 2,
            "mesh": {"fsdp": 2, "tp": 1},
        },
        "merge": {"out": str(tmp_path / "merged")},
        "serve": {"model_dir": str(tmp_path / "merged")},
        "bench": {"results_dir": str(tmp_path / "bench")},
        "eval": {"problems_dir": str(a_dir), "results_dir": str(tmp_path / "eval")},
        "release": {
            "project": "p",
            "zone": "z",
            "node": "n",
            "marker": str(tmp_path / "released.json"),
        },
    }
    return {"tmp": tmp_path, "config": config, "file": a_file, "dir": a_dir}


def _write_config(world: dict[str, Any], edit: Callable[[dict], None] | None = None) -> str:
    config = json.loads(json.dumps(world["config"]))
    if edit is not None:
        edit(config)
    path = world["tmp"] / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _set(section: str, key: str, value: Any) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config[section][key] = value

    return edit


PROGRESS = re.compile(r"^(?!error: |warning: )[a-z_]+: (?!warning: |error: )")

# --- the table: (subcommand, input class) -> the argv and the path the one line must name ---

Case = Callable[[dict[str, Any]], tuple[list[str], str]]
CONFIG_COMMANDS = ("train", "merge", "serve", "eval", "bench", "report", "release")


def _config_not_utf8(command: str) -> Case:
    def case(world):
        path = world["tmp"] / "run.yaml"
        path.write_bytes(NOT_UTF8)
        return [command, "--config", str(path)], str(path)

    return case


def _config_gzip(command: str) -> Case:
    def case(world):
        path = world["tmp"] / "run.yaml.gz"
        path.write_bytes(gzip.compress(yaml.safe_dump(world["config"]).encode()))
        return [command, "--config", str(path)], str(path)

    return case


def _config_is_a_directory(command: str) -> Case:
    return lambda world: ([command, "--config", str(world["dir"])], str(world["dir"]))


def _config_under_a_file(command: str) -> Case:
    def case(world):
        path = world["file"] / "run.yaml"
        return [command, "--config", str(path)], str(path)

    return case


def _train_with(key: str, value: Callable[[dict[str, Any]], str], section: str = "data") -> Case:
    def case(world):
        bad = value(world)
        return ["train", "--config", _write_config(world, _set(section, key, bad))], bad

    return case


def _dataset_bytes(content: bytes, name: str = "bad.jsonl") -> Callable[[dict[str, Any]], str]:
    def make(world):
        path = world["tmp"] / name
        path.write_bytes(content)
        return str(path)

    return make


_GOOD_ROWS = b'{"prompt": "p", "response": "```verilog\\nmodule m; endmodule\\n```"}\n'
CASES: dict[str, Case] = {}
for _command in CONFIG_COMMANDS:
    CASES[f"{_command}-config-not-utf8"] = _config_not_utf8(_command)
    CASES[f"{_command}-config-gzip"] = _config_gzip(_command)
    CASES[f"{_command}-config-is-a-directory"] = _config_is_a_directory(_command)
    CASES[f"{_command}-config-under-a-file"] = _config_under_a_file(_command)
CASES.update(
    {
        "train-dataset-not-utf8": _train_with(
            "dataset", _dataset_bytes(_GOOD_ROWS + b'{"prompt": "\xe9t\xe9", "response": "r"}\n')
        ),
        # A gzip dataset is read as such (tests/data/test_codev.py); a damaged one is an error.
        "train-dataset-damaged-gzip": _train_with(
            "dataset", _dataset_bytes(gzip.compress(_GOOD_ROWS * 50)[:60], "bad.jsonl.gz")
        ),
        "train-dataset-is-a-directory": _train_with("dataset", lambda w: str(w["dir"])),
        "train-dataset-under-a-file": _train_with("dataset", lambda w: str(w["file"] / "d.jsonl")),
        "train-dataset-lone-surrogate": _train_with(
            "dataset", _dataset_bytes(_GOOD_ROWS + b'{"prompt": "p\\ud800", "response": "r"}\n')
        ),
        "train-output-is-a-file": _train_with("output_dir", lambda w: str(w["file"]), "train"),
        "train-output-under-a-file": _train_with(
            "output_dir", lambda w: str(w["file"] / "run"), "train"
        ),
        "train-output-unwritable": _train_with("output_dir", lambda w: str(UNWRITABLE), "train"),
        "train-base-is-a-file": _train_with("base", lambda w: str(w["file"]), "model"),
        "merge-checkpoint-is-a-file": lambda w: (
            ["merge", "--config", _write_config(w), "--checkpoint", str(w["file"])],
            str(w["file"]),
        ),
        "serve-model-dir-is-a-file": lambda w: (
            ["serve", "--config", _write_config(w, _set("serve", "model_dir", str(w["file"])))],
            str(w["file"]),
        ),
        "eval-problems-is-a-file": lambda w: (
            ["eval", "--problems", str(w["file"]), "--out", str(w["tmp"] / "e")],
            str(w["file"]),
        ),
        "bench-aggregate-dir-is-a-file": lambda w: (
            ["bench", "--aggregate-only", str(w["file"])],
            str(w["file"]),
        ),
        "bench-aggregate-dir-unwritable": lambda w: (
            ["bench", "--aggregate-only", str(UNWRITABLE)],
            str(UNWRITABLE),
        ),
        "report-out-is-a-file": lambda w: (
            ["report", "--config", _write_config(w), "--out", str(w["file"])],
            str(w["file"]),
        ),
        "report-out-unwritable": lambda w: (
            ["report", "--config", _write_config(w), "--out", str(UNWRITABLE)],
            str(UNWRITABLE),
        ),
        "report-summary-is-a-directory": lambda w: (
            ["report", "--train-summary", str(w["dir"]), "--out", str(w["tmp"] / "r")],
            str(w["dir"]),
        ),
        "report-summary-not-utf8": lambda w: (
            ["report", "--out", str(w["tmp"]), "--train-summary", str(_write(w, "s.json"))],
            "s.json",
        ),
        "release-marker-unwritable": lambda w: (
            ["release", "--config", _finished_run(w, str(UNWRITABLE / "released.json"))],
            str(UNWRITABLE),
        ),
        "release-marker-under-a-file": lambda w: (
            ["release", "--config", _finished_run(w, str(w["file"] / "released.json"))],
            str(w["file"]),
        ),
        "demo-workdir-is-a-file": lambda w: (
            ["demo", "--workdir", str(w["file"])],
            str(w["file"]),
        ),
        "demo-workdir-unwritable": lambda w: (
            ["demo", "--workdir", str(UNWRITABLE)],
            str(UNWRITABLE),
        ),
        "demo-workdir-under-a-file": lambda w: (
            ["demo", "--workdir", str(w["file"] / "demo")],
            str(w["file"]),
        ),
    }
)


def _write(world: dict[str, Any], name: str, content: bytes = NOT_UTF8) -> pathlib.Path:
    path = world["tmp"] / name
    path.write_bytes(content)
    return path


def _finished_run(world: dict[str, Any], marker: str) -> str:
    """A config whose run has finished (summary and merge markers written), so release goes on
    to record the marker."""
    from workloads.serve import merged_weights
    from workloads.train import metrics

    run = pathlib.Path(world["config"]["train"]["output_dir"])
    run.mkdir(parents=True, exist_ok=True)
    (run / metrics.SUMMARY_FILE).write_text("{}\n")
    merged = pathlib.Path(world["config"]["merge"]["out"])
    merged.mkdir(parents=True, exist_ok=True)
    for name in merged_weights.MARKERS:
        (merged / name).write_text("{}\n")
    return _write_config(world, _set("release", "marker", marker))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_exit_2(name, world, capsys, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # merge sets it; keep the test process as it was
    argv, names = CASES[name](world)
    status = cli.main(argv)
    err = capsys.readouterr().err
    # Progress notes of the one voice (`train: stage data started`) may come first; what went
    # wrong is one line, and nothing else (no traceback, no warning).
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert names in lines[0], err


@pytest.mark.parametrize("command", ["train", "report"])
def test_a_real_process_prints_one_line_without_traceback(command, tmp_path):
    """The same through `python -m workloads` in its own process (what systemd and users run)."""
    config = tmp_path / "run.yaml"
    config.write_bytes(NOT_UTF8)
    proc = subprocess.run(
        [sys.executable, "-m", "workloads", command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: {config}: not UTF-8 text (byte 0xEF at offset 2); save it as UTF-8\n"
    )


def test_a_full_disk_is_not_passed_off_as_a_user_error(monkeypatch):
    """Only errors about the path itself are the user's; a full disk stays an unexpected error
    (its own handling names the free space), so the CLI does not turn it into exit 2."""
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/checkpoints/7")
    assert errors.path_error_line(full) is None
    assert errors.path_error_line(OSError(errno.EACCES, "Permission denied")) is None  # no path
    module = types.SimpleNamespace(main=lambda args: (_ for _ in ()).throw(full))
    monkeypatch.setattr(cli, "build_parser", lambda only=None: _parser_for(module))
    with pytest.raises(OSError, match="No space left"):
        cli.main(["train", "--config", "x.yaml"])


def _parser_for(module):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--config")
    parser.add_argument("--traceback", action="store_true")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(_module=module)
    return parser
