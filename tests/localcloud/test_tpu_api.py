"""The local Cloud TPU API against the real `google.cloud.tpu_v2.TpuClient` and the project's own
TPU code: node and queued-resource lifecycles, the API's errors, placement's zone failover, the
TpuNode provider, and IAM checked on every call (the program's own grants, Google's names)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import tpu_v2

from infra.resources import deployment_record, tpu_node
from infra.tpu import api as tpu_api
from infra.tpu import placement as tpu_placement
from localcloud import iam as iam_mod
from localcloud import metadata_server
from localcloud import tpu_api as local_tpu
from tests.fixtures import tpu_api as fixture
from tests.fixtures.pulumi_mocks import run_program, stack_file_config, with_key

GCLOUD = pathlib.Path(__file__).resolve().parents[2] / "localcloud" / "guest" / "gcloud"
PROJECT = fixture.PROJECT
ZONE = "us-central1-a"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"
VM_ACCOUNT = f"gemma4-vm@{PROJECT}.iam.gserviceaccount.com"
SPEC = {
    "accelerator_type": "v5p-8",
    "runtime_version": "v2-alpha-tpuv5",
    "labels": {"app": "gemma4-tpu", "stack": "dev", "role": "train"},
    "metadata": {"startup-script": "#!/bin/bash\n"},
    "scheduling_config": {"spot": True},
    "service_account": {"email": VM_ACCOUNT, "scope": ["cloud-platform"]},
}


def _create(client: Any, node_id: str, zone: str = ZONE) -> tpu_v2.Node:
    parent = f"projects/{PROJECT}/locations/{zone}"
    return client.create_node(parent=parent, node_id=node_id, node=tpu_v2.Node(SPEC)).result(30)


def test_a_node_lives_creating_ready_stopped_preempted_deleted_through_the_real_client(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    client = tpu_api.tpu_client()
    node = _create(client, "n1")
    name = f"{PARENT}/nodes/n1"
    assert node.state == tpu_v2.Node.State.READY and node.name == name
    assert node.network_endpoints[0].access_config.external_ip.startswith("10.130.")
    assert [n.name for n in client.list_nodes(parent=PARENT)] == [name]

    client.stop_node(request={"name": name}).result(30)
    assert client.get_node(name=name).state == tpu_v2.Node.State.STOPPED
    client.start_node(request={"name": name}).result(30)
    assert client.get_node(name=name).state == tpu_v2.Node.State.READY

    tpu_cloud.preempt(name)
    assert client.get_node(name=name).state == tpu_v2.Node.State.PREEMPTED
    assert (name, "preempted") in tpu_cloud.hooks.halted  # type: ignore[attr-defined]
    client.delete_node(name=name).result(30)
    with pytest.raises(exceptions.NotFound):
        client.get_node(name=name)
    # Every call went out under the operator's identity, read from the key file.
    assert {member for member, *_ in tpu_cloud.calls} == {f"serviceAccount:{fixture.OPERATOR}"}


def test_the_apis_errors_reach_the_client_as_googles_exceptions(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = tpu_api.tpu_client()
    _create(client, "n1")
    with pytest.raises(exceptions.Conflict, match="already exists"):
        _create(client, "n1")
    with pytest.raises(exceptions.NotFound):
        client.get_node(name=f"{PARENT}/nodes/nope")
    tpu_cloud.zone("europe-west1-b").readable = False
    with pytest.raises(exceptions.Forbidden, match="is not found or access is unauthorized"):
        client.list_nodes(parent=f"projects/{PROJECT}/locations/europe-west1-b")
    tpu_cloud.zone("us-east5-a").capacity = False
    with pytest.raises(exceptions.ResourceExhausted, match="no more capacity"):
        _create(client, "n2", "us-east5-a")
    # A key the API does not know: 401, as a revoked key gets.
    stranger = local_tpu.TpuApiServer(PROJECT)
    try:
        path = fixture.key_file(stranger, f"stranger@{PROJECT}.iam.gserviceaccount.com", tmp_path)
    finally:
        stranger.stop()
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    with pytest.raises(exceptions.Unauthorized):
        tpu_api.tpu_client().get_node(name=f"{PARENT}/nodes/n1")


def test_a_node_deleted_while_it_is_created_ends_its_create_in_an_error(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    """Its caller waits on the create's operation: it is told, not left waiting for ever, and
    the workers the node got on the way are stopped."""
    client = tpu_api.tpu_client()
    tpu_cloud.create_s = 1.0
    creating = client.create_node(parent=PARENT, node_id="n1", node=tpu_v2.Node(SPEC))
    name = f"{PARENT}/nodes/n1"
    client.delete_node(name=name).result(30)
    with pytest.raises(exceptions.Aborted, match="was deleted while being created"):
        creating.result(30)
    assert tpu_cloud.state(name) is None
    assert tpu_cloud.hooks.halted == [(name, "deleted"), (name, "deleted")]  # type: ignore[attr-defined]


class SlowHalt(local_tpu.NoWorkers):
    """Workers whose second halt takes `slow_s` (a VM slow to stop)."""

    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.slow_s = slow_s

    def halt(self, node: dict[str, Any], why: str) -> None:
        super().halt(node, why)
        if len(self.halted) == 2:
            time.sleep(self.slow_s)


def test_a_second_delete_of_a_deleting_node_leaves_the_next_node_of_its_name(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    """Two callers delete a lost node at once; one creates the next node under the name as soon
    as its delete is done: the other delete, still finishing, must not take that new node."""
    client = tpu_api.tpu_client()
    tpu_cloud.hooks = SlowHalt(3.0)
    tpu_cloud.delete_s = 0.5
    _create(client, "n1")
    name = f"{PARENT}/nodes/n1"
    first = client.delete_node(name=name)
    second = client.delete_node(name=name)  # the node is DELETING: its second delete is taken
    first.result(30)
    node = _create(client, "n1")
    second.result(30)
    assert tpu_cloud.nodes[name]["id"] == str(node.id) and tpu_cloud.state(name) == "READY"


def test_each_call_needs_its_permission_and_a_create_needs_act_as_on_the_account(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = f"reader@{PROJECT}.iam.gserviceaccount.com"
    tpu_cloud.iam.grant(
        f"serviceAccount:{reader}", ["tpu.nodes.get", "tpu.nodes.create", "tpu.operations.get"]
    )
    _create(tpu_api.tpu_client(), "n1")
    monkeypatch.setenv(
        "GOOGLE_APPLICATION_CREDENTIALS", str(fixture.key_file(tpu_cloud, reader, tmp_path))
    )
    client = tpu_api.tpu_client()
    assert client.get_node(name=f"{PARENT}/nodes/n1").state == tpu_v2.Node.State.READY
    with pytest.raises(exceptions.Forbidden, match=r"'tpu\.nodes\.delete' denied"):
        client.delete_node(name=f"{PARENT}/nodes/n1")
    with pytest.raises(
        exceptions.Forbidden, match=f"'iam.serviceAccounts.actAs' denied.*{VM_ACCOUNT}"
    ):
        _create(client, "n2")
    tpu_cloud.iam.grant(f"serviceAccount:{reader}", ["iam.serviceAccounts.actAs"], VM_ACCOUNT)
    assert _create(client, "n2").state == tpu_v2.Node.State.READY


def test_a_queued_resource_waits_for_capacity_then_becomes_active_with_its_node(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    api = tpu_api.GoogleTpuApi()
    tpu_cloud.zone(ZONE).capacity = False
    request = tpu_placement.Request(
        project=PROJECT,
        node_id="q1",
        zones=(ZONE,),
        node=SPEC,
        queue=tpu_placement.Queue(spot=True, valid_for_s=600),
    )
    api.create_queued_resource(request.parent(ZONE), "q1", tpu_placement.queued_body(request, ZONE))
    name = request.queued_name(ZONE)
    time.sleep(0.5)
    assert api.queued_state(name) == "WAITING_FOR_RESOURCES"
    assert api.get_node(request.node_name(ZONE)) is None
    tpu_cloud.zone(ZONE).capacity = True
    deadline = time.monotonic() + 10
    while api.queued_state(name) != "ACTIVE" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.queued_state(name) == "ACTIVE"
    node = api.get_node(request.node_name(ZONE))
    assert node is not None and node["state"] == "READY" and node["queued_resource"] == name
    assert [q["name"] for q in api.list_queued(request.parent(ZONE))] == [name]
    api.delete_queued_resource(name)  # force: the node goes with it
    assert api.get_node(request.node_name(ZONE)) is None and api.queued_state(name) is None


def test_placement_fails_over_past_a_refused_zone_and_a_stockout_through_the_real_client(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    tpu_cloud.zone("europe-west1-b").readable = False
    tpu_cloud.zone("us-east5-a").capacity = False
    said: list[str] = []
    request = tpu_placement.Request(
        project=PROJECT,
        node_id="gemma4-train",
        zones=("europe-west1-b", "us-east5-a", ZONE),
        node=SPEC,
    )
    placed = tpu_placement.place(tpu_api.GoogleTpuApi(), request, say=said.append)
    assert placed.zone == ZONE and placed.node["state"] == "READY"
    assert [r.split(":")[0] for r in placed.refusals] == ["europe-west1-b", "us-east5-a"]
    assert "no more capacity" in placed.refusals[1]
    # A second `up` adopts the node where it is: no second slice.
    again = tpu_placement.place(tpu_api.GoogleTpuApi(), request, say=said.append)
    assert again.zone == ZONE and len(tpu_cloud.nodes) == 1


def test_placement_with_a_queue_waits_in_line_then_takes_the_node(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    tpu_cloud.queue_s = [("WAITING_FOR_RESOURCES", 0.5), ("PROVISIONING", 0.3)]
    said: list[str] = []
    request = tpu_placement.Request(
        project=PROJECT,
        node_id="gemma4-train",
        zones=(ZONE,),
        node=SPEC,
        queue=tpu_placement.Queue(spot=True, valid_for_s=600),
    )
    placed = tpu_placement.place(tpu_api.GoogleTpuApi(), request, say=said.append, poll_s=0.1)
    assert placed.node["state"] == "READY" and placed.queued_resource == request.queued_name(ZONE)
    polls = [p for _, verb, p, _ in tpu_cloud.calls if verb == "GET" and "queuedResources/" in p]
    assert len(polls) >= 2, polls  # it watched its place in line through the API
    assert any("queued" in line for line in said), said


def test_the_tpu_node_provider_creates_reads_a_preemption_and_deletes_through_the_real_client(
    tpu_cloud: local_tpu.TpuApiServer, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(tpu_node, "known_hosts_file", lambda: tmp_path / "known_hosts")
    tpu_cloud.zone(ZONE).capacity = False
    props = {
        "project": PROJECT,
        "node_id": "gemma4-train",
        "zones": [ZONE, "us-east5-a"],
        "queue": None,
        **SPEC,
    }
    provider = tpu_node.TpuNodeProvider()
    created = provider.create(dict(props))
    outs = created.outs or {}
    assert created.id == f"projects/{PROJECT}/locations/us-east5-a/nodes/gemma4-train"
    assert outs["zone"] == "us-east5-a" and outs["state"] == "READY"
    assert outs["refusals"][0].startswith(f"{ZONE}: ")
    assert provider.diff(created.id, outs, dict(props)).changes is False

    tpu_cloud.preempt(created.id)
    read = provider.read(created.id, outs)
    assert (read.outs or {})["state"] == "PREEMPTED"
    diff = provider.diff(created.id, read.outs or {}, dict(props))
    assert "state" in (diff.replaces or []) and diff.delete_before_replace
    provider.delete(created.id, read.outs or {})
    assert provider.read(created.id, outs).id == ""


def test_destroy_finds_a_queue_in_a_zone_the_stack_no_longer_lists(
    tpu_cloud: local_tpu.TpuApiServer, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """A zone dropped from the list between `up` and `destroy` is still scanned: the zones the
    node was ever given come from its state."""
    monkeypatch.setattr(tpu_node, "known_hosts_file", lambda: tmp_path / "known_hosts")
    dropped, kept = "us-east5-a", ZONE
    tpu_cloud.zone(dropped).capacity = False
    props = {
        "project": PROJECT,
        "node_id": "gemma4-train",
        "zones": [dropped, kept],
        "queue": None,
        **SPEC,
        **dict.fromkeys(tpu_node.OUTPUT_KEYS),
    }
    provider = tpu_node.TpuNodeProvider()
    created = provider.create(dict(props))
    assert (created.outs or {})["zone"] == kept
    # What an `up` interrupted while it waited in line there left: this node's queue, which
    # the state never recorded.
    api = tpu_api.GoogleTpuApi()
    queued = tpu_placement.Request(
        project=PROJECT,
        node_id="gemma4-train",
        zones=(dropped,),
        node=SPEC,
        queue=tpu_placement.Queue(spot=True, valid_for_s=600),
    )
    api.create_queued_resource(
        queued.parent(dropped), "gemma4-train", tpu_placement.queued_body(queued, dropped)
    )
    # The next `up` lists only the zone the node is in, and its startup script changed: an
    # update in place, no replacement.
    news = dict(props) | {"zones": [kept], "metadata": {"startup-script": "#!/bin/bash\n# v2\n"}}
    diff = provider.diff(created.id, created.outs or {}, news)
    assert diff.changes and not diff.replaces
    updated = provider.update(created.id, created.outs or {}, news)

    provider.delete(created.id, dict(updated.outs or {}))

    assert api.list_queued(queued.parent(dropped)) == []
    assert api.get_node(created.id) is None


# -- IAM from the program's own grants ---------------------------------------------------------


def _program_grants(
    monkeypatch: pytest.MonkeyPatch, path: str, value: Any
) -> tuple[str, list[iam_mod.Grant]]:
    """(the VMs' account, every grant) of the dev stack with `path` set to `value`, as the
    program declares them under Pulumi's mocks (the run not released yet)."""
    from infra.ops import release_record

    monkeypatch.setattr(release_record.storage, "exists", lambda uri: False)
    mapping = with_key(stack_file_config("dev", project=PROJECT), path, value)
    recording = run_program("dev", mapping, hf_token="hf_test")
    account = recording.one("gcp:serviceaccount/account:Account", "vm-sa-account")
    email = f"{account.inputs['accountId']}@{PROJECT}.iam.gserviceaccount.com"
    return email, iam_mod.from_resources((r.type, r.inputs) for r in recording.resources)


@pytest.fixture
def vm_metadata(tpu_cloud: local_tpu.TpuApiServer):
    """The training VM's metadata server (its account and token), on a free loopback port."""
    instance = metadata_server.Instance(
        name="gemma4-dev-train",
        id="1",
        zone=ZONE,
        project=PROJECT,
        attributes={},
        service_account=VM_ACCOUNT,
        token=tpu_cloud.iam.issue_token(f"serviceAccount:{VM_ACCOUNT}"),
    )
    server = metadata_server.MetadataServer(instance, "127.0.0.1", 0)
    yield server
    server.stop()


def _gcloud(
    tpu_cloud: local_tpu.TpuApiServer, metadata: metadata_server.MetadataServer, *args: str
) -> subprocess.CompletedProcess[str]:
    host = f"127.0.0.1:{metadata.port}"
    return subprocess.run(
        [sys.executable, str(GCLOUD), *args],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "GCE_METADATA_HOST": host,
            tpu_api.ENDPOINT_ENV: tpu_cloud.url,
            "LOCALCLOUD_GCLOUD_LOG": os.devnull,
        },
        check=False,
        timeout=60,
    )


def test_the_vm_releases_its_node_with_the_grants_the_program_declares(
    tpu_cloud: local_tpu.TpuApiServer,
    vm_metadata: metadata_server.MetadataServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workloads.cli import give_back
    from workloads.contract import runconfig

    account, grants = _program_grants(monkeypatch, "training.releaseWhenDone", True)
    # The VM runs as the program's account: its token names it (the fixture's stand-in name).
    tpu_cloud.iam.grants += [
        iam_mod.Grant(f"serviceAccount:{VM_ACCOUNT}", g.permissions, g.resource)
        for g in grants
        if g.member == f"serviceAccount:{account}"
    ]
    vm_member = f"serviceAccount:{VM_ACCOUNT}"
    name = f"{PARENT}/nodes/gemma4-dev-train"
    _create(tpu_api.tpu_client(), "gemma4-dev-train")
    release = runconfig.ReleaseRunSection.model_validate(
        {"project": PROJECT, "zone": ZONE, "node": "gemma4-dev-train", "marker": "/tmp/x"}
    )
    argv = give_back.delete_argv(release, "gcloud")[1:]
    proc = _gcloud(tpu_cloud, vm_metadata, *argv)
    assert proc.returncode == 0, proc.stderr
    tpu_cloud.wait_state(name, (None,), 10)
    assert (vm_member, "DELETE", name.removeprefix("/"), 200) in tpu_cloud.calls


def test_a_role_without_tpu_nodes_delete_gets_one_clear_line_from_the_release(
    tpu_cloud: local_tpu.TpuApiServer, vm_metadata: metadata_server.MetadataServer
) -> None:
    vm_member = f"serviceAccount:{VM_ACCOUNT}"
    tpu_cloud.iam.grant(vm_member, ["tpu.nodes.get", "tpu.operations.get"])
    _create(tpu_api.tpu_client(), "gemma4-dev-train")
    proc = _gcloud(
        tpu_cloud,
        vm_metadata,
        "compute", "tpus", "tpu-vm", "delete", "gemma4-dev-train",
        f"--zone={ZONE}", f"--project={PROJECT}", "--quiet", "--async",
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "ERROR: (gcloud.compute.tpus.tpu-vm.delete) PERMISSION_DENIED: Permission "
        f"'tpu.nodes.delete' denied on resource '//tpu.googleapis.com/{PARENT}/nodes/"
        "gemma4-dev-train' (or it may not exist)."
    ]
    assert tpu_cloud.state(f"{PARENT}/nodes/gemma4-dev-train") == "READY"


# -- the operator commands' reads --------------------------------------------------------------


def test_ops_status_reads_the_nodes_state_and_its_queue_through_the_real_client(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    from infra.ops import cli

    request = tpu_placement.Request(
        project=PROJECT,
        node_id="gemma4-dev-train",
        zones=(ZONE,),
        node=SPEC,
        queue=tpu_placement.Queue(spot=True, valid_for_s=600),
    )
    tpu_placement.place(tpu_api.GoogleTpuApi(), request, say=lambda _: None, poll_s=0.1)
    # What the stack's outputs say of the VM (the fields this read uses).
    info = deployment_record.VmInfo.model_construct(
        role="train", vm="gemma4-dev-train", project=PROJECT, zone=ZONE
    )
    state, created = cli.tpu_state_and_creation(info)
    assert state == "READY, health HEALTHY, queued resource gemma4-dev-train ACTIVE"
    assert created is not None and abs(created - time.time()) < 60
    tpu_cloud.preempt(request.node_name(ZONE))
    assert cli.tpu_state_and_creation(info)[0].startswith("PREEMPTED")


def test_the_leftover_scan_finds_an_unrecorded_node_and_says_which_zone_it_cannot_read(
    tpu_cloud: local_tpu.TpuApiServer,
) -> None:
    from infra.ops import leftovers

    _create(tpu_api.tpu_client(), "gemma4-dev-train")
    tpu_cloud.zone("europe-west1-b").readable = False
    scope = leftovers.Scope(
        project=PROJECT,
        zones=(ZONE, "europe-west1-b"),
        labels={"app": "gemma4-tpu", "stack": "dev"},
    )
    found, unreadable = leftovers.scan(tpu_api.tpu_client(), scope, known=set())
    assert [(f.kind, f.name, f.zone, f.state) for f in found] == [
        ("node", "gemma4-dev-train", ZONE, "READY")
    ]
    assert [u.zone for u in unreadable] == ["europe-west1-b"]
    assert "is not found or access is unauthorized" in unreadable[0].line()
    # The stack's own node (in its state) is not a leftover.
    assert leftovers.scan(tpu_api.tpu_client(), scope, known={(ZONE, "gemma4-dev-train")})[0] == []
