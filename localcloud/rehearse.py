"""`python -m localcloud rehearse --stack dev`: the life of a run on containers, before a TPU bills.

The TPU nodes are created, preempted, replaced and deleted through the local Cloud TPU API
(localcloud/tpu_api.py) by the project's own TpuNode provider and the real client, with the
program's IAM checked on every call (localcloud/control_plane.py).

Stages: localcloud/stages.py's STAGES, in order (each prints one line with its time);
docs/rehearsal.md describes each.
Then a summary: which VM ran what, and the stand-ins used.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from infra.config import runconfig_render, stack_config
from infra.errors import InfraError
from infra.vm import layout
from localcloud import (
    cloud_vm,
    control_plane,
    metadata_server,
    rootfs,
    stack_plan,
    stages,
    throttle,
)
from localcloud.errors import CannotBoot, MachineError, RehearsalError
from localcloud.machine import Machine
from workloads.common import gcs_server
from workloads.train import runlock

# GCE's Debian 12 image as the boot path sees it, with sshd and sudo (a VM has both), and
# libnuma1 for the docker stand-in's CPU build of vLLM (the TPU image carries its own).
VM_PACKAGES = (*rootfs.STOCK_GCE, "openssh-server", "sudo", "libnuma1")
REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE_VENV = REPO / ".venv-serve"  # `bash .ci/setup` makes it
METADATA_PREFIX = "127.0.1."
# The run lock's lease on the rehearsal's VMs (GEMMA4_LOCK_LEASE_S; 120 s on a real VM): the new
# VM still watches the preempted one's lock go unrenewed for a whole lease before it takes the
# run over, so the takeover runs as on GCP, in a sixth of the wait.
LEASE_S = 20
# How long the first VM's base model weights take to stage from the bucket by default (their
# reads are slowed to that: localcloud/throttle.py), so that the boot's stage records show the
# trainer's data and compile finishing while the weights still arrive, as on a VM staging ~62 GB.
# Long enough for python, the venv, the deploy, the data and a compile on 2 busy cores (in CI,
# beside the slow tests, at 150 s the compile ended after the weights); the new VM after the
# preemption stages at full speed (nothing more to show). CI does not wait for it: the default
# suite beside the rehearsal takes longer than the whole rehearsal.
WEIGHTS_S = 240.0
# run's exit status when this machine cannot build or boot containers (not root, a tool missing).
EXIT_CANNOT_BOOT = 2
# What a rehearsal owns in its workdir, removed when the next one starts.
OWNED = ("gcs", "vms", "logs", "ssh", "tiny-model", "data.jsonl")

# How long each stage's wait may take before the stage fails. The stages' times measured on the
# 2-core development VM with a CI run beside it (docs/benchmarks.md, "The local rehearsal") are
# the yardstick: each limit is several times its wait's measured time, room for a slower or
# busier machine, and still minutes, not the hour a hung VM would bill on GCP.
# The startup script to its ready marker (apt, the venv by uv), then the deploy over SSH: the
# SshDeployment's ready_timeout_s, an hour on a real VM (the deploy stage took 92 s).
READY_S = 900.0
# The recovery controller's first look at the training node: its recover.sh (apt, its user and
# venv) ran beside the training VM's boot and deploy, so little is left by then (6 s measured);
# 600 s covers its whole boot had the deploy been quick.
CONTROLLER_S = 600.0
# The first intact checkpoint: the rest of the weights at WEIGHTS_S, the step's compile on JAX's
# CPU backend and 4 steps (213 s measured).
CHECKPOINT_S = 900.0
# The first VM's venv archive in the bucket (packed and uploaded after ready, beside the
# trainer): the preemption waits for it, so that the new VM restores the venv from it as every
# VM after the first does (on a TPU VM the upload is done minutes before a preemption could
# matter; here the first checkpoint can come first). About 40 s of packing and upload measured.
VENV_ARCHIVE_S = 600.0
# The controller's 30 s check seeing PREEMPTED, the node recreated, and the new VM's boot to its
# trainer: venv from the bucket's archive, the release installed (77 s measured).
RECOVER_S = 900.0
# A whole run-lock lease (LEASE_S) watched unrenewed, then steps 5-12 (105 s measured).
RESUME_S = 900.0
# The merge unit, which starts when the trainer ends: the merged shards in the bucket (4 s
# measured; the tiny model's merge reads and writes a few MiB).
MERGE_S = 600.0
# The release unit's record and the VM's delete of its own node through the API (2 s measured).
RELEASE_S = 300.0
# The serving VM's /health after its deploy: vLLM's CPU build loading the merged model (the
# serve stage, boot and deploy included, took 69 s).
HEALTH_S = 900.0
# The eval or the bench unit to its end, with the report (13 s and 12 s measured).
JOB_S = 900.0


@dataclasses.dataclass
class Stage:
    name: str
    seconds: float
    note: str


class Rehearsal:
    """One rehearsal's cloud: the storage server, the VMs, their metadata servers."""

    def __init__(self, stack: str, workdir: pathlib.Path, say: Callable[[str], None]) -> None:
        self.stack = stack
        self.workdir = workdir
        self.say = say
        self.stages: list[Stage] = []
        self.vms: list[cloud_vm.CloudVm] = []
        self.servers: list[metadata_server.MetadataServer] = []
        self.storage: gcs_server.GcsServer | None = None
        # What close undoes: this process's clients pointed at the storage server.
        self._undo = contextlib.ExitStack()
        self.addresses = 0
        self.ran: list[str] = []
        self.control: control_plane.ControlPlane | None = None
        self.weights_s = 0.0  # > 0: the model's weights are read that slowly (SlowReads)
        self.slow_reads: throttle.SlowReads | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[list[str]]:
        if name not in stages.STAGES:
            raise ValueError(f"stage {name!r} is not in localcloud/stages.py's STAGES")
        note: list[str] = []
        started = time.monotonic()
        try:
            yield note
        except (OSError, subprocess.SubprocessError, InfraError) as exc:
            # InfraError: infra's own, and the local cloud's (localcloud/errors.py).
            raise RehearsalError(f"stage {name}: {exc}") from exc
        seconds = time.monotonic() - started
        self.stages.append(Stage(name, seconds, "; ".join(note)))
        self.say(f"{name:<8} {seconds:6.1f} s  {'; '.join(note)}")

    # -- the cloud ---------------------------------------------------------------------------

    def start_storage(self) -> str:
        """Starts the GCS protocol server and points this process's gcsfs and TensorStore at
        it (restored by close): the program's own gs:// reads (released.json with
        releaseWhenDone) go to the stack's buckets here as they go to GCS on a real `up`."""
        self.storage = gcs_server.GcsServer(self.workdir / "gcs" / "objects")
        self.storage.root.parent.mkdir(parents=True, exist_ok=True)
        self.storage.start()
        self._undo.enter_context(gcs_server.clients_at(self.storage.url))
        return self.storage.url

    @property
    def gcs(self) -> gcs_server.Client:
        """The storage server's objects, read and written directly (not through a VM)."""
        return self._storage().client()

    def _storage(self) -> gcs_server.GcsServer:
        if self.storage is None:
            raise RehearsalError("the storage server is not started (start_storage)")
        return self.storage

    def add_buckets(self, buckets: list[str]) -> None:
        for name in buckets:
            try:
                self._storage().new_bucket(name)
            except urllib.error.HTTPError as exc:
                if exc.code != 409:  # 409: there already (a kept objects folder)
                    raise

    def new_vm(
        self,
        plan: stack_plan.VmPlan,
        tree: pathlib.Path,
        service_account: str = "",
        token: str = "localcloud",  # noqa: S107 - a stand-in, not a credential
    ) -> cloud_vm.CloudVm:
        """A new VM for `plan` (fresh disk, next address, new instance id), not booted; its
        metadata server hands out `token` for `service_account`."""
        n = self.addresses = _free_index(self.addresses + 1)
        address = f"{stack_plan.ADDRESS_PREFIX}{100 + n}"
        instance = metadata_server.Instance(
            name=plan.node_id,
            id=str(uuid.uuid4().int % 10**18),
            zone=plan.zone,
            project=str(stack_plan.OVERLAY["project"]),
            attributes=metadata_server.worker_attributes(plan.metadata, 0, [address]),
            service_account=service_account,
            token=token,
        )
        server = metadata_server.MetadataServer(instance, f"{METADATA_PREFIX}{n}")
        self.servers.append(server)
        machine = Machine(tree, self.workdir / "vms" / f"{plan.node_id}-{n}", f"{plan.node_id}-{n}")
        tpu_url = self.control.api.url if self.control is not None else None
        vm = cloud_vm.CloudVm(
            machine,
            address,
            server,
            self.slow_reads.url if self.slow_reads is not None else self._storage().url,
            tpu_url=tpu_url,
            settings={runlock.LEASE_ENV: str(LEASE_S)},
        )
        self.vms.append(vm)
        return vm

    def start_control_plane(self, cloud: TrainingCloud) -> control_plane.ControlPlane:
        """The local Cloud TPU API with the program's grants; its nodes boot as VMs here (the
        serving VM with its stand-ins), and stop as a killed machine, its logs kept."""

        def new_vm(plan: stack_plan.VmPlan, account: str, token: str) -> cloud_vm.CloudVm:
            vm = self.new_vm(plan, cloud.tree, account, token)
            if plan.role == "serve":
                from infra.config import runconfig_render
                from infra.vm import startup

                vm.install_serving(
                    ENGINE_VENV, runconfig_render.VERILOG_EVAL_DIR, startup.VERILOG_EVAL_COMMIT
                )
            return vm

        def halted(vm: cloud_vm.CloudVm) -> None:
            with contextlib.suppress(Exception):
                self.keep_logs(vm)
            vm.machine.preempt()

        self.control = control_plane.ControlPlane(cloud.plan, self.workdir, new_vm, halted)
        return self.control

    def keep_logs(self, vm: cloud_vm.CloudVm) -> pathlib.Path:
        """Copies the VM's startup log, journal and stage records under workdir/logs/<vm> (its
        disk goes). The stage records feed `benchmarks/startup.py --stage-records`."""
        out = self.workdir / "logs" / vm.name
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemma4-startup.log").write_text(vm.startup_log())
        with contextlib.suppress(OSError):
            shutil.copy(_stages_path(vm), out / "stages.jsonl")
        with contextlib.suppress(MachineError):
            if vm.machine.running():
                journal = vm.machine.run(["journalctl", "--no-pager", "-o", "short"], check=False)
                (out / "journal.log").write_text(journal.stdout)
        with contextlib.suppress(OSError):
            shutil.copy(vm.machine.console, out / "console.log")
        return out

    def slow_down_weights(self, model_uri: str, size: int) -> str:
        """Reads of `model_uri`'s safetensors (`size` bytes in all) from here on take
        `weights_s`: the VMs reach the storage through SlowReads. Returns a note."""
        rate = size / self.weights_s
        pattern = re.compile(re.escape(model_uri.rstrip("/")) + r"/[^/]+\.safetensors$")
        self.slow_reads = throttle.SlowReads(self._storage().url, pattern, rate)
        return (
            f"weights read at {rate / 1024:.0f} KiB/s ({size / 2**20:.1f} MiB in "
            f"{self.weights_s:.0f} s, as a large model stages)"
        )

    def close(self) -> None:
        if self.slow_reads is not None:
            self.slow_reads.stop()
            self.slow_reads = None
        if self.control is not None:
            self.control.close()
            self.control = None
        for vm in self.vms:
            with contextlib.suppress(Exception):
                self.keep_logs(vm)
            with contextlib.suppress(Exception):
                vm.machine.destroy()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()
        if self.storage is not None:
            self.storage.kill()
        self.vms, self.servers, self.storage = [], [], None
        self._undo.close()


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def _free_index(start: int) -> int:
    """The first VM index from `start` whose metadata (127.0.1.n:80) and SSH (127.0.2.100+n:22)
    addresses are free: another rehearsal (or test) may be running on this machine."""
    for n in range(start, 150):
        if _bindable(f"{METADATA_PREFIX}{n}", 80) and _bindable(
            f"{stack_plan.ADDRESS_PREFIX}{100 + n}", 22
        ):
            return n
    raise RehearsalError("no free loopback addresses for another VM (127.0.1.1-149 all in use)")


def _interrupted(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _ssh_key(workdir: pathlib.Path) -> tuple[pathlib.Path, str]:
    key = workdir / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rehearsal", "-f", str(key)],
            check=True,
        )
    return key, key.with_suffix(".pub").read_text().strip()


def _deploy(props: dict[str, Any], host: str, key: pathlib.Path, known_hosts: pathlib.Path) -> None:
    """Runs `pulumi up`'s SshDeployment deploy on `host`: the provider's own code (what its
    create and update run), with the rehearsal's key and known_hosts in place of the stack
    file's (the state is portable)."""
    from infra.remote import ssh
    from infra.resources import ssh_deployment

    settings = ssh.SshSettings(
        user=props["ssh_user"], key_path=str(key), known_hosts=str(known_hosts), port=22
    )
    inputs = ssh_deployment.DeploymentInputs.model_validate(
        {**props, "hosts": [host], "ready_timeout_s": READY_S}
    )
    ssh_deployment.SshDeploymentProvider().deploy(inputs, settings)


def _wait(
    what: str,
    check: Callable[[], bool],
    timeout_s: float,
    vm: cloud_vm.CloudVm,
    explain: Callable[[], str] | None = None,
) -> None:
    """Waits for `check`; on timeout the error names `vm`'s journal and, from `explain`, what
    the wait saw last (CI keeps only the tail of the output: the failure must say why)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if not vm.machine.running():
            raise RehearsalError(f"{vm.name} stopped while waiting for {what}")
        time.sleep(2)
    seen = ""
    if explain is not None:
        try:
            seen = explain()
        except Exception as exc:  # the diagnosis must not hide the timeout
            seen = f"(no diagnosis: {exc})"
    raise RehearsalError(
        f"{what}: not within {timeout_s:.0f} s on {vm.name} (its journal: "
        f"journalctl -D {vm.machine.root}/var/log/journal)" + (f"\n{seen}" if seen else "")
    )


def _unit_done(vm: cloud_vm.CloudVm, unit: str) -> bool:
    return _unit_state(vm, unit) in ("inactive", "failed")


def _unit_state(vm: cloud_vm.CloudVm, unit: str) -> str:
    """systemctl is-active's word, or "gone" once the VM is (a release deletes its own node,
    and the API then stops the VM: the units' work is done)."""
    try:
        proc = vm.machine.run(["systemctl", "is-active", unit], check=False)
    except MachineError:
        if vm.machine.running():
            raise
        return "gone"
    return proc.stdout.strip()


def _journal_tail(vm: cloud_vm.CloudVm, unit: str, lines: int = 15) -> str:
    with contextlib.suppress(MachineError):
        return vm.machine.run(
            ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"], check=False
        ).stdout
    return ""


def run(
    stack: str,
    workdir: pathlib.Path,
    say: Callable[[str], None] = print,
    weights_s: float = WEIGHTS_S,
) -> int:
    """The rehearsal; returns the exit status (0: every stage passed, 1: one failed, 2: this
    machine cannot boot containers)."""
    try:
        rootfs.check_tools()
    except CannotBoot as exc:
        say(f"rehearse: {exc}")
        return EXIT_CANNOT_BOOT
    workdir.mkdir(parents=True, exist_ok=True)
    for owned in OWNED:
        # A rehearsal starts from an empty cloud: no bucket objects, VMs or host keys of the last.
        shutil.rmtree(workdir / owned, ignore_errors=True)
    rehearsal = Rehearsal(stack, workdir, say)
    rehearsal.weights_s = weights_s
    # Ctrl-C or a SIGTERM (CI's timeout) still tears the VMs down and keeps their logs.
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        _life_of_a_run(rehearsal)
    except InfraError as exc:  # a stage's RehearsalError, a LocalCloudError or infra's own
        say(f"rehearse: FAILED: {exc} (logs: {workdir / 'logs'})")
        return 1
    except KeyboardInterrupt:
        say(f"rehearse: interrupted; VMs torn down (logs: {workdir / 'logs'})")
        return 130
    finally:
        rehearsal.close()
    _summary(rehearsal)
    return 0


@dataclasses.dataclass
class TrainingCloud:
    """The training VM's side of the cloud, ready to boot VMs into: what the rehearsal and the
    boot-fault cases (tests/localcloud) start from."""

    plan: stack_plan.StackPlan
    train: stack_plan.VmPlan
    deployment: dict[str, Any]
    run_config: dict[str, Any]
    tree: pathlib.Path
    key: pathlib.Path
    known_hosts: pathlib.Path

    def deploy(self, vm: cloud_vm.CloudVm) -> None:
        """`pulumi up`'s deployment of the training VM's workloads to `vm`."""
        _deploy(self.deployment, vm.address, self.key, self.known_hosts)


def prepare_training(
    r: Rehearsal, overlay: dict[str, Any] | None = None, *, serving: bool = False
) -> TrainingCloud:
    """Stages plan, cloud and image: the program under mocks (the rehearsal's config plus
    `overlay`), the storage server with the stack's buckets, the tiny model and data in them,
    and the Debian 12 tree."""
    key, public_key = _ssh_key(r.workdir)
    with r.stage("plan") as note:
        storage = r.start_storage()
        config = stack_plan.rehearsal_config(r.stack, public_key, key, serving=serving)
        config = stack_plan.merged(config, overlay or {})
        plan = stack_plan.plan(r.stack, config)
        train = plan.vms["train"]
        if train.deployment is None:
            raise RehearsalError("the program declares no deployment for the training VM")
        note.append(f"{len(plan.vms)} VM(s), buckets {', '.join(plan.buckets)}")
    with r.stage("cloud") as note:
        from workloads.data import synthetic
        from workloads.model import tiny_model

        r.add_buckets(plan.buckets)
        for uri, data in plan.objects.items():  # what `pulumi up` uploads (recovery records...)
            r.gcs.put(uri, data)
        # Where the startup script stages the model from: the renderer's answer for this config.
        cfg = plan.stack_config()
        model_uri = runconfig_render.base_model_uri(cfg)
        marker_uri = runconfig_render.base_model_marker_uri(cfg)
        local_model = r.workdir / "tiny-model"
        shutil.rmtree(local_model, ignore_errors=True)
        tiny_model.write_tiny_model(
            local_model, global_kv_heads=tiny_model.TP4_GLOBAL_KV_HEADS, dtype="bfloat16"
        )
        for path in sorted(local_model.iterdir()):
            r.gcs.put(f"{model_uri}/{path.name}", path.read_bytes())
        r.gcs.put(marker_uri, b"gemma4-tpu/gemma-4-tiny-random\n")
        if r.weights_s > 0:
            size = sum(p.stat().st_size for p in local_model.glob("*.safetensors"))
            note.append(r.slow_down_weights(model_uri, size))
        run_config = yaml.safe_load(train.deployment["run_config_yaml"])
        dataset_uri = run_config["data"]["dataset"]
        local_data = r.workdir / "data.jsonl"
        synthetic.write_synthetic_codev(str(local_data), 200)
        r.gcs.put(dataset_uri, local_data.read_bytes())
        note.append(f"storage {storage}; tiny model -> {model_uri}; data -> {dataset_uri}")
    with r.stage("image") as note:
        tree = rootfs.ensure(VM_PACKAGES)
        note.append(f"Debian 12 tree {tree}")
    return TrainingCloud(
        plan, train, train.deployment, run_config, tree, key, r.workdir / "ssh" / "known_hosts"
    )


@dataclasses.dataclass
class TrainingRun:
    """The training node's run as the stages hand it on: the node, its VM now, the recovery
    controller's VM, and the last step saved intact before the preemption."""

    cloud: TrainingCloud
    control: control_plane.ControlPlane
    node: str = ""
    vm: cloud_vm.CloudVm | None = None
    controller: cloud_vm.CloudVm | None = None
    saved: int = 0

    @property
    def run_dir(self) -> str:
        return str(self.cloud.run_config["train"]["output_dir"])

    def on(self) -> cloud_vm.CloudVm:
        """The node's VM now (the first, or the one recovery booted)."""
        if self.vm is None:
            raise RehearsalError("the training node has no VM yet (the boot stage)")
        return self.vm

    def watching(self) -> cloud_vm.CloudVm:
        if self.controller is None:
            raise RehearsalError("the recovery controller has no VM yet")
        return self.controller


def _life_of_a_run(r: Rehearsal) -> None:
    # recovery.enabled: the controller VM watches the training node through the API and
    # recreates it after the preemption (its own code; nothing here does it for it).
    # It checks every 30 s here, the shortest the stack config allows (120 s by default).
    cloud = prepare_training(
        r, {"recovery": {"enabled": True, "intervalSeconds": 30}}, serving=True
    )
    run = TrainingRun(cloud, r.start_control_plane(cloud))
    _boot(r, run)
    run.controller = _boot_controller(r, cloud, run.control)
    _deploy_training(r, run)
    _controller_watching(r, run)  # before the first checkpoint: the preemption must find it
    _train(r, run)
    _preempt(r, run)
    _recover(r, run)
    _resume(r, run)
    _merge(r, run)
    if "gemma4-release.service" in cloud.deployment["units"]:
        _release(r, run)
    run.control.destroy("train")  # without a release: `pulumi destroy` deletes it
    _serving(r, cloud, run.control)
    r.ran.append(
        f"{run.watching().name}: the recovery controller (recover.sh, then `python -m infra.ops "
        f"recover --watch` as its own account): {_recover_lines(run.watching())[-1]}"
    )
    answered, refused = run.control.calls()
    r.ran.append(
        f"the control plane: {answered} Cloud TPU API calls, each checked against the program's "
        f"IAM ({refused} answered with an error, as placement and reads expect)"
    )


def _boot(r: Rehearsal, run: TrainingRun) -> None:
    with r.stage("boot") as note:
        placed = run.control.up("train")
        run.node, run.vm = placed.id, run.control.hooks.vms[placed.id]
        note.append(
            f"{run.vm.name} at {placed.address}: node created in {placed.outs['zone']} by the "
            "TpuNode provider through the local Cloud TPU API"
        )


def _deploy_training(r: Rehearsal, run: TrainingRun) -> None:
    vm = run.on()
    with r.stage("deploy") as note:
        run.cloud.deploy(vm)
        note.append(f"{vm.name}: ready marker seen, workloads deployed over SSH")
        r.ran.append(
            f"{vm.name}: startup script (venv installed by uv), deploy, training until preempted"
        )


def _controller_watching(r: Rehearsal, run: TrainingRun) -> None:
    controller = run.watching()
    with r.stage("control") as note:
        _wait(
            "the recovery controller's first look at the training node",
            lambda: bool(_recover_lines(controller)),
            CONTROLLER_S,
            controller,
        )
        note.append(f"{controller.name}: watching; {_recover_lines(controller)[-1]}")


def _saved_steps(r: Rehearsal, run_dir: str) -> list[int]:
    """The steps saved resumable in the bucket: Orbax committed them and the trainer wrote their
    checksums."""
    names = set(r.gcs.names(f"{run_dir}/checkpoints/"))
    return sorted(
        int(m.group(1))
        for n in names
        if (m := re.search(r"/checkpoints/(\d+)/commit_success\.txt$", n))
        and n.replace("commit_success.txt", "checksums.json") in names
    )


def _train(r: Rehearsal, run: TrainingRun) -> None:
    vm = run.on()
    with r.stage("train") as note:
        _wait(
            "an intact checkpoint in the bucket",
            lambda: bool(_saved_steps(r, run.run_dir)),
            CHECKPOINT_S,
            vm,
        )
        # Held where it is until the preemption: the trainer runs on while the venv archive
        # still uploads (the next stage waits for it), and a busy CI machine once gave it the
        # ~20 s it needed to finish all 12 steps: the controller then found the run finished
        # and rightly recreated nothing. SIGSTOP to every process of the unit; the preemption
        # SIGKILLs them as it would the running ones.
        vm.machine.run(["systemctl", "kill", "--signal=SIGSTOP", "gemma4-train.service"])
        run.saved = _saved_steps(r, run.run_dir)[-1]
        note.append(
            f"step {run.saved} saved intact to {run.run_dir}/checkpoints (the trainer held "
            "there until the preemption)"
        )
        if r.slow_reads is not None:
            note.append(_overlap(vm))
            r.slow_reads.bytes_per_s = 0.0  # full speed from here on


def _stages_path(vm: cloud_vm.CloudVm) -> pathlib.Path:
    """The VM's stage records file, seen from this machine."""
    return vm.machine.root / layout.RemoteLayout().stages_file.lstrip("/")


def _boot_records(vm: cloud_vm.CloudVm) -> tuple[pathlib.Path, list[dict[str, Any]]]:
    """The VM's stage records file, and the records of its latest boot."""
    from workloads.common import stage_records

    path = _stages_path(vm)
    records = stage_records.read_records(str(path))
    boot = stage_records.latest_boot(records)
    return path, [record for record in records if record.get("boot") == boot]


def _stage_end(vm: cloud_vm.CloudVm, source: str, stage: str) -> dict[str, Any] | None:
    """The end record of `stage` (from `source`: startup, trainer, upload) in the VM's stage
    records of its latest boot, or None while it has not ended."""
    ends = [
        record
        for record in _boot_records(vm)[1]
        if record.get("source") == source
        and record.get("stage") == stage
        and record.get("event") == "end"
    ]
    return ends[-1] if ends else None


def _preempt(r: Rehearsal, run: TrainingRun) -> None:
    vm = run.on()
    with r.stage("preempt") as note:
        _wait(
            "the venv archive's upload",
            lambda: _stage_end(vm, "upload", "venv_upload") is not None,
            VENV_ARCHIVE_S,
            vm,
        )
        upload = _stage_end(vm, "upload", "venv_upload") or {}
        run.control.api.preempt(run.node)
        note.append(
            f"{vm.name}: the API took the node back (PREEMPTED, SIGKILL to PID 1) after "
            f"step {run.saved} was saved and the venv archive "
            + ("uploaded" if upload.get("ok") else f"failed to upload ({upload.get('note')})")
        )


def _recover(r: Rehearsal, run: TrainingRun) -> None:
    control, node, old = run.control, run.node, run.on()
    with r.stage("recover") as note:
        _wait(
            "the controller to recreate the node and its trainer to start",
            lambda: (
                control.hooks.vms.get(node) not in (None, old)
                and control.api.state(node) == "READY"
                and _unit_state(control.hooks.vms[node], "gemma4-train.service")
                in ("active", "activating")
            ),
            RECOVER_S,
            run.watching(),
            functools.partial(_recovery_seen, control, node, old, run.watching()),
        )
        run.vm = control.hooks.vms[node]
        creator = _created_by(control, node)
        note.append(
            f"{creator.removeprefix('serviceAccount:')} recreated the node; {run.vm.name} booted, "
            "installed the release from the bucket and started its trainer (no deploy)"
        )


def _recovery_seen(
    control: control_plane.ControlPlane,
    node: str,
    old: cloud_vm.CloudVm,
    controller: cloud_vm.CloudVm,
) -> str:
    """What a recovery that did not happen left: the controller's last lines, the node's state
    in the API, and the new VM's units and startup script, if there is one."""
    lines = [
        f"  the node in the API: {control.api.state(node) or 'gone'}",
        f"  {controller.name}'s gemma4-recover.service: "
        f"{_unit_state(controller, 'gemma4-recover.service')}; its last lines:",
        *(f"    {line}" for line in _journal_tail(controller, "gemma4-recover", 8).splitlines()),
    ]
    vm = control.hooks.vms.get(node)
    if vm is None or vm is old:
        lines.append("  no new VM was booted for the node")
    else:
        units = ("google-startup-scripts.service", "gemma4-train.service")
        lines.append(
            f"  {vm.name}: "
            + ", ".join(f"{unit} {_unit_state(vm, unit)}" for unit in units)
            + "; its startup script's last lines:"
        )
        lines += [
            f"    {line}" for line in _journal_tail(vm, "google-startup-scripts", 8).splitlines()
        ]
    return "\n".join(lines)


def _resume(r: Rehearsal, run: TrainingRun) -> None:
    vm, run_dir = run.on(), run.run_dir
    with r.stage("resume") as note:
        _wait(
            "the trainer to finish",
            lambda: (
                _unit_state(vm, "gemma4-train.service") in ("inactive", "failed", "gone")
                and f"{run_dir.split('/', 3)[3]}/train_summary.json" in r.gcs.names(run_dir)
            ),
            RESUME_S,
            vm,
        )
        summary = json.loads(r.gcs.get(f"{run_dir}/train_summary.json"))
        steps = run.cloud.run_config["train"]["max_steps"]
        if summary.get("resumed_from_step", 0) < run.saved or summary.get("total_steps") != steps:
            raise RehearsalError(
                f"the new VM's trainer did not resume from step {run.saved} to {steps}: "
                f"resumed_from_step={summary.get('resumed_from_step')}, "
                f"total_steps={summary.get('total_steps')}"
            )
        note.append(
            f"{vm.name}: resumed from step {summary['resumed_from_step']}, "
            f"finished step {steps} (loss {summary['first_loss']:.3f} -> "
            f"{summary['final_loss']:.3f})"
        )


def _merge(r: Rehearsal, run: TrainingRun) -> None:
    from workloads.serve import merged_weights

    vm, merged = run.on(), run.cloud.run_config["merge"]["out"]
    with r.stage("merge") as note:
        # What a finished merge leaves last (the release waits for the same files), read from
        # the bucket only: right after it the VM may release itself, and be gone.
        _wait(
            "the merge",
            lambda: all(
                n in {m.rsplit("/", 1)[-1] for m in r.gcs.names(merged)}
                for n in merged_weights.MARKERS
            ),
            MERGE_S,
            vm,
        )
        meta = json.loads(r.gcs.get(f"{merged}/merge_metadata.json"))
        note.append(f"{vm.name}: merged step {meta.get('step', '?')} into {merged}")
        venv = _stage_end(vm, "startup", "venv") or {}
        r.ran.append(
            f"{vm.name}: startup script (venv {venv.get('note') or 'not recorded'}), resume, "
            "merge, release"
        )


def _release(r: Rehearsal, run: TrainingRun) -> None:
    vm = run.on()
    with r.stage("release") as note:
        _wait_released(r, run.control, run.node, run.run_dir, vm)
        deleter = _deleted_by(run.control, run.node)
        note.append(
            f"{vm.name}: released.json in {run.run_dir}; the VM deleted its own node through "
            f"the API as {deleter.removeprefix('serviceAccount:')} (IAM: its self-service role)"
        )


def _overlap(vm: cloud_vm.CloudVm) -> str:
    """What the VM's stage records say of the weights' arrival. Required: the trainer's data
    ended, and its step's compile started, before the startup script's weights stage ended (the
    trainer starts at ready, not after the download). Reported: when the compile ended, before
    the weights (as on a quiet machine at the default --weights-seconds) or after (a busy one).

    Raises:
        RehearsalError: the trainer did not start while the weights arrived, or the records lack
            a stage.
    """
    path, records = _boot_records(vm)
    at = {
        (r["source"], r["stage"], r["event"]): float(r["at"])
        for r in records
        if r.get("event") == "start" or r.get("ok")
    }
    needed = (
        ("startup", "weights", "end"),
        ("trainer", "data", "end"),
        ("trainer", "compile_ahead", "start"),
        ("trainer", "compile_ahead", "end"),
    )
    missing = [" ".join(key) for key in needed if key not in at]
    if missing:
        raise RehearsalError(f"{vm.name}: no {', '.join(missing)} in {path}")
    weights = at[needed[0]]
    late = [" ".join(key[1:]) for key in needed[1:3] if at[key] >= weights]
    if late:
        raise RehearsalError(
            f"{vm.name}: the trainer's {' and '.join(late)} came after the weights were staged: "
            f"it did not start while they arrived ({path})"
        )
    compiled = weights - at[needed[3]]
    return (
        f"the trainer's data ended {weights - at[needed[1]]:.0f} s before the weights did, its "
        f"step's compile {abs(compiled):.0f} s {'before' if compiled > 0 else 'after'} them"
    )


def _wait_released(
    r: Rehearsal, control: control_plane.ControlPlane, node: str, run_dir: str, vm: cloud_vm.CloudVm
) -> None:
    """Waits for the training VM's release: its record in the run directory and its node gone
    from the API (the VM's own delete; the API then kills the VM)."""
    deadline = time.monotonic() + RELEASE_S
    while time.monotonic() < deadline:
        if control.api.state(node) is None and any(
            n.endswith("/released.json") for n in r.gcs.names(run_dir)
        ):
            return
        time.sleep(2)
    raise RehearsalError(
        f"the VM's release: node {node} is {control.api.state(node)} after {RELEASE_S:.0f} s "
        f"(its gcloud log: {_gcloud_log(vm).strip().splitlines()[-1:] or 'empty'})"
    )


def _last_caller(
    control: control_plane.ControlPlane, wanted: Callable[[str, str], bool], missing: str
) -> str:
    """The member behind the last successful API call that `wanted(verb, path)` picks.

    Raises:
        RehearsalError: no such call (`missing` says which).
    """
    for member, verb, called, code in reversed(control.api.calls):
        if code == 200 and wanted(verb, called):
            return member
    raise RehearsalError(missing)


def _deleted_by(control: control_plane.ControlPlane, node: str) -> str:
    """Who asked the API to delete `node` (the last successful DELETE of it)."""
    path = node.removeprefix("/")
    return _last_caller(
        control,
        lambda verb, called: verb == "DELETE" and called == path,
        f"node {node} is gone but no DELETE of it reached the API",
    )


def _serving(r: Rehearsal, cloud: TrainingCloud, control: control_plane.ControlPlane) -> None:
    """The serving VM boots its startup script (apt, venv, docker, verilog-eval, the merged
    model staged from the bucket), is deployed to, serves the merged model with the CPU build of
    vLLM (the docker stand-in), and its eval and bench units run against it."""
    serve = cloud.plan.vms.get("serve")
    if serve is None or serve.deployment is None:
        raise RehearsalError("serving.enabled declared no serving VM or deployment")
    run_config = yaml.safe_load(serve.deployment["run_config_yaml"])
    vm = _serve(r, cloud, control, serve.deployment, run_config["serve"]["port"])
    for job in ("eval", "bench"):
        if f"gemma4-{job}.service" in serve.deployment["units"]:
            _job(r, vm, job, run_config[job]["results_dir"])
    r.ran.append(f"{vm.name}: serving startup script, deploy, vLLM serving, eval, bench, report")
    control.destroy("serve")  # `pulumi destroy`: through the API, which stops the VM


def _serve(
    r: Rehearsal,
    cloud: TrainingCloud,
    control: control_plane.ControlPlane,
    deployment: dict[str, Any],
    port: int,
) -> cloud_vm.CloudVm:
    with r.stage("serve") as note:
        placed = control.up("serve")
        vm = control.hooks.vms[placed.id]
        _deploy(deployment, placed.address, cloud.key, cloud.known_hosts)
        _wait("the server's /health", lambda: _healthy(port), HEALTH_S, vm)
        note.append(
            f"{vm.name}: merged model staged, vLLM (CPU build, docker stand-in) healthy on :{port}"
        )
    return vm


def _job(r: Rehearsal, vm: cloud_vm.CloudVm, job: str, results: str) -> None:
    """The serving VM's eval or bench unit to its end, its results in the bucket."""
    unit = f"gemma4-{job}.service"
    with r.stage(job) as note:
        _wait(f"the {job} unit", functools.partial(_unit_done, vm, unit), JOB_S, vm)
        if _unit_state(vm, unit) == "failed":
            raise RehearsalError(f"the {job} unit failed: " + _journal_tail(vm, unit))
        if not r.gcs.names(results):
            raise RehearsalError(f"the {job} unit wrote nothing to {results}")
        note.append(f"{vm.name}: {unit} finished, results and report in {results}")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _boot_controller(
    r: Rehearsal, cloud: TrainingCloud, control: control_plane.ControlPlane
) -> cloud_vm.CloudVm:
    """Boots the recovery controller's VM (a Compute Engine instance: not through the TPU API)
    as its own service account; its recover.sh installs the controller and starts its watch."""
    plan = cloud.plan.vms.get("controller")
    if plan is None:
        raise RehearsalError("recovery.enabled declared no controller instance")
    token = control.api.iam.issue_token(f"serviceAccount:{plan.service_account}")
    vm = r.new_vm(plan, cloud.tree, plan.service_account, token)
    vm.boot(wait=False)
    return vm


def _recover_lines(vm: cloud_vm.CloudVm) -> list[str]:
    """The controller's own lines so far (its unit's journal)."""
    with contextlib.suppress(MachineError):
        out = vm.machine.run(
            ["journalctl", "-u", "gemma4-recover", "--no-pager", "-o", "cat"], check=False
        ).stdout
        # Its lines read `<UTC time> recover: ...` (infra.ops recover's watch).
        return [line for line in out.splitlines() if " recover: " in line]
    return []


def _created_by(control: control_plane.ControlPlane, node: str) -> str:
    """Who last created `node` through the API (a POST to its zone's nodes or queue)."""
    zone_path = node.removeprefix("/").rsplit("/nodes/", 1)[0]
    return _last_caller(
        control,
        lambda verb, called: (
            verb == "POST"
            and called.startswith(zone_path + "/")
            and called.endswith(("/nodes", "/queuedResources"))
        ),
        f"node {node} is there but no create of it reached the API",
    )


def _gcloud_log(vm: cloud_vm.CloudVm) -> str:
    try:
        return (vm.machine.root / "var/log/localcloud-gcloud.log").read_text(errors="replace")
    except OSError:
        return ""


def _summary(r: Rehearsal) -> None:
    total = sum(s.seconds for s in r.stages)
    r.say(f"rehearse: {len(r.stages)} stages passed in {total:.0f} s")
    for line in r.ran:
        r.say(f"  {line}")
    r.say(
        f"  settings of the rehearsal's own: the run lock's lease {LEASE_S} s "
        f"({runlock.LEASE_ENV}; 120 s on a real VM)"
    )
    r.say("  stand-ins:")
    for line in cloud_vm.STAND_INS:
        r.say(f"    {line}")


def known_stacks() -> list[str]:
    """The stacks of the checkout: those with a Pulumi.<stack>.yaml."""
    files = stack_config.ROOT.glob(stack_config.stack_file("*"))
    return sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in files)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stack", default="dev", help="the stack whose VMs to rehearse")
    parser.add_argument(
        "--weights-seconds",
        type=float,
        default=WEIGHTS_S,
        help="how long the base model's weights take to stage from the bucket (their reads "
        "slowed to that, as a large model's are); 0: full speed",
    )
    parser.add_argument(
        "--workdir",
        default="runs/rehearse",
        type=pathlib.Path,
        help="where the VMs' disks, the bucket's objects and the logs go",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcloud rehearse", description=__doc__)
    configure_parser(parser)
    args = parser.parse_args(argv)
    # float() takes nan and inf: nan would silently mean full speed, inf a stage that never ends.
    if not (math.isfinite(args.weights_seconds) and args.weights_seconds >= 0):
        parser.error(
            f"--weights-seconds {args.weights_seconds:g}: a finite number of seconds, 0 (off) or "
            "more"
        )
    stacks = known_stacks()
    if args.stack not in stacks:  # before anything starts, not at the plan stage
        parser.error(
            f"--stack {args.stack}: no {stack_config.stack_file(args.stack)} in the checkout; "
            f"its stacks are {', '.join(stacks)}"
        )
    workdir = args.workdir.resolve()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, or no permission: one line, not a traceback
        parser.error(f"--workdir {args.workdir}: cannot be a directory ({exc.strerror})")
    return run(
        args.stack,
        workdir,
        say=lambda line: print(line, flush=True),
        weights_s=args.weights_seconds,
    )


if __name__ == "__main__":
    sys.exit(main())
