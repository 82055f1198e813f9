"""The TPU node resource's provider: what a later `pulumi up` changes, replaces or keeps, and
create/update/read/delete against a fake Cloud TPU API (tests/infra/tpu/test_placement.py's)."""

from __future__ import annotations

import base64
from typing import Any

import dill
import pulumi.dynamic
import pytest

from infra.resources import tpu_node
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
