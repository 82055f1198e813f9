"""Training with its run directory in gs:// (the TPU VMs' layout) on a GCS protocol server
(tests/fixtures/gcs_server.py): checkpoints through TensorStore's GCS driver, the lock object,
metrics and the prepared-data cache through gcsfs. GCS has no rename: Orbax marks a finished
step with `commit_success.txt` in the step's own prefix instead of renaming a temporary one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.train.conftest import SAVE_EVERY, STEPS
from tests.train.test_runlock import hold_in_another_process
from tests.train.test_training import wait_for
from workloads.common import errors, storage


def same_weights(checkpoint_dir: str, reference_dir: str) -> float:
    from workloads.checkpoint import lora_restore

    ours = lora_restore.restore_lora_params(checkpoint_dir, STEPS)
    reference = lora_restore.restore_lora_params(reference_dir, STEPS)
    assert ours.keys() == reference.keys() and len(ours) == 70
    return max(float(np.max(np.abs(ours[k] - reference[k]))) for k in ours)


def metric_steps(run: str) -> list[int]:
    return [
        json.loads(line)["step"] for line in storage.read_text(f"{run}/metrics.jsonl").splitlines()
    ]


def test_a_gs_run_killed_after_a_checkpoint_resumes_to_the_same_weights(
    reference_run, config_for, gcs_bucket, tmp_path, capfd
):
    from workloads.checkpoint import lora_restore
    from workloads.train import trainer

    run = f"{gcs_bucket}/run"
    cfg = config_for(run)
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    done = f"{run}/checkpoints/{SAVE_EVERY}/commit_success.txt"
    with open(tmp_path / "train.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: storage.exists(done), 600, proc)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
    log_text = (tmp_path / "train.log").read_text()
    assert lora_restore.saved_steps(cfg.train.checkpoint_dir) == [SAVE_EVERY], log_text
    assert storage.exists(f"{run}/train.lock")  # a SIGKILL cannot give it back

    capfd.readouterr()
    lines: list[str] = []
    resumed = trainer.train(cfg, log=lines.append)
    assert resumed.resumed_from == SAVE_EVERY and resumed.final_step == STEPS
    # The killed trainer's lock names a dead process of this host: taken over with one note.
    assert any(line.startswith(f"note: taking over {run}/train.lock") for line in lines), lines
    # The prepared-data cache in gs:// was read back, not tokenized again.
    assert "not tokenized again" in capfd.readouterr().out
    assert same_weights(cfg.train.checkpoint_dir, reference_run.checkpoint_dir) <= 1e-6
    assert metric_steps(run) == list(range(1, STEPS + 1))
    summary = json.loads(storage.read_text(f"{run}/train_summary.json"))
    assert summary["segments"] == 2 and summary["checkpoint_steps"] == [SAVE_EVERY, STEPS]
    assert summary["real_tokens"] == reference_run.summary["real_tokens"]
    assert not storage.exists(f"{run}/train.lock")


@pytest.mark.parametrize("moment", ["before_commit", "mid_items"])
def test_a_save_to_gs_cut_short_is_redone_from_the_previous_step(
    reference_run, config_for, gcs_bucket, moment
):
    """What a SIGKILL inside the save of the last step leaves in gs://: the step's objects
    without `commit_success.txt` (killed just before the commit), or only some of its items'
    objects. The restart removes the unfinished step with one line, resumes from the step
    before and ends on the uninterrupted run's weights."""
    import pathlib

    from workloads.checkpoint import lora_restore
    from workloads.train import trainer

    local = pathlib.Path(reference_run.checkpoint_dir).parent
    run = f"{gcs_bucket}/run"
    storage.copy_tree(str(local), run)
    fs, root = storage.filesystem(f"{run}/checkpoints/{STEPS}")
    fs.rm_file(f"{root}/commit_success.txt")
    if moment == "mid_items":
        for name in fs.find(f"{root}/optimizer_state"):
            fs.rm_file(name)
        fs.rm_file(f"{root}/_CHECKPOINT_METADATA")
    storage.write_text_atomic(  # as the killed run left it: the last step's summary not written
        f"{run}/metrics.jsonl",
        "".join(
            line + "\n"
            for line in (local / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] <= STEPS - 1
        ),
    )
    fs.rm_file(storage.filesystem(f"{run}/train_summary.json")[1])

    cfg = config_for(run)
    assert lora_restore.saved_steps(cfg.train.checkpoint_dir) == [SAVE_EVERY]
    lines: list[str] = []
    result = trainer.train(cfg, log=lines.append)
    assert result.resumed_from == SAVE_EVERY and result.final_step == STEPS
    assert f"removed {run}/checkpoints/{STEPS}: a save that never completed" in lines
    assert same_weights(cfg.train.checkpoint_dir, reference_run.checkpoint_dir) <= 1e-6
    assert metric_steps(run) == list(range(1, STEPS + 1))


def test_a_second_trainer_on_a_gs_run_says_who_holds_it(config_for, gcs_bucket):
    from workloads.train import trainer

    run = f"{gcs_bucket}/run"
    proc = hold_in_another_process(run)
    try:
        with pytest.raises(errors.UserError) as info:
            trainer.train(config_for(run), log=lambda line: None)
    finally:
        proc.kill()
        proc.wait()
    message = str(info.value)
    assert message.startswith(f"{run}: another trainer holds {run}/train.lock (pid {proc.pid} ")
    assert "\n" not in message
    # Refused before any work: the holder's lock is the run's only object.
    assert storage.list_files(run) == ["train.lock"]
