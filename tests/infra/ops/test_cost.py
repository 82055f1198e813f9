"""`python -m infra.ops cost`: a fake Cloud TPU API that answers nodes with a state, a type, a
provisioning model and a creation time; prices from the catalog."""

from __future__ import annotations

import datetime
import io
import json
import pathlib
import types
from typing import Any

import pytest
from google.api_core import exceptions as api_exceptions

from infra.ops import cli as ops
from infra.ops import cost
from infra.tpu import api as tpu_api
from workloads.common import cli_options
from workloads.contract import catalog

NOW = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.UTC)


def _node(state: str, accelerator: str, hours_ago: float, *, spot: bool = False) -> Any:
    return types.SimpleNamespace(
        state=types.SimpleNamespace(name=state),
        accelerator_type=accelerator,
        scheduling_config=types.SimpleNamespace(spot=spot, preemptible=False),
        create_time=NOW - datetime.timedelta(hours=hours_ago),
    )


class NotFound(Exception):
    pass


class FakeTpu:
    def __init__(self, nodes: dict[str, Any]) -> None:
        self.nodes = nodes

    def __call__(self) -> FakeTpu:  # used as the client factory
        return self

    def get_node(self, *, name: str) -> Any:
        node = self.nodes.get(name.rsplit("/", 1)[-1])
        if node is None:
            raise NotFound(name)
        if isinstance(node, Exception):
            raise node
        return node


def _outputs(tmp_path: pathlib.Path, *roles: str) -> str:
    def record(role: str) -> dict[str, Any]:
        return {
            "vm": f"gemma4-{role}",
            "role": role,
            "project": "p",
            "zone": "us-central1-a",
            "hosts": [],
            "ssh_user": "gemma4",
        }

    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"deployments": {r: record(r) for r in roles}}))
    return str(path)


def test_running_vms_are_priced_and_summed():
    record = {"project": "p", "zone": "z", "ssh_user": "u"}
    outputs = {"deployments": {r: {**record, "vm": f"gemma4-{r}"} for r in ("train", "serve")}}
    infos = [ops.vm_info(outputs, r, require_hosts=False) for r in ("train", "serve")]
    client = FakeTpu(
        {
            "gemma4-train": _node("READY", "v5p-8", 2.5, spot=True),
            "gemma4-serve": _node("READY", "v6e-8", 1.0),
        }
    )
    out = io.StringIO()
    cost.run(infos, out, client=client, now=NOW)
    v5p, v6e = catalog.accelerator("v5p-8").hourly_usd, catalog.accelerator("v6e-8").hourly_usd
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        f"train VM gemma4-train: READY, v5p-8 spot: ${v5p:,.2f}/h (on-demand rate; spot bills "
        f"less); up 2.5 h, about ${v5p * 2.5:,.2f} so far"
    )
    assert lines[1] == (
        f"serve VM gemma4-serve: READY, v6e-8 on-demand: ${v6e:,.2f}/h; up 1.0 h, about "
        f"${v6e:,.2f} so far"
    )
    assert lines[2].startswith(
        f"now: ${v5p + v6e:,.2f}/h for 2 running VM(s); about ${v5p * 2.5 + v6e:,.2f} since "
        "the TPU VMs were created (an upper bound"
    )


@pytest.mark.parametrize("state", ["PREEMPTED", "STOPPED", "CREATING"])
def test_a_node_that_is_not_ready_is_not_billed(tmp_path, capsys, state):
    tpu = FakeTpu({"gemma4-train": _node(state, "v5p-8", 3)})
    out = io.StringIO()
    code = ops.main(
        ["--outputs", _outputs(tmp_path, "train"), "cost"], out=out, tpu_client_factory=tpu
    )
    assert code == 0
    assert out.getvalue().splitlines()[0] == (
        f"train VM gemma4-train: {state}; not billed now ($0.00/h)"
    )
    assert "now: $0.00/h for 0 running VM(s)" in out.getvalue()


def test_a_released_node_costs_nothing_and_api_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tpu_api, "is_not_found", lambda e: isinstance(e, NotFound))
    outputs = _outputs(tmp_path, "train", "serve")
    tpu = FakeTpu({"gemma4-serve": _node("READY", "v6e-8", 0.5)})
    out = io.StringIO()
    assert ops.main(["--outputs", outputs, "cost"], out=out, tpu_client_factory=tpu) == 0
    assert (
        out.getvalue().splitlines()[0]
        == "train VM gemma4-train: NOT_FOUND; not billed now ($0.00/h)"
    )

    # Not an answer of the API (here a local PermissionError): an ordinary error, exit 2.
    denied = FakeTpu({"gemma4-train": PermissionError("403 tpu.nodes.get denied")})
    code = ops.main(["--outputs", outputs, "cost"], out=io.StringIO(), tpu_client_factory=denied)
    assert code == 2
    assert capsys.readouterr().err == (
        "error: cannot read the TPU nodes: PermissionError: 403 tpu.nodes.get denied\n"
    )
    # The API refuses: its own exit status, 4, so a script tells it from a usage error.
    refused = FakeTpu({"gemma4-train": api_exceptions.PermissionDenied("tpu.nodes.get denied")})
    code = ops.main(["--outputs", outputs, "cost"], out=io.StringIO(), tpu_client_factory=refused)
    assert code == cli_options.EXIT_CLOUD_REFUSED == 4
    assert capsys.readouterr().err == (
        "error: cannot read the TPU nodes: PermissionDenied: 403 tpu.nodes.get denied\n"
    )


def test_cost_json_is_one_parseable_object_with_the_same_figures(tmp_path, capsys):
    outputs = _outputs(tmp_path, "train", "serve")
    tpu = FakeTpu(
        {
            "gemma4-train": _node("READY", "v5p-8", 2.0, spot=True),
            "gemma4-serve": _node("STOPPED", "v6e-8", 1.0),
        }
    )
    out = io.StringIO()
    argv = ["--outputs", outputs, "cost", "--stack", "dev", "--json"]
    assert ops.main(argv, out=out, tpu_client_factory=tpu) == 0
    record = json.loads(out.getvalue())
    v5p = catalog.accelerator("v5p-8").hourly_usd
    assert set(record) == {
        "released",
        "vms",
        "alwaysOn",
        "leftovers",
        "leftoverVms",
        "hourlyUsd",
        "soFarUsd",
        "upperBound",
        "runningVms",
    }
    train, serve = record["vms"]
    assert (train["vm"], train["state"], train["billing"], train["provisioning"]) == (
        "gemma4-train",
        "READY",
        True,
        "spot",
    )
    assert train["hourlyUsd"] == pytest.approx(v5p)
    assert train["hours"] >= 2.0  # created 2 h before NOW; the command prices at the real now
    assert train["soFarUsd"] == pytest.approx(v5p * train["hours"])
    assert record["soFarUsd"] == pytest.approx(train["soFarUsd"])
    assert (serve["state"], serve["billing"], serve["hourlyUsd"]) == ("STOPPED", False, 0.0)
    assert record["hourlyUsd"] == pytest.approx(v5p)
    assert record["upperBound"] is True and record["runningVms"] == 1
    assert record["released"] is None


def test_a_released_training_vm_is_reported_by_status_cost_and_recover(tmp_path, capsys):
    released = {
        "run_name": "codev-r1",
        "node": "gemma4-train",
        "released_at": "2026-11-25T03:00:00Z",
        "marker": "gs://b/checkpoints/codev-r1/released.json",
    }
    path = tmp_path / "outputs.json"
    path.write_text(
        json.dumps({"trainNode": "gemma4-train", "trainReleased": released, "deployments": {}})
    )
    out = io.StringIO()
    assert ops.main(["--outputs", str(path), "status"], out=out) == 0
    assert out.getvalue() == (
        "train VM: the training VM gemma4-train was released when run codev-r1 finished "
        "(2026-11-25T03:00:00Z; gs://b/checkpoints/codev-r1/released.json): set a new runName "
        "and `pulumi up` to train again\n"
    )
    out = io.StringIO()
    assert ops.main(["--outputs", str(path), "cost"], out=out, tpu_client_factory=FakeTpu({})) == 0
    assert out.getvalue().splitlines()[-1].startswith("now: $0.00/h for 0 running VM(s);")
    capsys.readouterr()
    assert ops.main(["--outputs", str(path), "recover", "-y"], out=io.StringIO()) == 2
    assert capsys.readouterr().err.startswith("error: the training VM gemma4-train was released")


def test_the_recovery_controller_is_counted_as_always_on(tmp_path):
    """It runs all the time, TPU or not: its hourly share of the stack's monthly estimate is in
    "now" even after the training VM has been released."""
    outputs = json.loads(pathlib.Path(_outputs(tmp_path, "train")).read_text())
    outputs["recoveryController"] = {
        "vm": "gemma4-recover",
        "estimatedMonthlyUsd": {"machine": 6.13, "total": 10.3},
    }
    path = tmp_path / "with-controller.json"
    path.write_text(json.dumps(outputs))
    tpu = FakeTpu({"gemma4-train": _node("READY", "v5p-8", 1.0)})
    out = io.StringIO()
    assert ops.main(["--outputs", str(path), "cost"], out=out, tpu_client_factory=tpu) == 0
    v5p = catalog.accelerator("v5p-8").hourly_usd
    lines = out.getvalue().splitlines()
    assert lines[1] == (
        "recovery controller VM gemma4-recover: always on, about $0.014/h ($10.30/month, the "
        "stack's estimate)"
    )
    assert lines[2].startswith(f"now: ${v5p + 10.3 / 730:,.2f}/h for 2 running VM(s); about $")

    outputs["deployments"] = {}
    outputs["trainReleased"] = {
        "run_name": "r1",
        "node": "gemma4-train",
        "released_at": "2026-11-25T03:00:00Z",
        "marker": "gs://b/m",
    }
    path.write_text(json.dumps(outputs))
    out = io.StringIO()
    assert ops.main(["--outputs", str(path), "cost"], out=out, tpu_client_factory=FakeTpu({})) == 0
    assert out.getvalue().splitlines()[-1].startswith("now: $0.01/h for 1 running VM(s);")
