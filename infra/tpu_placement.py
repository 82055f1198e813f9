"""Getting a TPU node placed: the first zone of an ordered list with capacity, either directly
(create the node) or through a queued resource (Cloud TPU's own waiting line for capacity).

Why a zone list: v5p and v6e capacity is scarce and moves; a create that fails for capacity or
quota in one zone is tried in the next instead of failing `pulumi up`. What was placed is
adopted on a later call (an existing node of this stack, found in any listed zone, is kept where
it is), so a lost or refreshed state never creates a second slice.

No Pulumi here: the dynamic provider in infra/components/tpu_node.py calls `place`, `remove`,
`read` and `update` during `pulumi up`/`destroy`/`refresh`; the tests call them with a fake API
that refuses zones, preempts nodes and comes back. The adapter onto google.cloud.tpu_v2 is
infra.tpu_api.GoogleTpuApi (node specs travel as plain dicts with the API's field names).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from workloads.errors import exception_line

# Words the TPU API uses when a zone cannot hold the slice now (stockout or quota); anything
# else (a bad runtime version, a permission) fails the same way in every zone and is raised.
CAPACITY_WORDS = (
    "capacity",
    "quota",
    "stockout",
    "resource_exhausted",
    "resources are exhausted",
    "insufficient",
)
# A queued resource in these states still waits for (or is getting) its capacity.
QUEUE_WAITING = (
    "STATE_UNSPECIFIED",
    "CREATING",
    "ACCEPTED",
    "WAITING_FOR_RESOURCES",
    "PROVISIONING",
)
# The queue gave up (validity window over, capacity withdrawn) or the spot slice was taken back.
QUEUE_LOST = ("FAILED", "SUSPENDING", "SUSPENDED")
# A node in these states will not run again: delete it and create a new one.
NODE_GONE = ("PREEMPTED", "TERMINATED")
# Node fields `update` changes in place (the API's update mask); any other change replaces it.
UPDATABLE = ("description", "labels", "metadata", "tags")
# Labels that say a node belongs to this stack (an existing node without them is not adopted).
OWNER_LABELS = ("app", "stack")
# The label placement puts on every node it creates or updates. A node of this stack without it
# was made by the stack's earlier gcp.tpu.V2Vm resource, which deletes it again at the end of the
# same `pulumi up`: adopting it would leave the stack pointing at a node that is gone.
PLACED_BY = {"placed-by": "gemma4-tpu-node"}


class PlacementError(Exception):
    """The node cannot be placed; the message says why and what to change."""


class NoCapacity(PlacementError):
    """Every zone refused for capacity or quota; `refusals` holds one line per zone."""

    def __init__(self, node_id: str, refusals: Sequence[str]):
        self.refusals = list(refusals)
        super().__init__(
            f"TPU node {node_id}: no zone had capacity ({'; '.join(self.refusals)}); add zones "
            "to zoneFallbacks, use provisioning: queued to wait for capacity, or retry later"
        )


class PlacementApi(Protocol):
    """The calls placement makes; infra.tpu_api.GoogleTpuApi is the real one, the tests' fake
    another.
    Names are full resource paths; the create and delete calls return once the API's
    operation finished (and raise what it failed with); a delete of what is gone already
    succeeds."""

    def get_node(self, name: str) -> dict[str, Any] | None: ...
    def create_node(self, parent: str, node_id: str, node: Mapping[str, Any]) -> None: ...
    def delete_node(self, name: str) -> None: ...
    def update_node(self, name: str, node: Mapping[str, Any], fields: Sequence[str]) -> None: ...
    def create_queued_resource(
        self, parent: str, queued_id: str, body: Mapping[str, Any]
    ) -> None: ...
    def queued_state(self, name: str) -> str | None: ...
    def delete_queued_resource(self, name: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Queue:
    """A queued request: what capacity it waits for and how long, per zone."""

    spot: bool
    valid_for_s: int


@dataclasses.dataclass(frozen=True)
class Request:
    """One node to place: its id, the zones to try in order, and its spec (API field names)."""

    project: str
    node_id: str
    zones: tuple[str, ...]
    node: Mapping[str, Any]
    queue: Queue | None = None

    def parent(self, zone: str) -> str:
        return f"projects/{self.project}/locations/{zone}"

    def node_name(self, zone: str) -> str:
        return f"{self.parent(zone)}/nodes/{self.node_id}"

    def queued_name(self, zone: str) -> str:
        return f"{self.parent(zone)}/queuedResources/{self.node_id}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the node runs and what the API says about it."""

    zone: str
    node: Mapping[str, Any]
    queued_resource: str | None
    refusals: tuple[str, ...] = ()
    adopted: bool = False


Say = Callable[[str], None]


def is_capacity_error(exc: BaseException) -> bool:
    """Whether a create failed because the zone has no room now (try another zone)."""
    try:
        from google.api_core import exceptions  # lazy: only the real client raises these

        if isinstance(exc, exceptions.ResourceExhausted | exceptions.TooManyRequests):
            return True
        # Refusals that would repeat in every zone, whatever their text says.
        if isinstance(
            exc,
            exceptions.PermissionDenied
            | exceptions.Unauthenticated
            | exceptions.InvalidArgument
            | exceptions.NotFound,
        ):
            return False
    except ImportError:  # pragma: no cover - google-api-core is a declared dependency
        pass
    text = str(exc).lower()
    return any(word in text for word in CAPACITY_WORDS)


def _owned(node: Mapping[str, Any], owner: Mapping[str, str]) -> bool:
    labels = node.get("labels") or {}
    return all(labels.get(k) == owner.get(k) for k in OWNER_LABELS)


def marked(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node spec with PLACED_BY among its labels (what create and update send)."""
    return {**node, "labels": {**(node.get("labels") or {}), **PLACED_BY}}


def _placed_by_us(node: Mapping[str, Any]) -> bool:
    labels = node.get("labels") or {}
    return all(labels.get(k) == v for k, v in PLACED_BY.items())


def _owner_of(request: Request) -> dict[str, str]:
    labels = request.node.get("labels") or {}
    return {k: str(labels.get(k, "")) for k in OWNER_LABELS}


def find_existing(api: PlacementApi, request: Request, say: Say) -> Placement | None:
    """The node this stack already has in one of the zones (adopted as it is), or None.
    A preempted or terminated one is deleted on the way: it will not run again.

    Raises:
        PlacementError: a node of that name exists there and belongs to something else.
    """
    owner = _owner_of(request)
    for zone in request.zones:
        node = api.get_node(request.node_name(zone))
        if node is None:
            continue
        if not _owned(node, owner):
            labels = node.get("labels") or {}
            raise PlacementError(
                f"TPU node {request.node_id} already exists in {zone} and is not this stack's "
                f"(labels app={labels.get('app')!r}, stack={labels.get('stack')!r}): set another "
                "nodeName or delete that node"
            )
        state = str(node.get("state") or "STATE_UNSPECIFIED")
        queued = node.get("queued_resource") or None
        if state in NODE_GONE:
            say(f"{zone}: {request.node_id} is {state}; deleting it to create a new one")
            remove(api, request.node_name(zone), queued)
            continue
        if not _placed_by_us(node):
            (key, value), node_id = next(iter(PLACED_BY.items())), request.node_id
            raise PlacementError(
                f"TPU node {node_id} in {zone} is this stack's but has no label {key}={value}: "
                "the stack's earlier gcp.tpu.V2Vm resource made it and would delete it at the end "
                "of this `pulumi up`. To keep it: `pulumi state delete --target-dependents "
                f"'<URN of the V2Vm>'`, then `gcloud compute tpus tpu-vm update {node_id} "
                f"--zone {zone} --update-labels {key}={value}`; or, between runs, delete it first: "
                "`pulumi destroy --target '<URN of the V2Vm>' --target-dependents`"
            )
        say(f"{zone}: {request.node_id} exists ({state}); keeping it")
        return Placement(zone, node, queued, adopted=True)
    return None


def place(
    api: PlacementApi,
    request: Request,
    *,
    say: Say,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 60.0,
    report_every_s: float = 600.0,
) -> Placement:
    """Places the node: keeps the stack's existing one, else creates it in the first zone that
    has capacity (a queued request waits up to its validity window in each zone).

    Raises:
        NoCapacity: every zone refused for capacity or quota (each reason in the message).
        PlacementError: a foreign node holds the name.
        Exception: any other API failure (bad spec, permissions), as the API raised it.
    """
    existing = find_existing(api, request, say)
    if existing is not None:
        return existing
    refusals: list[str] = []
    for zone in request.zones:
        try:
            if request.queue is None:
                api.create_node(request.parent(zone), request.node_id, marked(request.node))
                queued = None
            else:
                _queue_in(api, request, zone, say, sleep, clock, poll_s, report_every_s)
                queued = request.queued_name(zone)
        except Exception as exc:
            if not (isinstance(exc, QueueGaveUp) or is_capacity_error(exc)):
                raise
            reason = exception_line(exc)
            refusals.append(f"{zone}: {reason}")
            say(f"{zone}: no capacity for {request.node_id} ({reason})")
            # A refused create can leave a half-made node or a dead queued resource behind.
            remove(
                api, request.node_name(zone), request.queued_name(zone) if request.queue else None
            )
            continue
        node = api.get_node(request.node_name(zone))
        if node is None:
            raise PlacementError(
                f"TPU node {request.node_id}: created in {zone} but the API does not return it"
            )
        if refusals:
            say(f"{zone}: {request.node_id} placed after {len(refusals)} zone(s) refused")
        return Placement(zone, node, queued, tuple(refusals))
    raise NoCapacity(request.node_id, refusals)


class QueueGaveUp(Exception):
    """The queued resource left the queue without capacity (its message says capacity, so
    `place` moves on to the next zone)."""


def _queue_in(
    api: PlacementApi,
    request: Request,
    zone: str,
    say: Say,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    poll_s: float,
    report_every_s: float,
) -> None:
    """Queues the node in `zone` and waits until the queued resource is ACTIVE.

    Raises:
        QueueGaveUp: the queue failed or suspended, or the validity window passed.
    """
    assert request.queue is not None
    name = request.queued_name(zone)
    api.create_queued_resource(request.parent(zone), request.node_id, queued_body(request, zone))
    kind = "spot" if request.queue.spot else "on-demand"
    start = clock()
    # The API ends the request at its validity window; a little slack for it to say so.
    deadline = start + request.queue.valid_for_s + max(poll_s * 2, 300)
    last: tuple[str, float] | None = None
    while True:
        state = api.queued_state(name) or "GONE"
        if state == "ACTIVE":
            took = _took(clock() - start)
            say(f"{zone}: queued resource {request.node_id} is ACTIVE after {took}")
            return
        if state in QUEUE_LOST or state == "GONE":
            raise QueueGaveUp(f"queued resource {state}: no {kind} capacity in {zone}")
        now = clock()
        if now > deadline:
            raise QueueGaveUp(
                f"no {kind} capacity in {zone} within {_took(request.queue.valid_for_s)} "
                f"(queued resource still {state})"
            )
        if last is None or last[0] != state or now - last[1] >= report_every_s:
            say(
                f"{zone}: queued resource {request.node_id} {state} for {_took(now - start)} "
                f"(waits up to {_took(request.queue.valid_for_s)} for {kind} capacity)"
            )
            last = (state, now)
        sleep(poll_s)


def _took(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


def queued_body(request: Request, zone: str) -> dict[str, Any]:
    """The QueuedResource message (API field names) that asks for the node in `zone`."""
    assert request.queue is not None
    capacity: dict[str, Any] = {"spot": {}} if request.queue.spot else {"guaranteed": {}}
    return {
        "tpu": {
            "node_spec": [
                {
                    "parent": request.parent(zone),
                    "node_id": request.node_id,
                    "node": marked(request.node),
                }
            ]
        },
        **capacity,
        "queueing_policy": {"valid_until_duration": {"seconds": request.queue.valid_for_s}},
    }


def remove(api: PlacementApi, node_name: str, queued_resource: str | None) -> None:
    """Deletes the node (through its queued resource when it has one); gone already is fine."""
    if queued_resource:
        api.delete_queued_resource(queued_resource)
    api.delete_node(node_name)


def update(
    api: PlacementApi, node_name: str, node: Mapping[str, Any], fields: Sequence[str]
) -> None:
    """Changes `fields` (a subset of UPDATABLE) of the running node in place."""
    unknown = sorted(set(fields) - set(UPDATABLE))
    if unknown:
        raise ValueError(f"fields {unknown} cannot change in place (only {', '.join(UPDATABLE)})")
    if fields:
        api.update_node(node_name, marked(node), list(fields))


def external_ips(endpoints: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """External IPs of the workers, in worker order, from a node's network_endpoints."""
    ips = []
    for endpoint in endpoints or []:
        configs = endpoint.get("access_config") or endpoint.get("access_configs") or {}
        if isinstance(configs, list):
            configs = configs[0] if configs else {}
        ips.append(str(configs.get("external_ip") or ""))
    return ips


def internal_ips(endpoints: Sequence[Mapping[str, Any]] | None) -> list[str]:
    return [str(e.get("ip_address") or "") for e in endpoints or []]
