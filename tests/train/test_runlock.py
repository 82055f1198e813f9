"""One trainer per run directory: a second one stops with one line naming the holder; the lock
of a process that died is taken over (a local flock by the kernel, a gs:// lock object when its
writer is gone from this host); a lock held by a live process elsewhere is never taken."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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


@pytest.fixture
def remote_run(gcs_bucket):
    """A gs:// run directory in a bucket of the GCS protocol server (generation preconditions as
    on GCS)."""
    return f"{gcs_bucket}/run"


def write_remote_lock(path: str, holder: dict) -> None:
    from workloads.common import storage

    storage.write_bytes_atomic(f"{path}/train.lock", json.dumps(holder).encode())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remote_lock_is_created_once_and_given_back(remote_run):
    first = runlock.RunLock(remote_run, print)
    first.acquire()
    with pytest.raises(errors.UserError) as info:
        runlock.RunLock(remote_run, print).acquire()
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(info.value)
    assert "delete the lock (gcloud storage rm " in str(info.value)
    first.release()
    with runlock.RunLock(remote_run, print):
        pass


def test_remote_lock_of_a_dead_process_on_this_host_is_taken_over(remote_run):
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "start_time": "1", "since": "then"}
    write_remote_lock(remote_run, stale)
    notes: list[str] = []
    with runlock.RunLock(remote_run, notes.append):
        (note,) = notes
        assert note.startswith(f"note: taking over {remote_run}/train.lock from pid ")
        assert note.endswith("which no longer runs")


def test_remote_lock_from_before_this_boot_is_taken_over(remote_run):
    write_remote_lock(
        remote_run,
        {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": "another-boot"},
    )
    with runlock.RunLock(remote_run, print):
        pass


def test_remote_lock_of_a_live_process_on_this_host_is_never_taken(remote_run):
    write_remote_lock(remote_run, runlock._me())
    started = time.monotonic()
    with pytest.raises(errors.UserError, match="another trainer holds"):
        runlock.RunLock(remote_run, print).acquire()
    assert time.monotonic() - started < 5  # judged at once, no lease to wait out


def as_another_host(monkeypatch, name: str = "newcomer-host") -> None:
    """From here on this process looks like another host to the locks it judges (the holder's
    lock keeps the host name it was taken with)."""
    monkeypatch.setattr(socket, "gethostname", lambda: name)


def test_another_hosts_lock_that_is_renewed_is_never_taken(remote_run, monkeypatch):
    monkeypatch.setattr(runlock, "LEASE_S", 2.0)
    with runlock.RunLock(remote_run, print):  # renews every 0.5 s on its own thread
        as_another_host(monkeypatch)
        started = time.monotonic()
        with pytest.raises(errors.UserError, match=rf"pid {os.getpid()} on host "):
            runlock.RunLock(remote_run, print).acquire()
        assert time.monotonic() - started < 2.0  # seen alive before the lease would lapse


def test_a_newcomer_whose_clock_runs_five_minutes_fast_leaves_a_live_lock(remote_run, monkeypatch):
    # Its clock against the bucket's write times would call the lock 300 s old: only its own
    # monotonic clock, watching the lock change, judges the lease.
    monkeypatch.setattr(runlock, "LEASE_S", 2.0)
    with runlock.RunLock(remote_run, print) as holder:
        as_another_host(monkeypatch)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 300)
        with pytest.raises(errors.UserError, match="another trainer holds"):
            runlock.RunLock(remote_run, print).acquire()
        holder.check(renew=True)  # still the holder's


def test_another_hosts_lock_without_renewals_is_taken_over_after_the_lease(remote_run, monkeypatch):
    # A preempted VM's trainer: its replacement is a new host, and the old one never renews.
    monkeypatch.setattr(runlock, "LEASE_S", 1.5)
    write_remote_lock(remote_run, {**runlock._me(), "host": "preempted-vm", "pid": dead_pid()})
    notes: list[str] = []
    started = time.monotonic()
    with runlock.RunLock(remote_run, notes.append):
        waited = time.monotonic() - started
        assert notes[-1].startswith(f"note: taking over {remote_run}/train.lock from pid ")
    assert 1.5 <= waited < 10
    assert "watching it for up to 2 s" in notes[0]


def test_a_held_remote_lock_renews_its_lease(remote_run, monkeypatch):
    from workloads.common import storage

    monkeypatch.setattr(runlock, "LEASE_S", 0.4)
    with runlock.RunLock(remote_run, print) as lock:
        first = lock._generation
        time.sleep(0.3)
        assert lock._generation > first  # rewritten in place: a new generation
        assert lock.fence == first  # the token stays the one the lock was taken with
        assert storage.list_files(remote_run) == ["train.lock"]
    assert not storage.exists(f"{remote_run}/train.lock")


def test_a_renewal_after_a_takeover_fails_and_the_holder_stops(remote_run, monkeypatch):
    monkeypatch.setattr(runlock, "LEASE_S", 60.0)
    lost: list[runlock.LockLost] = []
    holder = runlock.RunLock(remote_run, print, on_lost=lost.append)
    holder.acquire()
    holder.check()  # renewed just now: no call to GCS
    # Another host judged the lease run out (the holder was frozen) and took the lock over.
    successor = {**runlock._me(), "host": "successor-vm", "pid": 4242}
    write_remote_lock(remote_run, successor)
    with pytest.raises(runlock.LockLost) as info:
        holder.check(renew=True)
    message = str(info.value)
    assert message == (
        f"{remote_run}: this trainer no longer holds {remote_run}/train.lock (taken over by "
        f"pid 4242 on host successor-vm since {successor['since']}: its lease ran out while this "
        "trainer was paused or cut off from GCS); stopping without writing anything more"
    )
    assert lost == [info.value] and holder.lost
    with pytest.raises(runlock.LockLost):  # every later check too, without asking GCS
        holder.check()
    holder.release()  # the successor's lock stays
    assert json.loads(read_remote_lock(remote_run))["pid"] == 4242


def test_a_holder_past_its_renewal_gap_renews_before_it_writes(remote_run, monkeypatch):
    monkeypatch.setattr(runlock, "LEASE_S", 60.0)
    with runlock.RunLock(remote_run, print) as holder:
        before = holder._generation
        holder.check()
        assert holder._generation == before  # a recent renewal: nothing asked
        holder._renewed_at -= 60.0 * runlock.WRITE_WITHIN  # as after a freeze of half the lease
        holder.check()
        assert holder._generation > before


def read_remote_lock(path: str) -> bytes:
    from workloads.common import storage

    fs, p = storage.filesystem(f"{path}/train.lock")
    fs.invalidate_cache(p)
    return bytes(fs.cat_file(p))


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_a_bad_lease_is_one_line(monkeypatch, value):
    monkeypatch.setenv("GEMMA4_LOCK_LEASE_S", value)
    with pytest.raises(errors.UserError) as info:
        runlock.lease_from_env()
    assert str(info.value) == (
        f"GEMMA4_LOCK_LEASE_S={value!r}: expected the gs:// run lock's lease in seconds, a "
        "number above 0 (unset: 120)"
    )


def test_a_good_lease_is_read(monkeypatch):
    monkeypatch.setenv("GEMMA4_LOCK_LEASE_S", "2.5")
    assert runlock.lease_from_env() == 2.5
    monkeypatch.delenv("GEMMA4_LOCK_LEASE_S")
    assert runlock.lease_from_env() == 120.0
