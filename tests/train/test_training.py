"""Training on the tiny Gemma 4 over 2 CPU devices with tp=2: the loss falls, a killed run
resumes to the same weights, SIGTERM saves before exiting, an fsdp=2 mesh trains the same model."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.train.conftest import SAVE_EVERY, STEPS


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"training exited early with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_loss_decreases_and_outputs_are_written(reference_run):
    records = reference_run.records
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses))
    # A learnable task: the last two steps are clearly below the first one.
    assert np.mean(losses[-2:]) < losses[0] - 0.3, losses

    run = pathlib.Path(reference_run.checkpoint_dir).parent
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for key in (
        "loss",
        "learning_rate",
        "grad_norm",
        "tokens_per_s",
        "computed_tokens_per_s",
        "device_memory_bytes",
    ):
        assert key in lines[0]
    assert not any("mfu" in key for key in lines[0])  # no 6N figure: it overstates a LoRA step
    assert lines[0]["learning_rate"] == 0.0  # 1 warm-up step, then the peak
    assert lines[1]["learning_rate"] == pytest.approx(5e-3)
    assert any((run / "tensorboard").iterdir())

    summary = json.loads((run / "train_summary.json").read_text())
    for key in (
        "run_name",
        "steps",
        "wall_seconds",
        "real_tokens",
        "computed_tokens",
        "tokens_per_second",
        "final_loss",
        "first_loss",
        "accelerator",
    ):
        assert key in summary
    assert summary["steps"] == STEPS and summary["accelerator"] is None
    assert summary["first_loss"] == losses[0] and summary["final_loss"] == losses[-1]
    assert 0 < summary["real_tokens"] <= summary["computed_tokens"] == STEPS * 2 * 2 * 256
    assert summary["checkpoint_steps"] == [SAVE_EVERY, STEPS]
    # One segment: the totals are this process's.
    last = summary["last_segment"]
    assert (summary["segments"], summary["steps_run"], summary["untracked_steps"]) == (1, STEPS, 0)
    assert (last["start_step"], last["end_step"], last["status"]) == (0, STEPS, "finished")
    assert summary["wall_seconds"] == last["wall_seconds"] > 0
    assert summary["real_tokens"] == last["real_tokens"] == sum(r["real_tokens"] for r in records)
    assert summary["tokens_per_second"] == summary["real_tokens"] / summary["wall_seconds"]
    assert summary["compile_seconds"] > 0  # the train step compiles (or loads from the cache)
    meta = json.loads((run / "checkpoints" / "lora_meta.json").read_text())
    assert (meta["rank"], meta["alpha"]) == (4, 8.0)


def test_stages_from_boot_to_first_step_are_in_the_hosts_file_and_the_summary(reference_run):
    """The trainer appends data, load, compile and first_step to the host's stage records
    (next to what the startup script wrote), and train_summary.json keeps the boot's stages."""
    from workloads.common import stage_records

    run = pathlib.Path(reference_run.checkpoint_dir).parent
    records = stage_records.read_records(str(run.parent / "stages.jsonl"))
    trainer_records = [r for r in records if r["source"] == "trainer"]
    assert [(r["stage"], r["event"]) for r in trainer_records] == [
        ("data", "start"),
        ("data", "end"),
        ("load", "start"),
        ("load", "end"),
        ("compile", "start"),
        ("first_step", "start"),
        ("compile", "end"),
        ("first_step", "end"),
    ]
    summary = json.loads((run / "train_summary.json").read_text())
    rows = {row["stage"]: row for row in summary["stages"]}
    assert [row["stage"] for row in summary["stages"]] == [
        "venv",
        "data",
        "load",
        "compile",
        "first_step",
    ]
    assert all(row["state"] == "done" for row in summary["stages"])
    assert rows["venv"]["note"] == "restored from gs://b/venv/train-0123.tar.gz"
    # compile is the time JAX spent compiling up to the first step: part of that step's wall
    # time and of the run's total compile time.
    assert 0 < rows["compile"]["seconds"] <= rows["first_step"]["seconds"]
    assert rows["compile"]["seconds"] <= summary["compile_seconds"]
    assert rows["compile"]["start"] == rows["first_step"]["start"] >= rows["load"]["start"]
    assert rows["first_step"]["start"] + rows["first_step"]["seconds"] <= time.time()


def test_the_trainer_prepares_the_data_before_the_weights_arrive_and_waits_for_them(
    config_for, tiny_model_dir, tmp_path
):
    """As on a new VM: the host is ready with the model's small files staged and the weights
    still coming (`.files`, `.staging` naming a live process). The trainer prepares the data,
    then waits (stage weights_wait) until `.staged`, loads and trains."""
    import shutil

    from workloads.common import stage_records
    from workloads.train import trainer

    stage = tmp_path / "shm" / "models" / "base"
    stage.mkdir(parents=True)
    weights = sorted(tiny_model_dir.glob("*.safetensors"))
    for path in tiny_model_dir.iterdir():
        if path not in weights:
            shutil.copy(path, stage / path.name)
    marker = pathlib.Path(f"{stage}.staging")
    marker.write_text(f"{os.getpid()}\n")
    pathlib.Path(f"{stage}.files").touch()
    lines: list[str] = []

    def startup_script() -> None:  # the rest of the download, 2 s after the trainer waits
        wait_for(lambda: any("waiting for the base model's weights" in x for x in lines), 120)
        time.sleep(2)
        for path in weights:
            shutil.copy(path, stage / path.name)
        pathlib.Path(f"{stage}.staged").touch()
        marker.unlink()

    cfg = config_for(
        tmp_path / "run",
        model={"base": "gs://bucket/models/tiny", "stage_dir": str(stage)},
        train={"max_steps": 2, "save_every": 2},
    )
    stages_file = tmp_path / "stages.jsonl"
    os.environ[stage_records.STAGES_ENV] = str(stages_file)
    staging = threading.Thread(target=startup_script, daemon=True)
    staging.start()
    try:
        result = trainer.train(cfg, log=lines.append)
    finally:
        del os.environ[stage_records.STAGES_ENV]
    staging.join(timeout=5)
    assert result.final_step == 2
    rows = {
        r["stage"]: r for r in stage_records.summarise(stage_records.read_records(str(stages_file)))
    }
    assert list(rows) == ["data", "weights_wait", "load", "compile", "first_step"]
    data, wait, load = rows["data"], rows["weights_wait"], rows["load"]
    ms = 0.001  # a record's seconds are rounded to the millisecond
    assert data["start"] + data["seconds"] <= wait["start"] + ms
    assert wait["seconds"] >= 2 and wait["state"] == "done"
    assert wait["start"] + wait["seconds"] <= load["start"] + ms


def test_restarting_a_finished_run_changes_nothing(reference_run, config_for):
    from workloads.train import trainer

    run = pathlib.Path(reference_run.checkpoint_dir).parent
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = trainer.train(config_for(run), log=lambda line: None)
    assert again.final_step == STEPS and not again.interrupted
    assert again.summary == json.loads(json.dumps(reference_run.summary))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_sigkill_then_restart_resumes_and_matches_uninterrupted_run(
    reference_run, config_for, tmp_path, capfd
):
    from workloads.checkpoint import lora_restore
    from workloads.train import metrics, trainer

    cfg = config_for(tmp_path / "run")
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    checkpoints = tmp_path / "run" / "checkpoints"
    log = open(tmp_path / "train.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: (checkpoints / str(SAVE_EVERY) / "_CHECKPOINT_METADATA").is_file(), 600, proc
        )
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert lora_restore.saved_steps(str(checkpoints)) == [SAVE_EVERY], (
        tmp_path / "train.log"
    ).read_text()
    assert not (tmp_path / "run" / "train_summary.json").exists()

    capfd.readouterr()
    resumed = trainer.train(cfg, log=lambda line: None)
    assert resumed.resumed_from == SAVE_EVERY and resumed.final_step == STEPS
    assert not resumed.interrupted
    # The restart read the killed run's tokenized, packed data back instead of preparing it.
    assert "not tokenized again" in capfd.readouterr().out

    ours = lora_restore.restore_lora_params(str(checkpoints), STEPS)
    reference = lora_restore.restore_lora_params(reference_run.checkpoint_dir, STEPS)
    assert ours.keys() == reference.keys() and len(ours) == 70
    worst = max(float(np.max(np.abs(ours[k] - reference[k]))) for k in ours)
    # Same data order, same dropout masks (re-keyed per micro-step), same optimizer state: the
    # weights agree to 1e-6 absolute (observed: bit-identical on CPU).
    assert worst <= 1e-6, worst
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    # Every step once, step 4 included: a checkpointed step's line is written before its
    # checkpoint, so the kill right after the checkpoint did not lose it.
    assert steps == list(range(1, STEPS + 1))

    # The summary totals both processes: all the wall time spent, the final trajectory's tokens.
    killed, last = sorted(
        metrics.read_segments(str(tmp_path / "run")).values(), key=lambda seg: seg["start_step"]
    )
    # Recorded before the checkpoint at SAVE_EVERY was written, never updated after the kill.
    assert (killed["start_step"], killed["status"]) == (0, "running")
    assert killed["end_step"] >= SAVE_EVERY and killed["wall_seconds"] > 0
    assert (last["start_step"], last["end_step"], last["status"]) == (SAVE_EVERY, STEPS, "finished")
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert (summary["segments"], summary["untracked_steps"]) == (2, 0)
    assert summary["last_segment"]["start_step"] == SAVE_EVERY
    assert summary["wall_seconds"] == pytest.approx(killed["wall_seconds"] + last["wall_seconds"])
    assert summary["steps_run"] == killed["steps"] + STEPS - SAVE_EVERY
    # Steps re-run after the resume are counted once: the uninterrupted run's token counts.
    assert summary["real_tokens"] == reference_run.summary["real_tokens"]
    assert summary["computed_tokens"] == reference_run.summary["computed_tokens"]
    assert summary["tokens_per_second"] == summary["real_tokens"] / summary["wall_seconds"]


def test_sigterm_saves_a_checkpoint_and_exits_143(config_for, tmp_path):
    from workloads.checkpoint import lora_restore
    from workloads.train import metrics, trainer

    cfg = config_for(tmp_path / "run")  # the reference config: its train step is compiled already
    checkpoints = tmp_path / "run" / "checkpoints"
    handler_before = signal.getsignal(signal.SIGTERM)

    def preempt() -> None:
        wait_for(lambda: (checkpoints / str(SAVE_EVERY) / "_CHECKPOINT_METADATA").is_file(), 600)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    result = trainer.train(cfg, log=lambda line: None)
    assert result.interrupted and result.exit_status == 143
    assert SAVE_EVERY <= result.final_step < STEPS
    # The final save happened at the step it stopped, not only at the last interval.
    assert lora_restore.saved_steps(str(checkpoints))[-1] == result.final_step
    assert not (tmp_path / "run" / "train_summary.json").exists()
    assert signal.getsignal(signal.SIGTERM) is handler_before
    (segment,) = metrics.read_segments(str(tmp_path / "run")).values()
    assert (segment["end_step"], segment["status"]) == (result.final_step, "stopped")
    assert result.summary["segments"] == 1


@pytest.mark.slow
def test_fsdp2_mesh_trains_the_same_model(reference_run, config_for, tmp_path):
    from workloads.train import trainer

    cfg = config_for(tmp_path / "run", train={"max_steps": 2, "mesh": {"fsdp": 2, "tp": 1}})
    result = trainer.train(cfg, log=lambda line: None)
    losses = [r["loss"] for r in result.records]
    assert result.final_step == 2 and all(np.isfinite(losses))
    # Step 1 is the base model on the same two micro-batches: the mesh must not change it.
    assert abs(losses[0] - reference_run.records[0]["loss"]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_a_random_moment_then_restart_ends_on_the_same_weights(
    reference_run, config_for, tmp_path, seed
):
    """Killed at a random moment (loading, compiling, between steps, inside a save), then
    restarted: the run resumes from the newest intact checkpoint and ends on the uninterrupted
    run's weights, with every step logged once and no lock left behind."""
    import random

    from workloads.checkpoint import lora_restore
    from workloads.train import trainer

    cfg = config_for(tmp_path / "run")
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(random.Random(seed).uniform(5, 45))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)

    resumed = trainer.train(cfg, log=lambda line: None)
    assert resumed.final_step == STEPS and not resumed.interrupted
    ours = lora_restore.restore_lora_params(str(tmp_path / "run" / "checkpoints"), STEPS)
    reference = lora_restore.restore_lora_params(reference_run.checkpoint_dir, STEPS)
    worst = max(float(np.max(np.abs(ours[k] - reference[k]))) for k in ours)
    assert worst <= 1e-6, worst
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, STEPS + 1))
    assert not (tmp_path / "run" / "train.lock").exists()
