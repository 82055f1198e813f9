"""What the stack's outputs say about its VMs, for the operator commands (ops, recover).

The `deployments` output maps a role's name (infra/vm/roles.py) to what
infra.components.stack_deployments exports as `ops_info` (worker addresses, SSH identity, units,
run directory, serving port); VmInfo (infra/resources/deployment_record.py) is that record,
typed, and the one thing the commands pass around.
"""

from __future__ import annotations

import json
from typing import Any

from infra.errors import CloudRefused, OpsError, Released
from infra.ops.stack_client import StackClient, StackClientError
from infra.resources.deployment_record import VmInfo
from infra.vm import roles

__all__ = [
    "CloudRefused",
    "OpsError",
    "Released",
    "VmInfo",
    "load_outputs",
    "release_message",
    "vm_info",
]


def load_outputs(stack: str | None = None, outputs_file: str | None = None) -> dict[str, Any]:
    """The stack's outputs as a dict: from `outputs_file` (written by `pulumi stack output
    --json`), else from the stack through infra.ops.stack_client.

    Raises:
        OpsError: the file cannot be read, or the pulumi CLI is missing or fails.
    """
    if outputs_file:
        try:
            with open(outputs_file) as handle:
                data = json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise OpsError(f"cannot read stack outputs from {outputs_file}: {exc}") from None
    else:
        try:
            data = StackClient(stack).outputs()
        except StackClientError as exc:
            raise OpsError(
                f"{exc} (or pass --outputs FILE written by `pulumi stack output --json`)"
            ) from None
    if not isinstance(data, dict):
        raise OpsError("stack outputs are not a JSON object")
    return data


def release_message(outputs: dict[str, Any], role: str | None = None) -> str | None:
    """What the `<role>Released` output of a role that gives its node back says (the training
    VM's `trainReleased`, training.releaseWhenDone), as one line; None when that VM was not
    released. `role`: the role asked about; None = any."""
    asked = roles.ROLES if role is None else tuple(r for r in roles.ROLES if r.name == role)
    for row in asked:
        released = outputs.get(row.output("Released")) if row.releasable else None
        if isinstance(released, dict):
            return (
                f"the {row.noun} VM {released.get('node') or outputs.get(row.output('Node'))} "
                f"was released when run {released.get('run_name', '?')} finished "
                f"({released.get('released_at', '?')}; "
                f"{released.get('marker', 'released.json')}): "
                "set a new runName and `pulumi up` to train again"
            )
    return None


def vm_info(outputs: dict[str, Any], role: str, *, require_hosts: bool = True) -> VmInfo:
    """The deployment info of the stack's `role` VM (`require_hosts=False`: addresses optional).

    Raises:
        OpsError: the stack has no deployments output, no such VM, or no worker addresses.
    """
    released = release_message(outputs, role)
    if released is not None:
        raise Released(released)
    deployments = outputs.get("deployments")
    if not isinstance(deployments, dict) or not deployments:
        raise OpsError(
            "the stack has no 'deployments' output: run `pulumi up` first (or check --stack)"
        )
    data = deployments.get(role)
    if not isinstance(data, dict):
        have = ", ".join(sorted(deployments)) or "none"
        row = roles.find(role)
        hint = f" ({row.absent_hint})" if row is not None and row.absent_hint else ""
        raise OpsError(f"the stack has no {role} VM{hint}; it has: {have}")
    info = VmInfo.model_validate({**data, "role": role})
    if require_hosts and not info.hosts:
        raise OpsError(f"the {role} VM {info.vm} has no worker addresses in the stack outputs yet")
    return info
