"""The deployment component of one VM: the wheel, the run config and the systemd units of its
role, pushed to every worker by one infra.resources.ssh_deployment.SshDeployment whose inputs are
content hashes, so `pulumi preview` shows what would be redeployed and why."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra import remote
from infra.components import boot_release
from infra.resources import ssh_access, ssh_deployment
from infra.resources.deployment_record import VmInfo
from infra.tpu import api as tpu_api
from infra.vm import roles, source_archive
from infra.vm.workloads_wheel import Wheel, build_wheel
from workloads.contract import runconfig


@dataclasses.dataclass
class WorkloadsDeploymentArgs:
    """Inputs of one VM's deployment.

    Attributes:
        vm: TPU node name.
        role: the name of the VM's role (infra/vm/roles.py): which units it runs.
        hosts: worker addresses, worker 0 first (usually an Output of the TPU VM).
        run_config: the run config rendered from the stack config (infra.config.runconfig_render).
        ssh: the stack, user, key fingerprint, known_hosts name, port: portable values only;
            the key file is found on the machine that runs each operation
            (infra.resources.ssh_access).
        project: Google Cloud project (for `python -m infra.ops status`).
        zone: the VM's zone (same).
        remote_root: prefix of every remote path; "/" on real VMs (tests use a temp dir).
        use_sudo: run privileged commands with `sudo -n`; None = unless the user is root.
        ready_timeout_s: how long to wait for SSH and the startup script's ready marker (the
            training VM's first boot installs the stack and stages ~62 GB of weights).
        install_deps: let pip add dependencies the startup script did not install.
        wheel: a prebuilt wheel; None = build this checkout (cached in .whl/).
        release_bucket: push the bundle to this bucket too, as the release a new worker of the
            VM installs at boot (infra/components/boot_release.py); None = only the deploy.
    """

    vm: str
    role: str
    hosts: pulumi.Input[Sequence[str]]
    run_config: runconfig.RunConfig
    ssh: ssh_access.SshAccess
    project: str | None = None
    zone: pulumi.Input[str] | None = None
    remote_root: str = "/"
    use_sudo: bool | None = None
    ready_timeout_s: float = 3600.0
    install_deps: bool = True
    wheel: Wheel | None = None
    release_bucket: pulumi.Input[str] | None = None


class WorkloadsDeployment(pulumi.ComponentResource):
    """The workloads of one VM: wheel + run config + systemd units on every worker.

    Attributes:
        deployment: the dynamic resource that does the work.
        fingerprint: hash of everything deployed.
        ops_info: what `python -m infra.ops` needs about this VM (export it under
            `deployments.<role>`).
    """

    deployment: ssh_deployment.SshDeployment
    fingerprint: pulumi.Output[str]
    ops_info: pulumi.Output[dict[str, Any]]

    def __init__(
        self, name: str, args: WorkloadsDeploymentArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("gemma4-tpu:infra:WorkloadsDeployment", name, None, opts)
        layout = remote.RemoteLayout(args.remote_root)
        plan = roles.role(args.role).plan_units(args.run_config, layout)
        wheel = args.wheel or build_wheel()
        access = args.ssh
        use_sudo = args.use_sudo if args.use_sudo is not None else access.user != "root"
        yaml_text = args.run_config.to_yaml()
        inputs = ssh_deployment.DeploymentInputs(
            vm=args.vm,
            hosts=[],
            ssh=access,
            bundle=remote.Bundle(
                wheel_path=ssh_access.portable_path(wheel.path),
                wheel_sha256=wheel.sha256,
                run_config_yaml=yaml_text,
                units=plan.units,
                enable=plan.enable,
                start=plan.start,
                install_deps=args.install_deps,
            ),
            use_sudo=use_sudo,
            remote_root=args.remote_root,
            ready_timeout_s=args.ready_timeout_s,
        )
        if args.release_bucket is not None:
            self._declare_boot_release(name, args, inputs.local_bundle(), wheel)
        props = {**inputs.props(), "hosts": args.hosts}
        if args.project is not None and args.zone is not None:
            # The deploy reads its node first: a node started again at other addresses than the
            # state's stops it at once instead of after its whole ready timeout.
            project, vm = args.project, args.vm
            props["node"] = pulumi.Output.from_input(args.zone).apply(
                lambda zone: tpu_api.node_path(project, zone, vm)
            )
        self.deployment = ssh_deployment.SshDeployment(
            f"{name}-workloads", props, pulumi.ResourceOptions(parent=self)
        )
        self.fingerprint = self.deployment.fingerprint
        record = VmInfo(
            role=args.role,
            vm=args.vm,
            hosts=[],
            access=access,
            use_sudo=use_sudo,
            remote_root=args.remote_root,
            units=sorted(plan.units),
            start=list(plan.start),
            project=args.project,
            zone=None,  # where the VM was placed: known once it exists (below)
            run_dir=args.run_config.train.output_dir,
            serve_port=args.run_config.serve.port if args.run_config.serve else None,
        )
        self.ops_info = pulumi.Output.all(args.hosts, args.zone).apply(
            lambda hosts_zone: _ops_info(record, *hosts_zone)
        )
        self.register_outputs({"fingerprint": self.fingerprint, "ops_info": self.ops_info})

    def _declare_boot_release(
        self, name: str, args: WorkloadsDeploymentArgs, bundle: remote.Bundle, wheel: Wheel
    ) -> None:
        """The bundle as the release a new worker installs at boot, in the training bucket."""
        archive = boot_release.write_archive(
            bundle, pathlib.Path(wheel.path), source_archive.ROOT / ".recovery", args.vm
        )
        self.boot_release = gcp.storage.BucketObject(
            f"{name}-boot-release",
            bucket=args.release_bucket,
            name=boot_release.object_name(args.vm),
            source=pulumi.FileAsset(str(archive)),
            content_type="application/gzip",
            opts=pulumi.ResourceOptions(parent=self),
        )


def _ops_info(record: VmInfo, hosts: Sequence[str], zone: str | None) -> dict[str, Any]:
    """Pure: the deployment's record with the resolved worker addresses and zone, as exported."""
    return record.model_copy(update={"hosts": list(hosts), "zone": zone}).props()


def declare(
    name: str,
    *,
    vm: str,
    role: str,
    hosts: pulumi.Input[Sequence[str]],
    run_config: runconfig.RunConfig,
    access: ssh_access.SshAccess,
    project: str | None = None,
    zone: pulumi.Input[str] | None = None,
    opts: pulumi.ResourceOptions | None = None,
    **overrides: Any,
) -> WorkloadsDeployment:
    """Declares the deployment of one VM (what infra.components.stack_deployments calls per VM).

    Args:
        name: component name (`<role>-deploy`).
        vm: TPU node name.
        role: the role's name (infra/vm/roles.py ROLES).
        hosts: worker addresses (Output of the TPU VM component), worker 0 first.
        run_config: infra.config.runconfig_render.render_run_config(cfg).
        access: how to reach the workers (declare_for_stack builds it from the stack config).
        project: Google Cloud project id.
        zone: the VM's zone (an Output of the TPU VM: where it was placed).
        opts: resource options (depends_on the VM, the bucket, the secret IAM binding).
        **overrides: other WorkloadsDeploymentArgs fields (remote_root, wheel, ...).

    Returns:
        The component; export `component.ops_info` under `deployments.<role>` for infra.ops.
    """
    args = WorkloadsDeploymentArgs(
        vm=vm,
        role=role,
        hosts=hosts,
        run_config=run_config,
        ssh=access,
        project=project,
        zone=zone,
        **overrides,
    )
    return WorkloadsDeployment(name, args, opts)
