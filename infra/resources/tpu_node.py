"""The TPU node resource: a Pulumi dynamic provider on infra/tpu/placement.py.

Why not `gcp.tpu.V2Vm`: it asks for one zone and fails `pulumi up` on a stockout, and the
pinned pulumi-gcp's `V2QueuedResource` cannot carry a node's metadata (startup script, ssh
keys), service account or spot setting, and has no way to read the workers' addresses back.
This resource takes an ordered zone list and, optionally, a queue: create places the node in
the first zone with capacity (waiting in line per zone when queued) and records the zone; a
later `pulumi up` keeps it there as long as the zone is still listed; description, labels,
metadata and tags change in place, anything else replaces the node (deleted first: the name is
fixed). Progress lines (`tpu: <node>: ...`) go through workloads.common.logs, which `pulumi up`
shows.

The provider runs in Pulumi's provider process with the user's Application Default
Credentials (as pulumi-gcp does); Pulumi stores it with dill, by reference to this module.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import pulumi
import pulumi.dynamic
import pydantic

from infra.config import stack_config
from infra.remote import ssh
from infra.resources import dynamic_values
from infra.tpu import api as tpu_api
from infra.tpu import placement as tpu_placement
from workloads.common import logs


class TpuNodeInputs(dynamic_values.ProviderState):
    """What the resource is given: where and how to place the node (project, node_id, zones,
    queue), then the node's spec named as the Cloud TPU API names its fields."""

    project: str
    node_id: str
    zones: list[str]
    queue: tpu_placement.Queue | None = None
    accelerator_type: str
    runtime_version: str
    description: str | None = None
    scheduling_config: dict[str, Any] | None = None
    service_account: dict[str, Any] | None = None
    network_config: dict[str, Any] | None = None
    tags: list[str] | None = None
    labels: dict[str, str] | None = None
    metadata: dict[str, str] | None = None

    def request(self) -> tpu_placement.Request:
        return tpu_placement.Request(
            project=self.project,
            node_id=self.node_id,
            zones=tuple(self.zones),
            node=node_spec(self.props()),
            queue=self.queue,
        )


class TpuNodeOutputs(TpuNodeInputs):
    """What create and read report next to the inputs (the resource's outputs)."""

    zone: str
    state: str = "STATE_UNSPECIFIED"
    network_endpoints: list[dict[str, Any]] = pydantic.Field(default_factory=list)
    queued_resource: str | None = None
    refusals: list[str] = pydantic.Field(default_factory=list)
    # Every zone the node was ever given, in the order first given: `destroy` scans them all
    # for its queued resources, a zone the list has dropped since included (an interrupted
    # `up` may have left a queue waiting there).
    zones_ever: list[str] = pydantic.Field(default_factory=list)


def zones_ever(*lists: Any) -> list[str]:
    """The zones of every list given (None or missing ones skipped), each once, first seen
    first."""
    merged: list[str] = []
    for zones in lists:
        for zone in zones or []:
            if isinstance(zone, str) and zone not in merged:
                merged.append(zone)
    return merged


# Inputs that say where and how the node is placed (not part of the node's spec).
CONTROL_KEYS = ("project", "node_id", "zones", "queue")
# The node's spec.
NODE_KEYS = tuple(k for k in TpuNodeInputs.model_fields if k not in CONTROL_KEYS)
# What create and read report (outputs of the resource).
OUTPUT_KEYS = tuple(k for k in TpuNodeOutputs.model_fields if k not in TpuNodeInputs.model_fields)
# A change here is a different node: replace it.
REPLACE_KEYS = tuple(k for k in (*CONTROL_KEYS, *NODE_KEYS) if k not in tpu_placement.UPDATABLE)
UNKNOWN = dynamic_values.UNKNOWN  # Pulumi's placeholder, during preview, for a value not known yet


def new_api() -> tpu_placement.PlacementApi:
    """The Cloud TPU API the provider talks to (tests replace this function)."""
    return tpu_api.GoogleTpuApi()


def node_spec(props: Mapping[str, Any]) -> dict[str, Any]:
    """The node's spec from the resource inputs (unset fields left out)."""
    return {k: props[k] for k in NODE_KEYS if props.get(k) is not None}


def _say(node_id: str) -> logs.Say:
    say = logs.say("tpu")
    return lambda line: say(f"{node_id}: {line}")


def _outputs(inputs: TpuNodeInputs, placement: tpu_placement.Placement) -> dict[str, Any]:
    node = placement.node
    return TpuNodeOutputs(
        **dict(inputs),
        zone=placement.zone,
        state=str(node.get("state") or "STATE_UNSPECIFIED"),
        network_endpoints=list(node.get("network_endpoints") or []),
        queued_resource=placement.queued_resource,
        refusals=list(placement.refusals),
        zones_ever=zones_ever(inputs.zones),
    ).props()


def plan_change(olds: Mapping[str, Any], news: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(changed keys, keys that force a replacement). The zone list is a replacement only when
    it no longer holds the zone the node was placed in: reordering or adding zones keeps it."""
    changed, replaces = [], []
    for key in (*CONTROL_KEYS, *NODE_KEYS):
        new = news.get(key)
        if key == "zones" and not dynamic_values.is_unknown(new):
            if olds.get("zone") not in (new or []):
                changed.append(key)
                replaces.append(key)
            continue
        if dynamic_values.is_unknown(new) or dynamic_values.comparable(
            olds.get(key)
        ) != dynamic_values.comparable(new):
            changed.append(key)
            if key in REPLACE_KEYS:
                replaces.append(key)
    return changed, replaces


def _gone_now(id_: str, olds: Mapping[str, Any]) -> bool:
    """Whether the node is preempted, terminated or deleted: what the API says now, or, when it
    cannot be asked (preview without credentials), what the last refresh recorded."""
    if not id_ or dynamic_values.is_unknown(id_):
        return False
    try:
        node = new_api().get_node(id_)
    except Exception:
        return str(olds.get("state") or "") in tpu_placement.NODE_GONE
    return node is None or str(node.get("state") or "") in tpu_placement.NODE_GONE


# How `destroy` waits for a queued resource being deleted (tests shorten them).
QUEUE_POLL_S = 15.0
QUEUE_DELETE_WAIT_S = tpu_placement.QUEUE_DELETE_WAIT_S


def known_hosts_file() -> pathlib.Path:
    """The project-local known_hosts of this machine (the one the deployments and `infra.ops`
    pin the workers' host keys in; tests replace this function)."""
    return stack_config.ROOT / ssh.DEFAULT_KNOWN_HOSTS


def forget_host_keys(props: Mapping[str, Any]) -> None:
    """Drops the deleted node's workers from this machine's known_hosts. Their external
    addresses are ephemeral: a node created after this one (a replacement, the same `up`) may
    get one back, with a new host key, and must be trusted as the new host it is rather than
    refused as "host key changed". A node not deleted keeps its keys pinned. Best effort: the
    node is gone either way, and a key left behind only makes a later connection say how to
    forget it."""
    hosts = [ip for ip in tpu_placement.external_ips(props.get("network_endpoints")) if ip]
    try:
        removed = ssh.forget_hosts(known_hosts_file(), hosts)
    except OSError as exc:
        _say(str(props.get("node_id") or "?"))(f"cannot update known_hosts: {exc}")
        return
    if removed:
        _say(str(props.get("node_id") or "?"))(
            f"forgot the host keys of {', '.join(sorted(set(removed)))} in {known_hosts_file()}"
        )


def remove_queues(api: tpu_placement.PlacementApi, props: Mapping[str, Any]) -> None:
    """Deletes the node's queued resources in every zone it was ever given (zones_ever: a zone
    dropped from the list since is scanned too), the ones its state never recorded included
    (tpu_placement.remove_stack_queues): Pulumi cannot cancel a dynamic provider's create, so
    Ctrl-C while a queue waits leaves that queue behind, and `destroy` must not leave what can
    still start a billed TPU. Old states (every number a float, unset inputs None, no
    zones_ever) read back as any other."""
    inputs = TpuNodeInputs.model_validate(props)
    zones = zones_ever(props.get("zones_ever"), inputs.zones)
    request = dataclasses.replace(inputs.request(), zones=tuple(zones))
    waits = tpu_placement.Waits(poll_s=QUEUE_POLL_S, delete_wait_s=QUEUE_DELETE_WAIT_S)
    tpu_placement.remove_stack_queues(api, request, _say(inputs.node_id), waits)


class TpuNodeProvider(pulumi.dynamic.ResourceProvider):
    """create places (zone failover, queue), update changes labels/metadata in place, delete
    removes the node and its queued resource, read refreshes state and addresses."""

    # Nothing secret is captured (no attributes): the state need not encrypt the provider.
    serialize_as_secret_always = False

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        changed, replaces = plan_change(olds, news)
        if _gone_now(_id, olds):
            # A preempted spot/preemptible node cannot be restarted or updated (the API refuses
            # "update is not supported while in state PREEMPTED"): delete and create it again.
            changed.append("state")
            replaces.append("state")
        return pulumi.dynamic.DiffResult(
            changes=bool(changed),
            replaces=replaces,
            stables=[k for k in ("project", "node_id") if k not in changed],
            # The node name is fixed per zone: the old node must go before the new one comes.
            delete_before_replace=True,
        )

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        inputs = TpuNodeInputs.model_validate(props)
        request = inputs.request()
        placement = tpu_placement.place(new_api(), request, say=_say(request.node_id))
        outs = _outputs(inputs, placement)
        return pulumi.dynamic.CreateResult(id_=request.node_name(placement.zone), outs=outs)

    def update(
        self, id_: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.UpdateResult:
        changed, _ = plan_change(olds, news)
        fields = [k for k in changed if k in tpu_placement.UPDATABLE]
        api = new_api()
        current = api.get_node(id_)
        state = str((current or {}).get("state") or "GONE")
        if current is None or state in tpu_placement.NODE_GONE:
            # Preempted between this `up`'s diff and its update: never update it in place.
            raise tpu_placement.PlacementError(
                f"TPU node {id_.rsplit('/', 1)[-1]} is {state}: it cannot be updated, only "
                "replaced; run `pulumi up` again (it replaces the node) or `python -m infra.ops "
                "recover`"
            )
        tpu_placement.update(api, id_, node_spec(news), fields)
        outs = {k: v for k, v in news.items() if k != "__provider"}
        outs |= {k: olds.get(k) for k in OUTPUT_KEYS}
        # The new list replaces the old one in the state; the zones it dropped stay known.
        outs["zones_ever"] = zones_ever(
            olds.get("zones_ever"), olds.get("zones"), news.get("zones")
        )
        node = api.get_node(id_)
        if node is not None:
            outs["state"] = str(node.get("state") or "STATE_UNSPECIFIED")
            outs["network_endpoints"] = list(node.get("network_endpoints") or [])
        return pulumi.dynamic.UpdateResult(outs=outs)

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        api = new_api()
        if id_:
            tpu_placement.remove(api, id_, props.get("queued_resource"))
        remove_queues(api, props)
        forget_host_keys(props)

    def read(self, id_: str, props: dict[str, Any]) -> pulumi.dynamic.ReadResult:
        node = new_api().get_node(id_)
        if node is None:  # gone (deleted by hand, or released): an empty id tells Pulumi so
            return pulumi.dynamic.ReadResult("", {})
        outs = dict(props) | {
            "state": str(node.get("state") or "STATE_UNSPECIFIED"),
            "network_endpoints": list(node.get("network_endpoints") or []),
        }
        return pulumi.dynamic.ReadResult(id_, outs)


MODULE, NAME = "gemma4", "TpuNode"
TYPE = f"pulumi-python:dynamic/{MODULE}:{NAME}"
"""TpuNode's type in a stack's state (what `infra.ops recover` looks for)."""


class TpuNode(pulumi.dynamic.Resource, module=MODULE, name=NAME):
    """One TPU node placed in the first zone of `zones` with capacity.

    Outputs:
        zone: where it was placed. state: the node's state at the last create/update/refresh.
        network_endpoints: the workers (API field names), worker 0 first.
        queued_resource: the queued resource's name when queued, else None.
        refusals: "zone: reason" of the zones that refused at creation.
    """

    zone: pulumi.Output[str]
    state: pulumi.Output[str]
    network_endpoints: pulumi.Output[list[dict[str, Any]]]
    queued_resource: pulumi.Output[str | None]
    refusals: pulumi.Output[list[str]]

    def __init__(
        self, name: str, props: Mapping[str, Any], opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(TpuNodeProvider(), name, {**props, **dict.fromkeys(OUTPUT_KEYS)}, opts)
