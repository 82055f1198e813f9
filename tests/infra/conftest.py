"""Shared pieces of the deployment tests: run configs, the wheel of this checkout, bundles, and
deploying to real-sshd workers (tests.fixtures.sshd) with a hook that records or acts at a step."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import threading
import time
from typing import Any

import pytest
import yaml

from infra import remote
from infra.remote import ssh
from infra.resources import ssh_access, ssh_deployment
from infra.vm import roles, workloads_wheel
from localcloud import pulumi_mocks
from tests.fixtures.sshd import Worker
from workloads.contract import runconfig


def make_run_config(
    run_dir: str = "gs://b/checkpoints/demo",
    *,
    merge: bool = True,
    serve: bool = False,
    release: bool = False,
    stop_after_hours: float | None = None,
    run_name: str = "demo",
) -> runconfig.RunConfig:
    data: dict[str, Any] = {
        "run_name": run_name,
        "model": {"base": "gs://b/models/gemma-4-31b"},
        "data": {"dataset": "gs://b/data/codev-r1.jsonl"},
        "train": {"output_dir": run_dir, "max_steps": 5},
    }
    if merge:
        data["merge"] = {"out": "gs://b/merged/demo"}
    if release:
        data["release"] = {
            "project": "p",
            "zone": "us-central1-a",
            "node": "demo-train",
            "marker": f"{run_dir}/released.json",
        }
    if stop_after_hours is not None:
        data["stop"] = {
            "project": "p",
            "zone": "asia-northeast1-b",
            "node": "demo-serve",
            "after_hours": stop_after_hours,
        }
    if serve:
        data["serve"] = {"model_dir": "gs://b/merged/demo", "port": 8000}
        data["eval"] = {
            "problems_dir": "/opt/verilog-eval/dataset_spec-to-rtl",
            "results_dir": "gs://b/eval",
        }
        data["bench"] = {"results_dir": "gs://b/bench"}
    return runconfig.parse(data)


@pytest.fixture(autouse=True)
def _an_event_loop() -> None:
    """Pulumi's mocks run on the thread's current event loop, and a test that used asyncio.run()
    earlier in the same process leaves none: every infra test starts with one, whatever ran before
    it in its process (pytest-xdist's workers run the files in no fixed order)."""
    pulumi_mocks.ensure_event_loop()


@pytest.fixture(scope="session")
def wheel() -> workloads_wheel.Wheel:
    """The real wheel of this checkout (built once, cached in .whl/)."""
    return workloads_wheel.build_wheel()


def make_bundle(
    root: pathlib.Path | str,
    wheel: workloads_wheel.Wheel,
    cfg: runconfig.RunConfig | None = None,
    role: str = "train",
) -> remote.Bundle:
    cfg = cfg or make_run_config()
    plan = roles.role(role).plan_units(cfg, remote.RemoteLayout(str(root)))
    # install_deps=False: the worker venv borrows its dependencies from the test venv (no index).
    return remote.Bundle(
        wheel.path,
        wheel.sha256,
        cfg.to_yaml(),
        plan.units,
        plan.enable,
        plan.start,
        install_deps=False,
    )


def provider_props(
    worker_root: str,
    wheel: workloads_wheel.Wheel,
    access: ssh_access.SshAccess,
    hosts: list[str],
    **changes: Any,
) -> dict[str, Any]:
    """The props the dynamic provider receives for a train deployment (JSON, numbers floats)."""
    bundle = make_bundle(worker_root, wheel, changes.pop("cfg", None))
    inputs = ssh_deployment.DeploymentInputs(
        vm="gemma4-train",
        hosts=hosts,
        ssh=access,
        bundle=remote.Bundle(
            wheel_path=wheel.path,
            wheel_sha256=wheel.sha256,
            run_config_yaml=bundle.run_config_yaml,
            units=bundle.units,
            enable=bundle.enable,
            start=bundle.start,
            install_deps=False,
        ),
        use_sudo=False,
        remote_root=worker_root,
        ready_timeout_s=20,
    )
    props = {**inputs.props(), **changes}
    # What the provider process receives: JSON values, every number a float.
    return json.loads(json.dumps(props), parse_int=float)


class Steps:
    """Records (host, step, time) of every remote step; optionally acts at one of them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []
        self.actions: dict[tuple[str, str], object] = {}
        self.lock = threading.Lock()

    def __call__(self, host: str, step: str) -> None:
        with self.lock:
            self.calls.append((host, step, time.monotonic()))
            action = self.actions.pop((host, step), None)
        if action is not None:
            action()  # type: ignore[operator]

    def steps(self, host: str | None = None) -> list[str]:
        return [s for h, s, _ in self.calls if host is None or h == host]


def host(worker: Worker) -> str:
    return f"{worker.host}:{worker.port}"


def deploy(
    workers: list[Worker], bundle: remote.Bundle, hook: Steps, ready_timeout_s: float = 20
) -> list[remote.HostResult]:
    """remote.deploy_all over real SSH; each test worker has its own root (one layout each)."""
    conns = [ssh.connect(w.host, w.settings) for w in workers]
    try:
        return remote.deploy_all(
            "test-vm",
            conns,
            bundle,
            [remote.RemoteLayout(str(w.root)) for w in workers],
            sudo=False,
            ready_timeout_s=ready_timeout_s,
            ready_initial_delay_s=0.1,
            settings=workers[0].settings,
            hook=hook,
        )
    finally:
        for conn in conns:
            conn.close()


def installed(worker: Worker) -> dict[str, Any]:
    """What the deploys left on a worker: the active release, every release directory, the
    installed distributions of the active one, the staging area and the deployed state."""
    app = worker.root / "opt/gemma4"
    current = app / "current"
    site = next(current.glob("venv/lib/python3*/site-packages")) if current.exists() else None
    state_file = worker.root / "var/lib/gemma4/deployed.json"
    incoming = worker.root / "var/lib/gemma4/incoming"
    return {
        "active": os.readlink(current) if current.is_symlink() else None,
        "releases": sorted(p.name for p in (app / "releases").iterdir()),
        "complete": sorted(p.parent.name for p in (app / "releases").glob("*/COMPLETE")),
        "dist_infos": sorted(p.name for p in site.glob("gemma4_tpu-*.dist-info")) if site else [],
        "wheels": sorted(p.name for p in current.glob("*.whl")),
        "incoming": sorted(p.name for p in incoming.iterdir()) if incoming.exists() else [],
        "state": json.loads(state_file.read_text()) if state_file.exists() else {},
    }


def assert_converged(
    worker: Worker, bundle: remote.Bundle, previous: remote.Bundle | None = None
) -> None:
    """The worker runs exactly `bundle`: its release active and complete, the deployed package
    importable from it reading its config the way the unit starts it, the units on disk the
    bundle's (naming only `current`), enabled and started after the last stop, the state
    recorded, and nothing left over but the previous release."""
    found = installed(worker)
    assert found["active"] == f"releases/{bundle.release}"
    assert found["state"]["fingerprint"] == bundle.fingerprint
    assert found["dist_infos"] == ["gemma4_tpu-0.1.0.dist-info"]
    assert found["wheels"] == [bundle.wheel_name]
    assert found["incoming"] == []
    kept = {bundle.release} | ({previous.release} if previous else set())
    assert set(found["releases"]) == set(found["complete"]) == kept
    assert (worker.root / "etc/gemma4/run.yaml").read_text() == bundle.run_config_yaml
    current = str(worker.root / "opt/gemma4/current")
    for name, text in bundle.units.items():
        assert (worker.root / "etc/systemd/system" / name).read_text() == text
        assert f"{current}/venv/bin/python" in text and f"{current}/run.yaml" in text
    leftovers = sorted(p.name for p in (worker.root / "etc/systemd/system").glob("*.part"))
    assert leftovers == []
    calls = worker.systemctl_calls()
    last_stop = max((i for i, c in enumerate(calls) if c[0] == "stop"), default=-1)
    after = calls[last_stop + 1 :]
    assert ["enable", *bundle.enable] in after
    assert ["start", "--no-block", *bundle.start] in after
    cfg = runconfig.parse(yaml.safe_load(bundle.run_config_yaml))
    run_name, max_steps, module, has_train = run_unit_job(worker, bundle.start[0]).split()
    assert (run_name, max_steps, has_train) == (cfg.run_name, str(cfg.train.max_steps), "True")
    release_dir = worker.root / "opt/gemma4/releases" / bundle.release
    assert os.path.realpath(module).startswith(str(release_dir) + "/")


def run_unit_job(worker: Worker, unit: str) -> str:
    """Runs the installed unit's interpreter with its Environment= and --config, over SSH.

    The job is a real read of the deployed run config by the deployed package (what `train`
    does first); the unit's full command would start a TPU training run.
    """
    text = (worker.root / "etc/systemd/system" / unit).read_text()
    lines = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    exec_start = shlex.split(lines["ExecStart"])
    python, config = exec_start[0], exec_start[exec_start.index("--config") + 1]
    env = lines["Environment"].split()
    script = (
        "import sys, workloads, workloads.cli, workloads.contract.runconfig as rc; "
        "cfg = rc.load(sys.argv[1]); "
        "print(cfg.run_name, cfg.train.max_steps, workloads.__file__, "
        "'train' in workloads.cli.COMMANDS)"
    )
    conn = ssh.connect(worker.host, worker.settings)
    try:
        result = remote.run(conn, "job", ["env", *env, python, "-c", script, config])
    finally:
        conn.close()
    return result.stdout
