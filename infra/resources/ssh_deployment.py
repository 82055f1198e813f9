"""The deployment resource: a Pulumi dynamic provider that pushes the workloads to a VM's workers.

`pulumi preview` shows a SshDeployment per VM with its inputs; `pulumi up` runs create or
update (infra.remote.deploy_all over SSH to every worker in parallel), `pulumi destroy` runs
delete (stop and disable the units). The diff looks only at content hashes (wheel, run config,
units) and at what is enabled and started, so an unchanged checkout costs nothing; a different
host list is a new set of machines and replaces the resource (old units are stopped first).

The provider runs in Pulumi's provider process, not in the program: no SSH happens in
`Output.apply`, and everything it needs travels in its inputs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Mapping
from typing import Any

import fabric
import pulumi
import pulumi.dynamic
import pydantic

from infra import remote
from infra.errors import InfraError
from infra.remote import ssh
from infra.remote.ssh import SshSettings  # the field `ssh` below shadows the module in the class
from infra.resources import dynamic_values, ssh_access
from infra.resources.previous_types import renamed_from
from infra.tpu import api as tpu_api
from infra.tpu import placement as tpu_placement
from workloads.common import logs

# This runs in Pulumi's provider process: what it says reaches `pulumi up` through stderr
# (workloads.common.logs explains how).
LOG = logs.get("deploy")

UNKNOWN = dynamic_values.UNKNOWN  # Pulumi's placeholder, during preview, for a value not known yet

# A different value here means different machines: replace (delete old, then create new).
REPLACE_KEYS = ("hosts", "remote_root", "vm")
# Content and behaviour: update in place (a remote no-op when the fingerprint matches).
CONTENT_KEYS = (
    "wheel_sha256",
    "run_config_sha256",
    "units_sha256",
    "enable",
    "start",
    "install_deps",
)
# How to reach the workers: an update so the state (used by delete) follows the config. Only
# portable values (infra.resources.ssh_access): each operation finds the key file on its own
# machine.
CONNECTION_KEYS = ("stack", "port", "ssh_user", "ssh_key_fingerprint", "known_hosts", "use_sudo")


def _still_ours(conn: Any, settings: Any) -> bool:
    """Whether a worker answers as the VM we deployed to. A changed host key or a refused
    identity on delete means the address now belongs to another machine (a replaced or
    preempted VM): we must not talk to it, and there is nothing of ours left to stop there."""
    try:
        return remote.reachable(conn, settings=settings)
    except ssh.SshError as exc:
        LOG.warning("%s: not the deployed worker any more (%s); skipping", conn.host, exc)
        return False


class DeploymentInputs(dynamic_values.ProviderState):
    """The inputs of one SshDeployment, as the provider receives and stores them (flat: the
    fields of `ssh` and `bundle` sit next to `vm` and `hosts`, with the content hashes).

    Attributes:
        vm: TPU node name (for messages and the resource id).
        hosts: addresses of every worker of the VM, worker 0 first.
        ssh: the stack, user, key fingerprint, known_hosts name and port (portable: the key
            file is found on the machine that runs each operation, `settings`).
        bundle: what is installed on every worker (wheel, run config, units; infra.remote);
            its wheel path is relative to the project directory (`local_bundle`).
        use_sudo: prefix privileged commands with `sudo -n` (any user but root).
        remote_root: prefix of every remote path ("/" on real VMs).
        ready_timeout_s: how long to wait for SSH and the startup script's ready marker.
        node: the TPU node's full name (projects/P/locations/Z/nodes/N), read through the
            Cloud TPU API before a deploy waits on `hosts`; None: not read (older states).
    """

    vm: str
    hosts: list[str]
    node: str | None = None
    ssh: ssh_access.SshAccess = pydantic.Field(json_schema_extra=dynamic_values.FLAT)
    bundle: remote.Bundle = pydantic.Field(json_schema_extra=dynamic_values.FLAT)
    use_sudo: bool = True
    remote_root: str = "/"
    ready_timeout_s: float = 3600.0

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def run_config_sha256(self) -> str:
        return remote.sha256_text(self.bundle.run_config_yaml)

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def units_sha256(self) -> str:
        return units_sha256(self.bundle.units)

    def local_bundle(self) -> remote.Bundle:
        """The bundle with its wheel found in this machine's project directory."""
        return dataclasses.replace(
            self.bundle, wheel_path=ssh_access.local_path(self.bundle.wheel_path)
        )

    def settings(self) -> SshSettings:
        """How this machine reaches the workers (its key file, its known_hosts)."""
        return ssh_access.settings_here(self.ssh)

    def connections(self, settings: SshSettings) -> list[fabric.Connection]:
        return [ssh.connect(host, settings) for host in self.hosts]


class DeploymentOutputs(DeploymentInputs):
    """What create and update store: the inputs, and what the deploy found.

    Attributes:
        fingerprint: hash of everything deployed (equal on every worker).
        changed_hosts: workers the deploy actually changed.
    """

    fingerprint: str
    changed_hosts: list[str]


def _forget_hosts(inputs: DeploymentInputs, settings: SshSettings) -> None:
    """Drops the deployment's old workers from known_hosts once it is deleted: a different host
    list replaces the deployment (this delete runs first), and the old addresses, ephemeral,
    can come back on another VM with another host key, which must then be trusted as a new
    host. Best effort: the units are stopped already, and a key left behind only makes a later
    connection say how to forget it."""
    try:
        removed = ssh.forget_hosts(settings.known_hosts, list(inputs.hosts), (settings.port, 22))
    except OSError as exc:
        LOG.warning("%s: cannot update %s: %s", inputs.vm, settings.known_hosts, exc)
        return
    if removed:
        LOG.info("%s: forgot the host keys of %s", inputs.vm, ", ".join(sorted(set(removed))))


def new_tpu_api() -> tpu_placement.PlacementApi:
    """The Cloud TPU API the deploy reads its node through (tests replace this function)."""
    return tpu_api.GoogleTpuApi(timeout_s=60.0)


def check_node(inputs: DeploymentInputs) -> None:
    """Reads the deployment's node before the deploy waits on its workers, and stops at once
    with one line when they cannot be where the state says.

    Why: the workers' addresses come from the node's state, which changes only at a refresh.
    A node stopped (serving.stopAfterHours) and started again may have other external
    addresses; a deploy to the old ones would wait its whole ready timeout (an hour) for a
    machine that is not there. A read that fails (no credentials, the API down) is logged
    and the deploy goes on as before: the check only spares a wait.

    Raises:
        InfraError: the node is gone, stopped, or has other worker addresses.
    """
    if not inputs.node:
        return
    short = inputs.node.rsplit("/", 1)[-1]
    try:
        node = new_tpu_api().get_node(inputs.node)
    except Exception as exc:
        LOG.warning(
            "%s: cannot read TPU node %s (%s); deploying to %s",
            inputs.vm,
            short,
            exc,
            ", ".join(inputs.hosts),
        )
        return
    refresh = "run `pulumi up --refresh` (or `pulumi refresh`, then `pulumi up`)"
    if node is None:
        raise InfraError(f"{inputs.vm}: TPU node {short} does not exist any more: {refresh}")
    state = str(node.get("state") or "")
    if state in ("STOPPED", "STOPPING"):
        zone = inputs.node.split("/locations/", 1)[-1].split("/", 1)[0]
        raise InfraError(
            f"{inputs.vm}: TPU node {short} is {state}: start it (`gcloud compute tpus tpu-vm "
            f"start {short} --zone {zone}`), then {refresh}"
        )
    now = tpu_placement.external_ips(node.get("network_endpoints"))
    if state == "READY" and all(now) and now != list(inputs.hosts):
        raise InfraError(
            f"{inputs.vm}: TPU node {short} now has its workers at {', '.join(now)}, not at "
            f"{', '.join(inputs.hosts)} as the state says (it was stopped and started again?): "
            f"{refresh}"
        )


def units_sha256(units: Mapping[str, str]) -> str:
    return remote.sha256_text(
        "\n".join(f"{name}\0{remote.sha256_text(text)}" for name, text in sorted(units.items()))
    )


def progress(vm: str) -> remote.StepHook:
    """Reports each remote step as `deploy: <vm> <host>: <step>` (the line `pulumi up` shows)."""

    def hook(host: str, step: str) -> None:
        LOG.info("%s %s: %s", vm, host, step)

    return hook


class SshDeploymentProvider(pulumi.dynamic.ResourceProvider):
    """create/update deploy over SSH, delete stops the job; diff compares content hashes.

    Pulumi serialises this object into the state with dill; it holds no attributes, and the
    modules it uses (infra.remote, infra.remote.ssh) are imported by name in the provider process.
    """

    # Tests shorten the backoff; real VMs take minutes to boot.
    ready_initial_delay_s = 2.0

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.CheckResult:
        failures = []
        hosts = news.get("hosts") or []
        if not dynamic_values.is_unknown(hosts) and not hosts:
            failures.append(
                pulumi.dynamic.CheckFailure("hosts", "the VM reports no worker addresses")
            )
        elif not dynamic_values.is_unknown(hosts) and any(not h for h in hosts):
            failures.append(
                pulumi.dynamic.CheckFailure(
                    "hosts", f"a worker has no address (got {hosts}); the VM needs external IPs"
                )
            )
        units = news.get("units")
        if not dynamic_values.is_unknown(units) and not units:
            failures.append(pulumi.dynamic.CheckFailure("units", "no systemd unit to deploy"))
        for key in ("enable", "start"):
            names = news.get(key) or []
            if dynamic_values.is_unknown(names) or dynamic_values.is_unknown(units):
                continue
            missing = [n for n in names if n not in (units or {})]
            if missing:
                failures.append(
                    pulumi.dynamic.CheckFailure(
                        key, f"{missing} not among the units {sorted(units or {})}"
                    )
                )
        return pulumi.dynamic.CheckResult(news, failures)

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        news = dict(news)
        if (
            "units" in news
            and "units_sha256" not in news
            and not dynamic_values.is_unknown(news["units"])
        ):
            news["units_sha256"] = units_sha256(news["units"])
        replaces = [
            k
            for k in REPLACE_KEYS
            if not dynamic_values.is_unknown(news.get(k))
            and dynamic_values.comparable(olds.get(k)) != dynamic_values.comparable(news.get(k))
        ]
        changed = [
            k
            for k in (*REPLACE_KEYS, *CONTENT_KEYS, *CONNECTION_KEYS)
            if dynamic_values.is_unknown(news.get(k))
            or dynamic_values.comparable(olds.get(k)) != dynamic_values.comparable(news.get(k))
        ]
        return pulumi.dynamic.DiffResult(
            changes=bool(changed),
            replaces=replaces,
            stables=[k for k in ("vm", "remote_root") if k not in changed],
            # The same machines may come back under a changed list: stop the old units first.
            delete_before_replace=True,
        )

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        inputs = DeploymentInputs.model_validate(props)
        outs = self.deploy(inputs)
        return pulumi.dynamic.CreateResult(id_=f"{inputs.vm}-workloads", outs=outs)

    def update(
        self, _id: str, _olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.UpdateResult:
        inputs = DeploymentInputs.model_validate(news)
        return pulumi.dynamic.UpdateResult(outs=self.deploy(inputs))

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        # Stopping units is best effort: the VM is usually being deleted too (or was preempted
        # and replaced, and its address may now belong to another machine).
        inputs = DeploymentInputs.model_validate(props)
        settings = inputs.settings()
        conns = inputs.connections(settings)
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(conns) or 1) as pool:
                answers = list(pool.map(lambda c: _still_ours(c, settings), conns))
            reachable = [c for c, ok in zip(conns, answers, strict=True) if ok]
            for conn, ok in zip(conns, answers, strict=True):
                if not ok:
                    # The VM is gone (or its address changed): nothing is left to stop there.
                    LOG.warning("%s: not reachable, assuming the worker is gone", conn.host)
            remote.undeploy_all(
                inputs.vm,
                reachable,
                remote.RemoteLayout(inputs.remote_root),
                list(inputs.bundle.units),
                sudo=inputs.use_sudo,
                hook=progress(inputs.vm),
            )
        finally:
            for conn in conns:
                conn.close()
        _forget_hosts(inputs, settings)

    def deploy(
        self, inputs: DeploymentInputs, settings: SshSettings | None = None
    ) -> dict[str, Any]:
        """Deploys the bundle to every worker of `inputs` and returns the outputs to store: what
        create and update run, and what the rehearsal runs on its container VMs.

        Args:
            settings: how to reach the workers; None: this machine's (`inputs.settings()`: the
                key file and known_hosts its stack file names). The rehearsal passes its own
                key and known_hosts.

        Raises:
            InfraError: the node cannot be where the state says (`check_node`), or the deploy
                failed on a worker (infra.remote's DeployError).
        """
        check_node(inputs)
        bundle = inputs.local_bundle()
        settings = settings or inputs.settings()
        conns = inputs.connections(settings)
        try:
            results = remote.deploy_all(
                inputs.vm,
                conns,
                bundle,
                remote.RemoteLayout(inputs.remote_root),
                sudo=inputs.use_sudo,
                ready_timeout_s=inputs.ready_timeout_s,
                ready_initial_delay_s=self.ready_initial_delay_s,
                settings=settings,
                hook=progress(inputs.vm),
            )
        finally:
            for conn in conns:
                conn.close()
        return DeploymentOutputs(
            **dict(inputs),
            fingerprint=bundle.fingerprint,
            changed_hosts=[r.host for r in results if r.changed],
        ).props()


class SshDeployment(pulumi.dynamic.Resource, module="gemma4", name="SshDeployment"):
    """The workloads package, run config and systemd units deployed to every worker of one VM.

    Outputs:
        fingerprint: hash of everything deployed (equal on every worker).
        changed_hosts: workers the last create/update actually changed.
    """

    fingerprint: pulumi.Output[str]
    changed_hosts: pulumi.Output[list[str]]
    hosts: pulumi.Output[list[str]]
    units_sha256: pulumi.Output[str]

    def __init__(
        self, name: str, props: Mapping[str, Any], opts: pulumi.ResourceOptions | None = None
    ) -> None:
        """Declares the deployment.

        Args:
            name: resource name.
            props: DeploymentInputs.props() keys; any value may be a pulumi Input (the host
                list is usually the VM's Output).
            opts: resource options (parent, depends_on).
        """
        # Registered as WorkloadDeployment (next to the WorkloadsDeployment component) before;
        # the alias keeps existing stacks from replacing it, which would stop the running job.
        opts = renamed_from("pulumi-python:dynamic/gemma4:WorkloadDeployment", opts)
        super().__init__(
            SshDeploymentProvider(),
            name,
            {**props, "fingerprint": None, "changed_hosts": None},
            opts,
        )
