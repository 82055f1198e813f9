"""`python -m workloads release`: only a finished run is released; the record comes first; the
delete request goes to a fake `gcloud` on PATH. Each test runs with the run and merge
directories local and in gs:// (the VMs' layout, on the GCS protocol server), where `pulumi up`
reads the record back (infra/ops/release_record.py)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import yaml

from workloads import cli
from workloads.common import storage

FAKE_GCLOUD = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
exit "$(cat "$(dirname "$0")/rc" 2>/dev/null || echo 0)"
"""


@dataclasses.dataclass(frozen=True)
class Run:
    """A test's run: `tmp` holds run.yaml and the fake gcloud; `root` the run and merge
    directories (tmp itself, or a gs:// bucket)."""

    tmp: pathlib.Path
    root: str

    @property
    def config(self) -> str:
        return str(self.tmp / "run.yaml")

    @property
    def marker(self) -> str:
        return f"{self.root}/run/released.json"


@pytest.fixture(params=["local", "gs"])
def run(request, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """A run config whose run and merge directories are local or in a gs:// bucket; gcloud is a
    recording fake."""
    root = str(tmp_path) if request.param == "local" else request.getfixturevalue("gcs_bucket")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    config = {
        "run_name": "codev-r1",
        "model": {"base": str(tmp_path / "base")},
        "data": {"dataset": str(tmp_path / "data.jsonl")},
        "train": {"output_dir": f"{root}/run"},
        "merge": {"out": f"{root}/merged"},
        "release": {
            "project": "my-project",
            "zone": "us-central1-a",
            "node": "gemma4-prod-train",
            "marker": f"{root}/run/released.json",
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return Run(tmp_path, root)


def _finish(run: Run, *, merge: bool = True) -> None:
    storage.write_text_atomic(f"{run.root}/run/train_summary.json", "{}")
    if merge:
        for name in ("model.safetensors.index.json", "merge_metadata.json"):
            storage.write_text_atomic(f"{run.root}/merged/{name}", "{}")


def _record(run: Run) -> dict:
    return json.loads(storage.read_text(run.marker))


def _calls(run: Run) -> list[str]:
    path = run.tmp / "bin" / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_an_unfinished_run_is_not_released(run, capsys):
    _finish(run, merge=False)  # trained, not merged yet
    assert cli.main(["release", "--config", run.config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run codev-r1 has not finished: ")
    assert "model.safetensors.index.json is missing (and 1 more); nothing released" in err
    assert not storage.exists(run.marker) and _calls(run) == []


def test_a_finished_run_is_recorded_then_its_node_deleted(run, capsys, monkeypatch):
    monkeypatch.delenv("GEMMA4_ZONE", raising=False)
    _finish(run)
    assert cli.main(["release", "--config", run.config]) == 0
    record = _record(run)
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
    assert cli.main(["release", "--config", run.config]) == 0
    assert _record(run)["zone"] == "us-east5-a"
    assert _calls(run)[0].startswith(
        "compute tpus tpu-vm delete gemma4-prod-train --zone=us-east5-a "
    )


def test_a_failed_request_keeps_the_record_and_exits_for_a_retry(run, capsys):
    _finish(run)
    (run.tmp / "bin" / "rc").write_text("1")
    assert cli.main(["release", "--config", run.config]) == 1
    assert storage.exists(run.marker)  # the next `pulumi up` deletes the node
    assert "release: error: " in capsys.readouterr().err


def test_dry_run_changes_nothing_and_no_release_section_is_a_user_error(run, capsys):
    _finish(run)
    assert cli.main(["release", "--config", run.config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would run: " in out and "tpu-vm delete gemma4-prod-train" in out
    assert not storage.exists(run.marker) and _calls(run) == []

    config = yaml.safe_load((run.tmp / "run.yaml").read_text())
    del config["release"]
    (run.tmp / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["release", "--config", run.config]) == 2
    assert "no release section" in capsys.readouterr().err


def test_pulumi_reads_back_the_record_the_release_wrote(run, monkeypatch):
    import types

    from infra.ops import release_record

    _finish(run)
    # The stack's marker is where the rendered run config told the VM to write it.
    monkeypatch.setattr(
        release_record.runconfig_render, "release_marker_uri", lambda cfg: run.marker
    )
    stack = types.SimpleNamespace(training=types.SimpleNamespace(release_when_done=True))
    assert release_record.read(stack) is None  # not released yet: the node stays declared
    assert cli.main(["release", "--config", run.config]) == 0
    record = release_record.read(stack)
    assert record == {**_record(run), "marker": run.marker}
    assert record["run_name"] == "codev-r1" and record["node"] == "gemma4-prod-train"
