"""The gs:// run lock under faults between gcsfs and a GCS protocol server
(tests/fixtures/gcs_faults.py): still exactly one holder."""

from __future__ import annotations

import threading

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
