"""Ways a checkpoint step gets damaged on disk, as the fault-injection tests apply them."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np

KINDS = (
    "truncated_file",
    "no_step_metadata",
    "no_manifest",
    "no_item_metadata",
    "nan_values",
    "finite_garbage",
    "flipped_bytes",
    "no_checksums",
)
# What 64 flipped bytes in the issue decoded to: finite, far beyond any weight.
GARBAGE = np.float32(2.4e37)


def largest_data_file(item: pathlib.Path) -> pathlib.Path:
    """The biggest data file of an Orbax item that a restore reads: the item's own OCDBT `d/`
    (the per-process `ocdbt.process_N/d/` copies are merged into it when the save finishes)."""
    return max((item / "d").iterdir(), key=lambda p: p.stat().st_size)


def poison_item(item: pathlib.Path, values: float = np.nan) -> int:
    """Rewrites an Orbax PyTree item with its first floating array set to `values` (what a
    bit flip in an exponent does); returns how many values were changed."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    tree = checkpointer.metadata(str(item)).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = checkpointer.restore(str(item), args=ocp.args.PyTreeRestore(restore_args=args))
    leaves, treedef = jax.tree.flatten(restored)
    index = next(i for i, leaf in enumerate(leaves) if np.asarray(leaf).dtype.kind == "f")
    leaves[index] = np.full_like(np.asarray(leaves[index]), values)
    shutil.rmtree(item)
    checkpointer.save(str(item), args=ocp.args.PyTreeSave(jax.tree.unflatten(treedef, leaves)))
    checkpointer.close()
    return int(leaves[index].size)


def garbage_values(item: pathlib.Path, count: int = 16) -> str:
    """Rewrites an Orbax PyTree item with the first `count` values of its largest array set to
    GARBAGE: finite, so a restore reads them back without an error and no NaN check sees them.
    (Orbax compresses each chunk with zstd, so flipping bytes of a data file in place gives no
    predictable values; the item is written again through Orbax instead.) Returns the array's
    name."""
    import jax
    import orbax.checkpoint as ocp

    from workloads.checkpoint import lora_restore

    name = max(lora_restore.read_item(str(item)).items(), key=lambda kv: kv[1].nbytes)[0]
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    tree = checkpointer.metadata(str(item)).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = checkpointer.restore(str(item), args=ocp.args.PyTreeRestore(restore_args=args))
    flat, treedef = jax.tree_util.tree_flatten_with_path(restored)
    leaves = [np.array(leaf) for _, leaf in flat]
    (index,) = [i for i, (path, _) in enumerate(flat) if lora_restore._name(path) == name]
    leaves[index].reshape(-1)[:count] = GARBAGE
    shutil.rmtree(item)
    checkpointer.save(str(item), args=ocp.args.PyTreeSave(jax.tree.unflatten(treedef, leaves)))
    checkpointer.close()
    return name


def flip_bytes(item: pathlib.Path, count: int = 64) -> pathlib.Path:
    """Inverts `count` bytes in the middle of the item's largest data file (every `d/` of the
    item, the per-process ones included); returns that file."""
    data = max(
        (p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    content = bytearray(data.read_bytes())
    middle = len(content) // 2
    content[middle : middle + count] = bytes(b ^ 0xFF for b in content[middle : middle + count])
    data.write_bytes(bytes(content))
    return data


def damage(step_dir: pathlib.Path, kind: str) -> None:
    item = step_dir / "model_params"
    if kind == "truncated_file":
        data = largest_data_file(item)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif kind == "no_step_metadata":
        (step_dir / "_CHECKPOINT_METADATA").unlink()
    elif kind == "no_manifest":
        (item / "manifest.ocdbt").unlink()
    elif kind == "no_item_metadata":
        (item / "_METADATA").unlink()
    elif kind == "nan_values":
        poison_item(item)
    elif kind == "finite_garbage":
        garbage_values(item)
    elif kind == "flipped_bytes":
        flip_bytes(item)
    elif kind == "no_checksums":
        (step_dir / "checksums.json").unlink()
    else:
        raise ValueError(kind)


def copy_run(reference_checkpoint_dir: str, dest: pathlib.Path, keep: list[int]) -> pathlib.Path:
    """A copy of the reference run directory with only the checkpoint steps in `keep` (the
    metrics and segments as they were); returns the new run directory."""
    source = pathlib.Path(reference_checkpoint_dir).parent
    shutil.copytree(source, dest)
    for step_dir in (dest / "checkpoints").iterdir():
        if step_dir.is_dir() and step_dir.name.isdigit() and int(step_dir.name) not in keep:
            shutil.rmtree(step_dir)
    (dest / "train_summary.json").unlink(missing_ok=True)
    return dest
