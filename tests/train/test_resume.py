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
from workloads.common import errors


@pytest.mark.parametrize("kind", damage.KINDS)
def test_a_damaged_latest_step_is_moved_aside_with_one_line(
    reference_run, config_for, tmp_path, kind
):
    from workloads.checkpoint import lora_restore
    from workloads.train import resume

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
    assert lora_restore.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY]


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

    from workloads.checkpoint import lora_restore
    from workloads.train import trainer

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
    assert lora_restore.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY, SAVE_EVERY + 1]


def test_a_nan_latest_checkpoint_resumes_from_the_previous_one_to_the_same_weights(
    reference_run, config_for, tmp_path
):
    """The issue's case: a bit-flipped latest checkpoint used to resume, train on NaN and exit 0."""
    from workloads.checkpoint import lora_restore
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


def test_a_temporary_file_of_a_killed_write_is_removed_with_one_line(config_for, tmp_path):
    # A trainer killed while it wrote lora_meta.json at start-up (storage.write_bytes_atomic)
    # left its temporary file; the next trainer removes it before it resumes.
    from workloads.train import resume

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / ".lora_meta.json.k2x9_a1.tmp").write_text('{"rank": ')
    (checkpoints / "lora_meta.json").write_text("{}")
    lines: list[str] = []
    chosen = resume.choose_step(
        config_for(tmp_path / "run").train,
        fresh_optimizer_state=False,
        move_damaged=True,
        log=lines.append,
    )
    assert chosen == 0
    assert lines == [
        f"removed {checkpoints / '.lora_meta.json.k2x9_a1.tmp'}: a write that never completed"
    ]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["lora_meta.json"]


def test_finite_garbage_in_the_latest_step_resumes_from_the_previous_one_to_the_same_weights(
    reference_run, config_for, tmp_path
):
    """Issue #33: the latest step's LoRA data decode to finite values up to 2.4e37; the run used
    to take that step (finished: nothing to do, or trained on from it)."""
    from workloads.checkpoint import lora_restore
    from workloads.train import trainer

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY, STEPS])
    item = run / "checkpoints" / str(STEPS) / "model_params"
    name = damage.garbage_values(item)
    garbage = lora_restore.read_item(str(item))[name]
    assert np.isfinite(garbage).all() and np.abs(garbage).max() == damage.GARBAGE  # the case
    lines: list[str] = []
    result = trainer.train(config_for(run), log=lines.append)
    assert result.resumed_from == SAVE_EVERY and result.final_step == STEPS
    (line,) = [line for line in lines if "damaged" in line]
    assert line.startswith(f"checkpoint step {STEPS} in {run / 'checkpoints'} is damaged (")
    assert "model_params/" in line and "checksums.json" in line  # the first file that differs
    assert line.endswith(f"; falling back to step {SAVE_EVERY}") and "\n" not in line
    ours = lora_restore.restore_lora_params(str(run / "checkpoints"), STEPS)
    reference = lora_restore.restore_lora_params(reference_run.checkpoint_dir, STEPS)
    worst = max(float(np.max(np.abs(ours[k] - reference[k]))) for k in ours)
    assert worst <= 1e-6, worst
    # The step trained again carries its own manifest, and it checks out.
    assert resume_problem(run, STEPS) is None


def test_flipped_bytes_of_a_data_file_are_named(reference_run, tmp_path):
    """64 inverted bytes in the latest step's largest data file: the manifest names the file,
    whatever the bytes decode to."""
    from workloads.checkpoint import checksums

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[STEPS])
    step_dir = run / "checkpoints" / str(STEPS)
    data = damage.flip_bytes(step_dir / "model_params")
    problem, notice = checksums.check_step(str(step_dir))
    assert notice is None and problem is not None
    assert problem.startswith(
        f"{data.relative_to(step_dir)} does not match checksums.json (crc32c "
    ), problem


def resume_problem(run: pathlib.Path, step: int) -> str | None:
    from workloads.train import resume

    return resume.step_problem(str(run / "checkpoints"), step)[0]


def test_every_file_of_a_saved_step_is_in_its_manifest(reference_run):
    import json as json_lib

    from workloads.checkpoint import checksums

    for step in (SAVE_EVERY, STEPS):
        step_dir = pathlib.Path(reference_run.checkpoint_dir) / str(step)
        manifest = json_lib.loads((step_dir / checksums.MANIFEST).read_text())
        on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()}
        # Orbax writes (or rewrites) these two when it commits the step, after the manifest.
        on_disk -= {checksums.MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt"}
        assert manifest["step"] == step and manifest["algorithm"] in ("crc32c", "sha256")
        assert set(manifest["files"]) == on_disk
        assert any(name.startswith("model_params/d/") for name in on_disk)
        assert any(name.startswith("optimizer_state/") for name in on_disk)
        assert checksums.check_step(str(step_dir)) == (None, None)


def test_a_step_saved_by_an_earlier_version_is_accepted_with_a_notice(
    reference_run, config_for, tmp_path
):
    """No manifest and no mark in _CHECKPOINT_METADATA: what earlier versions saved."""
    from workloads.checkpoint import checksums
    from workloads.train import resume

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY, STEPS])
    step_dir = run / "checkpoints" / str(STEPS)
    (step_dir / checksums.MANIFEST).unlink()
    metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    assert metadata["custom_metadata"].pop(checksums.MARK) == checksums.MANIFEST
    (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))
    lines: list[str] = []
    chosen = resume.choose_step(
        config_for(run).train, fresh_optimizer_state=False, move_damaged=True, log=lines.append
    )
    assert chosen == STEPS
    assert lines == [
        f"note: {step_dir} has no checksums.json (saved by an earlier version); its bytes are "
        "not checked"
    ]


def test_the_fine_tune_merges_within_the_delta_bound_and_verifies(reference_run, tmp_path):
    """A real (tiny) fine-tune: its checksums check out in the merge (no note), its deltas stay
    inside the merge's plausibility bound, and verify says OK."""
    from workloads import merge

    run = pathlib.Path(reference_run.checkpoint_dir).parent
    base = json.loads((run / "checkpoints" / "lora_meta.json").read_text())["base"]
    result = merge.merge_lora(base, str(run), str(tmp_path / "merged"), progress=False)
    assert result.step == STEPS and result.notes == ()
    report = merge.verify_merged(str(tmp_path / "merged"), base=base)
    assert report.ok, report.problems
