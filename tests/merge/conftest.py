"""Fixtures of the merge tests: a tiny f32 Gemma 4, a LoRA run saved the way training saves it,
and its merged checkpoint (built once per session).

The run goes through the training code path: workloads.model.gemma4.load_model, workloads.model.lora
.apply_lora on every target (k_einsum of the global layers included), tunix's CheckpointManager
.save (what PeftTrainer calls) and adapter_meta.write. LoRA B starts at zero in Qwix, so it is
randomised here: a merge of all-zero adapters would prove nothing.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

RANK = 4
ALPHA = 8.0
STEPS = (3, 7)  # two checkpoints with different adapters; the latest is 7
SHARD_SIZE = 450_000  # the tiny model is ~3.6 MB: several shards (embedding 393 kB fits in one)


@dataclasses.dataclass(frozen=True)
class LoraRun:
    base: pathlib.Path
    run: pathlib.Path
    checkpoints: pathlib.Path
    targets: tuple[str, ...]
    tokens: np.ndarray  # [2, 39]: crosses the sliding window (16) twice
    base_logits: np.ndarray
    lora_logits: dict[int, np.ndarray]  # step -> logits of the LoRA model saved at that step


def single_device_mesh():
    import jax

    from workloads.model import gemma4

    auto = jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1), gemma4.MESH_AXES, axis_types=(auto, auto)
    )


def jax_logits(model_dir, tokens):
    """Logits of a model directory loaded by Tunix without LoRA (f32)."""
    from workloads.merge import verify
    from workloads.model import gemma4

    mesh = single_device_mesh()
    return verify.forward(gemma4.load_model(model_dir, mesh=mesh, dtype="float32"), tokens, mesh)


@pytest.fixture(scope="session")
def lora_run(tiny_model_dir, tmp_path_factory) -> LoraRun:
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.sft import checkpoint_manager

    from workloads.checkpoint import adapter_meta
    from workloads.contract import runconfig
    from workloads.merge import verify
    from workloads.model import gemma4, lora

    root = tmp_path_factory.mktemp("merge")
    base = tiny_model_dir  # shared, read-only: tests that need a changed base copy it
    targets = runconfig.ALL_LORA_TARGETS  # includes k_einsum (global layers, k_eq_v)
    # Trained and saved sharded over 2 devices (tp=2); the merge restores it onto the host.
    mesh = gemma4.make_mesh(1, 2)
    base_model = gemma4.load_model(base, mesh=mesh, dtype="float32")
    tokens = np.random.default_rng(0).integers(
        0, base_model.config.num_embed, (2, 39), dtype=np.int32
    )
    base_logits = verify.forward(base_model, tokens, mesh)
    settings = runconfig.LoraRunSection(rank=RANK, alpha=ALPHA, dropout=0.0, targets=targets)
    lora_model = lora.apply_lora(base_model, settings, mesh=mesh, seed=0)

    checkpoints = root / "run" / "checkpoints"
    adapter_meta.write(
        str(checkpoints),
        adapter_meta.AdapterMeta(
            rank=RANK,
            alpha=ALPHA,
            targets=targets,
            base=str(base),
            hf_config=gemma4.read_hf_config(base),
        ),
    )
    manager = checkpoint_manager.CheckpointManager(
        str(checkpoints), ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3)
    )
    lora_logits = {}
    for step in STEPS:
        state = nnx.state(lora_model, nnx.LoRAParam)
        for i, (path, var) in enumerate(state.flat_state()):
            if path[-1].endswith("lora_b"):
                value = var.get_value()
                noise = 0.05 * jax.random.normal(
                    jax.random.key(step * 1000 + i), value.shape, value.dtype
                )
                var.set_value(jax.device_put(noise, value.sharding))
        nnx.update(lora_model, state)
        manager.save(step, lora_model, save_only_lora_params=True, force=True)
        lora_logits[step] = verify.forward(lora_model, tokens, mesh)
    manager.close()
    return LoraRun(base, root / "run", checkpoints, targets, tokens, base_logits, lora_logits)


@pytest.fixture(scope="session")
def merged(lora_run, tmp_path_factory):
    """The latest step merged into a fresh directory (with the default mapping)."""
    from workloads import merge

    out = tmp_path_factory.mktemp("merged") / "out"
    result = merge.merge_lora(
        str(lora_run.base), str(lora_run.run), str(out), shard_size=SHARD_SIZE, progress=False
    )
    return out, result
