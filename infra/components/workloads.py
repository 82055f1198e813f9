"""The deployment component: builds the wheel of this checkout and deploys it to one VM's workers.

`declare(...)` is what the program calls once per VM (training, serving). It renders the systemd
units for the VM's role from templates/systemd/, builds (or reuses) the wheel, and declares one
infra.ssh_deployment.SshDeployment whose inputs are content hashes, so `pulumi preview` shows
what would be redeployed and why.

One module on purpose (~480 lines): building the wheel, rendering the systemd units and declaring
the deployment are the three steps of one component, and their content hashes must agree with each
other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import pulumi

from infra import remote, ssh, ssh_access, ssh_deployment, templating, wheel_build
from infra.deployment_record import VmInfo
from workloads import runconfig

if TYPE_CHECKING:  # the config model is only needed for the type; no import cycle at runtime
    from infra import config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_WHEEL_CACHE = REPO_ROOT / ".whl"
# The files the wheel is built from (their hash is the build cache key).
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "workloads", "infra")
# The content hash ignores `infra/` (shipped in the same distribution but never run on the VMs)
# and RECORD (it lists infra's hashes): editing the Pulumi program does not restart training.
_HASH_IGNORED_PREFIXES = ("infra/",)

Role = Literal["train", "serve"]
ROLES: tuple[Role, ...] = ("train", "serve")

TRAIN_UNIT = "gemma4-train.service"
MERGE_UNIT = "gemma4-merge.service"
SERVE_UNIT = "gemma4-serve.service"
EVAL_UNIT = "gemma4-eval.service"
BENCH_UNIT = "gemma4-bench.service"
RELEASE_UNIT = "gemma4-release.service"
STOP_UNIT = "gemma4-serve-stop.service"
STOP_TIMER = "gemma4-serve-stop.timer"
ALL_UNITS = (
    TRAIN_UNIT,
    MERGE_UNIT,
    RELEASE_UNIT,
    SERVE_UNIT,
    EVAL_UNIT,
    BENCH_UNIT,
    STOP_UNIT,
    STOP_TIMER,
)
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


class WheelBuildError(Exception):
    """The checkout cannot be built into a wheel; the message names the file or key."""


@dataclasses.dataclass(frozen=True)
class Wheel:
    """A built wheel: its path and its content hash (see wheel_hash)."""

    path: str
    sha256: str


def _source_files(source_dir: pathlib.Path) -> list[pathlib.Path]:
    files = []
    for entry in WHEEL_SOURCES:
        path = source_dir / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
            ]
    return sorted(files)


def source_hash(source_dir: pathlib.Path = REPO_ROOT) -> str:
    """Hash of every file that goes into the wheel build (the cache key)."""
    digest = hashlib.sha256()
    for path in _source_files(source_dir):
        digest.update(path.relative_to(source_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def wheel_hash(wheel_path: str | pathlib.Path) -> str:
    """Content hash of a wheel: member names and bytes, independent of zip timestamps.

    Members under infra/ and the RECORD file are left out (see _HASH_IGNORED_PREFIXES).
    """
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel_path) as archive:
        for name in sorted(archive.namelist()):
            if name.startswith(_HASH_IGNORED_PREFIXES) or name.endswith(".dist-info/RECORD"):
                continue
            digest.update(name.encode() + b"\0")
            digest.update(hashlib.sha256(archive.read(name)).digest())
    return digest.hexdigest()


def build_wheel(
    source_dir: pathlib.Path = REPO_ROOT, cache_dir: pathlib.Path = DEFAULT_WHEEL_CACHE
) -> Wheel:
    """Builds the wheel of this checkout (infra.wheel_build: no pip, no setuptools, offline),
    cached by source hash.

    The same source files give the same members on any machine (a clone or the recovery
    controller's copy from the source archive), hence the same wheel_hash and fingerprint.

    Raises:
        WheelBuildError: pyproject.toml cannot be built (the message names the key or file).
    """
    key = source_hash(source_dir)[:20]
    target = cache_dir / key
    found = sorted(target.glob("*.whl")) if target.is_dir() else []
    if len(found) == 1:
        return Wheel(str(found[0]), wheel_hash(found[0]))
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".build-") as tmp:
        staged = pathlib.Path(tmp) / key
        try:
            wheel_build.build(source_dir, staged)
        except wheel_build.WheelBuildError as exc:
            raise WheelBuildError(f"building the wheel of {source_dir}: {exc}") from None
        try:
            # Atomic: a concurrent build of the same source wins or loses whole.
            staged.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    _prune(cache_dir, keep=target)
    wheel = sorted(target.glob("*.whl"))[0]
    return Wheel(str(wheel), wheel_hash(wheel))


def _prune(cache_dir: pathlib.Path, keep: pathlib.Path, entries: int = 5) -> None:
    """Keeps the newest few builds in the cache (only directories this module created)."""
    builds = sorted(
        (p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[entries - 1 :]:
        if all(f.suffix == ".whl" for f in old.iterdir()):
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# systemd units


def systemd_quote(value: Any) -> str:
    """Quotes one argument of a systemd ExecStart= line (also escapes % specifiers and $)."""
    text = str(value).replace("%", "%%").replace("$", "$$")
    if text and all(c.isalnum() or c in "/._-+=:,@" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _environment() -> jinja2.Environment:
    env = templating.environment()
    env.filters["sd"] = systemd_quote
    return env


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """The units of one VM: name -> rendered text, which to enable and which to start."""

    units: dict[str, str]
    enable: list[str]
    start: list[str]


def plan_units(
    role: Role,
    run_config: runconfig.RunConfig,
    layout: remote.RemoteLayout,
    *,
    curl: str = "/usr/bin/curl",
    restart_burst: int = 10,
) -> UnitPlan:
    """Renders the units for a VM's role.

    train: gemma4-train (enabled, started) and, when the run config has a merge section,
        gemma4-merge (started by train's OnSuccess=); with a release section, gemma4-release
        (started by the last of those two on success).
    serve: gemma4-serve (enabled, started), plus gemma4-eval and gemma4-bench when configured
        (enabled as WantedBy=gemma4-serve, so every serve start pulls them in; bench after eval),
        and with a stop section the gemma4-serve-stop timer (enabled, started) and its service.

    Raises:
        ValueError: an unknown role, or a serve role without a serve section.
    """
    env = _environment()
    context: dict[str, Any] = {
        "run_name": run_config.run_name,
        # Only paths under `current`: a unit starts whatever release is active, and `current`
        # only ever points at a complete one (infra.remote.release).
        "python": layout.active_python,
        "config_path": layout.active_config,
        "env_file": layout.env_file,
        "work_dir": layout.state_dir,
        "ready_marker": layout.ready_marker,
        "restart_burst": restart_burst,
    }

    def render(unit: str, **extra: Any) -> str:
        return env.get_template(f"systemd/{unit}.j2").render(**context, **extra)

    if role == "train":
        merge, release = run_config.merge is not None, run_config.release is not None
        units = {TRAIN_UNIT: render(TRAIN_UNIT, merge=merge, release=release and not merge)}
        if merge:
            units[MERGE_UNIT] = render(MERGE_UNIT, release=release)
        if release:
            units[RELEASE_UNIT] = render(RELEASE_UNIT)
        return UnitPlan(units, enable=[TRAIN_UNIT], start=[TRAIN_UNIT])
    if role == "serve":
        if run_config.serve is None:
            raise ValueError(
                "role 'serve' needs a run config with a serve section (serving.enabled)"
            )
        serve = run_config.serve
        health = {
            "curl": curl,
            "health_url": f"http://127.0.0.1:{serve.port}/health",
            "ready_timeout_s": serve.ready_timeout_s,
        }
        units = {SERVE_UNIT: render(SERVE_UNIT)}
        order = [SERVE_UNIT]
        if run_config.eval is not None:
            units[EVAL_UNIT] = render(EVAL_UNIT, **health)
            order.append(EVAL_UNIT)
        if run_config.bench is not None:
            units[BENCH_UNIT] = render(BENCH_UNIT, after_eval=run_config.eval is not None, **health)
            order.append(BENCH_UNIT)
        if run_config.stop is not None:
            stop = run_config.stop
            units[STOP_UNIT] = render(STOP_UNIT, stop=stop)
            units[STOP_TIMER] = render(STOP_TIMER, after_s=round(stop.after_hours * 3600))
            order.append(STOP_TIMER)
        return UnitPlan(units, enable=list(order), start=list(order))
    raise ValueError(f"unknown role {role!r}; allowed: {', '.join(ROLES)}")


# ---------------------------------------------------------------------------------------------
# The component


@dataclasses.dataclass
class WorkloadsDeploymentArgs:
    """Inputs of one VM's deployment.

    Attributes:
        vm: TPU node name.
        role: "train" (train + merge units) or "serve" (serve + eval + bench units).
        hosts: worker addresses, worker 0 first (usually an Output of the TPU VM).
        run_config: the run config rendered from the stack config (infra.runconfig_render).
        ssh: the stack, user, key fingerprint, known_hosts name, port: portable values only;
            the key file is found on the machine that runs each operation (infra.ssh_access).
        project: Google Cloud project (for `python -m infra.ops status`).
        zone: the VM's zone (same).
        remote_root: prefix of every remote path; "/" on real VMs (tests use a temp dir).
        use_sudo: run privileged commands with `sudo -n`; None = unless the user is root.
        ready_timeout_s: how long to wait for SSH and the startup script's ready marker (the
            training VM's first boot installs the stack and stages ~62 GB of weights).
        install_deps: let pip add dependencies the startup script did not install.
        wheel: a prebuilt wheel; None = build this checkout (cached in .whl/).
    """

    vm: str
    role: Role
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
        plan = plan_units(args.role, args.run_config, layout)
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
        props = {**inputs.props(), "hosts": args.hosts}
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


def _ops_info(record: VmInfo, hosts: Sequence[str], zone: str | None) -> dict[str, Any]:
    """Pure: the deployment's record with the resolved worker addresses and zone, as exported."""
    return record.model_copy(update={"hosts": list(hosts), "zone": zone}).props()


def declare(
    name: str,
    *,
    vm: str,
    role: Role,
    hosts: pulumi.Input[Sequence[str]],
    run_config: runconfig.RunConfig,
    access: ssh_access.SshAccess,
    project: str | None = None,
    zone: pulumi.Input[str] | None = None,
    opts: pulumi.ResourceOptions | None = None,
    **overrides: Any,
) -> WorkloadsDeployment:
    """Declares the deployment of one VM (what infra/__main__.py calls).

    Args:
        name: component name, e.g. "train" or "serve".
        vm: TPU node name.
        role: "train" or "serve".
        hosts: worker addresses (Output of the TPU VM component), worker 0 first.
        run_config: infra.runconfig_render.render_run_config(cfg).
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
        cfg: the validated infra.config.StackConfig.
        run_config: infra.runconfig_render.render_run_config(cfg); each VM gets it without
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
    # Portable values only: the key file is found where each operation runs (infra.ssh_access).
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
