"""One trainer per run directory: a second one stops with one line naming the holder; the lock
of a process that died is taken over (a local flock by the kernel, a gs:// lock object when its
writer is gone from this host); a lock held by a live process elsewhere is never taken."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from workloads.common import errors
from workloads.train import runlock

HOLD = (
    "import sys, time\n"
    "from workloads.train import runlock\n"
    "lock = runlock.RunLock(sys.argv[1], print)\n"
    "lock.acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def hold_in_another_process(output_dir) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(output_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_trainer_gets_one_line_naming_the_holder(tmp_path):
    proc = hold_in_another_process(tmp_path / "run")
    try:
        with pytest.raises(errors.UserError) as info:
            runlock.RunLock(str(tmp_path / "run"), print).acquire()
        message = str(info.value)
        assert message.startswith(
            f"{tmp_path / 'run'}: another trainer holds {tmp_path / 'run' / 'train.lock'} "
            f"(pid {proc.pid} on host {socket.gethostname()} since "
        )
        assert message.endswith("); stop it first, or use another train.output_dir")
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_of_a_killed_trainer_is_free_at_once(tmp_path):
    proc = hold_in_another_process(tmp_path / "run")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    holder = json.loads((tmp_path / "run" / "train.lock").read_text())
    assert holder["pid"] == proc.pid  # left behind, but no process holds its flock
    with runlock.RunLock(str(tmp_path / "run"), print) as lock:
        assert json.loads((tmp_path / "run" / "train.lock").read_text())["pid"] == os.getpid()
        with pytest.raises(errors.UserError):  # a second holder in this very process too
            runlock.RunLock(str(tmp_path / "run"), print).acquire()
        assert lock.path.endswith("train.lock")
    assert not (tmp_path / "run" / "train.lock").exists()


def test_training_refuses_a_locked_run_directory_before_any_work(config_for, tmp_path):
    from workloads.train import trainer

    proc = hold_in_another_process(tmp_path / "run")
    try:
        started = time.monotonic()
        with pytest.raises(errors.UserError) as info:
            trainer.train(config_for(tmp_path / "run"), log=lambda line: None)
        assert "another trainer holds" in str(info.value) and f"pid {proc.pid}" in str(info.value)
        assert time.monotonic() - started < 30  # before staging, data and compilation
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["train.lock"]
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(params=["memory", "gs"])
def memory_run(request):
    """A remote run directory (the gs:// code path): on fsspec's in-memory filesystem, and in a
    bucket of the GCS protocol server (generation preconditions as on GCS)."""
    from workloads.common import storage

    if request.param == "gs":
        yield f"{request.getfixturevalue('gcs_bucket')}/run"
        return
    path = f"memory://locktest-{os.getpid()}-{time.monotonic_ns()}"
    yield path
    fs, root = storage.filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


def write_remote_lock(path: str, holder: dict) -> None:
    from workloads.common import storage

    storage.write_bytes_atomic(f"{path}/train.lock", json.dumps(holder).encode())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remote_lock_is_created_once_and_given_back(memory_run):
    first = runlock.RunLock(memory_run, print)
    first.acquire()
    with pytest.raises(errors.UserError) as info:
        runlock.RunLock(memory_run, print).acquire()
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(info.value)
    assert "delete the lock (gcloud storage rm " in str(info.value)
    first.release()
    with runlock.RunLock(memory_run, print):
        pass


def test_remote_lock_of_a_dead_process_on_this_host_is_taken_over(memory_run):
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "start_time": "1", "since": "then"}
    write_remote_lock(memory_run, stale)
    notes: list[str] = []
    with runlock.RunLock(memory_run, notes.append):
        (note,) = notes
        assert note.startswith(f"note: taking over {memory_run}/train.lock from pid ")
        assert note.endswith("which no longer runs")


def test_remote_lock_from_before_this_boot_is_taken_over(memory_run):
    write_remote_lock(
        memory_run,
        {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": "another-boot"},
    )
    with runlock.RunLock(memory_run, print):
        pass


def test_remote_lock_of_a_live_process_on_this_host_is_never_taken(memory_run):
    write_remote_lock(memory_run, runlock._me())
    started = time.monotonic()
    with pytest.raises(errors.UserError, match="another trainer holds"):
        runlock.RunLock(memory_run, print).acquire()
    assert time.monotonic() - started < 5  # judged at once, no lease to wait out


def test_another_hosts_lock_that_is_renewed_is_never_taken(memory_run, monkeypatch):
    monkeypatch.setattr(runlock, "LEASE_S", 3.0)
    holder = {**runlock._me(), "host": "some-other-host", "pid": dead_pid()}
    write_remote_lock(memory_run, holder)
    stop = threading.Event()

    def renew() -> None:  # the holder's lease thread, on its own host
        while not stop.is_set():
            write_remote_lock_alive(memory_run, holder["token"])
            stop.wait(0.3)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(errors.UserError, match=r"pid .* on host some-other-host"):
            runlock.RunLock(memory_run, print).acquire()
        assert time.monotonic() - started < 3.0  # seen alive before the lease would lapse
    finally:
        stop.set()
        thread.join()


def test_another_hosts_lock_without_renewals_is_taken_over_after_the_lease(memory_run, monkeypatch):
    # A preempted VM's trainer: its replacement is a new host, and the old one never renews.
    monkeypatch.setattr(runlock, "LEASE_S", 1.5)
    write_remote_lock(memory_run, {**runlock._me(), "host": "preempted-vm", "pid": dead_pid()})
    notes: list[str] = []
    started = time.monotonic()
    with runlock.RunLock(memory_run, notes.append):
        waited = time.monotonic() - started
        assert notes[-1].startswith(f"note: taking over {memory_run}/train.lock from pid ")
    assert 1.0 <= waited < 10
    assert "watching it for up to" in notes[0]


def test_a_held_remote_lock_renews_its_lease(memory_run, monkeypatch):
    from workloads.common import storage

    monkeypatch.setattr(runlock, "LEASE_S", 0.4)
    alive = f"{memory_run}/{runlock.ALIVE_FILE}"
    with runlock.RunLock(memory_run, print):
        time.sleep(0.05)
        fs, path = storage.filesystem(alive)
        first = runlock._written_at(fs.info(path))
        time.sleep(0.4)
        assert runlock._written_at(fs.info(path)) > first
    assert not storage.exists(alive)  # released: no lease left behind


def write_remote_lock_alive(path: str, token: str) -> None:
    from workloads.common import storage

    storage.write_bytes_atomic(
        f"{path}/{runlock.ALIVE_FILE}", json.dumps({"token": token}).encode()
    )
