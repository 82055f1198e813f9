"""The trainer's side of the run's checkpoint directory: the adapter settings it was written with
must be the run's, and when checkpoints are saved. The format itself (layout, lora_meta.json,
checksums, finished steps) is workloads.checkpoint's, which the merge reads too.

Checkpoints are PeftTrainer's (LoRA params + optimizer state) every `train.save_every` steps,
keeping `train.keep_checkpoints`; a restarted run resumes from the latest one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workloads.checkpoint import adapter_meta, lora_restore
from workloads.common import errors, storage
from workloads.contract import runconfig


def check_checkpoint_dir(cfg: runconfig.RunConfig) -> bool:
    """Refuses a checkpoint dir written with other LoRA settings. Returns whether it has metadata.

    Raises:
        errors.UserError: lora_meta.json differs in rank, alpha or targets, or there are step
            directories without lora_meta.json.
    """
    ckpt = cfg.train.checkpoint_dir
    if storage.exists(adapter_meta.path(ckpt)):
        meta = adapter_meta.read(ckpt)
        diffs = [
            f"{name} {old!r} (run config: {new!r})"
            for name, old, new in (
                ("rank", meta.rank, cfg.lora.rank),
                ("alpha", meta.alpha, cfg.lora.alpha),
                ("targets", sorted(meta.targets), sorted(cfg.lora.targets)),
            )
            if old != new
        ]
        if diffs:
            raise errors.UserError(
                f"{ckpt}: holds LoRA checkpoints with {'; '.join(diffs)}; use another "
                "train.output_dir or the same lora settings"
            )
        return True
    if lora_restore.saved_steps(ckpt):
        raise errors.UserError(
            f"{ckpt}: has checkpoints but no {adapter_meta.FILENAME}; refusing to resume from "
            "adapters of unknown rank/alpha/targets (use another train.output_dir)"
        )
    return False


def options(
    train: runconfig.TrainingRunSection, on_finalized: Callable[[], None] | None = None
) -> Any:
    """Every `save_every` steps (and when JAX reports a preemption), keeping `keep_checkpoints`.

    `on_finalized` runs on the primary process once a step's files are all written, before the
    step is committed (workloads.checkpoint.checksums writes the step's manifest there).

    The policy is spelled out because Orbax's default for `save_interval_steps` also saves the
    first step of a fresh run, which would take one of the kept slots for an untrained adapter.
    The half-written temporary directory of a save that died (a kill, a full disk) is removed
    by the next run (workloads.train.resume.remove_partial_saves).
    """
    import orbax.checkpoint as ocp

    policies = ocp.checkpoint_managers
    return ocp.CheckpointManagerOptions(
        async_options=(
            ocp.AsyncOptions(post_finalization_callback=on_finalized) if on_finalized else None
        ),
        save_interval_steps=train.save_every,
        max_to_keep=train.keep_checkpoints,
        save_decision_policy=policies.AnySavePolicy(
            [
                policies.FixedIntervalPolicy(train.save_every),
                policies.PreemptionCheckpointingPolicy(),
            ]
        ),
    )
