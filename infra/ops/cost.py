"""`python -m infra.ops cost`: what the stack runs now, what it costs per hour, what it has cost.

For each VM in the stack's `deployments` output, the Cloud TPU API says whether the node exists,
its state, its accelerator type, its provisioning model and when it was created. Cloud TPU bills
a node while it is READY; the hourly rate is the catalog's on-demand price of the slice
(workloads/contract/catalog.py, the table the cost report uses). The catalog holds no spot or
preemptible prices, so for those nodes the figure is an upper bound and says so. "So far" is
the rate times the hours since the node was created: it counts the time the node spent
CREATING (not billed) and forgets earlier nodes of the same run that a recovery replaced, so
it is an estimate; the billing report is the ground truth.

The recovery controller (`recovery.enabled`) is an ordinary Compute Engine VM that runs all the
time: it is listed at the hourly share of the monthly estimate the stack exports for it
(`recoveryController.estimatedMonthlyUsd`), and counted in "now" but not in "so far" (the TPU API
does not know when it was made).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence
from typing import Any, TextIO

from infra.resources.deployment_record import VmInfo
from infra.tpu import api as tpu_api
from workloads.contract import catalog

BILLED_STATES = frozenset({"READY"})


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """One VM of the stack as the TPU API sees it, priced."""

    role: str
    vm: str
    state: str
    accelerator: str | None = None
    provisioning: str = "on-demand"
    hourly_usd: float | None = None
    hours: float | None = None

    @property
    def billing(self) -> bool:
        return self.state in BILLED_STATES

    @property
    def so_far_usd(self) -> float | None:
        if self.hourly_usd is None or self.hours is None:
            return None
        return self.hourly_usd * self.hours


@dataclasses.dataclass(frozen=True)
class AlwaysOn:
    """A small VM of the stack that bills every hour, priced by the stack's own estimate."""

    label: str
    monthly_usd: float

    @property
    def hourly_usd(self) -> float:
        return self.monthly_usd / catalog.HOURS_PER_MONTH


def _provisioning(node: Any) -> str:
    scheduling = getattr(node, "scheduling_config", None)
    if getattr(scheduling, "spot", False):
        return "spot"
    if getattr(scheduling, "preemptible", False):
        return "preemptible"
    return "on-demand"


def _as_datetime(value: Any) -> datetime.datetime | None:
    """The node's create_time (a datetime from the client library), timezone-aware."""
    if not isinstance(value, datetime.datetime):
        return None
    return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)


def node_cost(info: VmInfo, client: tpu_api.TpuApi, now: datetime.datetime) -> NodeCost:
    """The priced state of one VM.

    Raises:
        Exception: whatever the TPU API raised, other than "not found".
    """
    node = tpu_api.get_node(client, tpu_api.node_path(str(info.project), str(info.zone), info.vm))
    if node is None:
        return NodeCost(info.role, info.vm, "NOT_FOUND")
    return price(info.role, info.vm, node, now)


def price(role: str, vm: str, node: Any, now: datetime.datetime) -> NodeCost:
    """The priced state of a node the TPU API returned (get_node or list_nodes)."""
    state = tpu_api.state_name(node)
    accelerator = str(getattr(node, "accelerator_type", "") or "") or None
    known = catalog.ACCELERATORS.get(accelerator or "")
    created = _as_datetime(getattr(node, "create_time", None))
    hours = max(0.0, (now - created).total_seconds() / 3600) if created else None
    return NodeCost(
        role,
        vm,
        state,
        accelerator,
        _provisioning(node),
        known.hourly_usd if known else None,
        hours,
    )


def report(
    costs: Sequence[NodeCost],
    out: TextIO,
    always_on: Sequence[AlwaysOn] = (),
    leftover_lines: Sequence[str] = (),
    leftover_costs: Sequence[NodeCost] = (),
) -> None:
    """One line per VM, then what bills outside the state (infra/ops/leftovers.py: its lines, and
    the costs of its billed nodes, counted in the totals), then the totals."""
    for c in costs:
        head = f"{c.role} VM {c.vm}: {c.state}"
        if not c.billing:
            print(f"{head}; not billed now ($0.00/h)", file=out)
            continue
        kind = f"{c.accelerator or '?'} {c.provisioning}"
        if c.hourly_usd is None:
            print(f"{head}, {kind}: no price in the catalog for this type", file=out)
            continue
        bound = (
            ""
            if c.provisioning == "on-demand"
            else f" (on-demand rate; {c.provisioning} bills less)"
        )
        line = f"{head}, {kind}: ${c.hourly_usd:,.2f}/h{bound}"
        if c.so_far_usd is not None and c.hours is not None:
            line += f"; up {c.hours:.1f} h, about ${c.so_far_usd:,.2f} so far"
        print(line, file=out)
    for vm in always_on:
        print(
            f"{vm.label}: always on, about ${vm.hourly_usd:,.3f}/h "
            f"(${vm.monthly_usd:,.2f}/month, the stack's estimate)",
            file=out,
        )
    for line in leftover_lines:
        print(line, file=out)
    hourly, so_far, upper, count = _totals(costs, always_on, leftover_costs)
    print(
        f"now: ${hourly:,.2f}/h for {count} running VM(s); about "
        f"${so_far:,.2f} since the TPU VMs were created"
        f"{' (an upper bound: spot/preemptible priced on demand)' if upper else ''}; "
        "estimates from the catalog's prices, the billing report is exact",
        file=out,
    )


def _totals(
    costs: Sequence[NodeCost], always_on: Sequence[AlwaysOn], leftover_costs: Sequence[NodeCost]
) -> tuple[float, float, bool, int]:
    """(USD per hour now, USD so far, whether spot/preemptible made it an upper bound, how many
    VMs bill now)."""
    running = [c for c in (*costs, *leftover_costs) if c.billing and c.hourly_usd is not None]
    hourly = sum(c.hourly_usd or 0.0 for c in running) + sum(vm.hourly_usd for vm in always_on)
    so_far = sum(c.so_far_usd or 0.0 for c in running)
    upper = any(c.provisioning != "on-demand" for c in running)
    return hourly, so_far, upper, len(running) + len(always_on)


def _node_record(c: NodeCost) -> dict[str, Any]:
    return {
        "role": c.role,
        "vm": c.vm,
        "state": c.state,
        "billing": c.billing,
        "accelerator": c.accelerator,
        "provisioning": c.provisioning,
        "hourlyUsd": c.hourly_usd if c.billing else 0.0,
        "hours": c.hours,
        "soFarUsd": c.so_far_usd,
    }


def summary(
    costs: Sequence[NodeCost],
    always_on: Sequence[AlwaysOn] = (),
    leftover_lines: Sequence[str] = (),
    leftover_costs: Sequence[NodeCost] = (),
) -> dict[str, Any]:
    """What `report` prints, as data (what `ops cost --json` prints)."""
    hourly, so_far, upper, count = _totals(costs, always_on, leftover_costs)
    return {
        "vms": [_node_record(c) for c in costs],
        "alwaysOn": [
            {"label": vm.label, "hourlyUsd": vm.hourly_usd, "monthlyUsd": vm.monthly_usd}
            for vm in always_on
        ],
        "leftovers": list(leftover_lines),
        "leftoverVms": [_node_record(c) for c in leftover_costs],
        "hourlyUsd": hourly,
        "soFarUsd": so_far,
        "upperBound": upper,
        "runningVms": count,
    }


def run(
    infos: Sequence[VmInfo],
    out: TextIO,
    *,
    client: tpu_api.TpuApi | None,
    now: datetime.datetime | None = None,
    always_on: Sequence[AlwaysOn] = (),
    leftover_lines: Sequence[str] = (),
    leftover_costs: Sequence[NodeCost] = (),
    released: str | None = None,
    as_json: bool = False,
) -> int:
    """Prices every VM of the stack (and what bills outside its state), as text or as one JSON
    object (`summary`, plus `released`: why the training VM is gone, or null); 0.

    Raises:
        Exception: whatever the TPU API raised, other than "not found".
    """
    moment = now or datetime.datetime.now(datetime.UTC)
    costs = [node_cost(info, client, moment) for info in infos] if client is not None else []
    if as_json:
        record = {"released": released, **summary(costs, always_on, leftover_lines, leftover_costs)}
        json.dump(record, out, indent=2)
        out.write("\n")
        return 0
    if released is not None:
        print(f"train VM: {released}; not billed", file=out)
    report(costs, out, always_on, leftover_lines, leftover_costs)
    return 0
