"""The deployments of a stack: one WorkloadsDeployment per VM it has (a role of
infra/vm/roles.py's ROLES), each given the run config without the sections its role leaves out,
and the `deployments` output that `python -m infra.ops` reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pulumi

from infra.components.workloads import WorkloadsDeployment, declare
from infra.remote import ssh
from infra.resources import ssh_access
from infra.vm import roles
from workloads.contract import runconfig

if TYPE_CHECKING:  # the config model is only needed for the type; no import cycle at runtime
    from infra.config import model as config


def run_config_for(role: str, run_config: runconfig.RunConfig) -> runconfig.RunConfig:
    """The run config one VM role gets: without the sections the role leaves out."""
    data = run_config.model_dump(mode="json")
    # Each VM's copy leaves out the other's sections: a change there does not redeploy it.
    data.update(dict.fromkeys(roles.role(role).leaves_out))
    return runconfig.parse(data)


@dataclasses.dataclass(frozen=True)
class PlacedVm:
    """Where one declared VM ended up: what its deployment connects to."""

    hosts: pulumi.Input[Sequence[str]]
    """The workers' addresses (TpuVm.external_ips)."""
    zone: pulumi.Input[str] | None = None
    """Where it was placed (TpuVm.zone); None = its configured zone."""


def declare_for_stack(
    cfg: config.StackConfig,
    run_config: runconfig.RunConfig,
    vms: Mapping[str, PlacedVm],
    *,
    known_hosts: str = ssh.DEFAULT_KNOWN_HOSTS,
    opts: pulumi.ResourceOptions | None = None,
    release_bucket: pulumi.Input[str] | None = None,
) -> dict[str, WorkloadsDeployment]:
    """Declares one deployment per VM the stack has, in the order of roles.ROLES.

    Args:
        cfg: the validated infra.config.model.StackConfig.
        run_config: infra.config.runconfig_render.render_run_config(cfg); each VM gets it without
            the sections its role leaves out (run_config_for).
        vms: role name -> where that VM is; a role the stack does not have now (serving off, a
            released training node) is absent.
        known_hosts: the project-local known_hosts file (relative to the project directory).
        opts: extra resource options for all (e.g. depends_on the bucket grants).
        release_bucket: the training bucket: the training VM's bundle is pushed there too, the
            release a recreated node installs at boot (infra/components/boot_release.py).

    Returns:
        role -> component; export `ops_outputs(result)` as the `deployments` stack output.
    """
    # Portable values only: the key file is found where each operation runs
    # (infra.resources.ssh_access).
    access = ssh_access.SshAccess(
        stack=pulumi.get_stack(),
        user=cfg.ssh.user,
        key_fingerprint=ssh_access.configured_fingerprint(
            cfg.ssh.public_key, cfg.ssh.private_key_file
        ),
        known_hosts=known_hosts,
    )
    result: dict[str, WorkloadsDeployment] = {}
    for row in roles.ROLES:
        vm = vms.get(row.name)
        if vm is None:
            continue
        result[row.name] = declare(
            f"{row.name}-deploy",
            vm=row.node_name(cfg),
            role=row.name,
            hosts=vm.hosts,
            run_config=run_config_for(row.name, run_config),
            access=access,
            project=cfg.project,
            zone=vm.zone or row.section(cfg).zone,
            opts=opts,
            # The bundle a recreated node installs at boot, for the VM the controller recovers.
            **({"release_bucket": release_bucket} if row.recovered_by_controller else {}),
        )
    return result


def ops_outputs(
    deployments: dict[str, WorkloadsDeployment],
) -> dict[str, pulumi.Output[dict[str, Any]]]:
    """The `deployments` stack output that `python -m infra.ops` reads (role -> ops_info)."""
    return {role: d.ops_info for role, d in deployments.items()}
