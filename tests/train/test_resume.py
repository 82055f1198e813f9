"""Resume integrity: a damaged latest checkpoint falls back to the newest intact one with one
line (and the run ends on the uninterrupted run's weights); a checkpoint that lost its optimizer
state is an error unless the user asks for a fresh one; no intact checkpoint is one line."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tests.train import damage
from tests.train.conftest import SAVE_EVERY, STEPS
from workloads import errors


@pytest.mark.parametrize("kind", damage.KINDS)
def test_a_damaged_latest_step_is_moved_aside_with_one_line(
    reference_run, config_for, tmp_path, kind
):
    from workloads.train import checkpoints, resume

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY, STEPS])
    damage.damage(run / "checkpoints" / str(STEPS), kind)
    lines: list[str] = []
    cfg = config_for(run)
    chosen = resume.choose_step(
        cfg.train, fresh_optimizer_state=False, move_damaged=True, log=lines.append
    )
    assert chosen == SAVE_EVERY
    (line,) = lines
    assert line.startswith(f"checkpoint step {STEPS} in {run / 'checkpoints'} is damaged (")
    assert line.endswith(f"; falling back to step {SAVE_EVERY}")
    assert "\n" not in line
    # Kept for a look, out of Orbax's sight: a later save of that step cannot collide with it.
    (moved,) = (run / "damaged_checkpoints").iterdir()
    assert moved.name.startswith(f"{STEPS}-") and str(moved) in line
    assert checkpoints.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY]


def test_nan_values_name_the_item_and_the_count(reference_run, config_for, tmp_path):
    from workloads.train import resume

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY])
    count = damage.poison_item(run / "checkpoints" / str(SAVE_EVERY) / "optimizer_state")
    problem, has_optimizer = resume.step_problem(str(run / "checkpoints"), SAVE_EVERY)
    assert problem is not None and has_optimizer
    assert problem.startswith(f"optimizer_state holds {count:,} NaN/Inf values (first in ")


def test_no_intact_checkpoint_is_one_line(reference_run, config_for, tmp_path):
    from workloads.train import resume

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY, STEPS])
    damage.damage(run / "checkpoints" / str(SAVE_EVERY), "no_manifest")
    damage.damage(run / "checkpoints" / str(STEPS), "truncated_file")
    lines: list[str] = []
    with pytest.raises(errors.UserError) as info:
        resume.choose_step(
            config_for(run).train, fresh_optimizer_state=False, move_damaged=True, log=lines.append
        )
    assert str(info.value) == (
        f"{run / 'checkpoints'}: no intact checkpoint (damaged: steps {STEPS}, {SAVE_EVERY}, "
        f"moved to {run / 'damaged_checkpoints'}); run again to start over from the base "
        "model, or restore a copy of the checkpoints"
    )
    assert len(lines) == 2


def test_missing_optimizer_state_is_an_error_unless_asked_for(reference_run, config_for, tmp_path):
    import shutil

    from workloads.train import checkpoints, trainer

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY])
    shutil.rmtree(run / "checkpoints" / str(SAVE_EVERY) / "optimizer_state")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(errors.UserError) as info:
        trainer.train(config_for(run), log=lambda line: None)
    assert str(info.value) == (
        f"{run / 'checkpoints' / str(SAVE_EVERY)}: no optimizer_state/ (the AdamW moments and "
        "step count); resuming would restart the optimizer, warm-up included; run `train "
        "--fresh-optimizer-state` to continue from these weights with a new optimizer state"
    )
    # Refused before anything was written (the lock file is gone again too).
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    lines: list[str] = []
    result = trainer.train(
        config_for(run), log=lines.append, fresh_optimizer_state=True, stop_after_steps=1
    )
    assert result.resumed_from == SAVE_EVERY and result.final_step == SAVE_EVERY + 1
    assert any(line.startswith("note: ") and "fresh optimizer state" in line for line in lines)
    assert checkpoints.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY, SAVE_EVERY + 1]


def test_a_nan_latest_checkpoint_resumes_from_the_previous_one_to_the_same_weights(
    reference_run, config_for, tmp_path
):
    """The issue's case: a bit-flipped latest checkpoint used to resume, train on NaN and exit 0."""
    from workloads.merge import lora_restore
    from workloads.train import trainer

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY, STEPS])
    # The last step, NaN: without the check the run took it as finished (or resumed from it).
    damage.poison_item(run / "checkpoints" / str(STEPS) / "model_params")
    lines: list[str] = []
    result = trainer.train(config_for(run), log=lines.append)
    assert result.resumed_from == SAVE_EVERY and result.final_step == STEPS
    (line,) = [line for line in lines if "damaged" in line]
    assert line.startswith(f"checkpoint step {STEPS} in {run / 'checkpoints'} is damaged (")
    assert "model_params holds" in line and "NaN/Inf values" in line
    ours = lora_restore.restore_lora_params(str(run / "checkpoints"), STEPS)
    reference = lora_restore.restore_lora_params(reference_run.checkpoint_dir, STEPS)
    worst = max(float(np.max(np.abs(ours[k] - reference[k]))) for k in ours)
    assert worst <= 1e-6, worst
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert pathlib.Path(run / "damaged_checkpoints").is_dir()


def test_a_save_that_never_completed_is_removed_with_one_line(reference_run, config_for, tmp_path):
    from workloads.train import resume

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY])
    partial = run / "checkpoints" / f"{STEPS}.orbax-checkpoint-tmp" / "model_params"
    partial.mkdir(parents=True)
    (partial / "half-written").write_bytes(b"\0" * 1000)
    lines: list[str] = []
    chosen = resume.choose_step(
        config_for(run).train, fresh_optimizer_state=False, move_damaged=True, log=lines.append
    )
    assert chosen == SAVE_EVERY
    assert lines == [
        f"removed {run / 'checkpoints' / f'{STEPS}.orbax-checkpoint-tmp'}: a save that never "
        "completed"
    ]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        str(SAVE_EVERY),
        "lora_meta.json",
    ]
