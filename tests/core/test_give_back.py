"""`python -m workloads release`: only a finished run is released; the record comes first; the
delete request goes to a fake `gcloud` on PATH."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from workloads import cli

FAKE_GCLOUD = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
exit "$(cat "$(dirname "$0")/rc" 2>/dev/null || echo 0)"
"""


@pytest.fixture
def run(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A run config whose run and merge directories are local; gcloud is a recording fake."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    config = {
        "run_name": "codev-r1",
        "model": {"base": str(tmp_path / "base")},
        "data": {"dataset": str(tmp_path / "data.jsonl")},
        "train": {"output_dir": str(tmp_path / "run")},
        "merge": {"out": str(tmp_path / "merged")},
        "release": {
            "project": "my-project",
            "zone": "us-central1-a",
            "node": "gemma4-prod-train",
            "marker": str(tmp_path / "run" / "released.json"),
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def _finish(run: pathlib.Path, *, merge: bool = True) -> None:
    (run / "run").mkdir(exist_ok=True)
    (run / "run" / "train_summary.json").write_text("{}")
    if merge:
        (run / "merged").mkdir(exist_ok=True)
        for name in ("model.safetensors.index.json", "merge_metadata.json"):
            (run / "merged" / name).write_text("{}")


def _calls(run: pathlib.Path) -> list[str]:
    path = run / "bin" / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_an_unfinished_run_is_not_released(run, capsys):
    _finish(run, merge=False)  # trained, not merged yet
    assert cli.main(["release", "--config", str(run / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run codev-r1 has not finished: ")
    assert "model.safetensors.index.json is missing (and 1 more); nothing released" in err
    assert not (run / "run" / "released.json").exists() and _calls(run) == []


def test_a_finished_run_is_recorded_then_its_node_deleted(run, capsys, monkeypatch):
    monkeypatch.delenv("GEMMA4_ZONE", raising=False)
    _finish(run)
    assert cli.main(["release", "--config", str(run / "run.yaml")]) == 0
    record = json.loads((run / "run" / "released.json").read_text())
    assert {k: record[k] for k in ("run_name", "node", "zone", "project")} == {
        "run_name": "codev-r1",
        "node": "gemma4-prod-train",
        "zone": "us-central1-a",
        "project": "my-project",
    }
    assert _calls(run) == [
        "compute tpus tpu-vm delete gemma4-prod-train --zone=us-central1-a "
        "--project=my-project --quiet --async"
    ]
    assert "release: deletion of gemma4-prod-train requested" in capsys.readouterr().err


def test_a_node_placed_in_a_fallback_zone_is_deleted_there(run, monkeypatch):
    # The startup script wrote the zone the VM booted in (the stack's first had no capacity).
    monkeypatch.setenv("GEMMA4_ZONE", "us-east5-a")
    _finish(run)
    assert cli.main(["release", "--config", str(run / "run.yaml")]) == 0
    assert json.loads((run / "run" / "released.json").read_text())["zone"] == "us-east5-a"
    assert _calls(run)[0].startswith(
        "compute tpus tpu-vm delete gemma4-prod-train --zone=us-east5-a "
    )


def test_a_failed_request_keeps_the_record_and_exits_for_a_retry(run, capsys):
    _finish(run)
    (run / "bin" / "rc").write_text("1")
    assert cli.main(["release", "--config", str(run / "run.yaml")]) == 1
    assert (run / "run" / "released.json").exists()  # the next `pulumi up` deletes the node
    assert "release: error: " in capsys.readouterr().err


def test_dry_run_changes_nothing_and_no_release_section_is_a_user_error(run, capsys):
    _finish(run)
    assert cli.main(["release", "--config", str(run / "run.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would run: " in out and "tpu-vm delete gemma4-prod-train" in out
    assert not (run / "run" / "released.json").exists() and _calls(run) == []

    config = yaml.safe_load((run / "run.yaml").read_text())
    del config["release"]
    (run / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["release", "--config", str(run / "run.yaml")]) == 2
    assert "no release section" in capsys.readouterr().err
