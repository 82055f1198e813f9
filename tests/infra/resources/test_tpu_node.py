"""The TPU node resource's provider: what a later `pulumi up` changes, replaces or keeps, and
create/update/read/delete against a fake Cloud TPU API (tests/infra/tpu/test_placement.py's)."""

from __future__ import annotations

import base64
import subprocess
from typing import Any

import dill
import paramiko
import pulumi.dynamic
import pytest

from infra.remote import ssh
from infra.resources import tpu_node
from infra.tpu import placement as tpu_placement
from tests.fixtures.sshd import Worker
from tests.infra.tpu.test_placement import NODE, STOCKOUT, FakeTpu

PROPS: dict[str, Any] = {
    "project": "p",
    "node_id": "gemma4-train",
    "zones": ["us-central1-a", "us-east5-a"],
    "queue": None,
    **NODE,
    "scheduling_config": {"spot": True},
}


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeTpu:
    fake = FakeTpu(refuse={"us-central1-a": STOCKOUT})
    monkeypatch.setattr(tpu_node, "new_api", lambda: fake)
    return fake


def test_create_places_the_node_and_records_the_zone(api: FakeTpu, capsys) -> None:
    provider = tpu_node.TpuNodeProvider()
    result = provider.create({**PROPS, "__provider": "x"})
    assert result.id == "projects/p/locations/us-east5-a/nodes/gemma4-train"
    outs = result.outs or {}
    assert outs["zone"] == "us-east5-a" and outs["state"] == "READY"
    assert outs["refusals"][0].startswith("us-central1-a: ResourceExhausted")
    assert outs["network_endpoints"][0]["access_config"]["external_ip"] == "203.0.113.9"
    assert "__provider" not in outs
    # The progress lines go to the provider's stderr, which `pulumi up` shows.
    assert "tpu: gemma4-train: us-central1-a: cannot place gemma4-train here" in (
        capsys.readouterr().err
    )


def test_a_later_up_keeps_the_zone_and_changes_what_it_can_in_place(api: FakeTpu) -> None:
    provider = tpu_node.TpuNodeProvider()
    created = provider.create(dict(PROPS))
    state = created.outs or {}

    same = provider.diff(created.id, state, dict(PROPS))
    assert same.changes is False and same.replaces == []
    # Reordered or extended zones: the node stays where it is.
    reordered = {**PROPS, "zones": ["us-east5-a", "us-central1-a", "europe-west4-b"]}
    assert provider.diff(created.id, state, reordered).changes is False
    # Its zone dropped from the list: a new node elsewhere.
    moved = provider.diff(created.id, state, {**PROPS, "zones": ["europe-west4-b"]})
    assert moved.replaces == ["zones"] and moved.delete_before_replace is True
    # A new startup script changes in place; a new runtime or capacity kind replaces.
    script = {**PROPS, "metadata": {"startup-script": "#!/bin/bash\necho v2\n"}}
    in_place = provider.diff(created.id, state, script)
    assert in_place.changes is True and in_place.replaces == []
    assert provider.diff(created.id, state, {**PROPS, "runtime_version": "x"}).replaces == [
        "runtime_version"
    ]
    queued = {**PROPS, "queue": {"spot": True, "valid_for_s": 3600}}
    assert provider.diff(created.id, state, queued).replaces == ["queue"]
    # A value not known yet (preview) is a change.
    unknown = {**PROPS, "metadata": tpu_node.UNKNOWN}
    assert provider.diff(created.id, state, unknown).changes is True

    updated = provider.update(created.id, state, script)
    assert api.calls[-1] == ("update_node", "metadata")
    assert (updated.outs or {})["zone"] == "us-east5-a"
    assert api.nodes[created.id]["metadata"]["startup-script"].endswith("echo v2\n")


def test_read_reports_a_gone_node_and_delete_removes_the_queued_resource(api: FakeTpu) -> None:
    provider = tpu_node.TpuNodeProvider()
    queued = {**PROPS, "queue": {"spot": True, "valid_for_s": 3600}}
    created = provider.create(queued)
    outs = created.outs or {}
    assert outs["queued_resource"] == "projects/p/locations/us-east5-a/queuedResources/gemma4-train"
    api.nodes[created.id]["state"] = "PREEMPTED"
    assert (provider.read(created.id, outs).outs or {})["state"] == "PREEMPTED"
    provider.delete(created.id, outs)
    assert api.nodes == {} and api.queued == {}
    assert provider.read(created.id, outs).id == ""  # gone: Pulumi drops it on refresh


def test_the_provider_is_stored_by_reference_and_not_as_a_secret() -> None:
    provider = tpu_node.TpuNodeProvider()
    text = pulumi.dynamic.dynamic.serialize_provider(provider)
    assert isinstance(dill.loads(base64.b64decode(text)), tpu_node.TpuNodeProvider)
    assert len(text) < 400  # the module is imported by name in the provider process
    assert provider.serialize_as_secret_always is False


def test_a_preempted_node_is_replaced_never_updated(api: FakeTpu) -> None:
    """The API refuses to update a PREEMPTED node, and a spot node cannot be restarted: the next
    `up` replaces it (delete, then create), even when only its metadata changed."""
    provider = tpu_node.TpuNodeProvider()
    created = provider.create(dict(PROPS))
    state = created.outs or {}
    script = {**PROPS, "metadata": {"startup-script": "#!/bin/bash\necho v2\n"}}
    assert provider.diff(created.id, state, script).replaces == []
    api.nodes[created.id]["state"] = "PREEMPTED"
    diff = provider.diff(created.id, state, script)
    assert diff.replaces == ["state"] and diff.delete_before_replace is True
    assert provider.diff(created.id, state, dict(PROPS)).replaces == ["state"]
    # Preempted between the diff and the update: refused in one line, nothing sent.
    with pytest.raises(tpu_node.tpu_placement.PlacementError) as info:
        provider.update(created.id, state, script)
    assert str(info.value).startswith("TPU node gemma4-train is PREEMPTED: it cannot be updated")
    assert not any(c[0] == "update_node" for c in api.calls)

    # The API out of reach (preview without credentials): the last refresh's state decides.
    def unreachable(name: str) -> None:
        raise RuntimeError("no credentials")

    api.get_node = unreachable  # type: ignore[method-assign]
    assert provider.diff(created.id, {**state, "state": "PREEMPTED"}, dict(PROPS)).replaces == [
        "state"
    ]
    assert provider.diff(created.id, state, dict(PROPS)).replaces == []


def test_stored_inputs_read_back_typed() -> None:
    """Pulumi hands the inputs back with every number a float and unset values as None."""
    stored = {**PROPS, "queue": {"spot": True, "valid_for_s": 86400.0}, "labels": None}
    request = tpu_node.TpuNodeInputs.model_validate({**stored, "__provider": "x"}).request()
    assert request.queue is not None and type(request.queue.valid_for_s) is int
    assert (request.queue.spot, request.queue.valid_for_s) == (True, 86400)
    assert request.zones == ("us-central1-a", "us-east5-a") and "labels" not in request.node


class Interrupted(FakeTpu):
    """Ctrl-C while the queue waits: the first poll after the queued resource was created raises
    KeyboardInterrupt (Pulumi cannot cancel a dynamic provider's create; the state never
    records the resource or its queue)."""

    interrupted = False

    def queued_state(self, name: str) -> str | None:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return super().queued_state(name)


def test_destroy_deletes_the_queue_an_interrupted_create_left(monkeypatch, capsys) -> None:
    api = Interrupted(queues={"us-central1-a": ["WAITING_FOR_RESOURCES"]})
    monkeypatch.setattr(tpu_node, "new_api", lambda: api)
    monkeypatch.setattr(tpu_node, "QUEUE_POLL_S", 0.0)
    provider = tpu_node.TpuNodeProvider()
    queued = {**PROPS, "labels": {**NODE["labels"], "role": "train"}}
    queued["queue"] = {"spot": True, "valid_for_s": 3600}
    with pytest.raises(KeyboardInterrupt):
        provider.create(dict(queued))
    left = "projects/p/locations/us-central1-a/queuedResources/gemma4-train"
    assert list(api.queued) == [left]

    # Queues of this node the state never held: one from an earlier nodeName (found by the
    # stack's labels, not by name), one being deleted already (waited on, not deleted again);
    # the serving VM's queue (another role) and someone else's are left alone.
    request = tpu_node.TpuNodeInputs.model_validate(queued).request()

    def put(zone: str, node_id: str, labels: dict[str, str], states: list[str]) -> str:
        other = tpu_placement.Request("p", node_id, (zone,), {**NODE, "labels": labels})
        name = other.queued_name(zone)
        api.queued[name] = {
            "body": tpu_placement.queued_body(
                tpu_placement.Request(
                    "p", node_id, (zone,), other.node, tpu_placement.Queue(True, 60)
                ),
                zone,
            ),
            "states": states,
        }
        return name

    mine = dict(request.node["labels"])
    earlier = put("us-east5-a", "gemma4-train-old", {**mine, "run": "r0"}, ["ACTIVE"])
    deleting = put("us-east5-a", "gemma4-train", mine, ["DELETING", "DELETING", "GONE"])
    serve = put("us-east5-a", "gemma4-serve", {**mine, "role": "serve"}, ["WAITING_FOR_RESOURCES"])
    foreign = put("us-central1-a", "x", {"app": "x"}, ["WAITING_FOR_RESOURCES"])

    # destroy with the old state: the inputs only, no queued_resource recorded.
    provider.delete("projects/p/locations/us-central1-a/nodes/gemma4-train", dict(queued))
    assert sorted(api.queued) == sorted([serve, foreign])
    deleted = [c[1] for c in api.calls if c[0] == "delete_queued_resource"]
    assert left in deleted and earlier in deleted and deleting not in deleted
    err = capsys.readouterr().err
    assert "us-east5-a: queued resource gemma4-train is DELETING; waiting for it to go" in err
    assert "us-east5-a: deleting queued resource gemma4-train-old (ACTIVE)" in err


def test_destroy_goes_on_past_a_zone_that_refuses_reads(api: FakeTpu) -> None:
    from google.api_core import exceptions

    provider = tpu_node.TpuNodeProvider()
    created = provider.create(dict(PROPS))
    api.refuse_reads["us-central1-a"] = exceptions.PermissionDenied(
        "Location us-central1-a is not found or access is unauthorized."
    )
    provider.delete(created.id, created.outs or {})
    assert api.nodes == {}


def _new_host_key(worker: Worker) -> None:
    """The worker's address comes back on another VM: same address and port, a new host key."""
    worker.stop()
    for path in worker.base.glob("ssh_host_ed25519_key*"):
        path.unlink()
    subprocess.run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-f",
            str(worker.base / "ssh_host_ed25519_key"),
        ],
        check=True,
    )
    worker.start()


def _echo(worker: Worker) -> str:
    conn = ssh.connect(worker.host, worker.settings)
    try:
        return str(conn.run("echo hello", hide=True, in_stream=False).stdout)
    finally:
        conn.close()


@pytest.mark.sshd
def test_a_replaced_node_s_recycled_address_is_a_new_host(
    worker: Worker, api: FakeTpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node replaced (deleted, then created again) can get its ephemeral address back with a
    new host key: the deleted node's keys leave known_hosts, so the deploy trusts the new host;
    without the node's deletion the same change is still refused as a changed host key."""
    monkeypatch.setattr(tpu_node, "known_hosts_file", lambda: worker.known_hosts)
    provider = tpu_node.TpuNodeProvider()
    created = provider.create(dict(PROPS))
    outs = dict(created.outs or {})
    outs["network_endpoints"] = [
        {"ip_address": "10.0.0.2", "access_config": {"external_ip": worker.host}}
    ]
    assert _echo(worker) == "hello\n"  # the first node's key is pinned
    _new_host_key(worker)
    with pytest.raises(paramiko.BadHostKeyException):  # not replaced: still an error
        _echo(worker)

    provider.delete(created.id, outs)  # Pulumi replaces the node: delete first
    assert _echo(worker) == "hello\n"
    new_key = (worker.base / "ssh_host_ed25519_key.pub").read_text().split()[1]
    assert new_key in worker.known_hosts.read_text()
