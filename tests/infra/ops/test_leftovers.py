"""TPU nodes and queued resources of the stack that its state does not hold: found by label in
the stack's zones, priced, listed by `infra.ops status` and `cost`. A fake client answers with the
real tpu_v2 message types."""

from __future__ import annotations

import datetime
import io
import json
import pathlib
from typing import Any

from google.api_core import exceptions
from google.cloud import tpu_v2

from infra.ops import cli as ops
from infra.ops import leftovers
from infra.tpu import api as tpu_api
from workloads.contract import catalog

NOW = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.UTC)
MINE = {"app": "gemma4-tpu", "stack": "prod", "role": "train", "run": "r1"}
SCOPE = {
    "project": "p",
    "zones": ["us-central1-a", "us-east5-a"],
    "labels": {"app": "gemma4-tpu", "stack": "prod"},
}


def _node(zone: str, name: str, labels: dict[str, str], state: str = "READY", **kw: Any):
    return tpu_v2.Node(
        name=f"projects/p/locations/{zone}/nodes/{name}",
        state=state,
        accelerator_type="v5p-8",
        labels=labels,
        create_time=NOW - datetime.timedelta(hours=2),
        **kw,
    )


def _queued(zone: str, name: str, labels: dict[str, str], state: str):
    return tpu_v2.QueuedResource(
        name=f"projects/p/locations/{zone}/queuedResources/{name}",
        tpu={"node_spec": [{"node_id": name, "node": {"labels": labels}}]},
        state={"state": state},
    )


class FakeClient:
    def __init__(self, nodes: list[Any], queued: list[Any]) -> None:
        self.nodes, self.queued, self.parents = nodes, queued, []

    def __call__(self) -> FakeClient:  # the client factory
        return self

    def list_nodes(self, *, parent: str) -> list[Any]:
        self.parents.append(parent)
        return [n for n in self.nodes if n.name.startswith(parent + "/")]

    def list_queued_resources(self, *, parent: str) -> list[Any]:
        return [q for q in self.queued if q.name.startswith(parent + "/")]

    def get_node(self, *, name: str) -> Any:
        for node in self.nodes:
            if node.name == name:
                return node
        raise exceptions.NotFound(name)


def _client() -> FakeClient:
    return FakeClient(
        nodes=[
            # The state's own node: not a leftover.
            _node("us-central1-a", "gemma4-train", MINE, scheduling_config={"spot": True}),
            # Left by an interrupted up in a fallback zone: billed, not in the state.
            _node("us-east5-a", "gemma4-train", MINE, scheduling_config={"spot": True}),
            # Someone else's node, and another stack's: not ours to list.
            _node("us-east5-a", "other", {"app": "x"}),
            _node("us-east5-a", "gemma4-dev-train", {**MINE, "stack": "dev"}),
        ],
        queued=[
            _queued("us-central1-a", "gemma4-serve", MINE, "WAITING_FOR_RESOURCES"),
            _queued("us-east5-a", "gemma4-x", {"app": "x"}, "WAITING_FOR_RESOURCES"),
        ],
    )


def test_nodes_and_queues_with_the_stacks_labels_that_the_state_does_not_hold_are_found():
    scope = leftovers.Scope.from_outputs({"tpuScope": SCOPE})
    assert scope is not None
    client = _client()
    found = leftovers.find(client, scope, {("us-central1-a", "gemma4-train")}, NOW)
    assert [(f.kind, f.name, f.zone, f.state) for f in found] == [
        ("node", "gemma4-train", "us-east5-a", "READY"),
        ("queued resource", "gemma4-serve", "us-central1-a", "WAITING_FOR_RESOURCES"),
    ]
    assert client.parents == [
        "projects/p/locations/us-central1-a",
        "projects/p/locations/us-east5-a",
    ]
    v5p = catalog.accelerator("v5p-8").hourly_usd
    assert found[0].line() == (
        "not in the stack's state: TPU node gemma4-train in us-east5-a, READY, v5p-8 spot: "
        f"${v5p:,.2f}/h; delete it: gcloud compute tpus tpu-vm delete gemma4-train "
        "--zone us-east5-a"
    )
    assert found[1].line() == (
        "not in the stack's state: TPU queued resource gemma4-serve in us-central1-a, "
        "WAITING_FOR_RESOURCES: not billed now; it starts a billed TPU if it gets capacity; "
        "delete it: gcloud compute tpus queued-resources delete gemma4-serve --zone "
        "us-central1-a --force"
    )


def _outputs(tmp_path: pathlib.Path, **extra: Any) -> str:
    record = {
        "vm": "gemma4-train",
        "role": "train",
        "project": "p",
        "zone": "us-central1-a",
        "hosts": [],
        "ssh_user": "gemma4",
    }
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"deployments": {"train": record}, **extra}))
    return str(path)


def test_ops_cost_prices_the_leftovers_and_counts_them_in_the_totals(tmp_path, monkeypatch):
    monkeypatch.setattr(tpu_api, "is_not_found", lambda e: isinstance(e, exceptions.NotFound))
    out = io.StringIO()
    code = ops.main(
        ["--outputs", _outputs(tmp_path, tpuScope=SCOPE), "cost"],
        out=out,
        tpu_client_factory=_client(),
    )
    assert code == 0
    lines = out.getvalue().splitlines()
    v5p = catalog.accelerator("v5p-8").hourly_usd
    assert lines[0].startswith("train VM gemma4-train: READY, v5p-8 spot:")
    assert lines[1].startswith("not in the stack's state: TPU node gemma4-train in us-east5-a")
    assert lines[2].startswith("not in the stack's state: TPU queued resource gemma4-serve")
    # Both running v5p-8s bill: the stack's and the one the state forgot.
    assert lines[3].startswith(f"now: ${2 * v5p:,.2f}/h for 2 running VM(s); about $")

    # A stack made before the tpuScope output: nothing scanned, the report as before.
    out = io.StringIO()
    ops.main(["--outputs", _outputs(tmp_path), "cost"], out=out, tpu_client_factory=_client())
    assert "not in the stack's state" not in out.getvalue()
    assert f"now: ${v5p:,.2f}/h for 1 running VM(s)" in out.getvalue()


def test_a_failed_scan_is_one_line_and_the_rest_of_the_report_stands(tmp_path, monkeypatch):
    monkeypatch.setattr(tpu_api, "is_not_found", lambda e: isinstance(e, exceptions.NotFound))

    class Denied(FakeClient):
        def list_nodes(self, *, parent: str) -> list[Any]:
            raise exceptions.PermissionDenied("Permission 'tpu.nodes.list' denied")

    client = _client()
    denied = Denied(client.nodes, client.queued)
    out = io.StringIO()
    code = ops.main(
        ["--outputs", _outputs(tmp_path, tpuScope=SCOPE), "cost"],
        out=out,
        tpu_client_factory=denied,
    )
    assert code == 0
    lines = out.getvalue().splitlines()
    for zone in SCOPE["zones"]:
        assert (
            f"not in the stack's state: unknown in {zone} (cannot list TPUs there: "
            "PermissionDenied: 403 Permission 'tpu.nodes.list' denied)" in lines
        )


def test_ops_status_lists_a_released_vms_node_that_still_runs(tmp_path, capsys):
    """The training VM released its node (releaseWhenDone), but the delete never happened: the
    state no longer holds the node, and status says it still bills."""
    released = {"run_name": "r1", "node": "gemma4-train", "released_at": "2026-11-25T03:00:00Z"}
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"trainReleased": released, "deployments": {}, "tpuScope": SCOPE}))
    out = io.StringIO()
    assert ops.main(["--outputs", str(path), "status"], out=out, tpu_client_factory=_client()) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train VM: the training VM gemma4-train was released")
    assert lines[1].startswith("not in the stack's state: TPU node gemma4-train in us-central1-a")
    assert lines[2].startswith("not in the stack's state: TPU node gemma4-train in us-east5-a")
    assert len(lines) == 4


class RefusesZone(FakeClient):
    """A client whose API refuses one location (an organisation's location policy, a zone
    without Cloud TPU), as the real one does: 403 PermissionDenied on every read there."""

    def __init__(self, nodes: list[Any], queued: list[Any], zone: str) -> None:
        super().__init__(nodes, queued)
        self.zone = zone

    def _check(self, parent: str) -> None:
        if parent.endswith("/" + self.zone):
            raise exceptions.PermissionDenied(
                f"Location {self.zone} is not found or access is unauthorized."
            )

    def list_nodes(self, *, parent: str) -> list[Any]:
        self._check(parent)
        return super().list_nodes(parent=parent)

    def list_queued_resources(self, *, parent: str) -> list[Any]:
        self._check(parent)
        return super().list_queued_resources(parent=parent)


def test_a_zone_that_refuses_reads_is_unknown_for_that_zone_only():
    scope = leftovers.Scope.from_outputs({"tpuScope": SCOPE})
    assert scope is not None
    client = _client()
    refusing = RefusesZone(client.nodes, client.queued, "us-central1-a")
    found, unreadable = leftovers.scan(refusing, scope, set(), NOW)
    # us-east5-a is still scanned: its leftover node is found.
    assert [(f.kind, f.name, f.zone) for f in found] == [("node", "gemma4-train", "us-east5-a")]
    assert [u.line() for u in unreadable] == [
        "not in the stack's state: unknown in us-central1-a (cannot list TPUs there: "
        "PermissionDenied: 403 Location us-central1-a is not found or access is unauthorized.)"
    ]


STACK_FILE = """\
config:
  gemma4-tpu:project: p
  gemma4-tpu:training:
    zone: us-central1-a
    zoneFallbacks: [us-east5-a]
"""


def test_ops_status_after_destroy_finds_a_left_queue_from_the_stack_file(tmp_path, monkeypatch):
    """`pulumi destroy` empties the outputs (no tpuScope, no deployments), while a queue an
    interrupted `up` left can still start a billed TPU: status looks where the stack file says
    (project, zones, the stack's labels) and lists it."""
    monkeypatch.setattr(leftovers, "PROJECT_DIR", tmp_path)
    (tmp_path / "Pulumi.prod.yaml").write_text(STACK_FILE)
    # The destroyed stack's outputs, as `pulumi stack output --json` prints them.
    monkeypatch.setattr(ops, "load_outputs", lambda stack, outputs_file: {})
    client = FakeClient(
        nodes=[],
        queued=[_queued("us-east5-a", "gemma4-train", MINE, "WAITING_FOR_RESOURCES")],
    )
    out = io.StringIO()
    argv = ["--stack", "prod", "status"]
    assert ops.main(argv, out=out, tpu_client_factory=client) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "train VM: the stack has no 'deployments' output: run `pulumi up` first (or check --stack)"
    )
    assert lines[1].startswith(
        "not in the stack's state: TPU queued resource gemma4-train in us-east5-a, "
        "WAITING_FOR_RESOURCES: not billed now; it starts a billed TPU if it gets capacity"
    )
    assert client.parents == [
        "projects/p/locations/us-central1-a",
        "projects/p/locations/us-east5-a",
    ]

    # Without a stack file to read, nothing says where to look: the error stays.
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    argv = ["--stack", "other", "status"]
    assert ops.main(argv, out=io.StringIO(), tpu_client_factory=client) == 2
    assert "has no 'deployments' output" in err.getvalue()
