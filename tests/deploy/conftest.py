"""Shared pieces of the deployment tests: run configs, the wheel of this checkout, bundles."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from infra import remote, ssh_access, ssh_deployment
from infra.components import workloads as component
from workloads import runconfig


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


@pytest.fixture(scope="session")
def wheel() -> component.Wheel:
    """The real wheel of this checkout (built once, cached in .whl/)."""
    return component.build_wheel()


def make_bundle(
    root: pathlib.Path | str,
    wheel: component.Wheel,
    cfg: runconfig.RunConfig | None = None,
    role: component.Role = "train",
) -> remote.Bundle:
    cfg = cfg or make_run_config()
    plan = component.plan_units(role, cfg, remote.RemoteLayout(str(root)))
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
    wheel: component.Wheel,
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
    props = {**inputs.to_props(), **changes}
    # What the provider process receives: JSON values, every number a float.
    return json.loads(json.dumps(props), parse_int=float)
