"""Getting a TPU node placed: the first zone of an ordered list with capacity, either directly
(create the node) or through a queued resource (Cloud TPU's own waiting line for capacity).

Why a zone list: v5p and v6e capacity is scarce and moves; a create that fails for capacity or
quota in one zone is tried in the next instead of failing `pulumi up`. What was placed is
adopted on a later call (an existing node of this stack, found in any listed zone, is kept where
it is), so a lost or refreshed state never creates a second slice.

No Pulumi here: the dynamic provider in infra/resources/tpu_node.py calls `place`, `remove`,
`read` and `update` during `pulumi up`/`destroy`/`refresh`; the tests call them with a fake API
that refuses zones, preempts nodes and comes back. The adapter onto google.cloud.tpu_v2 is
infra.tpu.api.GoogleTpuApi (node specs travel as plain dicts with the API's field names).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from infra.errors import InfraError
from workloads.common.errors import exception_line
from workloads.common.logs import Say

# Words of a refusal that means "not in this zone, now" when the exception's type cannot tell
# (a fake, or a message wrapped by another layer): stockout and quota.
CAPACITY_WORDS = (
    "capacity",
    "quota",
    "stockout",
    "resource_exhausted",
    "resources are exhausted",
)
# Messages of the Cloud TPU API that mean "not here" although their status (403, 400, 9) reads
# like a fault that would repeat everywhere. Each as it was seen:
NOT_HERE_WORDS = (
    # 403 PermissionDenied for a zone the project may not use or that has no Cloud TPU:
    # "403 Location europe-west1-b is not found or access is unauthorized." (google-api-core's
    # PermissionDenied from the TPU API; dstackai/gpuhunt issue 98, and skypilot's GCP failover
    # handler quotes the same text).
    "is not found or access is unauthorized",
    # 400 InvalidArgument for an accelerator type the zone does not offer: "Cloud TPU received a
    # bad request. The requested accelerator configuration for accelerator type, "v5litepod-8",
    # could not be found in the zonal accelerator configurations for "us-central1-b".; the
    # accelerator v5litepod-8 was not found in zone us-central1-b" (gcloud tpu-vm create), and
    # "the accelerator v4-128 was not found in zone us-central2-b" (skypilot issue 3840).
    "could not be found in the zonal accelerator configurations",
    "was not found in zone",
    # Operation error code 3 when the node was preempted while it was being created: "Cloud TPU
    # received a bad request. update is not supported while in state PREEMPTED" (skypilot's GCP
    # failover handler, which treats code 3 as "preempted during creation").
    "not supported while in state preempted",
    # Operation error code 9 (FailedPrecondition): "Insufficient reserved capacity. Contact
    # customer support to increase your reservation." (same handler).
    "insufficient reserved capacity",
)
# How placement treats a failed create in one zone.
ELSEWHERE = "elsewhere"  # not in this zone now: try the next one
TRANSIENT = "transient"  # the API failed for a moment: try the same zone again, a few times
FATAL = "fatal"  # would fail the same way in every zone: stop
# Tries of one zone while its failures are transient, and the waits between them (seconds).
TRANSIENT_TRIES = 3
TRANSIENT_BACKOFF_S = (30.0, 90.0)
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
# A queued resource being deleted: neither waiting nor lost yet. Its name stays taken (a create
# under it fails AlreadyExists) and a delete of it is refused until it is gone: wait for that.
QUEUE_DELETING = ("DELETING",)
# How long a DELETING queued resource is waited on before giving up (seconds).
QUEUE_DELETE_WAIT_S = 1800.0
# A read (get, list) the Cloud TPU API refuses for a whole zone: 403 PermissionDenied "Location
# europe-west1-b is not found or access is unauthorized." (an organisation's location policy, a
# zone without Cloud TPU). Reads of such a zone find nothing of ours (nothing can be there), so
# it must not stop placement or a scan of the other zones.
ZONE_REFUSED_WORDS = ("is not found or access is unauthorized",)
# A node in these states will not run again: delete it and create a new one.
NODE_GONE = ("PREEMPTED", "TERMINATED")
# A node being deleted (by a recovery, another `up`, the console): not to be kept (it is going)
# and its name stays taken until it is gone (a create under it fails AlreadyExists), so it is
# waited on like a deleting queued resource, then the zone holds nothing.
NODE_DELETING = ("DELETING",)
# How often a DELETING node is read while waiting for it to go (seconds, at most): a node's
# delete takes a minute or two, and another caller (the recovery controller beside an
# operator's `ops recover`) may create a new node under the name meanwhile, which ends the wait.
NODE_GONE_POLL_S = 10.0
# Node fields `update` changes in place (the API's update mask); any other change replaces it.
UPDATABLE = ("description", "labels", "metadata", "tags")
# Labels that say a node belongs to this stack (an existing node without them is not adopted).
OWNER_LABELS = ("app", "stack")
# The label placement puts on every node it creates or updates. A node of this stack without it
# was made by the stack's earlier gcp.tpu.V2Vm resource, which deletes it again at the end of the
# same `pulumi up`: adopting it would leave the stack pointing at a node that is gone.
PLACED_BY = {"placed-by": "gemma4-tpu-node"}


class PlacementError(InfraError):
    """The node cannot be placed; the message says why and what to change."""


class NoCapacity(PlacementError):
    """Every zone refused (capacity, quota, not offered there, ...); `refusals` holds one line
    per zone."""

    def __init__(self, node_id: str, refusals: Sequence[str]):
        self.refusals = list(refusals)
        super().__init__(
            f"TPU node {node_id}: no zone could take it ({'; '.join(self.refusals)}); add zones "
            "to zoneFallbacks, use provisioning: queued to wait for capacity, or retry later"
        )


class PlacementApi(Protocol):
    """The calls placement makes; infra.tpu.api.GoogleTpuApi is the real one, the tests' fake
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
    def get_queued(self, name: str) -> dict[str, Any] | None: ...
    def delete_queued_resource(self, name: str) -> None: ...
    def list_queued(self, parent: str) -> list[dict[str, Any]]: ...


@dataclasses.dataclass(frozen=True)
class Waits:
    """How placement waits on the API: its sleep and clock (the tests' are fake) and the poll
    interval; `delete_wait_s` bounds the wait for a DELETING queued resource."""

    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    poll_s: float = 60.0
    delete_wait_s: float = QUEUE_DELETE_WAIT_S


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


def zone_refused(exc: BaseException) -> bool:
    """Whether a TPU API call failed because the API refuses the whole zone (ZONE_REFUSED_WORDS;
    by message, as google-api-core's PermissionDenied/Forbidden or any wrapper carries it)."""
    text = str(exc).lower()
    return any(words in text for words in ZONE_REFUSED_WORDS)


class ZoneReads:
    """Reads of the listed zones, in which a zone the API refuses (zone_refused) holds nothing:
    its first refusal is said once, as one line naming the zone and the reason, and every later
    read of it answers None without asking again."""

    def __init__(self, say: Say) -> None:
        self.say = say
        self.refused: dict[str, str] = {}  # zone -> the refusal, as one line

    def read(self, zone: str, call: Callable[[], Any]) -> Any:
        """What `call` returns, or None when `zone` is refused.

        Raises:
            Exception: any other failure of `call`, as the API raised it.
        """
        if zone in self.refused:
            return None
        try:
            return call()
        except Exception as exc:
            if not zone_refused(exc):
                raise
            self.refused[zone] = exception_line(exc)
            self.say(
                f"{zone}: the TPU API refuses to read this zone ({self.refused[zone]}); "
                "nothing of this stack's can be there, going on without it"
            )
            return None


def classify(exc: BaseException) -> str:
    """ELSEWHERE, TRANSIENT or FATAL for a create (node or queued resource) that failed.

    The shapes are google-api-core's: the create call itself raises the HTTP/gRPC status as its
    exception class, and a long-running operation that ends in error raises
    `exceptions.from_grpc_status(code, message)` from `result()`: code 8 ResourceExhausted ("There
    is no more capacity in the zone "us-central1-a"; you can try in another zone where Cloud TPU
    Nodes are offered", the stockout), code 3 InvalidArgument, code 9 FailedPrecondition, code 13
    InternalServerError ("TPU operation failed: an internal error"), code 14 ServiceUnavailable,
    code 4 DeadlineExceeded. Quota refusals come as 429 ResourceExhausted ("Quota
    'TPUV5sLitepodServingPerProjectPerZoneForTPUAPI' exhausted. Limit 4 in zone us-central1-a").
    """
    if isinstance(exc, QueueGaveUp):
        return ELSEWHERE
    text = str(exc).lower()
    if any(words in text for words in NOT_HERE_WORDS):
        return ELSEWHERE
    try:
        from google.api_core import exceptions  # lazy: only the real client raises these
    except ImportError:  # pragma: no cover - google-api-core is a declared dependency
        exceptions = None  # type: ignore[assignment]
    if exceptions is not None:
        if isinstance(exc, exceptions.TooManyRequests):  # ResourceExhausted is one
            return ELSEWHERE
        if isinstance(exc, exceptions.ServerError) and not isinstance(
            exc, exceptions.MethodNotImplemented
        ):
            return TRANSIENT  # 500, 502, 503, 504 (DeadlineExceeded)
        if isinstance(exc, exceptions.GoogleAPICallError):
            # A bad runtime version, a missing permission, a malformed spec: the same elsewhere,
            # whatever its text says ("Insufficient permissions" is not about capacity).
            return FATAL
    return ELSEWHERE if any(word in text for word in CAPACITY_WORDS) else FATAL


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


def _foreign(request: Request, zone: str, labels: Mapping[str, Any], what: str) -> PlacementError:
    return PlacementError(
        f"TPU {what} {request.node_id} already exists in {zone} and is not this stack's "
        f"(labels app={labels.get('app')!r}, stack={labels.get('stack')!r}): set another "
        f"nodeName or delete that {what}"
    )


def queued_node_labels(queued: Mapping[str, Any]) -> dict[str, Any]:
    """The labels of the node a queued resource asks for (a queued resource has none itself)."""
    specs = (queued.get("tpu") or {}).get("node_spec") or [{}]
    return dict((specs[0].get("node") or {}).get("labels") or {})


def queued_state_of(queued: Mapping[str, Any]) -> str:
    return str((queued.get("state") or {}).get("state") or "STATE_UNSPECIFIED")


def leftover_queues(
    api: PlacementApi,
    request: Request,
    say: Say,
    reads: ZoneReads | None = None,
    waits: Waits | None = None,
) -> list[str]:
    """Deals with the queued resources of this stack's node id in the listed zones that the
    state does not know (an interrupted `up`, or a refresh that dropped the node): one still
    waiting for capacity while this request queues too is adopted (its zone is returned, to be
    waited on first; several: the first in list order, the others deleted); every other one is
    deleted, so that no forgotten queue can later start a billed TPU; one being deleted
    (DELETING) is waited on until it is gone, since its name stays taken until then. A queued
    resource whose node exists is the node's, and is left to find_existing. A zone the API
    refuses to read (`reads`) holds none.

    Raises:
        PlacementError: a queued resource of that name belongs to something else, or one stays
            DELETING past QUEUE_DELETE_WAIT_S.
    """
    reads = reads or ZoneReads(say)
    waits = waits or Waits()
    owner = _owner_of(request)
    adopted: list[str] = []
    for zone in request.zones:
        name = request.queued_name(zone)
        queued = reads.read(zone, functools.partial(api.get_queued, name))
        if queued is None:
            continue
        labels = queued_node_labels(queued)
        if not _owned({"labels": labels}, owner):
            raise _foreign(request, zone, labels, "queued resource")
        state = queued_state_of(queued)
        if state in QUEUE_DELETING:
            await_queue_gone(api, name, zone, say, waits)
            continue
        if api.get_node(request.node_name(zone)) is not None:
            continue
        if request.queue is not None and state in QUEUE_WAITING and not adopted:
            say(
                f"{zone}: queued resource {request.node_id} from an earlier up is {state}; "
                "waiting on it"
            )
            adopted.append(zone)
            continue
        say(f"{zone}: deleting queued resource {request.node_id} ({state}) left by an earlier up")
        api.delete_queued_resource(request.queued_name(zone))
    return adopted


def find_existing(
    api: PlacementApi,
    request: Request,
    say: Say,
    reads: ZoneReads | None = None,
    waits: Waits | None = None,
) -> Placement | None:
    """The node this stack already has in one of the zones (adopted as it is), or None.
    A preempted or terminated one is deleted on the way: it will not run again. One being
    deleted (DELETING) is waited on until it is gone, not kept. Another node of
    this stack under the same id in a later zone (left by an interrupted `up`) is deleted: one
    slice, one bill. A zone the API refuses to read (`reads`) holds none.

    Raises:
        PlacementError: a node of that name exists there and belongs to something else, or one
            stays DELETING past waits.delete_wait_s.
    """
    reads = reads or ZoneReads(say)
    waits = waits or Waits()
    owner = _owner_of(request)
    kept: Placement | None = None
    for zone in request.zones:
        name = request.node_name(zone)
        node = reads.read(zone, functools.partial(api.get_node, name))
        if node is not None and str(node.get("state")) in NODE_DELETING:
            await_node_gone(api, name, zone, say, waits)
            # Gone, or a new node under the name (another caller recreated it meanwhile): that
            # one is read and handled as any node found here.
            node = reads.read(zone, functools.partial(api.get_node, name))
        if node is None:
            continue
        if not _owned(node, owner):
            raise _foreign(request, zone, node.get("labels") or {}, "node")
        state = str(node.get("state") or "STATE_UNSPECIFIED")
        queued = node.get("queued_resource") or None
        if state in NODE_GONE:
            say(f"{zone}: {request.node_id} is {state}; deleting it to create a new one")
            remove(api, request.node_name(zone), queued)
            continue
        if state in NODE_DELETING:
            await_node_gone(api, name, zone, say, waits)
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
        if kept is not None:
            say(
                f"{zone}: {request.node_id} also exists here ({state}), left by an earlier up; "
                f"deleting it (keeping the one in {kept.zone})"
            )
            remove(api, request.node_name(zone), queued)
            continue
        say(f"{zone}: {request.node_id} exists ({state}); keeping it")
        kept = Placement(zone, node, queued, adopted=True)
    return kept


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
    takes it (a queued request waits up to its validity window in each zone). A zone that says
    "not here" (stockout, quota, type not offered, location refused, preempted while creating)
    is skipped; one whose API fails for a moment is tried again, TRANSIENT_TRIES times with a
    growing wait, then skipped; anything else stops at once. A zone whose reads the API refuses
    (zone_refused) is said once and skipped: nothing of the stack's is there, and a create there
    would be refused the same way.

    Raises:
        NoCapacity: every zone refused (each reason in the message).
        PlacementError: a foreign node or queued resource holds the name.
        Exception: any other API failure (bad spec, permissions), as the API raised it.
    """
    reads = ZoneReads(say)
    waits = Waits(sleep, clock, poll_s)
    adopted_queues = leftover_queues(api, request, say, reads, waits)
    existing = find_existing(api, request, say, reads, waits)
    if existing is not None:
        for zone in adopted_queues:  # the node is there already: this queue must not fill too
            say(
                f"{zone}: deleting queued resource {request.node_id}: the node runs in "
                f"{existing.zone}"
            )
            api.delete_queued_resource(request.queued_name(zone))
        return existing
    refusals: list[str] = []
    zones = [*adopted_queues, *(z for z in request.zones if z not in adopted_queues)]
    for zone in zones:
        if zone in reads.refused:
            refusals.append(f"{zone}: {reads.refused[zone]}")
            continue
        refusal, queued = _try_zone(
            api, request, zone, zone in adopted_queues, say, sleep, clock, poll_s, report_every_s
        )
        if refusal is not None:
            refusals.append(f"{zone}: {refusal}")
            continue
        node = api.get_node(request.node_name(zone))
        if node is None:
            raise PlacementError(
                f"TPU node {request.node_id}: created in {zone} but the API does not return it"
            )
        if not _owned(node, _owner_of(request)):  # a 409 adopts only what is this stack's
            raise _foreign(request, zone, node.get("labels") or {}, "node")
        if refusals:
            say(f"{zone}: {request.node_id} placed after {len(refusals)} zone(s) refused")
        return Placement(zone, node, queued, tuple(refusals))
    raise NoCapacity(request.node_id, refusals)


def _try_zone(
    api: PlacementApi,
    request: Request,
    zone: str,
    adopted: bool,
    say: Say,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    poll_s: float,
    report_every_s: float,
) -> tuple[str | None, str | None]:
    """(why the zone refused, None) or (None, the queued resource's name or None when placed).

    Raises:
        Exception: a FATAL failure, as the API raised it.
    """
    for attempt in range(1, TRANSIENT_TRIES + 1):
        try:
            queued = _create_in(
                api,
                request,
                zone,
                adopted and attempt == 1,
                say,
                sleep,
                clock,
                poll_s,
                report_every_s,
            )
            return None, queued
        except Exception as exc:
            kind = classify(exc)
            if kind == FATAL:
                raise
            reason = exception_line(exc)
            _clean_up_after(api, request, zone)
            if kind == TRANSIENT and attempt < TRANSIENT_TRIES:
                wait = TRANSIENT_BACKOFF_S[min(attempt, len(TRANSIENT_BACKOFF_S)) - 1]
                say(
                    f"{zone}: the TPU API failed ({reason}); trying again in {wait:.0f} s "
                    f"({attempt}/{TRANSIENT_TRIES})"
                )
                sleep(wait)
                continue
            if kind == TRANSIENT:
                reason = f"{reason} (failed {attempt} times)"
            say(f"{zone}: cannot place {request.node_id} here ({reason})")
            return reason, None
    raise AssertionError("unreachable: the last attempt returns or raises")


def _clean_up_after(api: PlacementApi, request: Request, zone: str) -> None:
    """Deletes what a refused or failed create in `zone` may have left (a half-made node, a
    queued resource). In a zone the API refuses (zone_refused) its deletes are refused too, and
    nothing can have been made there."""
    try:
        remove(api, request.node_name(zone), request.queued_name(zone) if request.queue else None)
    except Exception as exc:
        if not zone_refused(exc):
            raise


def _create_in(
    api: PlacementApi,
    request: Request,
    zone: str,
    adopted: bool,
    say: Say,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    poll_s: float,
    report_every_s: float,
) -> str | None:
    """Creates the node in `zone` (directly, or queued and waited for; `adopted`: the queued
    resource exists already). Returns the queued resource's name, or None."""
    if request.queue is None:
        try:
            api.create_node(request.parent(zone), request.node_id, marked(request.node))
        except Exception as exc:
            if not already_exists(exc):
                raise
            _racing(request, zone, "node", say)
        return None
    if not adopted:
        try:
            api.create_queued_resource(
                request.parent(zone), request.node_id, queued_body(request, zone)
            )
        except Exception as exc:
            if not already_exists(exc):
                raise
            _racing(request, zone, "queued resource", say)
    _await_queue(api, request, zone, say, sleep, clock, poll_s, report_every_s)
    return request.queued_name(zone)


def already_exists(exc: BaseException) -> bool:
    """Whether a create failed because its name is taken (409 ALREADY_EXISTS): between this
    caller's reads and its create, another one (a laptop's `ops recover` and the recovery
    controller at once, or a controller restarted mid-recovery) created it."""
    try:
        from google.api_core import exceptions  # lazy: only the real client raises these
    except ImportError:  # pragma: no cover - google-api-core is a declared dependency
        return "already exists" in str(exc).lower()
    return isinstance(exc, exceptions.Conflict) or "already exists" in str(exc).lower()


def _racing(request: Request, zone: str, what: str, say: Say) -> None:
    """A create refused with ALREADY_EXISTS: the name is fixed per zone, so what holds it is the
    one node this request wants, made by another caller. Adopted (its ownership is checked once
    it is read back), never created a second time under another name."""
    say(
        f"{zone}: {what} {request.node_id} already exists (another caller created it since this "
        "one looked); adopting it"
    )


class QueueGaveUp(InfraError):
    """The queued resource left the queue without capacity (`place` moves on to the next
    zone)."""


def _await_queue(
    api: PlacementApi,
    request: Request,
    zone: str,
    say: Say,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    poll_s: float,
    report_every_s: float,
) -> None:
    """Waits until the queued resource in `zone` is ACTIVE.

    Raises:
        QueueGaveUp: the queue failed or suspended, or the validity window passed.
    """
    assert request.queue is not None
    name = request.queued_name(zone)
    kind = "spot" if request.queue.spot else "on-demand"
    start = clock()
    # The API ends the request at its validity window; a little slack for it to say so.
    deadline = start + request.queue.valid_for_s + max(poll_s * 2, 300)
    last: tuple[str, float] | None = None
    while True:
        try:
            state = api.queued_state(name) or "GONE"
        except Exception as exc:
            # A read that fails for a moment must not cost the queue its place (the create
            # loop would delete it); the deadline still bounds the wait.
            if classify(exc) != TRANSIENT or clock() > deadline:
                raise
            say(
                f"{zone}: reading queued resource {request.node_id} failed "
                f"({exception_line(exc)}); asking again in {poll_s:.0f} s"
            )
            sleep(poll_s)
            continue
        if state == "ACTIVE":
            took = _took(clock() - start)
            say(f"{zone}: queued resource {request.node_id} is ACTIVE after {took}")
            return
        if state in QUEUE_LOST or state in QUEUE_DELETING or state == "GONE":
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


def await_queue_gone(api: PlacementApi, name: str, zone: str, say: Say, waits: Waits) -> None:
    """Waits until the queued resource `name` no longer exists (it is DELETING), one progress
    line when the wait starts and one per poll after that.

    Raises:
        PlacementError: it still exists after waits.delete_wait_s.
    """
    _await_gone(
        functools.partial(api.queued_state, name),
        "queued resource",
        name,
        "gcloud compute tpus queued-resources describe",
        zone,
        say,
        waits,
    )


def await_node_gone(api: PlacementApi, name: str, zone: str, say: Say, waits: Waits) -> None:
    """Waits until the node `name` no longer exists (it is DELETING), saying so as the queued
    resource's wait does, or until a node under the name is no longer DELETING: another caller
    created a new one meanwhile (the caller reads it again). Polls at most every
    NODE_GONE_POLL_S.

    Raises:
        PlacementError: it is still DELETING after waits.delete_wait_s.
    """

    def state() -> str | None:
        node = api.get_node(name)
        return None if node is None else str(node.get("state") or "STATE_UNSPECIFIED")

    waits = dataclasses.replace(waits, poll_s=min(waits.poll_s, NODE_GONE_POLL_S))
    _await_gone(
        state,
        "TPU node",
        name,
        "gcloud compute tpus tpu-vm describe",
        zone,
        say,
        waits,
        while_in=NODE_DELETING,
    )


def _await_gone(
    read_state: Callable[[], str | None],
    kind: str,
    name: str,
    describe: str,
    zone: str,
    say: Say,
    waits: Waits,
    while_in: tuple[str, ...] | None = None,
) -> None:
    """Polls read_state until it answers None (the `kind` resource `name` is gone), one progress
    line per poll; with `while_in`, also until it answers a state outside it (a new resource
    under the name).

    Raises:
        PlacementError: it still answers a state after waits.delete_wait_s.
    """
    resource_id = name.rsplit("/", 1)[-1]
    what = f"{kind} {resource_id}"
    start = waits.clock()
    while True:
        state = read_state()
        if state is None:
            if waits.clock() > start:
                say(f"{zone}: {what} is gone after {_took(waits.clock() - start)}")
            return
        if while_in is not None and state not in while_in:
            say(
                f"{zone}: {what} is {state} after {_took(waits.clock() - start)}: another caller "
                "made a new one under the name meanwhile"
            )
            return
        waited = waits.clock() - start
        if waited > waits.delete_wait_s:
            raise PlacementError(
                f"{what} in {zone} is still {state} after {_took(waited)}; check it with "
                f"`{describe} {resource_id} --zone {zone}` and run the command again"
            )
        say(
            f"{zone}: {what} is {state}; waiting for it to go "
            f"({_took(waited)} of at most {_took(waits.delete_wait_s)})"
        )
        waits.sleep(waits.poll_s)


def _owned_by_role(labels: Mapping[str, Any], owner: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in owner.items())


def remove_stack_queues(
    api: PlacementApi, request: Request, say: Say, waits: Waits | None = None
) -> list[str]:
    """Deletes every queued resource of this node in all its listed zones, whether the state
    recorded it or not: the one under its id, and every one whose node carries its owner labels
    (app, stack, and role when it has one; not run, which changes between runs). Why: an `up`
    interrupted while its queue waited (Pulumi cannot cancel a dynamic provider's create) leaves
    a queue the state never held, which can still get its capacity and start a billed TPU. A
    queue being deleted already is waited on until it is gone. A zone the API refuses to read
    holds none (one line says so); a queue under the id that is not this stack's is left alone.

    Returns:
        The names of the queued resources deleted or waited on.

    Raises:
        PlacementError: a queue stays DELETING past waits.delete_wait_s.
        Exception: any other API failure, as the API raised it.
    """
    waits = waits or Waits()
    reads = ZoneReads(say)
    owner = _owner_of(request)
    role = (request.node.get("labels") or {}).get("role")
    if role is not None:
        owner["role"] = str(role)
    gone: list[str] = []
    for zone in request.zones:
        named = request.queued_name(zone)
        found: dict[str, dict[str, Any]] = {}
        by_name = reads.read(zone, functools.partial(api.get_queued, named))
        if by_name is not None:
            found[named] = by_name
        parent = request.parent(zone)
        for queued in reads.read(zone, functools.partial(api.list_queued, parent)) or []:
            found.setdefault(str(queued.get("name") or ""), queued)
        for name, queued in found.items():
            if not name or not _owned_by_role(queued_node_labels(queued), owner):
                if name == named:
                    say(
                        f"{zone}: queued resource {request.node_id} is not this stack's; left alone"
                    )
                continue
            state = queued_state_of(queued)
            if state not in QUEUE_DELETING:
                say(f"{zone}: deleting queued resource {name.rsplit('/', 1)[-1]} ({state})")
                api.delete_queued_resource(name)
            await_queue_gone(api, name, zone, say, waits)
            gone.append(name)
    return gone


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
