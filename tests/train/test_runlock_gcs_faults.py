"""The gs:// run lock under faults between gcsfs and a GCS protocol server
(tests/fixtures/gcs_faults.py): still exactly one holder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from workloads.common import errors, storage
from workloads.train import runlock


def test_the_lock_under_503s_has_exactly_one_holder(gcs_faults):
    run = f"{gcs_faults.bucket}/run"
    # Every trainer's create meets 503s first (gcsfs retries them).
    gcs_faults.add("503", times=4, method="POST")
    outcomes: list[str] = []
    locks = [runlock.RunLock(run, print) for _ in range(3)]

    def take(lock: runlock.RunLock) -> None:
        try:
            lock.acquire()
            outcomes.append("held")
        except errors.UserError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert gcs_faults.proxy.count("503") == 4
    assert outcomes.count("held") == 1, outcomes
    assert all("another trainer holds" in o for o in outcomes if o != "held"), outcomes
    for lock in locks:
        lock.release()
    assert not storage.exists(f"{run}/{runlock.LOCK_FILE}")


def test_a_lock_whose_create_answer_was_lost_is_ours(gcs_faults):
    # The create reaches the server but its answer is cut; gcsfs's retry then meets the object
    # this very call wrote (412). That is our lock, not another trainer's.
    run = f"{gcs_faults.bucket}/run"
    gcs_faults.add("reset", method="POST", path="ifGenerationMatch=0")
    lock = runlock.RunLock(run, print)
    lock.acquire()
    assert gcs_faults.proxy.count("reset") == 1
    with pytest.raises(errors.UserError, match="another trainer holds"):
        runlock.RunLock(run, print).acquire()
    lock.release()
    assert not storage.exists(f"{run}/{runlock.LOCK_FILE}")


def test_a_lock_under_a_403_is_one_line_naming_it(gcs_faults):
    run = f"{gcs_faults.bucket}/run"
    gcs_faults.add("403", times=5)
    with pytest.raises(errors.UserError) as caught:
        runlock.RunLock(run, print).acquire()
    assert str(caught.value).startswith(
        f"{run}/{runlock.LOCK_FILE}: access denied (HTTP 403) trying to take the lock"
    )


SUCCESSOR = (
    "import socket, sys, time\n"
    "from workloads.common.gcs_server import point_clients_at\n"
    "point_clients_at(sys.argv[2])  # the server itself: this host is not cut off\n"
    "socket.gethostname = lambda: 'successor-vm'\n"
    "from workloads.train import runlock\n"
    "lock = runlock.RunLock(sys.argv[1], lambda line: None)\n"
    "lock.acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_holder_cut_off_from_gcs_past_its_lease_stops_when_it_is_back(
    gcs_faults, monkeypatch, tmp_path
):
    # The holder talks to GCS through the proxy, which answers 503 to everything for longer than
    # the lease (a 503 storm, a network partition); another host, which reaches GCS, watches the
    # lock for the lease, takes it over and trains on. The holder, meanwhile, waits before its
    # next write; once it is back its renewal fails the generation precondition and it stops.
    monkeypatch.setattr(runlock, "LEASE_S", 2.0)
    run = f"{gcs_faults.bucket}/run"
    notes: list[str] = []
    lost: list[runlock.LockLost] = []
    holder = runlock.RunLock(run, notes.append, on_lost=lost.append)
    holder.acquire()
    gcs_faults.add("503", times=10**6)
    outcome: list[BaseException | None] = []

    def write_when_allowed() -> None:  # the trainer's check before its next checkpoint
        try:
            holder.check(renew=True)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    checker = threading.Thread(target=write_when_allowed, daemon=True)
    checker.start()
    env = {**os.environ, "GEMMA4_LOCK_LEASE_S": "2"}
    started = time.monotonic()
    successor = subprocess.Popen(
        [sys.executable, "-c", SUCCESSOR, run, gcs_faults.server.url],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert successor.stdout is not None and successor.stdout.readline().strip() == "held"
        taken = time.monotonic() - started
        assert taken >= 2.0  # it watched the whole lease first
        assert not outcome  # the holder is still waiting: it wrote nothing
        gcs_faults.proxy.clear()  # the holder reaches GCS again
        checker.join(timeout=30)
        (stopped,) = outcome
        assert isinstance(stopped, runlock.LockLost), stopped
        assert f"taken over by pid {successor.pid} on host successor-vm" in str(stopped)
        assert lost == [stopped]
        assert "\n" not in str(stopped)
        assert any(note.startswith(f"note: could not renew {run}/train.lock") for note in notes)
        holder.release()  # leaves the successor's lock alone
        fs, path = storage.filesystem(f"{run}/{runlock.LOCK_FILE}")
        fs.invalidate_cache(path)
        assert json.loads(fs.cat_file(path))["pid"] == successor.pid
    finally:
        successor.kill()
        successor.wait()
