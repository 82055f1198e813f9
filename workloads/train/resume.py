"""Which checkpoint a restarted run resumes from: the newest intact one.

Before PeftTrainer restores the latest step, every step from the newest down is read onto the
host the way the merge reads it (workloads.checkpoint.lora_restore.read_item) and checked: Orbax's
step metadata is there, both items (`model_params`, `optimizer_state`) read back and hold no
NaN or Inf, and every file matches the step's checksum manifest (workloads.checkpoint.checksums). A
damaged step (truncated or missing file, missing metadata or manifest, values that are not
finite, bytes that differ from their checksum) is moved aside to
`<output_dir>/damaged_checkpoints/` (kept for a look, never deleted) with one line, and the next
older one is tried. Reading a checkpoint twice costs
little next to a run: the LoRA factors and their AdamW moments, not the base model.

A step saved under a gs:// run lock records the lock's generation, its fencing token
(workloads.train.runlock). Tokens only grow from one holder of the lock to the next, so a step
whose token is older than an earlier step's was saved by a trainer that had already lost the
lock to the one that saved the earlier step (it was frozen or cut off past its lease, and came
back while its successor trained on): it is refused like a damaged step, and the successor's
line of steps is resumed.

A step without `optimizer_state/` is intact weights with the AdamW moments and step count gone:
resuming from it silently would restart the optimizer (warm-up included) and train other
weights than an uninterrupted run. That is an error unless the user asks for it explicitly
(`train --fresh-optimizer-state`).
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Callable

from workloads.checkpoint import checksums, lora_restore
from workloads.common import errors, storage
from workloads.contract import runconfig
from workloads.train import runlock

MODEL_ITEM = "model_params"
OPTIMIZER_ITEM = "optimizer_state"
STEP_METADATA = "_CHECKPOINT_METADATA"
DAMAGED_DIR = "damaged_checkpoints"
# On a disk Orbax writes a step under `<step>.orbax-checkpoint-tmp...` and renames it when
# complete. GCS has no rename: there it writes the step's objects under their final `<step>/`
# prefix and marks the step finished with a last object, `commit_success.txt`.
PARTIAL_MARK = ".orbax-checkpoint-tmp"


def remove_partial_saves(checkpoint_dir: str) -> list[str]:
    """Removes what saves that never completed left (the process was killed, the disk filled up,
    the upload failed): never a checkpoint, only the space they hold. Returns their names.

    In gs:// that is every step prefix Orbax does not count as finished: left there, a later save
    of the same step would write its objects among the old ones."""
    if not storage.exists(checkpoint_dir):
        return []
    fs, root = storage.filesystem(checkpoint_dir)
    finished = set(lora_restore.saved_steps(checkpoint_dir))
    remote = storage.is_remote(checkpoint_dir)
    removed = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        head = name.split(".", 1)[0]
        unfinished = remote and name.isdigit() and int(name) not in finished
        if head.isdigit() and (PARTIAL_MARK in name or unfinished):
            storage.remove_tree(runconfig.join(checkpoint_dir, name))
            removed.append(name)
    return removed


def remove_stray_temporaries(checkpoint_dir: str) -> list[str]:
    """Removes the temporary files of local atomic writes (storage.write_bytes_atomic:
    `.<name>.<random>.tmp` beside their target, such as `lora_meta.json`'s) that a process
    killed mid-write left in the checkpoint directory: they are never read, and nothing else
    removes them. Returns their names. (A gs:// write is one upload: it leaves none.)"""
    root = pathlib.Path(checkpoint_dir)
    if storage.is_remote(checkpoint_dir) or not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def step_problem(
    checkpoint_dir: str, step: int, log: Callable[[str], None] | None = None
) -> tuple[str | None, bool]:
    """(what is wrong with checkpoint `step`, None when intact; whether it has optimizer state).

    Last, its files are checked against its checksum manifest (workloads.checkpoint.checksums): a
    flipped byte can decode to finite values that the checks above pass. A step saved by an
    earlier version, with no manifest, passes with a notice to `log`.
    """
    step_dir = runconfig.join(checkpoint_dir, str(step))
    if not storage.exists(runconfig.join(step_dir, STEP_METADATA)):
        return f"no {STEP_METADATA}", False
    has_optimizer = storage.exists(runconfig.join(step_dir, OPTIMIZER_ITEM))
    for item in (MODEL_ITEM, OPTIMIZER_ITEM) if has_optimizer else (MODEL_ITEM,):
        path = runconfig.join(step_dir, item)
        if not storage.exists(path):
            return f"no {item}/", has_optimizer
        try:
            arrays = lora_restore.read_item(path)
        except errors.UserError:
            return f"{item} unreadable (missing or damaged _METADATA, manifest or data)", True
        except Exception as exc:  # any failure to read is damage, named in one line
            return f"{item} unreadable ({errors.exception_line(exc)})", True
        if not arrays:
            return f"{item} holds no arrays", True
        bad, first = lora_restore.non_finite(arrays)
        if bad:
            return f"{item} holds {bad:,} NaN/Inf values (first in {first})", has_optimizer
    problem, notice = checksums.check_step(
        step_dir, absent=() if has_optimizer else (OPTIMIZER_ITEM,)
    )
    if notice is not None and log is not None:
        log(notice)
    return problem, has_optimizer


def _fence(checkpoint_dir: str, step: int) -> int | None:
    """The run-lock generation step `step` was saved under (None: none recorded, a local run
    directory or an earlier version)."""
    path = runconfig.join(checkpoint_dir, str(step), STEP_METADATA)
    try:
        data = json.loads(storage.read_text(path))
    except (errors.UserError, ValueError, OSError):
        return None  # unreadable metadata is step_problem's to name
    custom = data.get("custom_metadata") if isinstance(data, dict) else None
    token = custom.get(runlock.FENCE_KEY) if isinstance(custom, dict) else None
    return token if isinstance(token, int) and not isinstance(token, bool) else None


def fence_problem(checkpoint_dir: str, step: int, steps: list[int]) -> str | None:
    """Why step `step` must not be resumed from, as the step of a trainer that had lost the run
    lock (an earlier one of `steps` was saved under a newer token); None when it may."""
    token = _fence(checkpoint_dir, step)
    if token is None:
        return None
    newer = [
        (other_token, other)
        for other in steps
        if other < step and (other_token := _fence(checkpoint_dir, other)) is not None
    ]
    newest, which = max(newer, default=(token, step))
    if newest <= token:
        return None
    return (
        f"saved under run-lock generation {token}, older than step {which}'s {newest}: by a "
        "trainer that had lost the run directory to another one"
    )


def _move_aside(output_dir: str, checkpoint_dir: str, step: int) -> str:
    """Moves a damaged step out of the checkpoint directory (Orbax would list it as the latest
    step again, and a later save of that step would collide with it). Returns where it went."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    source = runconfig.join(checkpoint_dir, str(step))
    target = runconfig.join(output_dir, DAMAGED_DIR, f"{step}-{stamp}")
    if storage.is_remote(source):
        fs, path = storage.filesystem(source)
        fs.mv(path, storage.filesystem(target)[1], recursive=True)
    else:
        import os

        os.makedirs(runconfig.join(output_dir, DAMAGED_DIR), exist_ok=True)
        os.replace(source, target)
    return target


def choose_step(
    train: runconfig.TrainingRunSection,
    *,
    fresh_optimizer_state: bool,
    move_damaged: bool,
    log: Callable[[str], None],
) -> int:
    """The newest intact checkpoint step (0: none, a fresh start); damaged newer ones are moved
    aside (when `move_damaged`: the run's writing process) with one line each.

    Raises:
        errors.UserError: every checkpoint is damaged, or the newest intact one has no optimizer
            state and `fresh_optimizer_state` is off.
    """
    checkpoint_dir = train.checkpoint_dir
    if move_damaged:
        for name in remove_partial_saves(checkpoint_dir):
            log(f"removed {runconfig.join(checkpoint_dir, name)}: a save that never completed")
        for name in remove_stray_temporaries(checkpoint_dir):
            log(f"removed {runconfig.join(checkpoint_dir, name)}: a write that never completed")
    steps = lora_restore.saved_steps(checkpoint_dir)
    damaged: list[str] = []
    for step in reversed(steps):
        problem = fence_problem(checkpoint_dir, step, steps)
        has_optimizer = True
        if problem is None:
            problem, has_optimizer = step_problem(checkpoint_dir, step, log)
        if problem is None:
            if not has_optimizer:
                _no_optimizer(checkpoint_dir, step, fresh_optimizer_state, log)
            return step
        where = _move_aside(train.output_dir, checkpoint_dir, step) if move_damaged else None
        older = [s for s in steps if s < step]
        log(
            f"checkpoint step {step} in {checkpoint_dir} is damaged ({problem})"
            + (f"; moved to {where}" if where else "")
            + (f"; falling back to step {older[-1]}" if older else "")
        )
        damaged.append(str(step))
    if damaged:
        raise errors.UserError(
            f"{checkpoint_dir}: no intact checkpoint (damaged: steps {', '.join(damaged)}, moved "
            f"to {runconfig.join(train.output_dir, DAMAGED_DIR)}); run again to start over "
            "from the base model, or restore a copy of the checkpoints"
        )
    return 0


def _no_optimizer(checkpoint_dir: str, step: int, fresh: bool, log: Callable[[str], None]) -> None:
    step_dir = runconfig.join(checkpoint_dir, str(step))
    if not fresh:
        raise errors.UserError(
            f"{step_dir}: no {OPTIMIZER_ITEM}/ (the AdamW moments and step count); resuming "
            "would restart the optimizer, warm-up included; run `train --fresh-optimizer-state` "
            "to continue from these weights with a new optimizer state"
        )
    log(
        f"note: {step_dir} has no {OPTIMIZER_ITEM}/; continuing from its weights with a fresh "
        "optimizer state (--fresh-optimizer-state): the AdamW moments and the schedule's step "
        "count start over"
    )
