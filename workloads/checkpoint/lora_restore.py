"""Restores only the LoRA factors from a training run's Orbax checkpoints, as host numpy arrays.

The checkpoints are written by tunix's CheckpointManager (what PeftTrainer calls):
`<checkpoint_dir>/<step>/model_params` holds `nnx.state(model, nnx.LoRAParam)`. The tree and the
shapes come from the checkpoint's own metadata, so neither the base model nor an accelerator is
needed: every array is restored as a numpy array in host memory, whatever mesh wrote it.
"""

from __future__ import annotations

import logging

import numpy as np

from workloads.checkpoint import adapter_meta
from workloads.common import errors, storage
from workloads.contract import runconfig

ITEM = "model_params"


def find_checkpoint_dir(path: str) -> str:
    """The directory that holds lora_meta.json: `path` itself or its `checkpoints/` (a run dir).

    Raises:
        errors.UserError: neither has lora_meta.json.
    """
    for candidate in (path, runconfig.join(path, "checkpoints")):
        if storage.exists(adapter_meta.path(candidate)):
            return candidate
    raise errors.UserError(
        f"{path}: no {adapter_meta.FILENAME} here or in {runconfig.join(path, 'checkpoints')}; "
        "is this a run or checkpoint directory written by `workloads train`?"
    )


def saved_steps(checkpoint_dir: str) -> list[int]:
    """Finished checkpoint steps in a checkpoint dir (half-written temporary ones excluded); none
    when the directory does not exist (a run that has not saved yet)."""
    import orbax.checkpoint as ocp

    if not storage.exists(checkpoint_dir):
        return []
    return sorted(ocp.utils.checkpoint_steps(checkpoint_dir))


def list_steps(checkpoint_dir: str) -> list[int]:
    """Finalized checkpoint steps under `checkpoint_dir` (temporary, half-written ones excluded).

    Raises:
        errors.UserError: the directory does not exist.
    """
    if not storage.exists(checkpoint_dir):
        raise errors.UserError(f"{checkpoint_dir}: checkpoint directory not found")
    return saved_steps(checkpoint_dir)


def resolve_step(checkpoint_dir: str, step: int | None) -> int:
    """The requested step, or the latest one when `step` is None.

    Raises:
        errors.UserError: no checkpoints, or the requested step is not among them.
    """
    steps = list_steps(checkpoint_dir)
    if not steps:
        raise errors.UserError(f"{checkpoint_dir}: no finished checkpoint steps")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise errors.UserError(
            f"{checkpoint_dir}: no checkpoint for step {step}; "
            f"available: {', '.join(map(str, steps))}"
        )
    return step


def _name(path: tuple[object, ...]) -> str:
    """('layers', '0', 'attn', 'q_einsum', 'w_lora_a', 'value') -> `layers.0.attn.q_einsum.w_lora_a`
    (the path of a leaf of nnx.state(model, nnx.LoRAParam) as Orbax restores it)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if parts and parts[-1] == "value":  # nnx.State stores each Variable's array under "value"
        parts = parts[:-1]
    return ".".join(parts)


class _NoItemLevelMetadataNote(logging.Filter):
    """Drops Orbax's warning that `<item>/_CHECKPOINT_METADATA` does not exist: that file is
    written once per step (`<step>/_CHECKPOINT_METADATA`, which resume checks), never per item,
    so reading an item on its own warns every time, about nothing wrong, on every resume and
    merge."""

    def __init__(self, item: str):
        super().__init__()
        self.item = item.rstrip("/")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()  # a mapping names no path
        return not (
            record.msg == "Metadata file does not exist: %s"
            and str(args[0] if args else "").startswith(self.item)
        )


def read_item(item: str) -> dict[str, np.ndarray]:
    """Every array of one Orbax PyTree item (`<step>/model_params`, `<step>/optimizer_state`)
    onto the host, by flat name, whatever mesh wrote it.

    Raises:
        errors.UserError: the item's tree metadata is missing or unreadable (Orbax then has no
            tree to restore: a missing or damaged _METADATA, manifest or data file).
    """
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    quiet = _NoItemLevelMetadataNote(item)
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(quiet)
    try:
        metadata = checkpointer.metadata(item)
        if metadata is None or getattr(metadata, "item_metadata", None) is None:
            raise errors.UserError(
                f"{item}: unreadable (its _METADATA, manifest or data file is missing or damaged)"
            )
        tree = metadata.item_metadata.tree
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = checkpointer.restore(
            item, args=ocp.args.PyTreeRestore(restore_args=restore_args)
        )
    finally:
        absl_logger.removeFilter(quiet)
        checkpointer.close()
    return {
        _name(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
    }


def non_finite(arrays: dict[str, np.ndarray]) -> tuple[int, str | None]:
    """(number of NaN/Inf values over the floating arrays, the first array holding one)."""
    count, first = 0, None
    for name, array in arrays.items():
        # bfloat16 (ml_dtypes) is no numpy floating subtype; its name says what it is.
        if array.dtype.kind not in "fc" and not array.dtype.name.startswith(("bfloat", "float")):
            continue
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        if bad and first is None:
            first = name
        count += bad
    return count, first


def restore_lora_params(checkpoint_dir: str, step: int) -> dict[str, np.ndarray]:
    """Reads the LoRA params of one step onto the host.

    Args:
        checkpoint_dir: the run's `checkpoints/` directory (local or gs://).
        step: a step from `list_steps`.

    Returns:
        Flat name (`layers.<i>.attn.q_einsum.w_lora_a`) -> numpy array in the saved dtype.

    Raises:
        errors.UserError: the step has no `model_params` item, it is unreadable, or it holds no
            LoRA factors.
    """
    item = runconfig.join(checkpoint_dir, str(step), ITEM)
    if not storage.exists(item):
        raise errors.UserError(
            f"{item}: not found; is {checkpoint_dir} a tunix checkpoint directory?"
        )
    params = read_item(item)
    if not params:
        raise errors.UserError(f"{item}: holds no LoRA parameters")
    return params
