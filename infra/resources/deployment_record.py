"""The one record of what a deployment carries, written by the program and read by operators.

infra.components.workloads builds a VmInfo per VM and exports it (`props()`) in the stack's
`deployments` output; infra.ops and infra.ops.recover read it back (`VmInfo.model_validate`). One
model for both sides: a field added here is exported and read with the same name. The SSH part
is portable (infra.resources.ssh_access.SshAccess, its keys at the top level): `settings` finds
the key file on the machine that reads it, so `ops` works from the recovery controller and from any
clone alike.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pydantic

from infra.remote import ssh
from infra.resources import dynamic_values, ssh_access


class VmInfo(dynamic_values.ProviderState):
    """One VM of the stack as its deployment exported it: who may reach its workers, how, what
    runs there and where its run writes."""

    role: str
    vm: str
    hosts: list[str] = pydantic.Field(default_factory=list)
    access: ssh_access.SshAccess = pydantic.Field(json_schema_extra=dynamic_values.FLAT)
    use_sudo: bool
    remote_root: str = "/"
    units: list[str] = pydantic.Field(default_factory=list)
    start: list[str]
    project: str | None = None
    zone: str | None = None
    run_dir: str | None = None
    serve_port: int | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        """What an output written without these keys meant: the VM named by its role, sudo for
        any user but root, the first unit started."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if data.get("vm") is None:
            data["vm"] = data.get("role")
        if data.get("use_sudo") is None:
            access = data.get("access")
            user = access.user if isinstance(access, ssh_access.SshAccess) else data.get("ssh_user")
            data["use_sudo"] = user != "root"
        if data.get("start") is None:
            data["start"] = list(data.get("units") or [])[:1]
        return data

    @functools.cached_property
    def settings(self) -> ssh.SshSettings:
        """How this machine reaches the workers (infra.resources.ssh_access.settings_here).

        Raises:
            ssh_access.SshAccessError: this machine's stack file cannot be read.
        """
        return ssh_access.settings_here(self.access)

    def label(self, index: int) -> str:
        return f"[{self.vm} w{index} {self.hosts[index]}]"
