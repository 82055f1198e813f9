"""Relative paths from the command line to Orbax: `train` and `merge` run from another directory
with a relative --config whose paths are relative too (Orbax refuses relative checkpoint paths:
the README's `python -m workloads demo` died at its first checkpoint that way)."""

from __future__ import annotations

import copy
import json

import yaml

from tests.train.conftest import SAVE_EVERY, STEPS
from workloads import cli


def test_train_and_merge_with_relative_paths_from_the_working_directory(
    base_config, tiny_model_dir, codev_jsonl, tmp_path, monkeypatch, capsys
):
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "model").symlink_to(tiny_model_dir)
    (tmp_path / "inputs" / "codev.jsonl").symlink_to(codev_jsonl)
    data = copy.deepcopy(base_config)  # the reference run's shapes: its train step is compiled
    data["model"]["base"] = "inputs/model"
    data["data"]["dataset"] = "inputs/codev.jsonl"
    data["train"]["output_dir"] = "runs/rel"
    data["merge"] = {"out": "runs/rel/merged"}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)

    assert cli.main(["train", "--config", "configs/run.yaml"]) == 0
    run = tmp_path / "runs" / "rel"
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [SAVE_EVERY, STEPS]

    assert cli.main(["merge", "--config", "configs/run.yaml", "--no-progress"]) == 0
    meta = json.loads((run / "merged" / "merge_metadata.json").read_text())
    assert meta["step"] == STEPS
    assert meta["source_checkpoint"] == str(run / "checkpoints")
    capsys.readouterr()
    # The VM's merge unit runs it again: the finished merge is recognised, not redone.
    assert cli.main(["merge", "--config", "configs/run.yaml"]) == 0
    assert "nothing to do" in capsys.readouterr().out
