"""Placing a TPU node: zone failover on stockout or quota, queued resources, adoption, cleanup.

A fake Cloud TPU API refuses zones, keeps queued requests waiting, preempts and comes back;
`GoogleTpuApi` is checked against a fake client with the real tpu_v2 message types.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import tpu_v2

from infra.tpu import api as tpu_api
from infra.tpu import placement as tpu_placement

OWNER = {"app": "gemma4-tpu", "stack": "prod", "run": "r1"}
NODE = {
    "accelerator_type": "v5p-8",
    "runtime_version": "v2-alpha-tpuv5",
    "labels": OWNER,
    "metadata": {"startup-script": "#!/bin/bash\n"},
}
ZONES = ("us-central1-a", "us-east5-a", "europe-west4-b")


def _zone(path: str) -> str:
    return path.split("/locations/")[1].split("/")[0]


class FakeTpu:
    """Cloud TPU as placement sees it. `refuse`: zone -> the exception its creates raise (a
    refused create may leave a half-made node, as the real API can). `queues`: zone -> the
    states a queued request goes through (the last one repeats)."""

    def __init__(
        self,
        refuse: Mapping[str, Exception] | None = None,
        queues: Mapping[str, Sequence[str]] | None = None,
        leave_half_made: bool = False,
        refuse_reads: Mapping[str, Exception] | None = None,
    ):
        self.refuse = dict(refuse or {})
        # zone -> what every call about that zone raises (reads and deletes included), as the
        # API answers for a location it refuses.
        self.refuse_reads = dict(refuse_reads or {})
        self.queues = {z: list(s) for z, s in (queues or {}).items()}
        self.leave_half_made = leave_half_made
        self.nodes: dict[str, dict[str, Any]] = {}
        self.queued: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    def _node(self, name: str, spec: Mapping[str, Any], queued: str | None) -> None:
        self.nodes[name] = {
            **copy.deepcopy(dict(spec)),
            "name": name,
            "state": "READY",
            "network_endpoints": [
                {"ip_address": "10.0.0.2", "access_config": {"external_ip": "203.0.113.9"}}
            ],
            "queued_resource": queued or "",
        }

    def _check_zone(self, path: str) -> None:
        zone = _zone(path)
        if zone in self.refuse_reads:
            self.calls.append(("refused", zone))
            raise self.refuse_reads[zone]

    def get_node(self, name: str) -> dict[str, Any] | None:
        self._check_zone(name)
        return copy.deepcopy(self.nodes.get(name))

    def create_node(self, parent: str, node_id: str, node: Mapping[str, Any]) -> None:
        self.calls.append(("create_node", parent))
        zone = _zone(parent)
        if zone in self.refuse:
            if self.leave_half_made:
                self._node(f"{parent}/nodes/{node_id}", node, None)
                self.nodes[f"{parent}/nodes/{node_id}"]["state"] = "CREATING"
            raise self.refuse[zone]
        self._node(f"{parent}/nodes/{node_id}", node, None)

    def delete_node(self, name: str) -> None:
        self._check_zone(name)
        self.calls.append(("delete_node", name))
        self.nodes.pop(name, None)

    def update_node(self, name: str, node: Mapping[str, Any], fields: Sequence[str]) -> None:
        self.calls.append(("update_node", ",".join(fields)))
        for field in fields:
            self.nodes[name][field] = copy.deepcopy(node[field])

    def create_queued_resource(self, parent: str, queued_id: str, body: Mapping[str, Any]) -> None:
        self.calls.append(("create_queued_resource", parent))
        zone = _zone(parent)
        if zone in self.refuse:
            raise self.refuse[zone]
        self.queued[f"{parent}/queuedResources/{queued_id}"] = {
            "body": copy.deepcopy(dict(body)),
            "states": self.queues.get(zone, ["ACTIVE"]),
        }

    def queued_state(self, name: str) -> str | None:
        queued = self.queued.get(name)
        if queued is None:
            return None
        states = queued["states"]
        state = states.pop(0) if len(states) > 1 else states[0]
        if state == "GONE":  # a deletion that finished
            del self.queued[name]
            return None
        if state == "ACTIVE":
            spec = queued["body"]["tpu"]["node_spec"][0]
            node_name = f"{spec['parent']}/nodes/{spec['node_id']}"
            if node_name not in self.nodes:
                self._node(node_name, spec["node"], name)
        return state

    def get_queued(self, name: str) -> dict[str, Any] | None:
        self._check_zone(name)
        queued = self.queued.get(name)
        if queued is None:
            return None
        return {
            "name": name,
            "tpu": copy.deepcopy(queued["body"]["tpu"]),
            "state": {"state": queued["states"][0]},
        }

    def list_queued(self, parent: str) -> list[dict[str, Any]]:
        self._check_zone(parent)
        listed = [self.get_queued(n) for n in self.queued if n.startswith(parent + "/")]
        return [q for q in listed if q is not None]

    def delete_queued_resource(self, name: str) -> None:
        self._check_zone(name)
        self.calls.append(("delete_queued_resource", name))
        queued = self.queued.pop(name, None)
        if queued is not None:  # force: the node goes with it
            spec = queued["body"]["tpu"]["node_spec"][0]
            self.nodes.pop(f"{spec['parent']}/nodes/{spec['node_id']}", None)


def _request(
    zones: tuple[str, ...] = ZONES, node: Mapping[str, Any] = NODE, **kwargs: Any
) -> tpu_placement.Request:
    return tpu_placement.Request(
        project="p", node_id="gemma4-train", zones=zones, node=node, **kwargs
    )


STOCKOUT = exceptions.ResourceExhausted(
    'There is no more capacity in the zone "us-central1-a"; you can try in another zone'
)
QUOTA = RuntimeError("Quota limit 'TPUV5PPerProjectPerZoneForTPUAPI' has been exceeded")


class Clock:
    """A fake monotonic clock that sleep advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _place(api: FakeTpu, request: tpu_placement.Request, **kwargs: Any):
    said: list[str] = []
    clock = Clock()
    placement = tpu_placement.place(
        api, request, say=said.append, sleep=clock.sleep, clock=lambda: clock.now, **kwargs
    )
    return placement, said, clock


def test_a_stockout_and_a_quota_refusal_move_the_node_to_the_next_zone():
    api = FakeTpu(refuse={"us-central1-a": STOCKOUT, "us-east5-a": QUOTA}, leave_half_made=True)
    placement, said, _ = _place(api, _request())
    assert placement.zone == "europe-west4-b"
    assert placement.node["labels"] == {**OWNER, **tpu_placement.PLACED_BY}
    assert not placement.adopted
    assert tpu_placement.external_ips(placement.node["network_endpoints"]) == ["203.0.113.9"]
    assert [r.split(":")[0] for r in placement.refusals] == ["us-central1-a", "us-east5-a"]
    assert "ResourceExhausted" in placement.refusals[0] and "Quota limit" in placement.refusals[1]
    # The half-made nodes the refused creates left behind are deleted: one slice, one bill.
    assert list(api.nodes) == ["projects/p/locations/europe-west4-b/nodes/gemma4-train"]
    assert [c[0] for c in api.calls].count("create_node") == 3
    assert said[-1] == "europe-west4-b: gemma4-train placed after 2 zone(s) refused"


def test_every_zone_refusing_names_each_zone_and_what_to_do():
    api = FakeTpu(refuse={z: STOCKOUT for z in ZONES})
    with pytest.raises(tpu_placement.NoCapacity) as info:
        _place(api, _request())
    message = str(info.value)
    assert message.startswith("TPU node gemma4-train: no zone could take it (us-central1-a: ")
    assert all(f"{z}: ResourceExhausted" in message for z in ZONES)
    assert "add zones to zoneFallbacks, use provisioning: queued" in message
    assert api.nodes == {}


def test_an_error_that_is_not_about_capacity_stops_at_the_first_zone():
    api = FakeTpu(refuse={"us-central1-a": exceptions.InvalidArgument("bad runtime version")})
    with pytest.raises(exceptions.InvalidArgument):
        _place(api, _request())
    assert api.calls == [("create_node", "projects/p/locations/us-central1-a")]


def test_the_stacks_node_is_kept_where_an_earlier_failover_put_it():
    api = FakeTpu()
    api._node(
        "projects/p/locations/us-east5-a/nodes/gemma4-train", tpu_placement.marked(NODE), None
    )
    placement, said, _ = _place(api, _request())
    assert (placement.zone, placement.adopted) == ("us-east5-a", True)
    assert not any(c[0].startswith("create") for c in api.calls)
    assert said == ["us-east5-a: gemma4-train exists (READY); keeping it"]


def test_a_node_the_earlier_v2vm_resource_made_is_not_adopted():
    """The upgrade from gcp.tpu.V2Vm: the old resource deletes its node at the end of the same
    `pulumi up`, so adopting it would leave the stack pointing at nothing. One line says how to
    keep the node or clear it first; nothing is created or deleted."""
    api = FakeTpu()
    name = "projects/p/locations/us-central1-a/nodes/gemma4-train"
    api._node(name, NODE, None)  # this stack's labels, no placed-by label
    with pytest.raises(tpu_placement.PlacementError) as info:
        _place(api, _request())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "TPU node gemma4-train in us-central1-a is this stack's but has no label "
        "placed-by=gemma4-tpu-node: the stack's earlier gcp.tpu.V2Vm resource made it"
    )
    assert (
        "gcloud compute tpus tpu-vm update gemma4-train --zone us-central1-a --update-labels "
        "placed-by=gemma4-tpu-node" in message
    )
    assert api.calls == [] and name in api.nodes

    # Labelled as the message says (after `pulumi state delete` of the V2Vm): adopted.
    api.nodes[name]["labels"] = tpu_placement.marked(NODE)["labels"]
    placement, _, _ = _place(api, _request())
    assert (placement.zone, placement.adopted) == ("us-central1-a", True)


def test_updates_keep_the_placed_by_label():
    api = FakeTpu()
    placement, _, _ = _place(api, _request())
    name = _request().node_name(placement.zone)
    tpu_placement.update(api, name, {**NODE, "labels": {**OWNER, "run": "r2"}}, ["labels"])
    assert api.nodes[name]["labels"] == {**OWNER, "run": "r2", **tpu_placement.PLACED_BY}


def test_a_preempted_node_is_deleted_and_created_again_in_the_first_zone():
    api = FakeTpu()
    name = "projects/p/locations/us-east5-a/nodes/gemma4-train"
    api._node(name, NODE, None)
    api.nodes[name]["state"] = "PREEMPTED"
    placement, said, _ = _place(api, _request())
    assert placement.zone == "us-central1-a" and not placement.adopted
    assert ("delete_node", name) in api.calls
    assert said[0] == "us-east5-a: gemma4-train is PREEMPTED; deleting it to create a new one"


def test_a_node_of_that_name_that_is_not_the_stacks_is_left_alone():
    api = FakeTpu()
    api._node(
        "projects/p/locations/us-central1-a/nodes/gemma4-train",
        {**NODE, "labels": {"app": "someone-else"}},
        None,
    )
    with pytest.raises(tpu_placement.PlacementError) as info:
        _place(api, _request())
    assert str(info.value) == (
        "TPU node gemma4-train already exists in us-central1-a and is not this stack's "
        "(labels app='someone-else', stack=None): set another nodeName or delete that node"
    )
    assert not any(c[0].startswith(("create", "delete")) for c in api.calls)


def test_a_queued_request_waits_with_progress_lines_then_fails_over_when_the_queue_gives_up():
    api = FakeTpu(
        queues={
            "us-central1-a": ["ACCEPTED", "WAITING_FOR_RESOURCES", "FAILED"],
            "us-east5-a": ["ACCEPTED"]
            + ["WAITING_FOR_RESOURCES"] * 30
            + ["PROVISIONING", "ACTIVE"],
        }
    )
    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=6 * 3600))
    placement, said, clock = _place(api, request, poll_s=60, report_every_s=600)
    assert placement.zone == "us-east5-a"
    assert (
        placement.queued_resource == "projects/p/locations/us-east5-a/queuedResources/gemma4-train"
    )
    assert placement.refusals == (
        "us-central1-a: QueueGaveUp: queued resource FAILED: no spot capacity in us-central1-a",
    )
    # The failed request is deleted before the next zone is asked.
    assert (
        "delete_queued_resource",
        "projects/p/locations/us-central1-a/queuedResources/gemma4-train",
    ) in api.calls
    # A line per state change, and one every 10 minutes while the state stays the same.
    east = [line for line in said if line.startswith("us-east5-a: queued resource")]
    assert east[0] == (
        "us-east5-a: queued resource gemma4-train ACCEPTED for 0m (waits up to 6h00m for spot "
        "capacity)"
    )
    assert sum("WAITING_FOR_RESOURCES" in line for line in east) == 3  # at 1, 11 and 21 minutes
    assert east[-1].startswith("us-east5-a: queued resource gemma4-train is ACTIVE after 3")
    assert set(clock.sleeps) == {60}
    # The request asked for spot capacity with the node's own spec and the validity window.
    body = tpu_placement.queued_body(request, "us-east5-a")
    assert body["spot"] == {} and "guaranteed" not in body
    assert body["queueing_policy"] == {"valid_until_duration": {"seconds": 6 * 3600}}
    assert body["tpu"]["node_spec"][0]["node"] == tpu_placement.marked(NODE)


def test_a_queue_that_never_moves_is_given_up_after_its_validity_window():
    api = FakeTpu(queues={"us-central1-a": ["WAITING_FOR_RESOURCES"]})
    request = _request(
        zones=("us-central1-a", "us-east5-a"),
        queue=tpu_placement.Queue(spot=False, valid_for_s=3600),
    )
    placement, _, clock = _place(api, request, poll_s=60)
    assert placement.zone == "us-east5-a"
    assert "no on-demand capacity in us-central1-a within 1h00m" in placement.refusals[0]
    assert 3600 < clock.now < 3600 + 600 + 60
    assert tpu_placement.queued_body(request, "us-east5-a")["guaranteed"] == {}


def test_remove_deletes_the_queued_resource_with_its_node():
    api = FakeTpu()
    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=3600))
    placement, _, _ = _place(api, request)
    tpu_placement.remove(api, request.node_name(placement.zone), placement.queued_resource)
    assert api.nodes == {} and api.queued == {}
    tpu_placement.remove(api, request.node_name(placement.zone), placement.queued_resource)


def test_only_description_labels_metadata_and_tags_change_in_place():
    api = FakeTpu()
    placement, _, _ = _place(api, _request())
    name = _request().node_name(placement.zone)
    tpu_placement.update(api, name, {**NODE, "metadata": {"startup-script": "new"}}, ["metadata"])
    assert api.nodes[name]["metadata"] == {"startup-script": "new"}
    with pytest.raises(ValueError, match="cannot change in place"):
        tpu_placement.update(api, name, NODE, ["accelerator_type"])


# The Cloud TPU API's refusals as google-api-core raises them (the create call's own status, or
# `exceptions.from_grpc_status(code, message)` from the operation's result()); messages as seen
# in public reports (tpu_placement.NOT_HERE_WORDS cites where).
LOCATION_REFUSED = exceptions.PermissionDenied(
    "Location europe-west1-b is not found or access is unauthorized."
)
NOT_OFFERED = exceptions.from_grpc_status(
    3,
    "Cloud TPU received a bad request. The requested accelerator configuration for accelerator "
    'type, "v5p-8", could not be found in the zonal accelerator configurations for '
    '"us-central1-b".; the accelerator v5p-8 was not found in zone us-central1-b [EID: 0x5be9]',
)
PREEMPTED_WHILE_CREATING = exceptions.from_grpc_status(
    3,
    "Cloud TPU received a bad request. update is not supported while in state PREEMPTED "
    "[EID: 0x7301]",
)
NO_RESERVATION = exceptions.from_grpc_status(
    9,
    "Insufficient reserved capacity. Contact customer support to increase your reservation.",
)
QUOTA_429 = exceptions.ResourceExhausted(
    "Quota 'TPUV5PPerProjectPerZoneForTPUAPI' exhausted. Limit 8 in zone us-east5-a"
)
INTERNAL = exceptions.from_grpc_status(13, "TPU operation failed: an internal error")
UNAVAILABLE = exceptions.ServiceUnavailable("The service is currently unavailable.")
DEADLINE = exceptions.DeadlineExceeded("Deadline Exceeded")


def test_each_real_refusal_shape_is_classified_per_zone():
    elsewhere = [
        STOCKOUT,
        QUOTA,
        QUOTA_429,
        exceptions.TooManyRequests("slow down"),
        LOCATION_REFUSED,
        NOT_OFFERED,
        PREEMPTED_WHILE_CREATING,
        NO_RESERVATION,
        tpu_placement.QueueGaveUp("queued resource FAILED"),
    ]
    for exc in elsewhere:
        assert tpu_placement.classify(exc) == tpu_placement.ELSEWHERE, exc
    for exc in (INTERNAL, UNAVAILABLE, DEADLINE, exceptions.BadGateway("bad gateway")):
        assert tpu_placement.classify(exc) == tpu_placement.TRANSIENT, exc
    fatal = [
        exceptions.PermissionDenied("Permission 'tpu.nodes.create' denied on resource"),
        # "insufficient" in a permission message is not about capacity.
        exceptions.PermissionDenied("Insufficient permissions: tpu.nodes.create"),
        exceptions.InvalidArgument("Invalid runtime version v2-alpha-tpuv9"),
        exceptions.NotFound("Network 'projects/p/global/networks/nope' not found"),
        exceptions.Unauthenticated("Request had invalid authentication credentials."),
        exceptions.AlreadyExists("Resource already exists"),
        exceptions.MethodNotImplemented("not implemented"),
        RuntimeError("something else broke"),
    ]
    for exc in fatal:
        assert tpu_placement.classify(exc) == tpu_placement.FATAL, exc


def test_zone_fallback_moves_past_every_not_here_refusal():
    zones = ("us-central1-a", "us-central1-b", "europe-west1-b", "us-east5-a", "us-east5-b")
    api = FakeTpu(
        refuse={
            "us-central1-a": PREEMPTED_WHILE_CREATING,
            "us-central1-b": NOT_OFFERED,
            "europe-west1-b": LOCATION_REFUSED,
            "us-east5-a": NO_RESERVATION,
        },
        leave_half_made=True,
    )
    placement, said, _ = _place(api, _request(zones=zones))
    assert placement.zone == "us-east5-b"
    assert [r.split(":")[0] for r in placement.refusals] == list(zones[:4])
    assert list(api.nodes) == ["projects/p/locations/us-east5-b/nodes/gemma4-train"]
    assert "us-central1-b: cannot place gemma4-train here (InvalidArgument: " in said[1]


def test_a_transient_failure_is_retried_in_the_same_zone_with_a_bounded_backoff():
    class Flaky(FakeTpu):
        def __init__(self, failures: list[Exception]):
            super().__init__(leave_half_made=True)
            self.failures = failures

        def create_node(self, parent: str, node_id: str, node: Mapping[str, Any]) -> None:
            if self.failures:
                self.refuse[_zone(parent)] = self.failures.pop(0)
            else:
                self.refuse.pop(_zone(parent), None)
            super().create_node(parent, node_id, node)

    api = Flaky([UNAVAILABLE, INTERNAL])
    placement, said, clock = _place(api, _request())
    assert placement.zone == "us-central1-a" and placement.refusals == ()
    assert clock.sleeps == list(tpu_placement.TRANSIENT_BACKOFF_S)
    assert said[0].startswith("us-central1-a: the TPU API failed (ServiceUnavailable: ")
    assert said[0].endswith("trying again in 30 s (1/3)")
    assert list(api.nodes) == ["projects/p/locations/us-central1-a/nodes/gemma4-train"]

    # A zone whose API keeps failing is given up after TRANSIENT_TRIES, and the next one asked.
    api = Flaky([DEADLINE] * tpu_placement.TRANSIENT_TRIES)
    placement, _, clock = _place(api, _request())
    assert placement.zone == "us-east5-a"
    assert placement.refusals[0].endswith("(failed 3 times)")
    assert sum(clock.sleeps) == sum(tpu_placement.TRANSIENT_BACKOFF_S)


def test_leftover_queued_resources_are_adopted_or_deleted():
    """An interrupted `up` (or a refresh) leaves queued resources under the node's id that the
    state does not know: the next create would fail AlreadyExists, and a forgotten queue can
    start a billed TPU later."""
    queue = tpu_placement.Queue(spot=True, valid_for_s=3600)
    request = _request(queue=queue)
    api = FakeTpu(queues={"us-east5-a": ["WAITING_FOR_RESOURCES", "ACTIVE"]})
    failed = request.queued_name("us-central1-a")
    waiting = request.queued_name("us-east5-a")
    api.create_queued_resource(request.parent("us-central1-a"), "gemma4-train", {})
    api.queued[failed] = {
        "body": tpu_placement.queued_body(request, "us-central1-a"),
        "states": ["FAILED"],
    }
    api.queued[waiting] = {
        "body": tpu_placement.queued_body(request, "us-east5-a"),
        "states": ["WAITING_FOR_RESOURCES", "ACTIVE"],
    }
    api.calls.clear()
    placement, said, _ = _place(api, request)
    # The waiting one is adopted (not created again: no AlreadyExists), the failed one deleted.
    assert placement.zone == "us-east5-a" and placement.queued_resource == waiting
    assert ("delete_queued_resource", failed) in api.calls
    assert not any(c[0] == "create_queued_resource" for c in api.calls)
    assert said[0] == (
        "us-central1-a: deleting queued resource gemma4-train (FAILED) left by an earlier up"
    )
    assert "from an earlier up is WAITING_FOR_RESOURCES; waiting on it" in said[1]
    assert list(api.queued) == [waiting]

    # A direct (not queued) request deletes any queued resource left under its id.
    api = FakeTpu()
    api.queued[waiting] = {
        "body": tpu_placement.queued_body(request, "us-east5-a"),
        "states": ["WAITING_FOR_RESOURCES"],
    }
    placement, _, _ = _place(api, _request())
    assert placement.zone == "us-central1-a" and api.queued == {}

    # Someone else's queued resource under that name is not touched.
    api = FakeTpu()
    foreign = {**NODE, "labels": {"app": "other"}}
    api.queued[waiting] = {
        "body": tpu_placement.queued_body(_request(queue=queue, node=foreign), "us-east5-a"),
        "states": ["WAITING_FOR_RESOURCES"],
    }
    with pytest.raises(tpu_placement.PlacementError, match="queued resource gemma4-train"):
        _place(api, request)
    assert waiting in api.queued


def test_a_second_node_left_by_an_interrupted_up_is_deleted_and_the_first_kept():
    api = FakeTpu()
    for zone in ("us-east5-a", "europe-west4-b"):
        api._node(_request().node_name(zone), tpu_placement.marked(NODE), None)
    placement, said, _ = _place(api, _request())
    assert (placement.zone, placement.adopted) == ("us-east5-a", True)
    assert list(api.nodes) == ["projects/p/locations/us-east5-a/nodes/gemma4-train"]
    assert said[-1].startswith("europe-west4-b: gemma4-train also exists here (READY)")


# ---------------------------------------------------------------------------------------------
# The adapter onto google.cloud.tpu_v2, with the real message types and a fake client


class _Op:
    def __init__(self, error: Exception | None = None):
        self.error = error

    def result(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error


class FakeClient:
    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.node: tpu_v2.Node | None = None

    def create_node(self, *, parent: str, node_id: str, node: tpu_v2.Node) -> _Op:
        self.requests.append(("create_node", node))
        return _Op(STOCKOUT if parent.endswith("us-central1-a") else None)

    def get_node(self, *, name: str) -> tpu_v2.Node:
        if self.node is None:
            raise exceptions.NotFound(name)
        return self.node

    def create_queued_resource(
        self, *, parent: str, queued_resource_id: str, queued_resource: tpu_v2.QueuedResource
    ) -> _Op:
        self.requests.append(("create_queued_resource", queued_resource))
        return _Op()

    def get_queued_resource(self, *, name: str) -> tpu_v2.QueuedResource:
        return tpu_v2.QueuedResource(state={"state": "WAITING_FOR_RESOURCES"})

    def list_queued_resources(self, *, parent: str) -> list[tpu_v2.QueuedResource]:
        return [
            tpu_v2.QueuedResource(
                name=f"{parent}/queuedResources/n",
                tpu={"node_spec": [{"node_id": "n", "node": {"labels": OWNER}}]},
                state={"state": "DELETING"},
            )
        ]

    def delete_queued_resource(self, *, request: tpu_v2.DeleteQueuedResourceRequest) -> _Op:
        self.requests.append(("delete_queued_resource", request))
        return _Op(exceptions.NotFound("gone"))

    def update_node(self, *, request: tpu_v2.UpdateNodeRequest) -> _Op:
        self.requests.append(("update_node", (request.node, list(request.update_mask.paths))))
        return _Op()


def test_the_google_adapter_sends_real_messages_and_reads_nodes_back_as_dicts():
    client = FakeClient()
    api = tpu_api.GoogleTpuApi(client)
    spec = {
        **NODE,
        "scheduling_config": {"spot": True},
        "service_account": {"email": "sa@p.iam.gserviceaccount.com", "scope": ["x"]},
        "network_config": {"network": "default", "enable_external_ips": True},
        "tags": ["gemma4-ssh"],
    }
    with pytest.raises(exceptions.ResourceExhausted):
        api.create_node("projects/p/locations/us-central1-a", "n", spec)
    api.create_node("projects/p/locations/us-east5-a", "n", spec)
    sent = client.requests[-1][1]
    assert isinstance(sent, tpu_v2.Node)
    assert sent.scheduling_config.spot and sent.metadata["startup-script"] == "#!/bin/bash\n"
    assert list(sent.service_account.scope) == ["x"] and sent.network_config.enable_external_ips

    assert api.get_node("projects/p/locations/us-east5-a/nodes/n") is None  # NotFound -> None
    client.node = tpu_v2.Node(
        {
            **spec,
            "state": "READY",
            "network_endpoints": [
                {"ip_address": "10.0.0.2", "access_config": {"external_ip": "203.0.113.9"}}
            ],
        }
    )
    node = api.get_node("projects/p/locations/us-east5-a/nodes/n")
    assert node is not None and node["state"] == "READY" and node["labels"] == OWNER
    assert tpu_placement.external_ips(node["network_endpoints"]) == ["203.0.113.9"]
    assert tpu_placement.internal_ips(node["network_endpoints"]) == ["10.0.0.2"]

    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=7200))
    api.create_queued_resource(
        request.parent("us-east5-a"), "n", tpu_placement.queued_body(request, "us-east5-a")
    )
    queued = client.requests[-1][1]
    assert isinstance(queued, tpu_v2.QueuedResource) and "spot" in queued
    assert queued.queueing_policy.valid_until_duration.total_seconds() == 7200
    assert queued.tpu.node_spec[0].node.accelerator_type == "v5p-8"
    assert api.queued_state("q") == "WAITING_FOR_RESOURCES"
    api.delete_queued_resource("q")  # already gone is fine
    (listed,) = api.list_queued("projects/p/locations/us-east5-a")
    assert listed["name"] == "projects/p/locations/us-east5-a/queuedResources/n"
    assert tpu_placement.queued_node_labels(listed) == OWNER
    assert tpu_placement.queued_state_of(listed) == "DELETING"
    assert client.requests[-1][1].force is True

    api.update_node("projects/p/locations/us-east5-a/nodes/n", spec, ["metadata"])
    body, paths = client.requests[-1][1]
    assert paths == ["metadata"] and body.name.endswith("/nodes/n") and not body.accelerator_type


def test_a_transient_read_while_queued_keeps_the_queue_and_its_place():
    class FlakyRead(FakeTpu):
        def __init__(self) -> None:
            super().__init__(queues={"us-central1-a": ["WAITING_FOR_RESOURCES", "ACTIVE"]})
            self.failures = [UNAVAILABLE, DEADLINE]

        def queued_state(self, name: str) -> str | None:
            if self.failures:
                raise self.failures.pop(0)
            return super().queued_state(name)

    api = FlakyRead()
    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=3600))
    placement, said, _ = _place(api, request, poll_s=60)
    assert placement.zone == "us-central1-a" and placement.refusals == ()
    assert [c[0] for c in api.calls].count("create_queued_resource") == 1
    assert not any(c[0] == "delete_queued_resource" for c in api.calls)
    assert said[0].startswith("us-central1-a: reading queued resource gemma4-train failed")


# ---------------------------------------------------------------------------------------------
# A zone whose reads the API refuses (issue 33)

LOCATION_READ_REFUSED = exceptions.PermissionDenied(
    "Location us-central1-a is not found or access is unauthorized."
)


@pytest.mark.parametrize(
    "refusal",
    [
        LOCATION_READ_REFUSED,
        # The same answer over HTTP: google-api-core's Forbidden (PermissionDenied's parent).
        exceptions.Forbidden("Location us-central1-a is not found or access is unauthorized."),
    ],
)
def test_a_zone_that_refuses_reads_holds_nothing_and_placement_goes_on(refusal):
    """Placement reads every listed zone before it creates anything; an organisation's location
    policy (or a zone without Cloud TPU) refuses those reads with a 403, which must not stop
    every `up`: one line names the zone and why, and the next zone takes the node."""
    api = FakeTpu(refuse_reads={"us-central1-a": refusal})
    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=3600))
    placement, said, _ = _place(api, request)
    assert placement.zone == "us-east5-a"
    refused = [line for line in said if line.startswith("us-central1-a:")]
    assert refused == [
        "us-central1-a: the TPU API refuses to read this zone "
        f"({type(refusal).__name__}: 403 Location us-central1-a is not found or access is "
        "unauthorized.); nothing of this stack's can be there, going on without it"
    ]
    # Asked once, never created in: its creates are refused the same way.
    assert api.calls.count(("refused", "us-central1-a")) == 1
    assert not any(c[1].endswith("us-central1-a") for c in api.calls if c[0].startswith("create"))
    assert placement.refusals[0].startswith("us-central1-a: ")


def test_a_refused_permission_that_is_not_about_the_zone_still_stops_placement():
    denied = exceptions.PermissionDenied("Permission 'tpu.nodes.get' denied on resource")
    api = FakeTpu(refuse_reads={"us-central1-a": denied})
    with pytest.raises(exceptions.PermissionDenied):
        _place(api, _request())
    assert not any(c[0].startswith("create") for c in api.calls)


def test_a_deleting_queue_under_the_name_is_waited_on_then_placement_queues_anew():
    """A queued resource being deleted keeps its name taken: creating under it would fail
    AlreadyExists, deleting it again is refused. Placement waits, saying so, then queues."""
    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=3600))
    api = FakeTpu()
    name = request.queued_name("us-central1-a")
    api.queued[name] = {
        "body": tpu_placement.queued_body(request, "us-central1-a"),
        "states": ["DELETING", "DELETING", "GONE"],
    }
    placement, said, clock = _place(api, request, poll_s=30)
    assert placement.zone == "us-central1-a" and placement.queued_resource == name
    assert not any(c == ("delete_queued_resource", name) for c in api.calls)
    assert said[0] == (
        "us-central1-a: queued resource gemma4-train is DELETING; waiting for it to go "
        "(0m of at most 30m)"
    )
    assert said[2] == "us-central1-a: queued resource gemma4-train is gone after 1m"
    assert clock.sleeps[:2] == [30, 30]


def test_a_queue_that_stays_deleting_is_given_up_after_a_bounded_wait():
    request = _request(queue=tpu_placement.Queue(spot=True, valid_for_s=3600))
    api = FakeTpu()
    name = request.queued_name("us-east5-a")
    api.queued[name] = {
        "body": tpu_placement.queued_body(request, "us-east5-a"),
        "states": ["DELETING"],
    }
    with pytest.raises(tpu_placement.PlacementError) as info:
        _place(api, request, poll_s=300)
    assert str(info.value).startswith(
        "queued resource gemma4-train in us-east5-a is still DELETING after 35m"
    )
    assert not any(c[0].startswith("create") for c in api.calls)


def test_a_deleting_node_is_waited_on_not_kept_then_created_anew():
    """A node another caller is deleting (a recovery, the console) is going: keeping it would
    hand `up` a node about to vanish, and its name stays taken until it has. Placement waits for
    it, saying so, then creates the node in the first zone."""
    api = FakeTpu()
    name = "projects/p/locations/us-central1-a/nodes/gemma4-train"
    api._node(name, NODE, None)
    api.nodes[name]["state"] = "DELETING"
    reads = {"left": 4}  # the look, then two polls DELETING, then gone
    get_node = api.get_node

    def deleting_get_node(path: str) -> dict[str, Any] | None:
        if path == name and name in api.nodes and api.nodes[name]["state"] == "DELETING":
            reads["left"] -= 1
            if reads["left"] == 0:
                del api.nodes[name]
        return get_node(path)

    api.get_node = deleting_get_node  # type: ignore[method-assign]
    placement, said, clock = _place(api, _request(), poll_s=30)
    assert placement.zone == "us-central1-a" and not placement.adopted
    assert placement.node["state"] == "READY"
    assert not any(c == ("delete_node", name) for c in api.calls)
    assert said[0] == (
        "us-central1-a: TPU node gemma4-train is DELETING; waiting for it to go (0m of at most 30m)"
    )
    assert "us-central1-a: TPU node gemma4-train is gone after 0m" in said
    # Every NODE_GONE_POLL_S, whatever the queue's poll: another caller may make a new node.
    assert clock.sleeps[:2] == [10, 10]


def test_a_deleting_node_replaced_by_another_callers_new_one_ends_the_wait_and_is_kept():
    """The recovery controller deletes the preempted node and creates a new one under the name
    while an operator's `ops recover` waits for the old one to go: the wait ends at the new
    node (not after 30 minutes of waiting for a node that will not go), which is kept."""
    api = FakeTpu()
    name = "projects/p/locations/us-central1-a/nodes/gemma4-train"
    api._node(name, {**NODE, "labels": {**OWNER, **tpu_placement.PLACED_BY}}, None)
    api.nodes[name]["state"] = "DELETING"
    get_node = api.get_node
    reads = {"n": 0}

    def recreated_get_node(path: str) -> dict[str, Any] | None:
        reads["n"] += 1
        if path == name and reads["n"] == 3:  # the look, one poll DELETING, then the new one
            api.nodes[name]["state"] = "CREATING"
        return get_node(path)

    api.get_node = recreated_get_node  # type: ignore[method-assign]
    placement, said, clock = _place(api, _request(), poll_s=60)
    assert placement.zone == "us-central1-a" and placement.adopted
    assert not any(c[0] in ("create_node", "delete_node") for c in api.calls), api.calls
    assert (
        "us-central1-a: TPU node gemma4-train is CREATING after 0m: another caller made a new one "
        "under the name meanwhile"
    ) in said
    assert "us-central1-a: gemma4-train exists (CREATING); keeping it" in said
    assert clock.sleeps == [10]


def test_a_node_that_stays_deleting_is_given_up_after_a_bounded_wait():
    api = FakeTpu()
    name = "projects/p/locations/us-central1-a/nodes/gemma4-train"
    api._node(name, NODE, None)
    api.nodes[name]["state"] = "DELETING"
    with pytest.raises(tpu_placement.PlacementError) as info:
        _place(api, _request(), poll_s=300)
    assert str(info.value).startswith(
        "TPU node gemma4-train in us-central1-a is still DELETING after 30m; check it with "
        "`gcloud compute tpus tpu-vm describe gemma4-train --zone us-central1-a`"
    )
    assert not any(c[0].startswith("create") for c in api.calls)
