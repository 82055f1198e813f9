"""The Pulumi program: validated config in, components declared, stack outputs exported.

`run()` is what infra/__main__.py calls; tests call it under `pulumi.runtime.set_mocks`.
Nothing here runs at import time. Validation happens before the first resource is declared.

It reads top to bottom in the order one `up` declares things: validate (run), then build:
identity, buckets, secrets, recovery controller, firewalls, self-service grants, the VMs of
infra/vm/roles.py's table, their deployments, and the outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any

import pulumi

from infra.components import apis as apis_mod
from infra.components import boot_release, stack_deployments
from infra.components import bucket as bucket_mod
from infra.components import firewall as firewall_mod
from infra.components import recovery as recovery_mod
from infra.components import secret as secret_mod
from infra.components import service_account as sa_mod
from infra.components import tpu_vm as tpu_mod
from infra.components import workloads as workloads_mod
from infra.config import model as config_mod
from infra.config import runconfig_render, stack_config, validation
from infra.config.labels import base_labels, tpu_scope
from infra.ops import release_record
from infra.preflight import compile_check
from infra.vm import roles
from workloads.common import errors
from workloads.contract import catalog, runconfig

COST_BASIS = "on-demand list price per hour (the paper's rates); spot/preemptible is billed less"


@dataclasses.dataclass
class StackResources:
    """What the program declared; the deployment (infra/resources/ssh_deployment.py) builds on
    it."""

    config: config_mod.StackConfig
    run_config: runconfig.RunConfig
    labels: dict[str, str]
    apis: apis_mod.ProjectApis | None
    service_account: sa_mod.VmServiceAccount
    training_bucket: bucket_mod.Bucket
    serving_bucket: bucket_mod.Bucket
    secret: secret_mod.StoredSecret | None
    ssh_firewall: firewall_mod.IngressRule
    api_firewall: firewall_mod.IngressRule | None
    vms: dict[str, tpu_mod.TpuVm]
    """Role name -> VM, for the roles the stack has now (a released training node is absent)."""
    deployments: dict[str, workloads_mod.WorkloadsDeployment] = dataclasses.field(
        default_factory=dict
    )
    recovery: recovery_mod.RecoveryController | None = None
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    released: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------
# Pure helpers (named functions for Output.apply)


def _identity(key_file: str | None) -> str:
    """`-i KEY ` for a key file; nothing with ssh-agent (ssh.privateKeyFile null)."""
    return f"-i {key_file} " if key_file else ""


def ssh_commands(user: str, key_file: str | None, ips: list[str]) -> list[str]:
    return [f"ssh {_identity(key_file)}{user}@{ip}" for ip in ips]


def endpoint_url(port: int, ips: list[str]) -> str:
    return f"http://{ips[0]}:{port}/v1" if ips else ""


def tunnel_command(user: str, key_file: str | None, port: int, ips: list[str]) -> str:
    if not ips:
        return ""
    return f"ssh {_identity(key_file)}-N -L {port}:127.0.0.1:{port} {user}@{ips[0]}"


def hourly_cost(cfg: config_mod.StackConfig) -> dict[str, Any]:
    """Estimated cost per hour of what the stack runs, from the catalog: one entry per role,
    under its noun (`training`, `serving`; 0 when the stack does not have it), and the total."""
    prices = {
        row.noun: (
            catalog.accelerator(row.section(cfg).accelerator).hourly_usd
            if row.declared(cfg, False)  # the price of a run, whether or not it gave its node back
            else 0.0
        )
        for row in roles.ROLES
    }
    return {**prices, "total": round(sum(prices.values()), 2), "basis": COST_BASIS}


def resolve_ssh_keys(cfg: config_mod.StackConfig) -> str:
    """The ssh-keys metadata line `user:<public key>` (reads `<privateKeyFile>.pub` if needed).

    Raises:
        config.ConfigError: no public key configured and none on disk.
    """
    key = cfg.ssh.public_key
    if key is None:
        if cfg.ssh.private_key_file is None:  # validation requires publicKey with ssh-agent
            raise config_mod.ConfigError(
                ["ssh.publicKey: not set: required when ssh.privateKeyFile is null (ssh-agent)"]
            )
        private = pathlib.Path(os.path.expanduser(cfg.ssh.private_key_file))
        public = private.with_name(private.name + ".pub")
        if not public.is_file():
            raise config_mod.ConfigError(
                [
                    f"ssh.publicKey: not set: and {public} does not exist; set ssh.publicKey or "
                    f"create the key with `ssh-keygen -t ed25519 -f {cfg.ssh.private_key_file}`"
                ]
            )
        key = public.read_text().strip()
    return f"{cfg.ssh.user}:{key.strip()}"


# ---------------------------------------------------------------------------------------------
# Declaring the stack, in the order of the module docstring


def build(
    cfg: config_mod.StackConfig,
    hf_token: pulumi.Input[str] | None,
    *,
    ssh_keys: str,
    stack: str,
    released: dict[str, Any] | None = None,
) -> StackResources:
    """Declares every component of a validated config.

    Args:
        cfg: a config that passed validation.
        hf_token: the Hugging Face token as a Pulumi secret, or None.
        ssh_keys: the ssh-keys metadata value.
        stack: the Pulumi stack name (a label).
        released: the run's release record (infra.ops.release_record): the training node and its
            deployment are left out.
    """
    labels = base_labels(cfg, stack)
    apis, account = declare_identity(cfg, stack)
    after_apis = pulumi.ResourceOptions(depends_on=[apis] if apis else [])
    training_bucket, serving_bucket = declare_buckets(cfg, labels, account, after_apis)
    secret = declare_hf_secret(cfg, hf_token, labels, account, after_apis)
    controller = declare_recovery(cfg, stack, labels, account, training_bucket, after_apis)
    # The controller no longer deploys over SSH: the SSH rule is the configured ranges alone.
    ssh_firewall, api_firewall = declare_firewalls(cfg, after_apis)
    # The VMs boot straight into their startup scripts, which need the grants in place.
    grants: list[pulumi.Resource] = [account, training_bucket, serving_bucket]
    grants += [secret] if secret is not None else []
    grants += declare_self_service(cfg, account, released is not None)
    vm_opts = pulumi.ResourceOptions(depends_on=grants + ([apis] if apis else []))
    run_config = runconfig_render.render_run_config(cfg)
    vms = declare_vms(
        cfg,
        labels,
        account,
        ssh_keys,
        stack,
        released is not None,
        secret is not None,
        vm_opts,
        record=(training_bucket.name, run_config.train.output_dir),
    )
    deployments = declare_deployments(cfg, run_config, vms, training_bucket.name)
    resources = StackResources(
        config=cfg,
        run_config=run_config,
        labels=labels,
        apis=apis,
        service_account=account,
        training_bucket=training_bucket,
        serving_bucket=serving_bucket,
        secret=secret,
        ssh_firewall=ssh_firewall,
        api_firewall=api_firewall,
        vms=vms,
        deployments=deployments,
        released=released,
        recovery=controller,
    )
    resources.outputs = stack_outputs(resources)
    return resources


def declare_identity(
    cfg: config_mod.StackConfig, stack: str
) -> tuple[apis_mod.ProjectApis | None, sa_mod.VmServiceAccount]:
    """The project's APIs (when the stack enables them) and the VMs' service account."""
    apis = (
        apis_mod.ProjectApis("apis", apis_mod.ApisArgs(project=cfg.project))
        if cfg.enable_apis
        else None
    )
    account = sa_mod.VmServiceAccount(
        "vm-sa",
        sa_mod.ServiceAccountArgs(
            project=cfg.project,
            account_id=cfg.service_account_id,
            display_name=f"gemma4-tpu VMs ({stack})",
        ),
        opts=pulumi.ResourceOptions(depends_on=[apis] if apis else []),
    )
    return apis, account


def declare_buckets(
    cfg: config_mod.StackConfig,
    labels: dict[str, str],
    account: sa_mod.VmServiceAccount,
    opts: pulumi.ResourceOptions,
) -> tuple[bucket_mod.Bucket, bucket_mod.Bucket]:
    """The training bucket and the serving one (the same object when the stack shares one)."""

    def bucket(name: str, bucket_name: str, location: str) -> bucket_mod.Bucket:
        s = cfg.storage
        return bucket_mod.Bucket(
            name,
            bucket_mod.BucketArgs(
                project=cfg.project,
                name=bucket_name,
                location=location,
                labels=labels,
                object_users=[account.member],
                versioning=s.versioning,
                noncurrent_version_days=s.noncurrent_version_days,
                scratch_prefixes=runconfig_render.SCRATCH_PREFIXES,
                scratch_days=s.scratch_days,
                keep_on_destroy=s.keep_on_destroy,
                protect=s.protect,
                force_destroy=s.force_destroy,
                import_existing=s.import_existing,
            ),
            opts=opts,
        )

    training = bucket("train-bucket", cfg.training_bucket_name, cfg.training_bucket_location)
    if cfg.shared_bucket:
        return training, training
    return training, bucket("serve-bucket", cfg.serving_bucket_name, cfg.serving_bucket_location)


def declare_hf_secret(
    cfg: config_mod.StackConfig,
    hf_token: pulumi.Input[str] | None,
    labels: dict[str, str],
    account: sa_mod.VmServiceAccount,
    opts: pulumi.ResourceOptions,
) -> secret_mod.StoredSecret | None:
    """The Hugging Face token in Secret Manager, readable by the VMs only; None without one."""
    if hf_token is None:
        return None
    return secret_mod.StoredSecret(
        "hf-token",
        secret_mod.SecretArgs(
            project=cfg.project,
            secret_id=cfg.hf_secret_id,
            secret_data=hf_token,
            accessors=[account.member],
            labels=labels,
        ),
        opts=opts,
    )


def declare_recovery(
    cfg: config_mod.StackConfig,
    stack: str,
    labels: dict[str, str],
    account: sa_mod.VmServiceAccount,
    training_bucket: bucket_mod.Bucket,
    opts: pulumi.ResourceOptions,
) -> recovery_mod.RecoveryController | None:
    """The recovery controller VM when recovery.enabled, else None."""
    if not cfg.recovery.enabled:
        return None
    return recovery_mod.RecoveryController(
        "recover",
        recovery_mod.RecoveryArgs(
            project=cfg.project,
            stack=stack,
            prefix=cfg.name_prefix,
            zone=cfg.recovery_zone,
            machine_type=cfg.recovery.machine_type,
            network=cfg.network,
            subnetwork=cfg.subnetwork,
            training_bucket=training_bucket.name,
            record_uri=runconfig_render.recovery_record_uri(cfg, cfg.training_node_name),
            vm_service_account=account.account.name,
            interval_s=cfg.recovery.interval_seconds,
            labels=labels,
        ),
        opts=opts,
    )


def declare_firewalls(
    cfg: config_mod.StackConfig, opts: pulumi.ResourceOptions
) -> tuple[firewall_mod.IngressRule, firewall_mod.IngressRule | None]:
    """SSH from the configured ranges; the serving API when it is open."""
    ssh_firewall = firewall_mod.IngressRule(
        "ssh",
        firewall_mod.FirewallArgs(
            project=cfg.project,
            network=cfg.network,
            rule_name=f"{cfg.name_prefix}-allow-ssh",
            ports=("22",),
            source_ranges=cfg.ssh.source_ranges,
            target_tags=(cfg.ssh_tag,),
            description="SSH to the gemma4-tpu TPU VMs from the configured ranges only.",
        ),
        opts=opts,
    )
    if not (cfg.serving.enabled and cfg.serving.api_source_ranges):
        return ssh_firewall, None
    api_firewall = firewall_mod.IngressRule(
        "api",
        firewall_mod.FirewallArgs(
            project=cfg.project,
            network=cfg.network,
            rule_name=f"{cfg.name_prefix}-allow-api",
            ports=(str(cfg.serving.port),),
            source_ranges=cfg.serving.api_source_ranges,
            target_tags=(cfg.api_tag,),
            description="The vLLM OpenAI API of the serving VM from the configured ranges.",
        ),
        opts=opts,
    )
    return ssh_firewall, api_firewall


def declare_self_service(
    cfg: config_mod.StackConfig, account: sa_mod.VmServiceAccount, released: bool
) -> list[pulumi.Resource]:
    """The grant that lets the declared VMs act on their own nodes (roles.VmRole.self_service);
    none when no role asks for a permission."""
    permissions = [
        p for row in roles.ROLES if row.declared(cfg, released) for p in row.self_service(cfg)
    ]
    if not permissions:
        return []
    return [
        sa_mod.self_service_grant(
            "vm-sa-self", cfg.project, account, prefix=cfg.name_prefix, permissions=permissions
        )
    ]


def declare_vms(
    cfg: config_mod.StackConfig,
    labels: dict[str, str],
    account: sa_mod.VmServiceAccount,
    ssh_keys: str,
    stack: str,
    released: bool,
    has_hf_secret: bool,
    opts: pulumi.ResourceOptions,
    record: tuple[pulumi.Input[str], str] | None = None,
) -> dict[str, tpu_mod.TpuVm]:
    """One TPU VM per role of roles.ROLES that the stack has now, keyed by role name.

    Args:
        record: (training bucket name, run directory): each VM's create request is recorded
            there for recovery (infra/tpu/record.py); None records nothing.
    """
    vms: dict[str, tpu_mod.TpuVm] = {}
    for row in roles.ROLES:
        if not row.declared(cfg, released):
            continue
        section = row.section(cfg)
        acc = catalog.accelerator(section.accelerator)
        node = row.node_name(cfg)
        recorded = (
            tpu_mod.RecordArgs(
                bucket=record[0],
                role=row.name,
                run_dir=record[1] if row.has_training_metrics else None,
                boot_reports=runconfig_render.boot_reports_uri(cfg, node),
            )
            if record is not None
            else None
        )
        vms[row.name] = tpu_mod.TpuVm(
            row.name,
            tpu_mod.TpuVmArgs(
                project=cfg.project,
                zones=section.zones,
                node_name=node,
                accelerator_type=acc.name,
                runtime_version=section.runtime_version or acc.runtime_version,
                provisioning=section.provisioning,
                service_account_email=account.email,
                network=cfg.network,
                subnetwork=cfg.subnetwork,
                tags=row.tags(cfg),
                labels={**labels, "role": row.name},
                startup_script=row.startup_script(
                    cfg,
                    has_hf_secret=has_hf_secret,
                    # What a recreated node installs at boot (the deploy's scripts, above vm/).
                    release=(
                        boot_release.startup_context(cfg, node)
                        if row.recovered_by_controller
                        else None
                    ),
                ),
                ssh_keys=ssh_keys,
                description=f"gemma4-tpu {row.noun} slice ({stack})",
                queue_spot=section.queue.capacity == "spot",
                queue_valid_for_hours=section.queue.valid_for_hours,
                record=recorded,
            ),
            opts=opts,
        )
    return vms


def declare_deployments(
    cfg: config_mod.StackConfig,
    run_config: runconfig.RunConfig,
    vms: dict[str, tpu_mod.TpuVm],
    release_bucket: pulumi.Input[str] | None = None,
) -> dict[str, workloads_mod.WorkloadsDeployment]:
    """The workloads wheel + run config pushed over SSH to every worker of each VM, started as
    systemd units; the training VM's also to `release_bucket`, what a recreated node installs
    at boot."""
    placed = {
        name: stack_deployments.PlacedVm(hosts=vm.external_ips, zone=vm.zone)
        for name, vm in vms.items()
    }
    return stack_deployments.declare_for_stack(
        cfg, run_config, placed, release_bucket=release_bucket
    )


def stack_outputs(res: StackResources) -> dict[str, Any]:
    """The stack outputs (all plain: names, addresses, paths, prices; never a secret)."""
    cfg = res.config
    train = res.run_config.train
    outputs: dict[str, Any] = {
        "serviceAccount": res.service_account.email,
        "bucketUrls": {"training": res.training_bucket.url, "serving": res.serving_bucket.url},
        "runDir": train.output_dir,
        "checkpointDir": train.checkpoint_dir,
        "tensorboardDir": train.tensorboard_dir,
        "tensorboardCommand": f"tensorboard --logdir {train.tensorboard_dir}",
        "mergedDir": res.run_config.merge.out if res.run_config.merge else None,
        "estimatedHourlyUsd": hourly_cost(cfg),
        "deployments": stack_deployments.ops_outputs(res.deployments),
        # Where `infra.ops status`/`cost` look for this stack's TPUs the state does not hold.
        "tpuScope": tpu_scope(cfg, res.labels),
    }
    for row in roles.ROLES:
        outputs |= vm_outputs(res, row)
    if res.recovery is not None:
        outputs["recoveryController"] = res.recovery.outputs
    return outputs


def vm_outputs(res: StackResources, row: roles.VmRole) -> dict[str, Any]:
    """The outputs of one role's VM, named by the role (row.output): `<role>Node`, `<role>Zone`
    (where it was placed: the first of zone + zoneFallbacks with capacity), `<role>Placement`,
    `<role>WorkerIps`, `<role>SshCommands`, `<role>RecoveryRecord` (what `infra.ops recover --vm
    <role>` recreates it from), and for a role with a serving port the endpoint and the tunnel
    command. A role that gave its node back keeps its node and zone and adds `<role>Released`,
    what infra.ops names in its message; a role the stack does not have has none."""
    cfg = res.config
    user, key = cfg.ssh.user, cfg.ssh.private_key_file
    vm = res.vms.get(row.name)
    outputs: dict[str, Any] = {}
    if vm is None and not row.releasable:
        return outputs
    outputs[row.output("Node")] = row.node_name(cfg)
    outputs[row.output("Zone")] = vm.zone if vm is not None else row.section(cfg).zone
    if row.releasable and res.released is not None:
        outputs[row.output("Released")] = res.released
    if vm is None:
        return outputs
    ips = vm.external_ips
    outputs |= {
        row.output("Placement"): vm.placement,
        row.output("WorkerIps"): ips,
        row.output("SshCommands"): ips.apply(functools.partial(ssh_commands, user, key)),
    }
    if vm.record_uri is not None:
        outputs[row.output("RecoveryRecord")] = vm.record_uri
    if row.has_serving_port:
        port = cfg.serving.port
        outputs |= {
            "servingEndpoint": ips.apply(functools.partial(endpoint_url, port)),
            "servingTunnelCommand": ips.apply(functools.partial(tunnel_command, user, key, port)),
        }
    return outputs


def export(res: StackResources) -> None:
    for name, value in res.outputs.items():
        pulumi.export(name, value)


def run() -> StackResources:
    """Loads and validates the stack config, declares the stack and exports its outputs.

    Raises:
        pulumi.RunError: the config is invalid (every problem, one line each); nothing declared.
    """
    try:
        cfg, token = stack_config.load_stack_config()
        ssh_keys = resolve_ssh_keys(cfg)
    except config_mod.ConfigError as exc:
        lines = "\n".join(f"  {p}" for p in exc.problems)
        raise pulumi.RunError(
            f"stack config {pulumi.get_stack()!r} is invalid ({len(exc.problems)} problem(s)); "
            f"nothing was created:\n{lines}"
        ) from None
    if cfg.project == config_mod.PLACEHOLDER_PROJECT:
        pulumi.log.warn(
            f"project is the placeholder {cfg.project!r}: set your own with "
            f"`pulumi config set {config_mod.PROJECT}:project <id>` "
            "(`python -m infra.preflight` checks it)"
        )
    for warning in validation.cross_region_fallbacks(cfg):
        pulumi.log.warn(warning)
    report_compile_check(cfg, pulumi.get_stack())
    released = read_release(cfg)
    resources = build(
        cfg,
        token,
        ssh_keys=ssh_keys,
        stack=pulumi.get_stack(),
        released=released,
    )
    export(resources)
    return resources


def read_release(cfg: config_mod.StackConfig) -> dict[str, Any] | None:
    """The run's release record, with a line saying what it means; a bucket that cannot be read
    is a warning (the node is then declared as usual)."""
    try:
        released = release_record.read(cfg)
    except Exception as exc:
        pulumi.log.warn(
            f"training.releaseWhenDone: cannot read {runconfig_render.release_marker_uri(cfg)} "
            f"({errors.exception_line(exc)}); declaring the training node as usual"
        )
        return None
    if released is not None:
        pulumi.log.info(
            f"run {cfg.run_name} finished and released its training TPU "
            f"{cfg.training_node_name} ({released['marker']}): the node is left out; set a new "
            "runName to train again"
        )
    return released


def report_compile_check(cfg: config_mod.StackConfig, stack: str) -> None:
    """Shows the last deviceless compile check of these exact training settings (from its
    cache, nothing is compiled here); a step that XLA found too big for the chip stops the
    program before anything is declared.

    Raises:
        pulumi.RunError: the cached compile check says the step does not fit.
    """
    summary = compile_check.cached_summary(stack, cfg)
    if summary is None:
        pulumi.log.info(
            "compile-check: no result for these training settings yet; `python -m "
            f"infra.preflight --compile --stack {stack}` compiles the step for "
            f"{cfg.training.accelerator} on this machine (a few minutes, no TPU needed)"
        )
    elif compile_check.DOES_NOT_FIT in summary:
        raise pulumi.RunError(f"{summary}; nothing was created")
    else:
        pulumi.log.info(summary)
