"""The systemd units: what they say, and that `systemd-analyze verify` accepts them."""

from __future__ import annotations

import configparser
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from infra import remote
from infra.components import stack_deployments
from infra.vm import roles, units
from tests.infra.conftest import make_run_config

PROD = remote.RemoteLayout("/")


def _parse(text: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


def test_train_unit_runs_the_training_command_with_restart_and_environment() -> None:
    plan = roles.TRAIN.plan_units(make_run_config(merge=True), PROD)
    assert sorted(plan.units) == ["gemma4-merge.service", "gemma4-train.service"]
    assert plan.enable == plan.start == ["gemma4-train.service"]
    unit = _parse(plan.units["gemma4-train.service"])
    service = unit["Service"]
    # Only the active release, through `current`: a unit never starts a half-installed version.
    assert service["ExecStart"] == (
        "/opt/gemma4/current/venv/bin/python -m workloads train "
        "--config /opt/gemma4/current/run.yaml"
    )
    assert service["Restart"] == "on-failure"
    # Neither a bad run config (2) nor a non-finite loss (3) is retried forever.
    assert service["RestartPreventExitStatus"] == "2 3"
    assert service["Environment"] == "TMPDIR=/dev/shm PYTHONUNBUFFERED=1"
    assert service["EnvironmentFile"] == "-/etc/gemma4/env"  # the startup script's variables
    assert service["StandardOutput"] == service["StandardError"] == "journal"
    assert "/run/gemma4/ready" in service["ExecStartPre"]
    assert unit["Unit"]["OnSuccess"] == "gemma4-merge.service"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    merge = _parse(plan.units["gemma4-merge.service"])
    assert merge["Service"]["Type"] == "oneshot"
    assert merge["Service"]["ExecStart"].endswith(
        "-m workloads merge --config /opt/gemma4/current/run.yaml"
    )
    assert "Install" not in merge  # started by train's OnSuccess=, never on its own


def test_nothing_the_trainer_needs_is_ordered_after_the_startup_script() -> None:
    """The guest agent's startup-script unit is a oneshot whose start job lasts until the whole
    script exits, after the weights are staged: a unit ordered after it (directly or through a
    unit it needs) would start only then. The trainer waits for the ready marker instead, one
    that cannot be left from an earlier boot (tests/localcloud/test_unit_order.py boots it)."""
    plan = roles.TRAIN.plan_units(make_run_config(merge=True, release=True), PROD)
    needed, todo = set(), [units.TRAIN_UNIT]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        if name not in plan.units:
            continue
        section = _parse(plan.units[name])["Unit"]
        after = section.get("After", "").split()
        assert "google-startup-scripts.service" not in after, name
        for key in ("After", "Requires", "Wants", "BindsTo", "Requisite"):
            todo += section.get(key, "").split()
    assert needed >= {units.TRAIN_UNIT, "network-online.target"}
    assert PROD.ready_marker.startswith("/run/")  # a tmpfs: gone at every boot
    wait = _parse(plan.units[units.TRAIN_UNIT])["Service"]["ExecStartPre"]
    assert wait.endswith(f"wait-ready {PROD.ready_marker}")


@pytest.mark.parametrize(("worker", "runs"), [("0", True), ("1", False), (None, True)])
def test_only_worker_zero_of_a_slice_runs_the_merge(worker, runs) -> None:
    """Every worker of a multi-host slice trains; the merge must run once, on worker 0."""
    plan = roles.TRAIN.plan_units(make_run_config(merge=True), PROD)
    condition = _parse(plan.units["gemma4-merge.service"])["Service"]["ExecCondition"]
    argv = ["/bin/sh", "-c", condition.split("-c ", 1)[1].strip("'").replace("$$", "$")]
    env = {"PATH": os.environ["PATH"]} | ({"GEMMA4_WORKER": worker} if worker else {})
    assert (subprocess.run(argv, env=env).returncode == 0) is runs


def test_train_without_merge_has_no_merge_unit() -> None:
    plan = roles.TRAIN.plan_units(make_run_config(merge=False), PROD)
    assert list(plan.units) == ["gemma4-train.service"]
    assert "OnSuccess" not in _parse(plan.units["gemma4-train.service"])["Unit"]


@pytest.mark.parametrize("merge", [True, False])
def test_release_runs_after_the_last_unit_of_the_run_on_worker_zero(merge) -> None:
    plan = roles.TRAIN.plan_units(make_run_config(merge=merge, release=True), PROD)
    last = "gemma4-merge.service" if merge else "gemma4-train.service"
    assert _parse(plan.units[last])["Unit"]["OnSuccess"] == "gemma4-release.service"
    if merge:  # training still hands over to the merge first
        assert _parse(plan.units["gemma4-train.service"])["Unit"]["OnSuccess"] == (
            "gemma4-merge.service"
        )
    release = _parse(plan.units["gemma4-release.service"])
    assert release["Service"]["ExecStart"].endswith(
        "-m workloads release --config /opt/gemma4/current/run.yaml"
    )
    assert release["Service"]["RestartPreventExitStatus"] == "2"  # an unfinished run: no retry
    # Worker 0 only, by the same condition as the merge (tested above).
    merge_plan = roles.TRAIN.plan_units(make_run_config(merge=True), PROD)
    merge_unit = _parse(merge_plan.units["gemma4-merge.service"])
    assert release["Service"]["ExecCondition"] == merge_unit["Service"]["ExecCondition"]
    assert "Install" not in release and plan.enable == ["gemma4-train.service"]
    # The serving VM's copy of the run config has no release section.
    serve_cfg = stack_deployments.run_config_for("serve", make_run_config(serve=True, release=True))
    assert serve_cfg.release is None


def test_the_serving_time_limit_is_a_timer_that_stops_the_node(tmp_path: pathlib.Path) -> None:
    cfg = make_run_config(serve=True, stop_after_hours=12)
    plan = roles.SERVE.plan_units(cfg, PROD)
    assert plan.enable[-1] == plan.start[-1] == "gemma4-serve-stop.timer"
    timer = _parse(plan.units["gemma4-serve-stop.timer"])
    assert timer["Timer"]["OnBootSec"] == "43200s"  # 12 h after each boot
    assert timer["Timer"]["Unit"] == "gemma4-serve-stop.service"
    assert timer["Install"]["WantedBy"] == "timers.target"
    stop = _parse(plan.units["gemma4-serve-stop.service"])["Service"]
    # The command, run as systemd runs it ($$ is a literal $), with a gcloud that prints its
    # arguments: the zone is the one the VM booted in, else the stack's first.
    gcloud = tmp_path / "gcloud"
    gcloud.write_text('#!/bin/sh\necho "$@"\n')
    gcloud.chmod(0o755)
    argv = ["/bin/sh", "-c", stop["ExecStart"].split("-c ", 1)[1].strip("'").replace("$$", "$")]
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    booted = subprocess.run(
        argv, env={**env, "GEMMA4_ZONE": "us-east5-b"}, capture_output=True, text=True, check=True
    ).stdout
    assert (
        booted
        == "compute tpus tpu-vm stop demo-serve --zone=us-east5-b --project=p --quiet --async\n"
    )
    unknown = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    assert "--zone=asia-northeast1-b " in unknown
    # The training VM's copy of the run config has no stop section; without one, no timer.
    assert stack_deployments.run_config_for("train", cfg).stop is None
    plain = roles.SERVE.plan_units(make_run_config(serve=True), PROD)
    assert not [u for u in plain.units if "stop" in u]


def test_serve_units_sequence_serve_then_eval_then_bench() -> None:
    plan = roles.SERVE.plan_units(make_run_config(serve=True), PROD)
    assert plan.start == ["gemma4-serve.service", "gemma4-eval.service", "gemma4-bench.service"]
    eval_unit = _parse(plan.units["gemma4-eval.service"])
    bench = _parse(plan.units["gemma4-bench.service"])
    assert eval_unit["Unit"]["Requires"] == "gemma4-serve.service"
    assert bench["Unit"]["After"] == "gemma4-serve.service gemma4-eval.service"
    assert bench["Install"]["WantedBy"] == "gemma4-serve.service"
    assert "http://127.0.0.1:8000/health" in eval_unit["Service"]["ExecStartPre"]


def test_serve_role_needs_a_serve_section() -> None:
    with pytest.raises(ValueError, match="serve section"):
        roles.SERVE.plan_units(make_run_config(serve=False), PROD)


def test_paths_with_spaces_and_specifiers_are_quoted_for_systemd() -> None:
    assert units.systemd_quote("/opt/gemma4/venv/bin/python") == "/opt/gemma4/venv/bin/python"
    assert units.systemd_quote("/my dir/50%/$HOME") == '"/my dir/50%%/$$HOME"'
    plan = roles.TRAIN.plan_units(make_run_config(), remote.RemoteLayout("/tmp/a b"))
    exec_start = _parse(plan.units["gemma4-train.service"])["Service"]["ExecStart"]
    assert exec_start.startswith('"/tmp/a b/opt/gemma4/current/venv/bin/python" -m workloads train')


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("role", ["train", "serve"])
def test_every_unit_passes_systemd_analyze_verify(role: str, tmp_path: pathlib.Path) -> None:
    # The units are rendered with a temp root so the interpreter they name exists here; the text
    # is otherwise exactly the production one (checked below).
    root = tmp_path / "root"
    python = root / "opt/gemma4/current/venv/bin/python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    (root / "var/lib/gemma4").mkdir(parents=True)
    cfg = make_run_config(serve=True, release=True, stop_after_hours=1.5)
    plan = roles.role(role).plan_units(cfg, remote.RemoteLayout(str(root)))
    prod = roles.role(role).plan_units(cfg, PROD)
    units_dir = tmp_path / "units"
    units_dir.mkdir()
    for name, text in plan.units.items():
        assert text.replace(str(root), "") == prod.units[name]
        (units_dir / name).write_text(text)
    if role == "serve" and not pathlib.Path("/usr/bin/curl").exists():
        pytest.skip("curl not installed: the eval/bench readiness check names /usr/bin/curl")
    proc = subprocess.run(
        ["systemd-analyze", "verify", *sorted(str(p) for p in units_dir.iterdir())],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gemma4" not in proc.stderr, proc.stderr  # no warning about our units either


def test_the_eval_unit_never_runs_generated_code_as_root() -> None:
    """The eval compiles and simulates model output: a transient unprivileged user, which reads
    the root-only run config through a credential, never the file itself."""
    plan = roles.SERVE.plan_units(make_run_config(serve=True), PROD)
    service = _parse(plan.units["gemma4-eval.service"])["Service"]
    assert service["DynamicUser"] == "yes"
    assert "User" not in service and "Group" not in service
    # The active release's config (the deploy switches `current` atomically).
    assert service["LoadCredential"] == "run.yaml:/opt/gemma4/current/run.yaml"
    # The eval, then the report, both in ExecStart: the credential is not readable from
    # ExecStartPost (tests/localcloud: the rehearsal's serving VM runs this unit).
    assert service["ExecStart"] == (
        """/bin/sh -c '"$$0" -m workloads eval --config "$$1" && exec "$$0" -m workloads """
        """report --config "$$1"' /opt/gemma4/current/venv/bin/python %d/run.yaml"""
    )
    assert "ExecStartPost" not in service
    assert "/current/run.yaml" not in service["ExecStart"]
    assert service["Environment"] == "TMPDIR=/dev/shm PYTHONUNBUFFERED=1"  # writable for it


def test_every_serving_unit_that_can_hang_has_a_finite_start_timeout() -> None:
    cfg = make_run_config(serve=True, stop_after_hours=2)
    plan = roles.SERVE.plan_units(cfg, PROD)
    ready_s = cfg.serve.ready_timeout_s
    timeouts = {
        name: _parse(text)["Service"].get("TimeoutStartSec")
        for name, text in plan.units.items()
        if name.endswith(".service")
    }
    assert timeouts == {
        "gemma4-serve.service": "2h",
        "gemma4-eval.service": f"{ready_s + 6 * 3600}s",
        "gemma4-bench.service": f"{ready_s + 12 * 3600}s",
        "gemma4-serve-stop.service": "10min",
    }


def test_every_training_unit_has_a_finite_start_timeout() -> None:
    """A hung merge (a stalled bucket read or upload) ends and restarts; none waits forever.
    The release unit is a oneshot under systemd's default start timeout."""
    plan = roles.TRAIN.plan_units(make_run_config(merge=True), PROD)
    timeouts = {
        name: _parse(text)["Service"].get("TimeoutStartSec")
        for name, text in plan.units.items()
        if name.endswith(".service")
    }
    assert "infinity" not in timeouts.values(), timeouts
    assert timeouts["gemma4-merge.service"] == "4h"
    assert timeouts["gemma4-train.service"] == "4h"
