"""Merge: a training run's LoRA adapters + the base model -> a sharded HF checkpoint vLLM serves.

`merge_lora` restores only the LoRA factors (host memory, no accelerator), maps each Tunix module
onto the HF tensors it changes, and streams the base checkpoint into new shards (see stream.py);
`verify_merged` checks a merged directory against its metadata and its base, and
`compare_logits` checks on a small model that the merged weights compute what the LoRA model does.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from workloads.checkpoint import adapter_meta
from workloads.common import errors, storage
from workloads.contract import runconfig
from workloads.merge.verify import (
    LogitsComparison,
    VerifyReport,
    compare_logits,
    read_merge_metadata,
    verify_merged,
)

if TYPE_CHECKING:
    from workloads.merge.mapping import Rule

__all__ = [
    "LogitsComparison",
    "MergeResult",
    "VerifyReport",
    "compare_logits",
    "merge_lora",
    "read_merge_metadata",
    "verify_merged",
]

# Keys of the text config that fix every tensor shape: the adapters only fit a base that agrees.
_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "head_dim",
    "global_head_dim",
    "attention_k_eq_v",
    "layer_types",
)


@dataclasses.dataclass(frozen=True)
class MergeResult:
    """What `merge_lora` wrote.

    Attributes:
        out: the output directory.
        step: the checkpoint step that was merged.
        rank, alpha, targets: the adapters' settings (from lora_meta.json).
        shards: shard file name -> {"crc32c" (or "sha256", workloads.common.digest), "bytes"}.
        tensor_bytes: bytes of tensor data written (= the base's).
        merged_tensors: tensors that received a delta.
        copied_tensors: tensors copied bit for bit.
        seconds: wall time of the streaming pass.
        peak_rss_bytes: the process's peak resident memory so far.
        workers: parts of shards written at once (threads of this process).
        cpu_seconds: CPU time (user + system, all threads) of the streaming pass.
        notes: one line each about what the adapters leave out (a target with no factors).
    """

    out: str
    step: int
    rank: int
    alpha: float
    targets: tuple[str, ...]
    shards: dict[str, dict[str, Any]]
    tensor_bytes: int
    merged_tensors: int
    copied_tensors: int
    seconds: float
    peak_rss_bytes: int
    workers: int = 1
    cpu_seconds: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def gb_per_s(self) -> float:
        return self.tensor_bytes / 1e9 / max(self.seconds, 1e-9)

    def summary(self) -> str:
        return (
            f"merged step {self.step} (rank {self.rank}, alpha {self.alpha:g}) into {self.out}: "
            f"{len(self.shards)} shard(s), {self.tensor_bytes / 1e9:.2f} GB, "
            f"{self.merged_tensors} tensors merged + {self.copied_tensors} copied in "
            f"{self.seconds:.1f} s ({self.gb_per_s:.2f} GB/s, {self.workers} worker(s), "
            f"{self.cpu_seconds / max(self.tensor_bytes / 1e9, 1e-9):.1f} CPU s/GB), peak RSS "
            f"{self.peak_rss_bytes / 2**30:.2f} GiB"
        ) + "".join(f"\nnote: {note}" for note in self.notes)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    Linux's VmHWM belongs to the current program image; getrusage's ru_maxrss also carries the
    peak of the process that forked us, so a small child of a big parent would report the
    parent's size.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _norm(path: str) -> str:
    return path.rstrip("/") if storage.is_remote(path) else os.path.realpath(path)


def _check_distinct(out: str, **inputs: str) -> None:
    """The output must not be, contain or sit inside an input (--overwrite would destroy it)."""
    target = _norm(out)
    for what, path in inputs.items():
        other = _norm(path)
        if target == other or target.startswith(other + "/") or other.startswith(target + "/"):
            raise errors.UserError(
                f"--out {out} overlaps the {what} directory {path}; choose another output"
            )


def _check_base_config(base: str, meta: adapter_meta.AdapterMeta) -> None:
    """The base's config must describe the model the adapters were trained on."""
    from workloads.model import gemma4

    config = gemma4.read_hf_config(base)
    ours, trained = gemma4.text_config(config), gemma4.text_config(meta.hf_config)
    for key in _SHAPE_KEYS:
        if ours.get(key) != trained.get(key):
            raise errors.UserError(
                f"{base}/config.json: text_config.{key}={ours.get(key)!r} but the adapters were "
                f"trained on a model with {key}={trained.get(key)!r} ({meta.base})"
            )


def _check_step_bytes(checkpoint: str, step: int, notes: list[str]) -> None:
    """The step's files must match the checksums it was saved with (workloads.checkpoint.checksums):
    a flipped byte can decode to finite garbage that no later check of the factors sees. A step
    saved by an earlier version (no manifest) is merged with a note.

    Raises:
        errors.UserError: a file is missing or differs from its checksum, named in one line.
    """
    from workloads.checkpoint import checksums

    step_dir = runconfig.join(checkpoint, str(step))
    # The merge reads the LoRA factors only: a step without optimizer state is merged as it is.
    absent = (
        () if storage.exists(runconfig.join(step_dir, "optimizer_state")) else ("optimizer_state",)
    )
    problem, notice = checksums.check_step(step_dir, absent=absent)
    if problem is not None:
        raise errors.UserError(
            f"{step_dir}: damaged ({problem}); refusing to merge it (merge an earlier --step)"
        )
    if notice is not None:
        notes.append(notice.removeprefix("note: "))


def merge_lora(
    base: str,
    checkpoint: str,
    out: str,
    *,
    step: int | None = None,
    shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = True,
    staging_dir: str | None = None,
    rules: Mapping[str, Rule] | None = None,
    workers: int | None = None,
) -> MergeResult:
    """Merges a training run's LoRA adapters into the base model as sharded HF safetensors.

    Args:
        base: the base model directory (local or gs://), HF layout with config.json.
        checkpoint: the run's checkpoint directory (holding lora_meta.json and `<step>/`), or
            the run directory above it.
        out: output directory (local or gs://); must be absent or empty unless `overwrite`.
        step: checkpoint step to merge; None = the latest finished one.
        shard_size: largest output file, e.g. "5GB" (the Hugging Face per-file limit is 50 GB;
            5 GB is what HF itself writes).
        overwrite: replace a non-empty output.
        progress: show a progress bar over bytes and tensors on stderr.
        staging_dir: local scratch for gs:// input/output (default $TMPDIR; /dev/shm on TPU VMs).
        rules: the Tunix -> HF mapping (mapping.RULES); tests inject corrupted ones.
        workers: parts of shards merged at once, each in a thread of this process; None = one
            per core, at most 16 (and as the memory allows).

    Returns:
        A MergeResult.

    Raises:
        errors.UserError: bad input, named in one line (missing metadata or step, rank differing
            from the metadata, a target without base tensor, a shape mismatch, non-empty output,
            a checkpoint file that differs from its checksum, NaN/Inf in the LoRA factors or in
            a merged tensor, a delta far beyond its base tensor's scale).
    """
    from workloads.checkpoint import lora_restore
    from workloads.merge import mapping, stream
    from workloads.merge import safetensors_io as st

    try:
        size = runconfig.parse_size(shard_size)
    except ValueError as exc:
        raise errors.UserError(f"--shard-size: {exc}") from None
    if size <= 0:
        raise errors.UserError(f"--shard-size {shard_size!r} must be positive")
    if workers is not None and workers < 1:
        raise errors.UserError(f"--workers {workers}: must be at least 1")
    checkpoint = lora_restore.find_checkpoint_dir(checkpoint)
    _check_distinct(out, base=base, checkpoint=checkpoint)
    meta = adapter_meta.read(checkpoint)
    _check_base_config(base, meta)
    step = lora_restore.resolve_step(checkpoint, step)
    layout = st.read_layout(base)
    notes: list[str] = []
    _check_step_bytes(checkpoint, step, notes)
    params = lora_restore.restore_lora_params(checkpoint, step)
    bad, first = lora_restore.non_finite(params)
    if bad:
        raise errors.UserError(
            f"{runconfig.join(checkpoint, str(step))}: {bad:,} NaN/Inf values in the LoRA "
            f"factors (first in {first}); refusing to merge them (merge an earlier --step)"
        )
    notes.extend(mapping.targets_without_factors(params, meta.targets))
    deltas = mapping.build_deltas(
        params, rank=meta.rank, alpha=meta.alpha, targets=meta.targets, rules=rules or mapping.RULES
    )
    del params  # the deltas hold float32 copies of the factors
    metadata = {
        "source_checkpoint": checkpoint,
        "step": step,
        "rank": meta.rank,
        "alpha": meta.alpha,
        "targets": list(meta.targets),
        "base": base,
    }
    stats = stream.stream_merge(
        layout,
        deltas,
        out,
        shard_size=size,
        overwrite=overwrite,
        metadata=metadata,
        staging_dir=staging_dir,
        progress=progress,
        workers=workers,
    )
    return MergeResult(
        out=out,
        step=step,
        rank=meta.rank,
        alpha=meta.alpha,
        targets=tuple(meta.targets),
        shards=stats.shards,
        tensor_bytes=stats.tensor_bytes,
        merged_tensors=stats.merged_tensors,
        copied_tensors=stats.copied_tensors,
        seconds=stats.seconds,
        peak_rss_bytes=peak_rss_bytes(),
        workers=stats.workers,
        cpu_seconds=stats.cpu_seconds,
        notes=tuple(notes),
    )
