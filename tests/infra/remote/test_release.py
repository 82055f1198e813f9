"""Per-version releases: a deploy killed at any point converges on the next one.

The kills are real: the worker's sshd and every process it forked (the remote shell, pip) get
SIGKILL, at a step boundary (the step hook) or in the middle of `pip install` (a watcher that
fires when the files on the worker show pip half-way). Then sshd comes back and the same deploy
runs again, with no hand on the worker. The release commands' own rules (prune never removes
the active release, switch only to a complete one, no rebuild of the active one) are checked
directly with `sh`, without SSH.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from infra import remote
from infra.remote import release
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


def _site(worker: Worker, bundle: remote.Bundle) -> pathlib.Path:
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    venv = worker.root / "opt/gemma4/releases" / bundle.release / "venv"
    return venv / "lib" / python / "site-packages"


def _dist_info(worker: Worker, bundle: remote.Bundle) -> pathlib.Path:
    return _site(worker, bundle) / "gemma4_tpu-0.1.0.dist-info"


# Loaded (through a .pth of the worker's base venv) by every Python the release venv runs: pip
# stops right before or right after it writes the new dist-info's RECORD, drops a flag file,
# and waits there for the test to kill the worker. A precise moment, whatever the load.
PAUSE_AT_RECORD = """import os, time
_replace = os.replace
def _pausing_replace(src, dst, *args, **kwargs):
    at_record = str(dst).endswith("gemma4_tpu-0.1.0.dist-info/RECORD")
    if at_record and WHEN == "before":
        open(FLAG, "w").close(); time.sleep(600)
    result = _replace(src, dst, *args, **kwargs)
    if at_record and WHEN == "after":
        open(FLAG, "w").close(); time.sleep(600)
    return result
os.replace = _pausing_replace
"""


def _pause_pip_at_record(worker: Worker, when: str) -> pathlib.Path:
    flag = worker.base / "pip-paused"
    base_site = next((worker.root / "opt/gemma4/venv").glob("lib/python3*/site-packages"))
    (base_site / "_test_pause_pip.py").write_text(
        f"WHEN = {when!r}\nFLAG = {str(flag)!r}\n{PAUSE_AT_RECORD}"
    )
    (base_site / "_test_pause_pip.pth").write_text("import _test_pause_pip\n")
    return flag


# When to kill the worker during the new release's `pip install`.
PIP_MOMENTS: dict[str, Callable[[Worker, remote.Bundle], Callable[[], bool]]] = {
    # Where the earlier in-place deploy wedged: the package written, its RECORD not yet.
    "just before pip writes RECORD": lambda w, b: _pause_pip_at_record(w, "before").exists,
    "RECORD written": lambda w, b: _pause_pip_at_record(w, "after").exists,
    "venv made, pip starting": lambda w, b: (
        (w.root / "opt/gemma4/releases" / b.release / "venv/pyvenv.cfg").exists
    ),
    "package half extracted": lambda w, b: (_site(w, b) / "workloads").exists,
}


class KillWhen:
    """SIGKILLs the worker's sshd and everything it runs as soon as `moment` holds."""

    def __init__(self, worker: Worker, moment: Callable[[], bool], timeout_s: float = 120):
        self.fired = threading.Event()
        self.worker, self.moment, self.timeout_s = worker, moment, timeout_s

    def start(self) -> None:
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def join(self) -> None:
        """Waits until the watcher is done: the deploy sees its connection drop as soon as the
        kill lands, while stop() is still reaping the worker (and before `fired` is set)."""
        self.thread.join(timeout=self.timeout_s + 30)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.moment():
                self.worker.stop()
                self.fired.set()
                return
            time.sleep(0.001)


def _two_bundles(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> tuple[remote.Bundle, remote.Bundle]:
    old = make_bundle(worker.root, wheel, make_run_config(run_name="old"))
    new = make_bundle(worker.root, wheel, make_run_config(run_name="new", merge=False))
    return old, new


def _assert_old_untouched(worker: Worker, old: remote.Bundle) -> None:
    """A deploy that stopped before its switch left the running version as it was."""
    found = installed(worker)
    assert found["active"] == f"releases/{old.release}"
    assert found["state"]["fingerprint"] == old.fingerprint
    assert not [c for c in worker.systemctl_calls() if c[0] in ("stop", "disable")]
    for name, text in old.units.items():
        assert (worker.root / "etc/systemd/system" / name).read_text() == text
    assert (worker.root / "etc/gemma4/run.yaml").read_text() == old.run_config_yaml


def _assert_units_name_a_complete_release(worker: Worker) -> None:
    """Whatever a kill left, the units on disk name `current`, and `current` is complete."""
    current = worker.root / "opt/gemma4/current"
    assert (current / "COMPLETE").exists()
    for unit in (worker.root / "etc/systemd/system").glob("gemma4-*"):
        assert f"{current}/venv/bin/python" in unit.read_text()


@pytest.mark.sshd
@pytest.mark.parametrize(
    "moment",
    [
        "just before pip writes RECORD",
        pytest.param("venv made, pip starting", marks=pytest.mark.slow),
        pytest.param("package half extracted", marks=pytest.mark.slow),
        pytest.param("RECORD written", marks=pytest.mark.slow),
    ],
)
def test_a_worker_killed_during_pip_install_converges_on_the_next_deploy(
    worker: Worker, wheel: workloads_wheel.Wheel, moment: str
) -> None:
    old, new = _two_bundles(worker, wheel)
    deploy([worker], old, Steps())
    worker.clear_calls()

    killer = KillWhen(worker, PIP_MOMENTS[moment](worker, new))
    hook = Steps()
    hook.actions[(host(worker), "install")] = killer.start
    with pytest.raises(remote.DeployError) as caught:
        deploy([worker], new, hook)
    killer.join()
    assert killer.fired.is_set(), f"steps {hook.steps()}: {caught.value}"
    assert f"{host(worker)}: step 'install' failed (connection failed)" in str(caught.value)
    release_dir = worker.root / "opt/gemma4/releases" / new.release
    assert not (release_dir / "COMPLETE").exists()
    if moment == "just before pip writes RECORD":
        assert (_dist_info(worker, new) / "INSTALLER").exists()  # the package is all there

    worker.start()
    _assert_old_untouched(worker, old)  # the old job never stopped
    for hook_file in (worker.root / "opt/gemma4/venv").glob("lib/python3*/site-packages/_test*"):
        if hook_file.name != "_test_parent_venv.pth":
            hook_file.unlink()
    deploy([worker], new, Steps())
    assert_converged(worker, new, previous=old)


PHASE_1 = ["clean", "space", "upload", "verify-upload", "config", "verify"]
PHASE_2 = ["stop", "switch", "units", "daemon-reload", "enable", "start", "record", "prune"]


@pytest.mark.sshd
@pytest.mark.parametrize(
    "step",
    [pytest.param(s, marks=() if s == "units" else pytest.mark.slow) for s in PHASE_1 + PHASE_2],
)
def test_a_worker_killed_at_any_step_converges_on_the_next_deploy(
    worker: Worker, wheel: workloads_wheel.Wheel, step: str
) -> None:
    old, new = _two_bundles(worker, wheel)
    deploy([worker], old, Steps())
    worker.clear_calls()

    hook = Steps()
    hook.actions[(host(worker), step)] = worker.stop
    with pytest.raises(remote.DeployError, match=f"step '{step}' failed"):
        deploy([worker], new, hook)

    worker.start()
    if step in PHASE_1:
        _assert_old_untouched(worker, old)
    _assert_units_name_a_complete_release(worker)
    deploy([worker], new, Steps())
    assert_converged(worker, new, previous=old)


@pytest.mark.sshd
def test_a_worker_wedged_by_the_earlier_in_place_install_converges(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    # What a kill during the earlier `pip install --force-reinstall` into the base venv left: a
    # dist-info without RECORD (pip refuses to uninstall it: every later deploy failed), half a
    # package, the old units naming the base venv, a plain run config file, the wheels dir.
    base_site = next((worker.root / "opt/gemma4/venv").glob("lib/python3*/site-packages"))
    broken = base_site / "gemma4_tpu-0.1.0.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: gemma4-tpu\nVersion: 0.1.0\n")
    (base_site / "workloads").mkdir()
    (base_site / "workloads/__init__.py").write_text("raise ImportError('half written')\n")
    legacy_units = worker.root / "etc/systemd/system"
    legacy_units.mkdir(parents=True)
    (legacy_units / "gemma4-train.service").write_text(
        f"[Service]\nExecStart={worker.root}/opt/gemma4/venv/bin/python -m workloads train\n"
    )
    (worker.root / "etc/gemma4").mkdir(parents=True)
    (worker.root / "etc/gemma4/run.yaml").write_text("run_name: legacy\n")
    (worker.root / "opt/gemma4/wheels").mkdir()
    (worker.root / "opt/gemma4/wheels/gemma4_tpu-0.1.0-py3-none-any.whl").write_bytes(b"old")
    # The recorded bench unit lost its file to a kill in the middle of the units step: disabling
    # it would fail at every deploy (systemd no longer knows it).
    (worker.root / "var/lib/gemma4/deployed.json").write_text(
        '{"fingerprint": "legacy", "units": ["gemma4-bench.service", "gemma4-train.service"], '
        '"enable": ["gemma4-train.service"]}\n'
    )

    bundle = make_bundle(worker.root, wheel)
    deploy([worker], bundle, Steps())

    assert_converged(worker, bundle)
    calls = worker.systemctl_calls()
    # Stopped: the unit with a file, and the one without only if systemd still runs it.
    assert calls[:2] == [
        ["is-active", "--quiet", "gemma4-bench.service"],
        ["stop", "gemma4-bench.service", "gemma4-train.service"],
    ]
    assert not [c for c in calls if c[0] == "disable"]
    assert (worker.root / "etc/gemma4/run.yaml").is_symlink()
    assert not (worker.root / "opt/gemma4/wheels").exists()
    assert broken.exists()  # the base venv is the startup script's: shadowed, never modified


@pytest.mark.sshd
def test_an_unchanged_deploy_finishes_a_prune_that_was_killed(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    old, new = _two_bundles(worker, wheel)
    deploy([worker], old, Steps())
    deploy([worker], new, Steps())
    # A third, abandoned release and staged files: what a kill during the prune leaves.
    leftover = worker.root / "opt/gemma4/releases/.prune-0123456789abcdef/venv"
    leftover.mkdir(parents=True)
    staged = worker.root / "var/lib/gemma4/incoming" / new.release
    staged.mkdir()

    hook = Steps()
    assert deploy([worker], new, hook) == [remote.HostResult(host(worker), False)]
    assert hook.steps() == ["check", "prune"]
    assert_converged(worker, new, previous=old)


# The release commands themselves, run with sh on a local directory (no SSH, no pip).


def _sh(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def _release_tree(root: pathlib.Path, complete: list[str], partial: list[str]) -> None:
    for name in complete + partial:
        (root / "opt/gemma4/releases" / name / "venv").mkdir(parents=True)
    for name in complete:
        (root / "opt/gemma4/releases" / name / release.MARKER).write_text("fp\n")


def test_prune_keeps_the_active_release_and_the_complete_ones_asked_for(
    tmp_path: pathlib.Path,
) -> None:
    layout = remote.RemoteLayout(str(tmp_path))
    a, b, c, d, e = (letter * 16 for letter in "abcde")
    _release_tree(tmp_path, complete=[a, b, c], partial=[d, e])
    releases = tmp_path / "opt/gemma4/releases"
    (releases / ".prune-f").mkdir()
    (releases / "lost+found").mkdir()  # the releases directory may be a mount point
    os.symlink(f"releases/{e}", tmp_path / "opt/gemma4/current")  # active, even if incomplete

    proc = _sh(release.prune(layout, [a, d]))

    assert proc.returncode == 0, proc.stderr
    # a: kept (asked for, complete); d: asked for but incomplete; e: active, whatever it holds.
    assert sorted(os.listdir(releases)) == [a, e, "lost+found"]


def test_switch_refuses_an_incomplete_release_and_replaces_current_in_one_rename(
    tmp_path: pathlib.Path,
) -> None:
    layout = remote.RemoteLayout(str(tmp_path))
    a, b, c = (letter * 16 for letter in "abc")
    _release_tree(tmp_path, complete=[a, b], partial=[c])
    (tmp_path / "etc/gemma4").mkdir(parents=True)
    current = tmp_path / "opt/gemma4/current"

    assert _sh(release.switch(layout, a)).returncode == 0
    assert os.readlink(current) == f"releases/{a}"
    proc = _sh(release.switch(layout, c))
    assert proc.returncode == 1 and "is not complete" in proc.stderr
    assert os.readlink(current) == f"releases/{a}"
    assert _sh(release.switch(layout, b)).returncode == 0
    assert os.readlink(current) == f"releases/{b}"
    assert os.readlink(tmp_path / "etc/gemma4/run.yaml") == f"{current}/run.yaml"
    assert sorted(os.listdir(current.parent)) == ["current", "releases"]  # no .part left


def test_build_never_rebuilds_the_active_release(tmp_path: pathlib.Path) -> None:
    layout = remote.RemoteLayout(str(tmp_path))
    _release_tree(tmp_path, complete=["a"], partial=[])
    os.symlink("releases/a", tmp_path / "opt/gemma4/current")

    proc = _sh(release.build(layout, "a", str(tmp_path / "x.whl"), install_deps=False))

    assert proc.returncode == 1 and "is the active release" in proc.stderr
    assert (tmp_path / "opt/gemma4/releases/a" / release.MARKER).exists()


@pytest.mark.sshd
@pytest.mark.slow
def test_a_worker_that_cannot_install_leaves_every_worker_on_the_old_version(
    sshd_factory, wheel: workloads_wheel.Wheel
) -> None:
    workers: list[Worker] = [sshd_factory("w0"), sshd_factory("w1")]
    for w in workers:
        w.make_venv()
        w.mark_ready()
    # One bundle for the slice (its units name w0's root; only the shim reads them on w1).
    old = make_bundle(workers[0].root, wheel, make_run_config(run_name="old"))
    new = make_bundle(workers[0].root, wheel, make_run_config(run_name="new"))
    deploy(workers, old, Steps())
    for w in workers:
        w.clear_calls()

    hook = Steps()
    hook.actions[(host(workers[1]), "install")] = workers[1].stop
    with pytest.raises(remote.DeployError, match="step 'install' failed"):
        deploy(workers, new, hook)
    workers[1].start()
    # w0 built the new release but switched nothing: a slice never runs two versions.
    assert (workers[0].root / "opt/gemma4/releases" / new.release / "COMPLETE").exists()
    for w in workers:
        _assert_old_untouched(w, old)

    hook = Steps()
    deploy(workers, new, hook)
    assert "install" not in hook.steps(host(workers[0]))  # its complete release is reused
    for w in workers:
        found = installed(w)
        assert found["active"] == f"releases/{new.release}"
        assert found["state"]["fingerprint"] == new.fingerprint
        assert set(found["releases"]) == set(found["complete"]) == {old.release, new.release}


# A deploy that finds the same bundle recorded must still find it working.


@pytest.mark.sshd
@pytest.mark.parametrize("lost", ["release", "venv"])
def test_the_same_bundle_is_reinstalled_when_its_active_release_or_venv_was_deleted(
    worker: Worker, wheel: workloads_wheel.Wheel, lost: str
) -> None:
    bundle = make_bundle(worker.root, wheel)
    deploy([worker], bundle, Steps())
    release_dir = worker.root / "opt/gemma4/releases" / bundle.release
    shutil.rmtree(release_dir if lost == "release" else release_dir / "venv")
    worker.clear_calls()

    hook = Steps()
    assert deploy([worker], bundle, hook) == [remote.HostResult(host(worker), True)]
    assert "install" in hook.steps() and "switch" in hook.steps()
    assert ("unmark" in hook.steps()) == (lost == "venv")  # its marker outlived the venv
    assert_converged(worker, bundle)
    # Then it is up to date again: one check, nothing else.
    hook = Steps()
    assert deploy([worker], bundle, hook) == [remote.HostResult(host(worker), False)]
    assert hook.steps() == ["check"]


@pytest.mark.sshd
@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_current_that_is_not_a_symlink_is_moved_aside_before_the_old_job_stops(
    worker: Worker,
    wheel: workloads_wheel.Wheel,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    old, new = _two_bundles(worker, wheel)
    deploy([worker], old, Steps())
    current = worker.root / "opt/gemma4/current"
    current.unlink()
    if kind == "directory":
        shutil.copytree(worker.root / "opt/gemma4/releases" / old.release, current, symlinks=True)
    else:
        current.write_text("not a release\n")
    worker.clear_calls()

    hook = Steps()
    assert deploy([worker], new, hook) == [remote.HostResult(host(worker), True)]
    steps = hook.steps()
    assert steps.index("current") < steps.index("stop") < steps.index("switch")
    moved = sorted(p.name for p in current.parent.glob("current.moved-*"))
    assert len(moved) == 1
    assert (current.parent / moved[0]).is_dir() == (kind == "directory")
    notices = [
        r.getMessage() for r in caplog.records if "not the release symlink" in r.getMessage()
    ]
    assert notices == [
        f"{host(worker)}: {current} was not the release symlink (a directory or file put "
        f"there): moved aside to {current.parent / moved[0]}"
    ]
    assert_converged(worker, new, previous=old)


def test_build_rebuilds_an_active_release_that_lost_its_marker(tmp_path: pathlib.Path) -> None:
    layout = remote.RemoteLayout(str(tmp_path))
    _release_tree(tmp_path, complete=[], partial=["a"])
    os.symlink("releases/a", tmp_path / "opt/gemma4/current")
    proc = _sh(release.build(layout, "a", str(tmp_path / "x.whl"), install_deps=False))
    # It went past the refusal: it removed the broken release and started building it.
    assert "is the active release" not in proc.stderr
    assert not (tmp_path / "opt/gemma4/releases/a/venv").exists()


def _damage(worker: Worker, bundle: remote.Bundle, what: str) -> pathlib.Path:
    """Deletes one file a working deploy needs, the way a hand on the worker would."""
    release_dir = worker.root / "opt/gemma4/releases" / bundle.release
    unit = sorted(bundle.units)[0]
    path = {
        "run config": release_dir / "run.yaml",
        "installed unit": worker.root / "etc/systemd/system" / unit,
        "release's unit": release_dir / "units" / unit,
        # Not one the import check imports: only the installed files' manifest sees it.
        "package module": _site(worker, bundle) / "workloads/data/packing.py",
    }[what]
    path.unlink()
    return path


@pytest.mark.sshd
@pytest.mark.parametrize(
    "what", ["run config", "installed unit", "release's unit", "package module"]
)
def test_the_same_bundle_is_redeployed_when_a_file_of_its_active_release_was_deleted(
    worker: Worker, wheel: workloads_wheel.Wheel, what: str
) -> None:
    bundle = make_bundle(worker.root, wheel)
    deploy([worker], bundle, Steps())
    lost = _damage(worker, bundle, what)
    worker.clear_calls()

    hook = Steps()
    assert deploy([worker], bundle, hook) == [remote.HostResult(host(worker), True)]
    assert lost.exists(), f"steps {hook.steps()}"
    # Only a damaged package is installed again; a lost config or unit is copied back.
    assert ("install" in hook.steps()) == (what == "package module")
    assert_converged(worker, bundle)
    python = worker.root / "opt/gemma4/current/venv/bin/python"
    subprocess.run([python, "-c", "import workloads.data.packing"], check=True)
    hook = Steps()
    assert deploy([worker], bundle, hook) == [remote.HostResult(host(worker), False)]
    assert hook.steps() == ["check"]
