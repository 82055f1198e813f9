"""TPU nodes and queued resources of this stack that its state does not hold, for `infra.ops
status` and `infra.ops cost`.

How they come about: an `up` interrupted while its queued resource waits leaves that queue
behind (it can still get its capacity hours later and start a billed TPU); a `refresh` that
found a node missing for a moment drops it from the state while it runs on; a node deleted from
the state by hand keeps billing. The placement of the next `up` cleans what lies under the node
names it uses (infra/tpu/placement.py); these commands show everything else in the stack's
zones that carries the stack's `app` and `stack` labels, priced, with the command that deletes
it.

Where to look comes from the `tpuScope` output (project, the zones of both VMs' lists, the owner
labels); a stack without it (destroyed, or made before it existed) is scanned where its stack
file says the same things (`scope_from_stack_file`). A zone the API will not list is "unknown"
for that zone alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from infra.config import stack_config
from infra.ops import cost
from infra.resources.deployment_record import VmInfo
from infra.tpu import api as tpu_api

# This checkout's project directory, where scope_from_stack_file finds the stack files.
PROJECT_DIR = stack_config.ROOT

SCOPE_OUTPUT = "tpuScope"
"""The stack output that says where this stack's TPUs can be: {project, zones, labels}."""


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where the stack's TPU nodes and queued resources can be, and the labels that mark them."""

    project: str
    zones: tuple[str, ...]
    labels: Mapping[str, str]

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, Any]) -> Scope | None:
        scope = outputs.get(SCOPE_OUTPUT)
        if not isinstance(scope, dict) or not scope.get("project") or not scope.get("labels"):
            return None
        return cls(
            project=str(scope["project"]),
            zones=tuple(str(z) for z in scope.get("zones") or ()),
            labels={str(k): str(v) for k, v in dict(scope["labels"]).items()},
        )

    def owns(self, labels: Mapping[str, Any] | None) -> bool:
        have = dict(labels or {})
        return all(have.get(k) == v for k, v in self.labels.items())


@dataclasses.dataclass(frozen=True)
class Leftover:
    """One TPU node or queued resource of the stack that the state does not hold."""

    kind: str  # "node" or "queued resource"
    name: str
    zone: str
    state: str
    priced: cost.NodeCost | None = None  # nodes only

    @property
    def delete_command(self) -> str:
        if self.kind == "node":
            return f"gcloud compute tpus tpu-vm delete {self.name} --zone {self.zone}"
        return f"gcloud compute tpus queued-resources delete {self.name} --zone {self.zone} --force"

    def line(self) -> str:
        head = f"not in the stack's state: TPU {self.kind} {self.name} in {self.zone}, {self.state}"
        if self.kind == "queued resource":
            what = (
                "its node bills while READY"
                if self.state == "ACTIVE"
                else "not billed now; it starts a billed TPU if it gets capacity"
            )
            return f"{head}: {what}; delete it: {self.delete_command}"
        priced = self.priced
        if priced is None or not priced.billing:
            return f"{head}: not billed now; delete it: {self.delete_command}"
        kind = f"{priced.accelerator or '?'} {priced.provisioning}"
        rate = (
            f"${priced.hourly_usd:,.2f}/h" if priced.hourly_usd is not None else "no catalog price"
        )
        return f"{head}, {kind}: {rate}; delete it: {self.delete_command}"


def known_nodes(infos: Iterable[VmInfo]) -> set[tuple[str, str]]:
    """(zone, node id) of every VM the state holds."""
    return {(str(i.zone), i.vm) for i in infos if i.zone}


def _id(name: str) -> str:
    return str(name).rsplit("/", 1)[-1]


def _queued_labels(queued: Any) -> Mapping[str, Any]:
    specs = list(getattr(getattr(queued, "tpu", None), "node_spec", None) or [])
    node = getattr(specs[0], "node", None) if specs else None
    return dict(getattr(node, "labels", None) or {})


def _queued_state(queued: Any) -> str:
    state = getattr(getattr(queued, "state", None), "state", None)
    return str(getattr(state, "name", None) or state or "STATE_UNSPECIFIED")


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A zone of the scope the TPU API would not list: what is there is unknown."""

    zone: str
    error: BaseException

    def line(self) -> str:
        from workloads.common.errors import exception_line

        return (
            f"not in the stack's state: unknown in {self.zone} "
            f"(cannot list TPUs there: {exception_line(self.error)})"
        )


def find(
    client: Any,
    scope: Scope,
    known: set[tuple[str, str]],
    now: datetime.datetime | None = None,
) -> list[Leftover]:
    """Every node and queued resource in the scope's zones with its labels that `known` (the
    state's (zone, node id) pairs) does not hold; a queued resource of a known node is its own.

    Raises:
        Exception: whatever the TPU API raised for the first zone it would not list.
    """
    found, unreadable = scan(client, scope, known, now)
    if unreadable:
        raise unreadable[0].error
    return found


def scan(
    client: Any,
    scope: Scope,
    known: set[tuple[str, str]],
    now: datetime.datetime | None = None,
) -> tuple[list[Leftover], list[Unreadable]]:
    """find, zone by zone: (what the zones that answered hold, the zones that did not). One zone
    the API refuses (a location policy, a zone without Cloud TPU: 403 "Location ... is not found
    or access is unauthorized") leaves only that zone unknown."""
    moment = now or datetime.datetime.now(datetime.UTC)
    found: list[Leftover] = []
    unreadable: list[Unreadable] = []
    for zone in scope.zones:
        try:
            found += _zone_leftovers(client, scope, zone, known, moment)
        except Exception as exc:
            unreadable.append(Unreadable(zone, exc))
    # Nodes (what bills) before queued resources, each in zone order.
    return sorted(found, key=lambda item: item.kind != "node"), unreadable


def _zone_leftovers(
    client: Any,
    scope: Scope,
    zone: str,
    known: set[tuple[str, str]],
    moment: datetime.datetime,
) -> list[Leftover]:
    """The leftovers in one zone.

    Raises:
        Exception: whatever the TPU API raised listing the zone.
    """
    found: list[Leftover] = []
    parent = f"projects/{scope.project}/locations/{zone}"
    for node in client.list_nodes(parent=parent):
        name = _id(node.name)
        if (zone, name) in known or not scope.owns(getattr(node, "labels", None)):
            continue
        priced = cost.price("leftover", name, node, moment)
        found.append(Leftover("node", name, zone, priced.state, priced))
    for queued in client.list_queued_resources(parent=parent):
        name = _id(queued.name)
        if (zone, name) in known or not scope.owns(_queued_labels(queued)):
            continue
        found.append(Leftover("queued resource", name, zone, _queued_state(queued)))
    return found


def report_lines(
    outputs: Mapping[str, Any],
    infos: Iterable[VmInfo],
    client_factory: Any,
    now: datetime.datetime | None = None,
    fallback: Scope | None = None,
) -> tuple[list[str], list[cost.NodeCost]]:
    """(lines to print, the billed leftover nodes' costs) for a stack's outputs; where the
    stack has no `tpuScope` output (destroyed, or made before it), the `fallback` scope (the
    stack file's: scope_from_stack_file); nothing without either. A failed scan is one line
    per zone it could not list, not an error: the rest of the command's report stands."""
    scope = Scope.from_outputs(outputs) or fallback
    if scope is None:
        return [], []
    try:
        client = tpu_api.new_client(client_factory)
    except Exception as exc:
        from workloads.common.errors import exception_line

        return [f"not in the stack's state: unknown (cannot list TPUs: {exception_line(exc)})"], []
    leftovers, unreadable = scan(client, scope, known_nodes(infos), now)
    costs = [item.priced for item in leftovers if item.priced is not None and item.priced.billing]
    return [item.line() for item in leftovers] + [zone.line() for zone in unreadable], costs


def scope_from_stack_file(stack: str, project_dir: pathlib.Path | None = None) -> Scope | None:
    """Where the stack's TPUs can be, from this checkout's Pulumi.<stack>.yaml (the project,
    both VMs' zone lists, the labels the program puts on them: infra.config.labels.tpu_scope), for a
    stack whose outputs cannot say (after `pulumi destroy` they are empty, and a queue an
    interrupted `up` left can still start a billed TPU). None when the file is missing, or too
    broken to name a project and zones.
    """
    from infra.config import labels
    from infra.config import model as config_mod

    path = (project_dir or PROJECT_DIR) / stack_config.stack_file(stack)
    if not path.is_file():
        return None
    try:
        cfg = stack_config.parse_stack_config(stack_config.read_stack_file(path), validate=False)
    except config_mod.ConfigError:
        return None
    return Scope.from_outputs({SCOPE_OUTPUT: labels.tpu_scope(cfg, labels.base_labels(cfg, stack))})
