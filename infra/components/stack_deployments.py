"""The deployments of a stack: one WorkloadsDeployment per VM it has (training, and serving when
on), each given the run config without the other VM's sections, and the `deployments` output
that `python -m infra.ops` reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pulumi

from infra.components.workloads import WorkloadsDeployment, declare
from infra.remote import ssh, ssh_access
from infra.vm.units import Role
from workloads import runconfig

if TYPE_CHECKING:  # the config model is only needed for the type; no import cycle at runtime
    from infra.config import model as config

# Run-config sections that only the serving VM reads. The training VM's copy leaves them out,
# so that a serving change (port, maxModelLen, eval or bench settings) keeps the training
# deployment's run-config hash and does not stop and restart a running training job.
SERVE_ONLY_SECTIONS = ("serve", "eval", "bench", "stop")


def run_config_for(role: Role, run_config: runconfig.RunConfig) -> runconfig.RunConfig:
    """The run config one VM role gets: the training VM's without SERVE_ONLY_SECTIONS."""
    data = run_config.model_dump(mode="json")
    # Each VM's copy leaves out the other's sections: a change there does not redeploy it.
    data.update(dict.fromkeys(SERVE_ONLY_SECTIONS if role == "train" else ("release",)))
    return runconfig.parse(data)


def declare_for_stack(
    cfg: config.StackConfig,
    run_config: runconfig.RunConfig,
    *,
    train_hosts: pulumi.Input[Sequence[str]] | None,
    serve_hosts: pulumi.Input[Sequence[str]] | None = None,
    train_zone: pulumi.Input[str] | None = None,
    serve_zone: pulumi.Input[str] | None = None,
    known_hosts: str = ssh.DEFAULT_KNOWN_HOSTS,
    opts: pulumi.ResourceOptions | None = None,
) -> dict[str, WorkloadsDeployment]:
    """Declares the deployments of a stack: the training VM, and the serving VM when it exists.

    Args:
        cfg: the validated infra.config.model.StackConfig.
        run_config: infra.config.runconfig_render.render_run_config(cfg); each VM gets it without
            the other's sections (run_config_for).
        train_hosts: the training VM's worker addresses (TpuVm.external_ips), or None when the
            run released its node.
        serve_hosts: the serving VM's, or None when serving is off.
        train_zone, serve_zone: where each VM was placed (TpuVm.zone); None = its configured zone.
        known_hosts: the project-local known_hosts file (relative to the project directory).
        opts: extra resource options for both (e.g. depends_on the bucket grants).

    Returns:
        role -> component; export `ops_outputs(result)` as the `deployments` stack output.
    """
    # Portable values only: the key file is found where each operation runs
    # (infra.remote.ssh_access).
    access = ssh_access.SshAccess(
        stack=pulumi.get_stack(),
        user=cfg.ssh.user,
        key_fingerprint=ssh_access.configured_fingerprint(
            cfg.ssh.public_key, cfg.ssh.private_key_file
        ),
        known_hosts=known_hosts,
    )
    result: dict[str, WorkloadsDeployment] = {}
    vms: tuple[tuple[Role, pulumi.Input[Sequence[str]] | None, str, pulumi.Input[str]], ...] = (
        ("train", train_hosts, cfg.training_node_name, train_zone or cfg.training.zone),
        ("serve", serve_hosts, cfg.serving_node_name, serve_zone or cfg.serving.zone),
    )
    for role, hosts, node, zone in vms:
        if hosts is None:
            continue
        result[role] = declare(
            f"{role}-deploy",
            vm=node,
            role=role,
            hosts=hosts,
            run_config=run_config_for(role, run_config),
            access=access,
            project=cfg.project,
            zone=zone,
            opts=opts,
        )
    return result


def ops_outputs(
    deployments: dict[str, WorkloadsDeployment],
) -> dict[str, pulumi.Output[dict[str, Any]]]:
    """The `deployments` stack output that `python -m infra.ops` reads (role -> ops_info)."""
    return {role: d.ops_info for role, d in deployments.items()}
