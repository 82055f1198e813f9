"""What the stack's outputs say about its VMs, for the operator commands (ops, recover).

The `deployments` output maps a role ("train", "serve") to what infra.components.workloads
exports as `ops_info` (worker addresses, SSH identity, units, run directory, serving port);
VmInfo is that record, typed, and the one thing the commands pass around.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from infra import ssh
from infra.stack_client import StackClient, StackClientError


class OpsError(Exception):
    """A problem the operator can fix; printed as one line."""


@dataclasses.dataclass(frozen=True)
class VmInfo:
    """One VM of the stack as its deployment exported it."""

    role: str
    vm: str
    hosts: list[str]
    settings: ssh.SshSettings
    use_sudo: bool
    remote_root: str
    units: list[str]
    start: list[str]
    project: str | None = None
    zone: str | None = None
    run_dir: str | None = None
    serve_port: int | None = None

    @classmethod
    def from_output(cls, role: str, data: dict[str, Any]) -> VmInfo:
        settings = ssh.SshSettings(
            user=str(data["ssh_user"]),
            key_path=data.get("ssh_key_path") or None,
            known_hosts=str(data.get("known_hosts") or ssh.DEFAULT_KNOWN_HOSTS),
            port=int(data.get("port") or 22),
        )
        units = [str(u) for u in data.get("units") or []]
        return cls(
            role=role,
            vm=str(data.get("vm") or role),
            hosts=[str(h) for h in data.get("hosts") or []],
            settings=settings,
            use_sudo=bool(data.get("use_sudo", settings.user != "root")),
            remote_root=str(data.get("remote_root") or "/"),
            units=units,
            start=[str(u) for u in data.get("start") or units[:1]],
            project=data.get("project"),
            zone=data.get("zone"),
            run_dir=data.get("run_dir"),
            serve_port=int(data["serve_port"]) if data.get("serve_port") else None,
        )

    def label(self, index: int) -> str:
        return f"[{self.vm} w{index} {self.hosts[index]}]"


def load_outputs(stack: str | None = None, outputs_file: str | None = None) -> dict[str, Any]:
    """The stack's outputs as a dict: from `outputs_file` (written by `pulumi stack output
    --json`), else from the stack through infra.stack_client.

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


def vm_info(outputs: dict[str, Any], role: str, *, require_hosts: bool = True) -> VmInfo:
    """The deployment info of the stack's `role` VM (`require_hosts=False`: addresses optional).

    Raises:
        OpsError: the stack has no deployments output, no such VM, or no worker addresses.
    """
    deployments = outputs.get("deployments")
    if not isinstance(deployments, dict) or not deployments:
        raise OpsError(
            "the stack has no 'deployments' output: run `pulumi up` first (or check --stack)"
        )
    data = deployments.get(role)
    if not isinstance(data, dict):
        have = ", ".join(sorted(deployments)) or "none"
        hint = " (the serving VM exists only with serving.enabled: true)" if role == "serve" else ""
        raise OpsError(f"the stack has no {role} VM{hint}; it has: {have}")
    info = VmInfo.from_output(role, data)
    if require_hosts and not info.hosts:
        raise OpsError(f"the {role} VM {info.vm} has no worker addresses in the stack outputs yet")
    return info
