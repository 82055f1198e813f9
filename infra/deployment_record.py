"""The one record of what a deployment carries, written by the program and read by operators.

infra.components.workloads builds a VmInfo per VM and exports it (`to_output`) in the stack's
`deployments` output; infra.ops and infra.recover read it back (`from_output`). One dataclass
for both sides: a field added here is exported and read with the same name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from infra import ssh


@dataclasses.dataclass(frozen=True)
class VmInfo:
    """One VM of the stack as its deployment exported it: who may reach its workers, how, what
    runs there and where its run writes."""

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

    def to_output(self) -> dict[str, Any]:
        """The plain mapping the stack exports (read back by from_output)."""
        return {
            "vm": self.vm,
            "role": self.role,
            "project": self.project,
            "zone": self.zone,
            "hosts": list(self.hosts),
            "ssh_user": self.settings.user,
            "ssh_key_path": self.settings.key_path,
            "known_hosts": self.settings.known_hosts,
            "port": self.settings.port,
            "use_sudo": self.use_sudo,
            "remote_root": self.remote_root,
            "units": list(self.units),
            "start": list(self.start),
            "run_dir": self.run_dir,
            "serve_port": self.serve_port,
        }

    def label(self, index: int) -> str:
        return f"[{self.vm} w{index} {self.hosts[index]}]"
