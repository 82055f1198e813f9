"""Deploying the real wheel over a real sshd: install, units, job, idempotency, parallel, faults."""

from __future__ import annotations

import json
import pathlib
import shlex
import stat
import threading
import time

import fabric
import pytest

from infra import remote, ssh
from infra.components import workloads as component
from tests.deploy.conftest import make_bundle, make_run_config
from tests.fixtures.sshd import Worker

pytestmark = pytest.mark.sshd


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


def _host(worker: Worker) -> str:
    return f"{worker.host}:{worker.port}"


def _deploy(
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


def _installed(worker: Worker) -> dict[str, object]:
    venv = worker.root / "opt/gemma4/venv"
    site = next(venv.glob("lib/python3*/site-packages"))
    return {
        "dist_infos": sorted(p.name for p in site.glob("gemma4_tpu-*.dist-info")),
        "wheels": sorted(p.name for p in (worker.root / "opt/gemma4/wheels").iterdir()),
        "incoming": sorted(p.name for p in (worker.root / "var/lib/gemma4/incoming").iterdir()),
        "state": json.loads((worker.root / "var/lib/gemma4/deployed.json").read_text()),
    }


def _run_unit_job(worker: Worker, unit: str) -> str:
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
        "import sys, workloads, workloads.cli, workloads.runconfig as rc; "
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


def test_deploy_installs_the_wheel_config_and_units_and_the_job_runs(
    worker: Worker, wheel: component.Wheel
) -> None:
    bundle = make_bundle(worker.root, wheel)
    hook = Steps()
    results = _deploy([worker], bundle, hook)

    assert results == [remote.HostResult(_host(worker), True)]
    config = worker.root / "etc/gemma4/run.yaml"
    assert config.read_text() == bundle.run_config_yaml
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE((worker.root / "etc/gemma4").stat().st_mode) == 0o755
    for name, text in bundle.units.items():
        assert (worker.root / "etc/systemd/system" / name).read_text() == text
    assert worker.systemctl_calls() == [
        ["daemon-reload"],
        ["enable", "gemma4-train.service"],
        ["start", "--no-block", "gemma4-train.service"],
    ]
    installed = _installed(worker)
    assert installed["dist_infos"] == ["gemma4_tpu-0.1.0.dist-info"]
    assert installed["wheels"] == [pathlib.Path(wheel.path).name]
    assert installed["incoming"] == []
    assert installed["state"]["fingerprint"] == bundle.fingerprint  # type: ignore[index]
    assert "== " in (worker.root / "var/log/gemma4-deploy.log").read_text()

    # The deployed package reads the deployed config, started the way the unit starts it.
    run_name, max_steps, module, has_train = _run_unit_job(worker, "gemma4-train.service").split()
    assert (run_name, max_steps, has_train) == ("demo", "5", "True")
    assert module.startswith(str(worker.root / "opt/gemma4/venv/lib"))  # not this checkout

    # Unchanged: one check per worker, nothing else (no upload, no systemctl).
    worker.clear_calls()
    again = Steps()
    assert _deploy([worker], bundle, again) == [remote.HostResult(_host(worker), False)]
    assert again.steps() == ["check"]
    assert worker.systemctl_calls() == []


def test_changed_config_stops_installs_and_starts_again(
    worker: Worker, wheel: component.Wheel
) -> None:
    _deploy([worker], make_bundle(worker.root, wheel, make_run_config(merge=True)), Steps())
    worker.clear_calls()
    without_merge = make_bundle(worker.root, wheel, make_run_config(merge=False, run_name="second"))
    hook = Steps()
    _deploy([worker], without_merge, hook)

    assert hook.steps() == [
        "check",
        "directories",
        "upload",
        "verify-upload",
        "stop",
        "install",
        "config",
        "units",
        "daemon-reload",
        "enable",
        "start",
        "record",
    ]
    assert worker.systemctl_calls() == [
        ["stop", "gemma4-merge.service", "gemma4-train.service"],
        ["disable", "gemma4-merge.service"],
        ["daemon-reload"],
        ["enable", "gemma4-train.service"],
        ["start", "--no-block", "gemma4-train.service"],
    ]
    assert not (worker.root / "etc/systemd/system/gemma4-merge.service").exists()
    assert "run_name: second" in (worker.root / "etc/gemma4/run.yaml").read_text()
    assert _installed(worker)["dist_infos"] == ["gemma4_tpu-0.1.0.dist-info"]


def test_ready_timeout_says_what_the_startup_log_shows(
    sshd_factory, wheel: component.Wheel
) -> None:
    worker: Worker = sshd_factory("booting")
    log = worker.root / "var/log/gemma4-startup.log"
    log.parent.mkdir(parents=True)
    log.write_text("installing python3.11\nstaging weights from gs://b/models: 41%\n")
    with pytest.raises(remote.DeployError) as caught:
        _deploy([worker], make_bundle(worker.root, wheel), Steps(), ready_timeout_s=0.5)
    message = str(caught.value)
    assert f"{_host(worker)}: step 'wait-ready' timed out; remote log: {log}" in message
    assert "not ready after 0.5 s" in message
    assert "ready marker" in message and str(worker.root / "var/lib/gemma4/ready") in message
    assert "staging weights from gs://b/models: 41%" in message
    assert str(log) in message


def test_unreachable_worker_times_out_naming_the_ssh_problem(
    sshd_factory, wheel: component.Wheel
) -> None:
    worker: Worker = sshd_factory("gone")
    worker.stop()
    started = time.monotonic()
    with pytest.raises(remote.DeployError, match="SSH not reachable"):
        _deploy([worker], make_bundle(worker.root, wheel), Steps(), ready_timeout_s=1)
    assert time.monotonic() - started < 10


def test_failing_step_names_host_step_exit_code_and_log(
    worker: Worker, wheel: component.Wheel
) -> None:
    (worker.root / "systemctl.exit").write_text("3\n")
    with pytest.raises(remote.DeployError) as caught:
        _deploy([worker], make_bundle(worker.root, wheel), Steps())
    error = caught.value.errors[0]
    assert isinstance(error, remote.RemoteError)
    assert (error.host, error.step, error.exit_code) == (_host(worker), "daemon-reload", 3)
    assert error.log_path == str(worker.root / "var/log/gemma4-deploy.log")
    assert f"step 'daemon-reload' failed (exit code 3); remote log: {error.log_path}" in str(
        caught.value
    )
    assert not (worker.root / "var/lib/gemma4/deployed.json").exists()  # not recorded as deployed


def test_two_workers_deploy_in_parallel_and_a_dead_sshd_fails_only_its_worker(
    sshd_factory,
    wheel: component.Wheel,
) -> None:
    workers: list[Worker] = [sshd_factory("w0"), sshd_factory("w1")]
    for w in workers:
        w.make_venv()
        w.mark_ready()
    h0, h1 = (_host(w) for w in workers)
    # One bundle for the slice (its units name w0's root; only the shim reads them on w1).
    bundle = make_bundle(workers[0].root, wheel)
    hook = Steps()
    assert [r.changed for r in _deploy(workers, bundle, hook)] == [True, True]
    installs = {h: t for h, s, t in hook.calls if s == "install"}
    records = {h: t for h, s, t in hook.calls if s == "record"}
    assert installs[h0] < records[h1] and installs[h1] < records[h0]  # both installing at once

    # Fault: w1's sshd (and its sessions) die when w1's install begins; w0 completes.
    bundle = make_bundle(workers[0].root, wheel, make_run_config(run_name="faulty"))
    hook = Steps()
    hook.actions[(h1, "install")] = workers[1].stop
    with pytest.raises(remote.DeployError) as caught:
        _deploy(workers, bundle, hook)
    assert len(caught.value.errors) == 1
    error = caught.value.errors[0]
    assert isinstance(error, remote.RemoteError)
    assert (error.host, error.step, error.exit_code) == (h1, "install", None)
    assert f"{h1}: step 'install' failed (connection failed)" in str(caught.value)
    assert _installed(workers[0])["state"]["fingerprint"] == bundle.fingerprint  # type: ignore[index]
    assert _installed(workers[1])["state"]["fingerprint"] != bundle.fingerprint  # type: ignore[index]

    # sshd back: the next deploy finishes w1 only and leaves exactly one installed version.
    workers[1].start()
    hook = Steps()
    assert [r.changed for r in _deploy(workers, bundle, hook)] == [False, True]
    assert hook.steps(h0) == ["check"]
    for w in workers:
        installed = _installed(w)
        assert installed["dist_infos"] == ["gemma4_tpu-0.1.0.dist-info"]
        assert installed["wheels"] == [pathlib.Path(wheel.path).name]
        assert installed["incoming"] == []
        assert installed["state"]["fingerprint"] == bundle.fingerprint  # type: ignore[index]
        assert "run_name: faulty" in (w.root / "etc/gemma4/run.yaml").read_text()


def test_file_contents_never_travel_on_a_command_line(
    worker: Worker, wheel: component.Wheel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run config (and anything sensitive a future field might hold) goes over SFTP with mode
    # 0600, never as a command argument that `ps` on the worker or a shell log would show.
    sentinel = "hf_SENTINEL_never_on_argv_5f1e"
    cfg = make_run_config()
    cfg = cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"dataset": f"gs://b/{sentinel}"})}
    )
    bundle = make_bundle(worker.root, wheel, cfg)
    assert sentinel in bundle.run_config_yaml
    commands: list[str] = []
    original = fabric.Connection.run

    def recording_run(self: fabric.Connection, command: str, **kwargs: object) -> object:
        commands.append(command)
        return original(self, command, **kwargs)

    monkeypatch.setattr(fabric.Connection, "run", recording_run)
    _deploy([worker], bundle, Steps())
    assert len(commands) > 5
    assert not [c for c in commands if sentinel in c]
    assert sentinel in (worker.root / "etc/gemma4/run.yaml").read_text()
