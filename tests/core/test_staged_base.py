"""workloads.staged_base: a job handed the bucket's URL reads the startup script's staged copy
when its marker says it is whole (the bucket's copy may still be uploading), and only then."""

from __future__ import annotations

import pathlib

from workloads import model, staged_base


def test_the_staged_copy_is_used_only_when_its_marker_is_there(tmp_path: pathlib.Path) -> None:
    stage = tmp_path / "shm" / "models" / "base"
    url = "gs://bucket/models/gemma-4-31b"
    assert staged_base.model_dir(url, str(stage)) == url  # nothing staged: the bucket
    stage.mkdir(parents=True)
    (stage / "config.json").write_text("{}")
    assert staged_base.model_dir(url, str(stage)) == url  # a copy in progress: not used
    (tmp_path / "shm" / "models" / "base.staged").touch()
    assert staged_base.model_dir(url, f"{stage}/") == str(stage)
    # What the trainer and the merge then do with it: used in place, nothing copied.
    assert model.stage(staged_base.model_dir(url, str(stage)), str(stage)) == stage


def test_a_local_base_is_used_as_given(tmp_path: pathlib.Path) -> None:
    (tmp_path / "base.staged").touch()
    (tmp_path / "base").mkdir()
    local = str(tmp_path / "my-model")
    assert staged_base.model_dir(local, str(tmp_path / "base")) == local
