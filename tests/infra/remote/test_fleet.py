"""Deploying the real wheel over a real sshd: install, units, job, idempotency, parallel, faults."""

from __future__ import annotations

import pathlib
import stat
import time

import fabric
import pytest

from infra import remote
from infra.vm import workloads_wheel
from tests.fixtures.sshd import Worker
from tests.infra.conftest import (
    Steps,
    assert_converged,
    deploy,
    host,
    installed,
    make_bundle,
    make_run_config,
)

pytestmark = pytest.mark.sshd


def test_deploy_installs_the_wheel_config_and_units_and_the_job_runs(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    bundle = make_bundle(worker.root, wheel)
    hook = Steps()
    results = deploy([worker], bundle, hook)

    assert results == [remote.HostResult(host(worker), True)]
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
    assert hook.steps() == [
        "check",
        "directories",
        "clean",
        "space",
        "upload",
        "verify-upload",
        "install",
        "config",
        "verify",
        "switch",
        "units",
        "daemon-reload",
        "enable",
        "start",
        "record",
        "prune",
    ]
    assert "== " in (worker.root / "var/log/gemma4-deploy.log").read_text()
    # The release is complete, active, imports from its own venv (not the base venv, not this
    # checkout) and reads its config the way the unit starts it.
    assert_converged(worker, bundle)
    release = worker.root / "opt/gemma4/releases" / bundle.release
    assert stat.S_IMODE((release / "run.yaml").stat().st_mode) == 0o600
    assert (release / "COMPLETE").read_text() == bundle.fingerprint + "\n"

    # Unchanged: one check per worker, nothing else (no upload, no systemctl).
    worker.clear_calls()
    again = Steps()
    assert deploy([worker], bundle, again) == [remote.HostResult(host(worker), False)]
    assert again.steps() == ["check"]
    assert worker.systemctl_calls() == []


def test_changed_config_stops_installs_and_starts_again(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    first = make_bundle(worker.root, wheel, make_run_config(merge=True))
    deploy([worker], first, Steps())
    worker.clear_calls()
    without_merge = make_bundle(worker.root, wheel, make_run_config(merge=False, run_name="second"))
    hook = Steps()
    deploy([worker], without_merge, hook)

    assert hook.steps() == [
        "check",
        "directories",
        "clean",
        "space",
        "upload",
        "verify-upload",
        "install",
        "config",
        "verify",
        # The old job ran until here: the new version was built and checked beside it.
        "stop",
        "switch",
        "units",
        "daemon-reload",
        "enable",
        "start",
        "record",
        "prune",
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
    assert_converged(worker, without_merge, previous=first)

    # Back to the first version: its release is still there, so nothing is uploaded or
    # installed, and the second one stays as the previous.
    hook = Steps()
    deploy([worker], first, hook)
    assert "upload" not in hook.steps() and "install" not in hook.steps()
    assert "verify" in hook.steps()
    assert_converged(worker, first, previous=without_merge)


def test_ready_timeout_says_what_the_startup_log_shows(
    sshd_factory, wheel: workloads_wheel.Wheel
) -> None:
    worker: Worker = sshd_factory("booting")
    log = worker.root / "var/log/gemma4-startup.log"
    log.parent.mkdir(parents=True)
    log.write_text("installing python3.11\nstaging weights from gs://b/models: 41%\n")
    with pytest.raises(remote.DeployError) as caught:
        deploy([worker], make_bundle(worker.root, wheel), Steps(), ready_timeout_s=0.5)
    message = str(caught.value)
    assert f"{host(worker)}: step 'wait-ready' timed out; remote log: {log}" in message
    assert "not ready after 0.5 s" in message
    assert "ready marker" in message and str(worker.root / "run/gemma4/ready") in message
    assert "staging weights from gs://b/models: 41%" in message
    assert str(log) in message


def test_unreachable_worker_times_out_naming_the_ssh_problem(
    sshd_factory, wheel: workloads_wheel.Wheel
) -> None:
    worker: Worker = sshd_factory("gone")
    worker.stop()
    started = time.monotonic()
    with pytest.raises(remote.DeployError, match="SSH not reachable"):
        deploy([worker], make_bundle(worker.root, wheel), Steps(), ready_timeout_s=1)
    assert time.monotonic() - started < 10


def test_failing_step_names_host_step_exit_code_and_log(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    (worker.root / "systemctl.exit").write_text("3\n")
    with pytest.raises(remote.DeployError) as caught:
        deploy([worker], make_bundle(worker.root, wheel), Steps())
    error = caught.value.errors[0]
    assert isinstance(error, remote.RemoteError)
    assert (error.host, error.step, error.exit_code) == (host(worker), "daemon-reload", 3)
    assert error.log_path == str(worker.root / "var/log/gemma4-deploy.log")
    assert f"step 'daemon-reload' failed (exit code 3); remote log: {error.log_path}" in str(
        caught.value
    )
    assert not (worker.root / "var/lib/gemma4/deployed.json").exists()  # not recorded as deployed


def test_two_workers_deploy_in_parallel_and_a_dead_sshd_fails_only_its_worker(
    sshd_factory,
    wheel: workloads_wheel.Wheel,
) -> None:
    workers: list[Worker] = [sshd_factory("w0"), sshd_factory("w1")]
    for w in workers:
        w.make_venv()
        w.mark_ready()
    h0, h1 = (host(w) for w in workers)
    # One bundle for the slice (its units name w0's root; only the shim reads them on w1).
    bundle = make_bundle(workers[0].root, wheel)
    hook = Steps()
    assert [r.changed for r in deploy(workers, bundle, hook)] == [True, True]
    installs = {h: t for h, s, t in hook.calls if s == "install"}
    records = {h: t for h, s, t in hook.calls if s == "record"}
    assert installs[h0] < records[h1] and installs[h1] < records[h0]  # both installing at once

    # Fault: w1's sshd (and its sessions) die when w1's switch begins, after every worker built
    # the new release; w0 completes.
    bundle = make_bundle(workers[0].root, wheel, make_run_config(run_name="faulty"))
    hook = Steps()
    hook.actions[(h1, "switch")] = workers[1].stop
    with pytest.raises(remote.DeployError) as caught:
        deploy(workers, bundle, hook)
    assert len(caught.value.errors) == 1
    error = caught.value.errors[0]
    assert isinstance(error, remote.RemoteError)
    assert (error.host, error.step, error.exit_code) == (h1, "switch", None)
    assert f"{h1}: step 'switch' failed (connection failed)" in str(caught.value)
    assert installed(workers[0])["state"]["fingerprint"] == bundle.fingerprint
    assert installed(workers[1])["state"]["fingerprint"] != bundle.fingerprint

    # sshd back: the next deploy finishes w1 only, reusing the release it built.
    workers[1].start()
    hook = Steps()
    assert [r.changed for r in deploy(workers, bundle, hook)] == [False, True]
    assert hook.steps(h0) == ["check"]
    assert "install" not in hook.steps(h1)
    for w in workers:
        found = installed(w)
        assert found["active"] == f"releases/{bundle.release}"
        assert found["dist_infos"] == ["gemma4_tpu-0.1.0.dist-info"]
        assert found["wheels"] == [pathlib.Path(wheel.path).name]
        assert found["incoming"] == []
        assert found["state"]["fingerprint"] == bundle.fingerprint
        assert len(found["releases"]) == 2  # this one and the previous
        assert "run_name: faulty" in (w.root / "etc/gemma4/run.yaml").read_text()


def test_file_contents_never_travel_on_a_command_line(
    worker: Worker, wheel: workloads_wheel.Wheel, monkeypatch: pytest.MonkeyPatch
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
    deploy([worker], bundle, Steps())
    assert len(commands) > 5
    assert not [c for c in commands if sentinel in c]
    assert sentinel in (worker.root / "etc/gemma4/run.yaml").read_text()
