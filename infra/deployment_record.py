"""The one record of what a deployment carries, written by the program and read by operators.

infra.components.workloads builds a VmInfo per VM and exports it (`to_output`) in the stack's
`deployments` output; infra.ops and infra.recover read it back (`from_output`). One dataclass
for both sides: a field added here is exported and read with the same name. The SSH part is
portable (infra.ssh_access.SshAccess): `settings` finds the key file on the machine that reads
it, so `ops` works from the recovery controller and from any clone alike.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from infra import ssh, ssh_access


@dataclasses.dataclass(frozen=True)
class VmInfo:
    """One VM of the stack as its deployment exported it: who may reach its workers, how, what
    runs there and where its run writes."""

    role: str
    vm: str
    hosts: list[str]
    access: ssh_access.SshAccess
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
        access = ssh_access.SshAccess.from_props(data)
        units = [str(u) for u in data.get("units") or []]
        return cls(
            role=role,
            vm=str(data.get("vm") or role),
            hosts=[str(h) for h in data.get("hosts") or []],
            access=access,
            use_sudo=bool(data.get("use_sudo", access.user != "root")),
            remote_root=str(data.get("remote_root") or "/"),
            units=units,
            start=[str(u) for u in data.get("start") or units[:1]],
            project=data.get("project"),
            zone=data.get("zone"),
            run_dir=data.get("run_dir"),
            serve_port=int(data["serve_port"]) if data.get("serve_port") else None,
        )

    def to_output(self) -> dict[str, Any]:
        """The plain mapping the stack exports (read back by from_output)."""
        return {
            "vm": self.vm,
            "role": self.role,
            "project": self.project,
            "zone": self.zone,
            "hosts": list(self.hosts),
            **self.access.to_props(),
            "use_sudo": self.use_sudo,
            "remote_root": self.remote_root,
            "units": list(self.units),
            "start": list(self.start),
            "run_dir": self.run_dir,
            "serve_port": self.serve_port,
        }

    @functools.cached_property
    def settings(self) -> ssh.SshSettings:
        """How this machine reaches the workers (infra.ssh_access.settings_here).

        Raises:
            ssh_access.SshAccessError: this machine's stack file cannot be read.
        """
        return ssh_access.settings_here(self.access)

    def label(self, index: int) -> str:
        return f"[{self.vm} w{index} {self.hosts[index]}]"
