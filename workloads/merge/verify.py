"""Checks of a merged checkpoint: integrity against its metadata and base, and logits parity.

`verify_merged` is what `merge --verify` runs on any model size: the index is there and matches
merge_metadata.json, every shard has the recorded checksum and size, no floating tensor holds NaN
or Inf, the tensors are the base's
(same names, dtypes, shapes), every tensor that is not a LoRA target is byte-identical to the
base, every target differs from it, and by less than 100 times the base tensor's largest value
(shard_worker.DELTA_SCALE_LIMIT). `compare_logits` is the numerical proof on a small model:
the merged checkpoint, loaded by Tunix without LoRA, against the LoRA model restored from the
training checkpoint through tunix's own restore path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from typing import Any

import numpy as np

import workloads.merge.safetensors_io as st
from workloads.common import digest, errors, storage
from workloads.contract import runconfig

_CHUNK = 16 * 1024 * 1024


def read_merge_metadata(out: str) -> dict[str, Any]:
    """merge_metadata.json of a merged directory.

    Raises:
        errors.UserError: missing or malformed.
    """
    from workloads.merge import stream

    path = runconfig.join(out, stream.METADATA_FILE)
    try:
        data = json.loads(storage.read_text(path))
    except json.JSONDecodeError as exc:
        raise errors.UserError(f"{path}: malformed ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise errors.UserError(f'{path}: malformed (no "files" mapping)')
    return data


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The outcome of `verify_merged`; `problems` is empty when everything holds."""

    out: str
    shards: int
    tensors: int
    merged_tensors: int
    identical_copies: int
    changed_targets: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (
            f"verify {self.out}: {self.shards} shard(s) match their checksum, "
            f"{self.tensors} tensors; "
            f"{self.identical_copies} non-target tensors byte-identical to the base, "
            f"{self.changed_targets}/{self.merged_tensors} targets changed"
        )
        if self.ok:
            return head + ": OK"
        return (
            head
            + f": {len(self.problems)} problem(s):\n"
            + "\n".join(f"  {p}" for p in self.problems)
        )


def verify_merged(
    out: str, *, base: str | None = None, staging_dir: str | None = None
) -> VerifyReport:
    """Checks a merged directory (local or gs://) against its metadata and, given `base`, against
    the base checkpoint. Reads every byte of the output (and of the base) once, chunk by chunk.

    Raises:
        errors.UserError: the output has no index (the merge did not finish) or no metadata.
    """
    if not storage.exists(runconfig.join(out, st.INDEX_FILE)):
        raise errors.UserError(f"{out}: no {st.INDEX_FILE}; the merge did not finish")
    meta = read_merge_metadata(out)
    problems: list[str] = []
    layout = st.read_layout(out)
    files: dict[str, dict[str, Any]] = meta["files"]
    if set(files) != set(layout.files):
        problems.append(
            f"index names shards {sorted(layout.files)} but merge_metadata.json lists "
            f"{sorted(files)}"
        )
    for name, expected in sorted(files.items()):
        path = runconfig.join(out, name)
        if not storage.exists(path):
            problems.append(f"{name}: missing")
            continue
        want = digest.expected(expected)
        if want is None:
            problems.append(
                f"{name}: merge_metadata.json records no checksum "
                f"(one of {', '.join(digest.ALGORITHMS)})"
            )
            continue
        algorithm, checksum = want
        got, size = st.file_digest(path, algorithm)
        if got != checksum or size != expected.get("bytes"):
            problems.append(
                f"{name}: {algorithm}/size {got[:12]}…/{size} differ from merge_metadata.json "
                f"{checksum[:12]}…/{expected.get('bytes')}"
            )
    targets = set(meta.get("merged_tensors", ()))
    _check_finite(layout, problems, staging_dir)
    identical = changed = 0
    if base is not None:
        identical, changed = _compare_with_base(
            st.read_layout(base), layout, targets, problems, staging_dir
        )
    return VerifyReport(
        out, len(files), len(layout.tensors), len(targets), identical, changed, tuple(problems)
    )


def _check_finite(layout: st.Layout, problems: list[str], staging_dir: str | None) -> None:
    """Adds a problem for every floating tensor of the output that holds NaN or Inf: a merge of
    damaged adapters (or of a bit-flipped shard) must not pass as OK."""
    bad: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="merge-verify-", dir=staging_dir) as scratch:
        source = st.Source(layout, scratch if storage.is_remote(layout.root) else None)
        buffer = bytearray(_CHUNK - _CHUNK % 8)  # whole elements of every float dtype
        try:
            for name, info in layout.tensors.items():
                dtype = st.float_dtype(info.dtype)
                if dtype is not None:
                    count = sum(
                        int(chunk.nbytes // dtype.itemsize)
                        - int(np.count_nonzero(np.isfinite(np.frombuffer(chunk, dtype))))
                        for chunk in source.chunks(info, buffer)
                    )
                    if count:
                        bad[name] = count
                source.done(info)
        finally:
            source.close()
    if bad:
        first = next(iter(bad))
        problems.append(
            f"{sum(bad.values()):,} NaN/Inf values in {len(bad)} tensor(s), e.g. {first} "
            f"({bad[first]:,}); this model must not be served"
        )


class _DeltaScale:
    """max |base| and max |merged - base| of a LoRA target, chunk by chunk (the merge's own
    plausibility bound, shard_worker.DELTA_SCALE_LIMIT, over the whole tensor): garbage
    adapters give finite merged weights that every other check here passes."""

    def __init__(self, dtype: np.dtype | None):
        self.dtype = dtype
        self.base_max = self.delta_max = 0.0

    def add(self, base: memoryview, merged: memoryview) -> None:
        if self.dtype is None or not len(base):
            return
        b = np.frombuffer(base, self.dtype).astype(np.float32)
        m = np.frombuffer(merged, self.dtype).astype(np.float32)
        self.base_max = max(self.base_max, float(np.max(np.abs(b))))
        np.subtract(m, b, out=m)
        self.delta_max = max(self.delta_max, float(np.nanmax(np.abs(m))))

    def too_large(self) -> bool:
        from workloads.merge import shard_worker

        return self.delta_max > shard_worker.DELTA_SCALE_LIMIT * self.base_max

    def problem(self, name: str) -> str:
        from workloads.merge import shard_worker

        return (
            f"{name}: differs from the base by up to {self.delta_max:.3g}, where the base's "
            f"largest value is {self.base_max:.3g} (a fine-tune's delta stays below "
            f"{shard_worker.DELTA_SCALE_LIMIT:g} times it); this model must not be served"
        )


def _compare_with_base(
    base: st.Layout,
    merged: st.Layout,
    targets: set[str],
    problems: list[str],
    staging_dir: str | None,
) -> tuple[int, int]:
    missing = sorted(set(base.tensors) - set(merged.tensors))
    extra = sorted(set(merged.tensors) - set(base.tensors))
    if missing:
        problems.append(f"{len(missing)} base tensor(s) missing, e.g. {missing[0]}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) not in the base, e.g. {extra[0]}")
    identical = changed = 0
    with tempfile.TemporaryDirectory(prefix="merge-verify-", dir=staging_dir) as scratch:
        base_src = st.Source(base, f"{scratch}/base" if storage.is_remote(base.root) else None)
        out_src = st.Source(merged, f"{scratch}/out" if storage.is_remote(merged.root) else None)
        buffers = (bytearray(_CHUNK), bytearray(_CHUNK))
        try:
            for name, b in base.tensors.items():
                m = merged.tensors.get(name)
                if m is None:
                    continue
                if (b.dtype, b.shape) != (m.dtype, m.shape):
                    problems.append(
                        f"{name}: {m.dtype}{list(m.shape)} in the output, "
                        f"{b.dtype}{list(b.shape)} in the base"
                    )
                else:
                    scale = _DeltaScale(st.float_dtype(b.dtype) if name in targets else None)
                    same = True
                    for x, y in zip(
                        base_src.chunks(b, buffers[0]), out_src.chunks(m, buffers[1]), strict=True
                    ):
                        same &= np.array_equal(
                            np.frombuffer(x, np.uint8), np.frombuffer(y, np.uint8)
                        )
                        scale.add(x, y)
                    if scale.too_large():
                        problems.append(scale.problem(name))
                    if name in targets:
                        changed += not same
                    elif same:
                        identical += 1
                    else:
                        problems.append(f"{name}: not a LoRA target but differs from the base")
                base_src.done(b)
                out_src.done(m)
        finally:
            base_src.close()
            out_src.close()
    return identical, changed


@dataclasses.dataclass(frozen=True)
class LogitsComparison:
    """Merged model vs LoRA model on the same tokens.

    Attributes:
        max_abs_diff: max |logits(merged, no LoRA) - logits(base + LoRA)|.
        lora_effect: max |logits(base + LoRA) - logits(base)|: how much the adapters change the
            output (a parity check on adapters that do nothing would prove nothing).
        batch, seq_len: the token array compared.
        dtype: parameter/activation dtype of the comparison.
    """

    max_abs_diff: float
    lora_effect: float
    batch: int
    seq_len: int
    dtype: str

    def summary(self) -> str:
        return (
            f"logits merged vs LoRA model: max |diff| {self.max_abs_diff:.2e} "
            f"(the adapters move the logits by up to {self.lora_effect:.2e}); "
            f"{self.batch}x{self.seq_len} tokens, {self.dtype}"
        )


def forward(model: Any, tokens: Any, mesh: Any) -> np.ndarray:
    """Logits of `model` for a [batch, length] token array, causal mask, positions from 0.

    The pass is one compiled program per model structure and token shape, not op by op: run
    eagerly, each pass compiled about 200 one-op programs (each also a persistent-cache entry),
    and a greedy decode of 8 tokens dispatched them 8 times over.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = jnp.broadcast_to(
        jnp.tril(jnp.ones((length, length), jnp.bool_)), (batch, length, length)
    )
    # nnx.jit writes the module's state back from the program's outputs: copies of every weight,
    # placed as the compiler chose. It gets a module of its own (new variables over the same
    # arrays), so the caller's model keeps its arrays.
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf, state))
    with mesh:
        logits = _compiled_logits()(view, jnp.asarray(tokens), positions, mask)
    return np.asarray(logits, dtype=np.float32)


@functools.cache
def _compiled_logits() -> Any:
    """The model's logits as one jitted function (nnx.jit: one program per model graph)."""
    from flax import nnx

    from workloads.model import tracer_sharding

    tracer_sharding.install()

    @nnx.jit
    def logits_of(model: Any, tokens: Any, positions: Any, mask: Any) -> Any:
        logits, _ = model(tokens, positions, None, mask)
        return logits

    return logits_of


def single_device_mesh() -> Any:
    """A 1x1 mesh on the first device: what the small CPU comparisons run on."""
    import jax

    from workloads.model import gemma4

    auto = jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1), gemma4.MESH_AXES, axis_types=(auto, auto)
    )


def restore_lora(
    base_model: Any, checkpoint: str, *, step: int | None, mesh: Any, seed: int = 0
) -> Any:
    """`base_model` with the run's LoRA adapters restored from its checkpoint (tunix's restore
    path, the training code's own model): the model the run trained, before any merge.

    Args:
        checkpoint: the run's checkpoint directory (or run directory).
        step: checkpoint step; None = latest.

    Raises:
        errors.UserError: the step cannot be restored.
    """
    import orbax.checkpoint as ocp
    from tunix.sft import checkpoint_manager

    from workloads.checkpoint import adapter_meta, lora_restore
    from workloads.model import lora

    checkpoint = lora_restore.find_checkpoint_dir(checkpoint)
    meta = adapter_meta.read(checkpoint)
    step = lora_restore.resolve_step(checkpoint, step)
    settings = runconfig.LoraRunSection(
        rank=meta.rank, alpha=meta.alpha, dropout=0.0, targets=meta.targets
    )
    lora_model = lora.apply_lora(base_model, settings, mesh=mesh, seed=seed)
    manager = checkpoint_manager.CheckpointManager(
        checkpoint, ocp.CheckpointManagerOptions(read_only=True)
    )
    try:
        restored, _ = manager.maybe_restore(lora_model, step=step, restore_only_lora_params=True)
    finally:
        manager.close()
    if restored != step:
        raise errors.UserError(f"{checkpoint}: could not restore step {step}")
    return lora_model


def compare_logits(
    base: str,
    checkpoint: str,
    merged: str,
    *,
    step: int | None = None,
    batch: int = 2,
    seq_len: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> LogitsComparison:
    """Loads the base model with the run's LoRA adapters (tunix's restore path) and the merged
    model without LoRA, runs both on the same random tokens and compares the logits.

    Meant for small models on CPU (the demo, the tests): it holds three copies of the model.

    Args:
        base, merged: local model directories.
        checkpoint: the run's checkpoint directory (or run directory).
        step: checkpoint step; None = latest.
        batch, seq_len: token array shape; seq_len defaults to a length that crosses the sliding
            window twice.
        seed: seed of the tokens.
        dtype: "float32" for an exact comparison (bf16 rounding alone moves logits by ~0.1).

    Returns:
        A LogitsComparison.
    """
    from workloads.model import gemma4

    mesh = single_device_mesh()
    base_model = gemma4.load_model(base, mesh=mesh, dtype=dtype)
    cfg = base_model.config
    if seq_len is None:
        seq_len = 2 * (cfg.sliding_window_size or 16) + 7
    tokens = np.random.default_rng(seed).integers(
        0, cfg.num_embed, (batch, seq_len), dtype=np.int32
    )
    base_logits = forward(base_model, tokens, mesh)
    lora_model = restore_lora(base_model, checkpoint, step=step, mesh=mesh, seed=seed)
    lora_logits = forward(lora_model, tokens, mesh)
    del base_model, lora_model

    merged_logits = forward(gemma4.load_model(merged, mesh=mesh, dtype=dtype), tokens, mesh)
    return LogitsComparison(
        max_abs_diff=float(np.max(np.abs(merged_logits - lora_logits))),
        lora_effect=float(np.max(np.abs(lora_logits - base_logits))),
        batch=batch,
        seq_len=seq_len,
        dtype=dtype,
    )
