"""The guards of a run: a NaN/Inf loss stops it with one line and exit status 3 before that step
is saved; a full disk during a save is one line naming the path and the free space, with the
earlier checkpoints kept."""

from __future__ import annotations

import errno
import pathlib
import subprocess
import sys

import pytest

from tests.fixtures.tmpfs import mount_tmpfs
from tests.train import damage
from tests.train.conftest import SAVE_EVERY, STEPS
from workloads import cli
from workloads.common import disk_space, errors


def poison_at(monkeypatch, optimizer_step: int, grad_accum: int = 2) -> None:
    """Sets one LoRA weight to NaN at the first micro-step of `optimizer_step` (through the
    dropout re-keying hook the trainer calls before every micro-step; same shapes and
    shardings, so nothing compiles again)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from workloads.model import lora

    real = lora.seed_dropout

    def seed_then_poison(model, seed, micro_step, mesh):
        real(model, seed, micro_step, mesh)
        if micro_step == (optimizer_step - 1) * grad_accum:
            state = nnx.state(model, nnx.LoRAParam)
            _, var = next(iter(state.flat_state()))
            value = var.get_value()
            var.set_value(
                jax.device_put(jnp.full(value.shape, jnp.nan, value.dtype), value.sharding)
            )
            nnx.update(model, state)

    monkeypatch.setattr(lora, "seed_dropout", seed_then_poison)


@pytest.mark.parametrize("bad_step", [STEPS, pytest.param(SAVE_EVERY + 2, marks=pytest.mark.slow)])
def test_a_nan_loss_stops_the_run_before_that_step_is_saved(
    reference_run, config_for, tmp_path, monkeypatch, bad_step
):
    from workloads.checkpoint import lora_restore
    from workloads.train import guards, trainer

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY])
    poison_at(monkeypatch, bad_step)
    with pytest.raises(guards.NonFiniteError) as info:
        trainer.train(config_for(run), log=lambda line: None)
    message = str(info.value)
    assert message.startswith(f"step {bad_step}: loss nan and gradient norm nan (not finite); ")
    assert f"resumed from checkpoint step {SAVE_EVERY} in {run / 'checkpoints'}" in message
    assert "\n" not in message and info.value.exit_status == guards.EXIT_NON_FINITE == 3
    # Nothing of the NaN step or after it was saved; the checkpoint it resumed from is intact.
    assert lora_restore.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY]
    assert not (run / "train_summary.json").exists()
    assert not (run / "train.lock").exists()  # given back on the way out


@pytest.fixture
def restore_log_hooks():
    """The CLI keeps its held-traceback filters after a one-line error (until the process
    exits); a test process goes on, so they are taken off again."""
    import logging
    import sys

    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    before = [list(logger.filters) for logger in loggers]
    hook, unraisable_hook = sys.excepthook, sys.unraisablehook
    yield
    for logger, filters in zip(loggers, before, strict=True):
        logger.filters[:] = filters
    sys.excepthook, sys.unraisablehook = hook, unraisable_hook


def test_the_cli_exits_3_with_one_line_on_a_non_finite_step(
    monkeypatch, capsys, tmp_path, restore_log_hooks
):
    from workloads.train import guards, trainer

    def diverge(cfg, **kwargs):
        guards.check_step(
            5, float("inf"), 1.0, resumed_from=4, checkpoint_dir=cfg.train.checkpoint_dir
        )

    monkeypatch.setattr(trainer, "train", diverge)
    config = tmp_path / "run.yaml"
    config.write_text(
        "run_name: r\nmodel: {base: /nonexistent}\ndata: {dataset: /nonexistent.jsonl}\n"
        f"train: {{output_dir: {tmp_path / 'run'}}}\n"
    )
    assert cli.main(["train", "--config", str(config)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: step 5: loss inf and gradient norm 1.0 (not finite); this run resumed from "
        f"checkpoint step 4 in {tmp_path / 'run' / 'checkpoints'}; stopped before saving step 5 "
        "(lower train.learning_rate or set train.max_grad_norm)"
    ]


def test_disk_full_during_a_save_is_one_line_and_keeps_the_earlier_checkpoint(
    reference_run, config_for, tmp_path, monkeypatch
):
    """ENOSPC injected where the checkpoint is written (runs everywhere; the tmpfs test below
    fills a real filesystem)."""
    from workloads.checkpoint import lora_restore
    from workloads.train import step, trainer

    run = damage.copy_run(reference_run.checkpoint_dir, tmp_path / "run", keep=[SAVE_EVERY])
    real_save = step.SaveHook.save

    def full_disk_at_the_last_step(self, at, *args, **kwargs):
        if at == STEPS:
            raise OSError(errno.ENOSPC, "No space left on device", str(run / "checkpoints"))
        return real_save(self, at, *args, **kwargs)

    monkeypatch.setattr(step.SaveHook, "save", full_disk_at_the_last_step)
    with pytest.raises(errors.UserError) as info:
        trainer.train(config_for(run), log=lambda line: None)
    message = str(info.value)
    assert message.startswith(f"{run / 'checkpoints'}: disk full while saving a checkpoint (")
    assert f"earlier checkpoints kept (steps: {SAVE_EVERY})" in message and "\n" not in message
    assert " free)" in message
    assert lora_restore.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY]


@pytest.mark.slow
def test_a_real_full_disk_during_a_save(reference_run, base_config, tmp_path):
    """The run directory on a small tmpfs, filled up after the first checkpoint (needs root to
    mount; skipped elsewhere): the save of the last step fails for real inside Orbax and
    TensorStore, in the CLI as a user runs it. stderr holds the one error line after the trainer's
    progress lines and nothing else (the writer threads' ~100 tracebacks, some through
    sys.unraisablehook, are dropped)."""
    import json
    import os
    import shutil
    import sys

    from workloads.checkpoint import lora_restore

    mount = tmp_path / "small"
    if not mount_tmpfs(mount, "8m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = damage.copy_run(reference_run.checkpoint_dir, mount / "run", keep=[SAVE_EVERY])
        config = dict(base_config, train=dict(base_config["train"], output_dir=str(run)))
        config_file = tmp_path / "run.json"  # YAML is a superset of JSON
        config_file.write_text(json.dumps(config))
        free = shutil.disk_usage(mount).free
        (mount / "filler").write_bytes(b"\0" * max(free - 64 * 1024, 0))
        proc = subprocess.run(
            [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
            capture_output=True,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            timeout=600,
            check=False,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        # The trainer's own progress lines ("train: stage load: 4.2 s", ...) share stderr; beside
        # them, the failure is the one last line: no traceback, no writer-thread noise.
        noise = [line for line in lines[:-1] if not line.startswith("train: ")]
        assert noise == [], proc.stderr[-3000:]
        assert lines[-1].startswith(f"error: {run / 'checkpoints'}: disk full while saving"), lines
        assert lora_restore.saved_steps(str(run / "checkpoints")) == [SAVE_EVERY]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_is_recognised_through_orbax_and_tensorstore_wrappers():

    # What TensorStore raises inside an Orbax save on a full disk (abridged from a real one).
    tensorstore = ValueError(
        'RESOURCE_EXHAUSTED: Error opening "zarr" driver: Failed to write 463 bytes to file 4: '
        "No space left on device [os_error_code='28']"
    )
    try:
        try:
            raise tensorstore
        except ValueError as exc:
            raise RuntimeError("Save Finalize thread (save_finalize) failed.") from exc
    except RuntimeError as wrapped:
        assert disk_space.is_disk_full(wrapped)
    assert disk_space.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not disk_space.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert disk_space.free_space_text("gs://bucket/run") == "free space unknown"


def test_background_tracebacks_are_dropped_after_a_one_line_error_and_shown_otherwise(
    capsys, caplog, restore_log_hooks
):
    import logging
    import sys

    from workloads.train import guards

    absl = logging.getLogger("absl")

    def background_failure():
        # Handed to the logger as Orbax's thread logs it, whatever level absl was set to.
        try:
            raise ValueError("No space left on device")
        except ValueError:
            absl.handle(
                absl.makeRecord(
                    "absl",
                    logging.ERROR,
                    __file__,
                    0,
                    "_SignalingThread.run() raised an exception",
                    (),
                    sys.exc_info(),
                )
            )

    class Callback:
        # What reaches sys.unraisablehook: an error no caller can receive (TensorStore's
        # writer callbacks use PyErr_WriteUnraisable; a failing __del__ takes the same path).
        def __del__(self):
            raise OSError(28, "a TensorStore callback on a closed loop")

    def unraisable_failure():
        Callback()

    # Python's own printing hook, as in the CLI's process (pytest installs one that warns).
    sys.unraisablehook = sys.__unraisablehook__
    hook, unraisable_hook = sys.excepthook, sys.unraisablehook
    try:
        with pytest.raises(errors.UserError), guards.HeldBackgroundErrors() as held:
            background_failure()
            unraisable_failure()
            raise errors.UserError("disk full")
        background_failure()  # a writer thread still failing after the error line: dropped
        unraisable_failure()
        assert not [r for r in caplog.records if r.name == "absl"]
        assert capsys.readouterr().err == ""
    finally:  # what the end of the process does
        for logger in held._loggers:
            logger.removeFilter(held._filter)
        sys.excepthook, sys.unraisablehook = hook, unraisable_hook

    with pytest.raises(RuntimeError), guards.HeldBackgroundErrors() as held:
        background_failure()
        unraisable_failure()
        assert not [r for r in caplog.records if r.name == "absl"]  # held while it runs
        assert len(held.held) == 2
        raise RuntimeError("an unexpected failure")
    err = capsys.readouterr().err
    assert "ERROR:absl:_SignalingThread.run() raised an exception" in err
    assert "ValueError: No space left on device" in err
    assert "OSError: [Errno 28] a TensorStore callback on a closed loop" in err
    assert sys.excepthook is hook and sys.unraisablehook is unraisable_hook


# A failed save's writer coroutine that never ran, still referenced when the process exits.
_ABANDONED_WRITER = """
import sys
from workloads.common import errors
from workloads.train import guards

async def write_fragment():
    pass

try:
    with guards.HeldBackgroundErrors():
        pending = write_fragment()
        raise errors.UserError("disk full")
except errors.UserError as exc:
    print(f"error: {exc}", file=sys.stderr)
"""


def test_writer_coroutines_a_failed_save_abandons_are_silent_at_exit():
    # CI saw "sys:1: RuntimeWarning: coroutine 'async_serialize_from_host.<locals>.
    # write_fragment' was never awaited" after the one line of a real full disk.
    proc = subprocess.run(
        [sys.executable, "-c", _ABANDONED_WRITER],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).resolve().parents[2],
        check=False,
    )
    assert proc.stderr.strip().splitlines() == ["error: disk full"], proc.stderr
