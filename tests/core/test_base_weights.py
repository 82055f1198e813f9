"""workloads.model.base_weights: a job handed the bucket's URL reads the startup script's staged
copy when its marker says it is whole (the bucket's copy may still be uploading), and only then; the
trainer starts on its small files and waits, bounded, for the weights."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from workloads.common import errors
from workloads.model import base_weights, gemma4


def test_the_staged_copy_is_used_only_when_its_marker_is_there(tmp_path: pathlib.Path) -> None:
    stage = tmp_path / "shm" / "models" / "base"
    url = "gs://bucket/models/gemma-4-31b"
    assert base_weights.model_dir(url, str(stage)) == url  # nothing staged: the bucket
    stage.mkdir(parents=True)
    (stage / "config.json").write_text("{}")
    assert base_weights.model_dir(url, str(stage)) == url  # a copy in progress: not used
    (tmp_path / "shm" / "models" / "base.staged").touch()
    assert base_weights.model_dir(url, f"{stage}/") == str(stage)
    # What the trainer and the merge then do with it: used in place, nothing copied.
    assert gemma4.stage(base_weights.model_dir(url, str(stage)), str(stage)) == stage


def test_a_local_base_is_used_as_given(tmp_path: pathlib.Path) -> None:
    (tmp_path / "base.staged").touch()
    (tmp_path / "base").mkdir()
    local = str(tmp_path / "my-model")
    assert base_weights.model_dir(local, str(tmp_path / "base")) == local


def _staging(tmp_path: pathlib.Path) -> tuple[pathlib.Path, str]:
    stage = tmp_path / "shm" / "models" / "base"
    stage.mkdir(parents=True)
    (stage / "config.json").write_text("{}")
    (tmp_path / "shm" / "models" / "base.files").touch()
    return stage, "gs://bucket/models/gemma-4-31b"


def test_the_trainer_starts_on_the_small_files_and_the_merge_does_not(tmp_path):
    stage, url = _staging(tmp_path)
    assert base_weights.model_dir(url, str(stage), before_weights=True) == str(stage)
    assert base_weights.model_dir(url, str(stage)) == url  # the merge needs the weights
    assert base_weights.weights_pending(str(stage), str(stage))
    (tmp_path / "shm" / "models" / "base.staged").touch()
    assert not base_weights.weights_pending(str(stage), str(stage))
    assert not base_weights.weights_pending(url, str(stage))


class FakeClock:
    """sleep() moves the clock; `on_sleep` changes the markers as the startup script would."""

    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, on_sleep

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep is not None:
            self.on_sleep(self.sleeps)

    def clock(self) -> float:
        return self.now


def _wait(stage: pathlib.Path, clock: FakeClock, lines: list[str], **kwargs) -> None:
    base_weights.wait_for_weights(
        str(stage), log=lines.append, sleep=clock.sleep, clock=clock.clock, **kwargs
    )


def test_the_wait_ends_when_the_weights_are_staged(tmp_path):
    stage, _ = _staging(tmp_path)
    staging = tmp_path / "shm" / "models" / "base.staging"
    staging.write_text(f"{os.getpid()}\n")  # a live process stages them

    def script(sleeps: int) -> None:
        if sleeps == 3:  # as staged() does: .staged first, then .staging goes
            (tmp_path / "shm" / "models" / "base.staged").touch()
            staging.unlink()

    clock, lines = FakeClock(script), []
    _wait(stage, clock, lines)
    assert clock.sleeps == 3
    assert lines == [
        f"waiting for the base model's weights in {stage}: the startup script is still staging "
        "them (the data is prepared and the step compiles meanwhile)"
    ]


def test_a_failed_staging_is_one_line_with_its_reason(tmp_path):
    stage, _ = _staging(tmp_path)
    (tmp_path / "shm" / "models" / "base.staging").write_text(f"{os.getpid()}\n")

    def script(sleeps: int) -> None:
        (tmp_path / "shm" / "models" / "base.failed").write_text(
            "the weights stage stopped (/var/log/gemma4-startup.log on t1v-0)\n"
        )

    with pytest.raises(errors.UserError) as info:
        _wait(stage, FakeClock(script), [])
    assert str(info.value) == (
        f"{stage}: the base model's weights did not arrive: the weights stage stopped "
        "(/var/log/gemma4-startup.log on t1v-0); the next boot stages them again"
    )


def test_a_staging_process_that_died_is_not_waited_for(tmp_path):
    stage, _ = _staging(tmp_path)
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    (tmp_path / "shm" / "models" / "base.staging").write_text(dead.stdout)
    with pytest.raises(errors.UserError, match="nothing is staging them"):
        _wait(stage, FakeClock(), [])
    (tmp_path / "shm" / "models" / "base.staging").unlink()  # no marker at all: the same
    with pytest.raises(errors.UserError, match=r"no base\.staging naming a live process"):
        _wait(stage, FakeClock(), [])


def test_the_wait_has_a_bound(tmp_path):
    stage, _ = _staging(tmp_path)
    (tmp_path / "shm" / "models" / "base.staging").write_text(f"{os.getpid()}\n")
    clock = FakeClock()
    with pytest.raises(errors.UserError, match=r"not staged within 60 s .*PID \d+"):
        _wait(stage, clock, [], timeout_s=60, poll_s=5)
    assert 60 <= clock.now <= 70


def test_a_long_wait_says_what_is_there_every_minute(tmp_path):
    stage, _ = _staging(tmp_path)
    index = {"metadata": {}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (stage / "model.safetensors.index.json").write_text(json.dumps(index))
    (stage / "model-1.safetensors").write_bytes(b"\0" * 1000)
    staging = tmp_path / "shm" / "models" / "base.staging"
    staging.write_text(f"{os.getpid()}\n")

    def script(sleeps: int) -> None:
        if sleeps == 30:  # 150 s
            (tmp_path / "shm" / "models" / "base.staged").touch()

    lines: list[str] = []
    _wait(stage, FakeClock(script), lines, poll_s=5, progress_s=60)
    assert lines[0].endswith("compiles meanwhile); 1 of 2 shard files present (0.0 GB)")
    assert lines[1:] == [
        "still waiting for the weights (60 s); 1 of 2 shard files present (0.0 GB)",
        "still waiting for the weights (120 s); 1 of 2 shard files present (0.0 GB)",
    ]


def test_shards_present_needs_a_readable_index(tmp_path):
    stage, _ = _staging(tmp_path)
    assert base_weights.shards_present(str(stage)) is None  # not staged yet
    (stage / "model.safetensors.index.json").write_text("{not json")
    assert base_weights.shards_present(str(stage)) is None
    (stage / "model.safetensors.index.json").write_text('{"weight_map": []}')
    assert base_weights.shards_present(str(stage)) is None
