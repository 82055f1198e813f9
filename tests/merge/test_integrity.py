"""Issue #33 on the merge's side: a checkpoint step whose bytes differ from its checksums is not
merged, and LoRA factors that decode to finite garbage never reach `merge --verify`'s OK: the
merge refuses a delta far beyond its base tensor's scale, and so does verify."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from tests.merge.conftest import SHARD_SIZE, STEPS
from workloads import merge
from workloads.checkpoint import lora_restore
from workloads.common import errors
from workloads.merge import shard_worker

GARBAGE_SCALE = np.float32(1e30)  # B * 1e30: finite deltas up to ~1e29 (float32 holds 3.4e38)


@pytest.fixture
def garbage_factors(monkeypatch):
    """The merge reads LoRA B factors 1e30 times what the checkpoint holds: finite garbage,
    as 64 flipped bytes of a factor decode to, with no NaN for the earlier checks to see."""
    restore = lora_restore.restore_lora_params

    def scaled(checkpoint_dir: str, step: int) -> dict[str, np.ndarray]:
        params = restore(checkpoint_dir, step)
        return {k: v * GARBAGE_SCALE if k.endswith("lora_b") else v for k, v in params.items()}

    monkeypatch.setattr(lora_restore, "restore_lora_params", scaled)


def test_a_merge_of_garbage_factors_is_refused_with_one_line(lora_run, garbage_factors, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(errors.UserError) as info:
        merge.merge_lora(
            str(lora_run.base), str(lora_run.run), str(out), shard_size=SHARD_SIZE, progress=False
        )
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("model.language_model.layers.") and ".weight: the LoRA delta of " in line
    assert "where the base's largest value is" in line and "below 100 times it" in line
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # nothing that looks merged


def test_verify_refuses_merged_weights_beyond_the_bound(
    lora_run, garbage_factors, tmp_path, monkeypatch
):
    """What the old merge wrote (the bound off): verify used to say OK."""
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(shard_worker, "DELTA_SCALE_LIMIT", float("inf"))
        merge.merge_lora(
            str(lora_run.base), str(lora_run.run), str(out), shard_size=SHARD_SIZE, progress=False
        )
    report = merge.verify_merged(str(out), base=str(lora_run.base))
    assert not report.ok
    problems = [p for p in report.problems if "differs from the base by up to" in p]
    assert problems and all("\n" not in p and "must not be served" in p for p in problems)
    assert len(problems) == report.merged_tensors  # every target got its garbage
    assert all(p.startswith("model.language_model.layers.") for p in problems)


def test_the_fixture_fine_tune_passes_the_bound_with_margin(lora_run, merged):
    """The randomised adapters (larger than a real fine-tune's) stay well inside the bound, in
    the merge (it finished) and in verify."""
    out, result = merged
    report = merge.verify_merged(str(out), base=str(lora_run.base))
    assert report.ok, report.problems
    assert result.merged_tensors == report.merged_tensors


def test_a_step_that_differs_from_its_checksums_is_not_merged(lora_run, tmp_path):
    from workloads.checkpoint import checksums

    run = tmp_path / "run"
    shutil.copytree(lora_run.run, run)
    step_dir = run / "checkpoints" / str(STEPS[-1])
    checksums.write_manifest(str(step_dir), STEPS[-1])  # as training writes it
    data = max(
        (p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x40  # one flipped bit
    data.write_bytes(bytes(content))
    with pytest.raises(errors.UserError) as info:
        merge.merge_lora(
            str(lora_run.base), str(run), str(tmp_path / "out"), shard_size=SHARD_SIZE,
            progress=False,
        )  # fmt: skip
    rel = data.relative_to(step_dir)
    assert str(info.value).startswith(
        f"{step_dir}: damaged ({rel} does not match checksums.json (crc32c "
    )
    assert str(info.value).endswith("refusing to merge it (merge an earlier --step)")
    assert not (tmp_path / "out").exists()


def test_a_step_saved_by_an_earlier_version_is_merged_with_a_note(lora_run, merged):
    """The fixture's steps are saved without checksums, as earlier versions saved them."""
    _, result = merged
    step_dir = pathlib.Path(lora_run.checkpoints) / str(STEPS[-1])
    assert not (step_dir / "checksums.json").exists()
    metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    assert "checksums" not in metadata.get("custom_metadata", {})
    assert (
        f"{step_dir} has no checksums.json (saved by an earlier version); its bytes are not checked"
    ) in result.notes
