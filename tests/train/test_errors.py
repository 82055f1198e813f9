"""Bad inputs fail before any training, each with one line that names the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workloads.common import errors


def run_train(cfg):
    from workloads.train import trainer

    with pytest.raises(errors.UserError) as info:
        trainer.train(cfg, log=lambda line: None)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_dataset_is_one_line_on_the_command_line(config_for, tmp_path):
    cfg = config_for(tmp_path / "run", data={"dataset": str(tmp_path / "nope.jsonl")})
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    proc = subprocess.run(
        [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == [f"error: {tmp_path / 'nope.jsonl'}: file not found"]


def test_dataset_with_other_fields_lists_the_fields_found(config_for, tmp_path):
    data = tmp_path / "other.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    message = run_train(config_for(tmp_path / "run", data={"dataset": str(data)}))
    assert "'prompt'" in message and "'question', 'answer'" in message


def test_mesh_that_does_not_fit_the_devices(config_for, tmp_path):
    message = run_train(config_for(tmp_path / "run", train={"mesh": {"fsdp": 2, "tp": 2}}))
    assert message.startswith("train.mesh fsdp=2 x tp=2 = 4 does not match the 2 available CPU")


def test_tp_that_does_not_divide_the_global_kv_heads(config_for, tmp_path):
    message = run_train(config_for(tmp_path / "run", train={"mesh": {"fsdp": 1, "tp": 4}}))
    assert message == (
        "train.mesh.tp=4 does not divide the model's global KV heads (2); allowed tp: 1, 2"
    )


def test_checkpoint_dir_from_a_different_lora_rank(reference_run, config_for):
    from workloads.checkpoint import lora_restore

    run_dir = reference_run.checkpoint_dir.rsplit("/", 1)[0]
    before = lora_restore.saved_steps(reference_run.checkpoint_dir)
    message = run_train(config_for(run_dir, lora={"rank": 8}))
    assert message == (
        f"{reference_run.checkpoint_dir}: holds LoRA checkpoints with rank 4 "
        "(run config: 8); use another train.output_dir or the same lora settings"
    )
    assert lora_restore.saved_steps(reference_run.checkpoint_dir) == before


def test_checkpoints_without_lora_meta_are_refused(reference_run, config_for, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference_run.checkpoint_dir, run / "checkpoints")
    (run / "checkpoints" / "lora_meta.json").unlink()
    message = run_train(config_for(run))
    assert "has checkpoints but no lora_meta.json" in message
