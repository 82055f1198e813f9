"""The gs:// run lock fences (workloads.train.runlock): a trainer frozen past its lease while
another host took the run over stops before it writes anything more, and the run ends as an
uninterrupted one; a step saved under an older lock generation than an earlier step's is
refused on resume.

One shared scenario on the GCS protocol server (`frozen_holder`), asserted on by several tests:
a trainer subprocess with a 3 s lease is stopped (SIGSTOP) right after its first checkpoint; a
successor (this process, as another host) watches the lock for the lease, takes it over and
trains on; the frozen trainer is continued (SIGCONT) as soon as the successor holds the lock,
beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.train.conftest import SAVE_EVERY, STEPS
from tests.train.test_gcs import metric_steps, same_weights
from tests.train.test_training import wait_for
from workloads.common import storage
from workloads.common.gcs_server import point_clients_at
from workloads.train import runlock

LEASE_S = 3.0


@dataclasses.dataclass
class Scenario:
    run: str
    holder_pid: int
    holder_status: int
    holder_log: str
    successor_lines: list[str]
    result: object
    continued: bool


def _read_lock(run: str) -> dict | None:
    fs, path = storage.filesystem(f"{run}/{runlock.LOCK_FILE}")
    fs.invalidate_cache(path)
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def frozen_holder(reference_run, config_for, gcs_server, tmp_path_factory):
    from workloads.train import trainer

    point_clients_at(gcs_server.url)
    run = f"gs://{gcs_server.new_bucket()}/run"
    cfg = config_for(run)
    work = tmp_path_factory.mktemp("fencing")
    config_file = work / "run.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    log_path = work / "holder.log"
    first_commit = f"{run}/checkpoints/{SAVE_EVERY}/commit_success.txt"
    with open(log_path, "w") as log:
        holder = subprocess.Popen(
            [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GEMMA4_LOCK_LEASE_S": str(LEASE_S)},
        )
    continued = threading.Event()

    def continue_beside_successor() -> None:
        # The frozen trainer comes back as soon as its successor holds the lock, while the
        # successor restores and trains.
        wait_for(lambda: (_read_lock(run) or {}).get("pid") == os.getpid(), 300)
        holder.send_signal(signal.SIGCONT)
        continued.set()

    try:
        wait_for(lambda: storage.exists(first_commit), 600, holder)
        holder.send_signal(signal.SIGSTOP)
        waker = threading.Thread(target=continue_beside_successor, daemon=True)
        waker.start()
        lines: list[str] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(runlock, "LEASE_S", LEASE_S)
            # Another host: the frozen trainer's lock names this host and a live process.
            patch.setattr(socket, "gethostname", lambda: "successor-vm")
            result = trainer.train(cfg, log=lines.append, handle_sigterm=False)
        waker.join(timeout=60)
        status = holder.wait(timeout=120)
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait()
    return Scenario(
        run=run,
        holder_pid=holder.pid,
        holder_status=status,
        holder_log=log_path.read_text(),
        successor_lines=lines,
        result=result,
        continued=continued.is_set(),
    )


@pytest.mark.slow
def test_a_frozen_holder_stops_with_one_line_and_no_restart(frozen_holder):
    assert frozen_holder.continued  # it ran again beside its successor
    # Exit status 2: gemma4-train.service does not restart it (RestartPreventExitStatus=2 3).
    assert frozen_holder.holder_status == 2, frozen_holder.holder_log
    lines = frozen_holder.holder_log.splitlines()
    (stop,) = [line for line in lines if "no longer holds" in line]
    assert stop == lines[-1]
    assert stop.startswith(
        f"error: {frozen_holder.run}: this trainer no longer holds {frozen_holder.run}/train.lock "
        f"(taken over by pid {os.getpid()} on host successor-vm since "
    )
    assert "Traceback" not in frozen_holder.holder_log


@pytest.mark.slow
def test_the_successor_took_over_after_watching_the_lease(frozen_holder):
    lines = frozen_holder.successor_lines
    assert any(
        line.startswith(f"note: {frozen_holder.run}/train.lock is held by pid ")
        and f"watching it for up to {LEASE_S:.0f} s" in line
        for line in lines
    ), lines
    taking_over = f"note: taking over {frozen_holder.run}/train.lock"
    assert any(line.startswith(taking_over) for line in lines)
    assert frozen_holder.result.resumed_from == SAVE_EVERY
    assert frozen_holder.result.final_step == STEPS
    assert _read_lock(frozen_holder.run) is None  # given back at the end


@pytest.mark.slow
def test_the_run_beside_a_frozen_holder_ends_as_an_uninterrupted_one(frozen_holder, reference_run):
    run = frozen_holder.run
    assert metric_steps(run) == list(range(1, STEPS + 1))  # every step once
    assert same_weights(f"{run}/checkpoints", reference_run.checkpoint_dir) <= 1e-6
    summary = json.loads(storage.read_text(f"{run}/train_summary.json"))
    assert summary["checkpoint_steps"] == [SAVE_EVERY, STEPS]
    assert summary["real_tokens"] == reference_run.summary["real_tokens"]
    # The frozen trainer's segment is as its first checkpoint left it: nothing written after.
    segments = {
        name: json.loads(storage.read_text(f"{run}/segments/{name}"))
        for name in storage.list_files(f"{run}/segments")
    }
    (held,) = [s for name, s in segments.items() if name.startswith("00000000-")]
    assert held["status"] == "running" and held["end_step"] == SAVE_EVERY


@pytest.mark.slow
def test_each_step_records_the_lock_generation_it_was_saved_under(frozen_holder):
    from workloads.train import resume

    checkpoints = f"{frozen_holder.run}/checkpoints"
    first, last = resume._fence(checkpoints, SAVE_EVERY), resume._fence(checkpoints, STEPS)
    assert first is not None and last is not None
    assert first < last  # the successor's token is the newer one
    assert resume.fence_problem(checkpoints, STEPS, [SAVE_EVERY, STEPS]) is None


def test_a_step_saved_under_an_older_lock_generation_is_refused(reference_run, tmp_path):
    """A trainer that had lost the lock saved step 8 under generation 100 after its successor
    had saved step 4 under 200: resume moves step 8 aside and resumes from step 4."""
    from workloads.train import resume

    run = tmp_path / "run"
    shutil.copytree(pathlib.Path(reference_run.checkpoint_dir).parent, run)
    for step, token in ((SAVE_EVERY, 200), (STEPS, 100)):
        meta_path = run / "checkpoints" / str(step) / resume.STEP_METADATA
        meta = json.loads(meta_path.read_text())
        meta["custom_metadata"][runlock.FENCE_KEY] = token
        meta_path.write_text(json.dumps(meta))
    from workloads.contract import runconfig

    train = runconfig.TrainingRunSection(output_dir=str(run))
    lines: list[str] = []
    step = resume.choose_step(
        train, fresh_optimizer_state=False, move_damaged=True, log=lines.append
    )
    assert step == SAVE_EVERY
    (line,) = lines
    assert line.startswith(
        f"checkpoint step {STEPS} in {run}/checkpoints is damaged (saved under run-lock "
        f"generation 100, older than step {SAVE_EVERY}'s 200: by a trainer that had lost the "
        "run directory to another one); moved to "
    )
    assert line.endswith(f"; falling back to step {SAVE_EVERY}")
