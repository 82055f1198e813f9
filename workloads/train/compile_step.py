"""Compiles the project's LoRA training step for a TPU topology without a TPU, and reads what XLA
says about it: per-chip memory and the step's FLOPs and estimated time.

libtpu (from PyPI) gives JAX a compile-only client: `jax.experimental.topologies` describes the
devices of a named TPU topology, a mesh is built on them while JAX itself runs on the CPU, and
`jit(...).lower(abstract arguments).compile()` produces the TPU executable's memory and cost
analyses. The model is built abstractly (`nnx.eval_shape`: shapes, dtypes and shardings, no
weights), Qwix adds the adapters in the same abstract trace, and the step is the trainer's own
(`step.make_trainer`): PeftTrainer's train step with the project's loss and packed inputs,
gradient accumulation, AdamW and the sharding pin, jitted as the trainer jits it
(`step.TrainableOnlyStep`). Tunix's activation-sharding helper skips its constraints when
the first JAX device is a CPU; here the step is for a TPU, so the helper is made to apply them
as it does on a TPU VM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from workloads.common import errors
from workloads.contract import catalog, runconfig
from workloads.model import gemma4
from workloads.model import lora as lora_lib
from workloads.train import packed_attention
from workloads.train import step as step_lib

if TYPE_CHECKING:
    import jax
    from flax import nnx


@dataclasses.dataclass(frozen=True)
class StepCompile:
    """What XLA reports for one compiled training micro-step, per chip (one JAX device = one
    v5p chip in megacore mode).

    Attributes:
        layers: decoder layers of the compiled model.
        argument_bytes, output_bytes, alias_bytes, temp_bytes, code_bytes: XLA's memory analysis.
        flops: floating-point operations of the step on one chip (XLA's cost analysis).
        bytes_accessed: HBM bytes read and written by the step on one chip.
        optimal_seconds: XLA's estimate of the step's time on one chip (a lower bound: XLA's
            cost model, not a measurement), plus `kernel_seconds`.
        kernel_flops: FLOPs of the splash attention kernels (Pallas), which XLA's cost analysis
            does not see: counted from the blocks each kernel visits
            (workloads.train.packed_attention), included in `flops`.
        kernel_seconds: those FLOPs at the chip's bf16 peak (as optimistic as XLA's own model),
            included in `optimal_seconds`.
        compile_seconds: wall time of trace + lower + compile on this machine.
    """

    layers: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    optimal_seconds: float
    compile_seconds: float
    kernel_flops: float = 0.0
    kernel_seconds: float = 0.0


def topology_devices(accelerator: catalog.Accelerator) -> list[jax.Device]:
    """The TPU devices of the accelerator's topology, from libtpu's compile-only client.

    Raises:
        errors.UserError: libtpu is not installed, or the accelerator has no known topology.
    """
    from jax.experimental import topologies

    if accelerator.topology is None:
        raise errors.UserError(
            f"{accelerator.name}: no TPU topology in the catalog; the compile check supports "
            f"{', '.join(a.name for a in catalog.ACCELERATORS.values() if a.topology)}"
        )
    topo = accelerator.topology
    libtpu_environment(accelerator.name)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topo.name,
            chip_config_name=topo.chip_config,
            chips_per_host_bounds=topo.chips_per_host_bounds,
            num_slices=1,
            wrap=(False, False, False),
        )
    except (RuntimeError, ValueError) as exc:
        if "libtpu" in str(exc).lower() or "tpu" in str(exc).lower():
            raise errors.UserError(
                f"cannot describe TPU topology {topo.name} ({exc}); the compile check needs "
                "libtpu: pip install -e '.[compile]'"
            ) from None
        raise
    return list(desc.devices)


def make_mesh(devices: list[jax.Device], fsdp: int, tp: int) -> jax.sharding.Mesh:
    """The (fsdp, tp) mesh of the training step (Auto axes, as tunix expects) on `devices`."""
    import jax

    if fsdp * tp != len(devices):
        raise errors.UserError(
            f"train.mesh fsdp={fsdp} x tp={tp} = {fsdp * tp} does not match the "
            f"{len(devices)} TPU devices of the slice; fsdp * tp must equal {len(devices)}"
        )
    auto = jax.sharding.AxisType.Auto
    grid = np.array(devices).reshape(fsdp, tp)
    return jax.sharding.Mesh(grid, gemma4.MESH_AXES, axis_types=(auto, auto))


@contextlib.contextmanager
def tpu_activation_sharding() -> Iterator[None]:
    """Tunix's `shard` helper applies activation sharding constraints unless the first JAX
    device is a CPU; while compiling for a TPU on a CPU host it must apply them as on the TPU."""
    import jax
    from jax.interpreters import pxla
    from tunix.models.gemma4 import model as gemma4_model

    original = gemma4_model.shard

    def shard(x: Any, spec: tuple[str | None, ...], eager: bool = False) -> Any:
        mesh = pxla.thread_resources.env.physical_mesh
        if mesh.empty:
            return x
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.lax.with_sharding_constraint(x, sharding)

    gemma4_model.shard = shard
    try:
        yield
    finally:
        gemma4_model.shard = original


def sliced_hf_config(hf_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The same model cut to its first `layers` decoder layers (same per-layer shapes, same
    sliding:global pattern)."""
    text = dict(gemma4.text_config(hf_config))
    types = text.get("layer_types")
    text["num_hidden_layers"] = layers
    if types:
        text["layer_types"] = list(types)[:layers]
    return {"text_config": text}


def _with_shardings(module: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Gives every abstract variable of `module` the NamedSharding its partition spec names."""
    import jax
    from flax import nnx

    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)

    def place(value: Any, spec: Any) -> Any:
        spec = spec if isinstance(spec, jax.sharding.PartitionSpec) else None
        spec = jax.sharding.PartitionSpec(*lora_lib.fit_spec(tuple(spec or ()), value.shape, mesh))
        return jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)
        )

    nnx.update(module, jax.tree.map(place, state, specs))


def abstract_inputs(cfg: runconfig.RunConfig, mesh: jax.sharding.Mesh) -> Any:
    """One micro-batch of packed rows as ShapeDtypeStructs, split over the data axes."""
    import jax
    import jax.numpy as jnp

    shape = (cfg.train.micro_batch, cfg.data.max_seq_len)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(step_lib.DATA_AXES))
    leaf = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    return step_lib.PackedInput(
        input_tokens=leaf, input_mask=leaf, segment_ids=leaf, positions=leaf
    )


def compile_train_step(
    cfg: runconfig.RunConfig,
    hf_config: dict[str, Any],
    accelerator: catalog.Accelerator,
    *,
    layers: int,
) -> StepCompile:
    """Compiles one training micro-step of `cfg` for the accelerator's TPU topology.

    Args:
        cfg: the run config (model dtype, data.max_seq_len, lora, train sections are used).
        hf_config: the base model's config.json (the catalog's 31B config for the real model).
        accelerator: the training slice (its topology and device count).
        layers: decoder layers to compile (the model's own count, or fewer for a slice).

    Raises:
        errors.UserError: no libtpu, bad mesh or tp for the model, or XLA could not fit the
            step into the chip's memory (the message carries XLA's own line).
    """
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model

    started = time.time()
    model_cfg = gemma4.tunix_config_from_hf(
        sliced_hf_config(hf_config, layers), dtype=cfg.model.dtype
    )
    gemma4.check_tp(model_cfg, cfg.train.mesh.tp)
    mesh = make_mesh(topology_devices(accelerator), cfg.train.mesh.fsdp, cfg.train.mesh.tp)
    if cfg.train.micro_batch % cfg.train.mesh.fsdp:
        raise errors.UserError(
            f"train.micro_batch={cfg.train.micro_batch} rows cannot split over "
            f"train.mesh.fsdp={cfg.train.mesh.fsdp}; use a multiple of it"
        )
    schedule = step_lib.learning_rate_schedule(cfg.train, total_steps=1000)

    with mesh, tpu_activation_sharding():

        def build() -> nnx.Module:
            base = gemma4_model.Gemma4(model_cfg, rngs=nnx.Rngs(params=0))
            return lora_lib.apply_lora(base, cfg.lora, mesh=mesh, seed=cfg.data.seed)

        model = nnx.eval_shape(build)
        gemma4.set_remat(model, cfg.train.remat)
        if cfg.train.attention == "kernel":
            packed_attention.use_kernel(model)
        _with_shardings(model, mesh)
        made: dict[str, Any] = {}

        def build_optimizer(m: nnx.Module) -> nnx.Module:
            made["trainer"] = step_lib.make_trainer(m, cfg.train, schedule, None)
            return made["trainer"].optimizer

        optimizer = nnx.eval_shape(build_optimizer, model)
        _with_shardings(optimizer, mesh)
        step = step_lib.TrainableOnlyStep(model, optimizer, made["trainer"].create_train_step_fn())
        with packed_attention.recording_costs() as kernels:
            lowered = step.lower(abstract_inputs(cfg, mesh))
        try:
            compiled = lowered.compile()
        except Exception as exc:  # XLA reports an over-full HBM as a compile error
            text = str(exc)
            if "RESOURCE_EXHAUSTED" in text or "memory" in text.lower():
                raise StepDoesNotFit(text.strip().splitlines()[0]) from None
            raise
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if memory is None or cost is None:
        raise errors.UserError(
            f"XLA gave no memory or cost analysis for {accelerator.name}; is libtpu the version "
            "the pinned jax expects? (pip install -e '.[compile]')"
        )
    # Under remat the backward pass runs each layer's forward again, its kernels included.
    forward_runs = 1 if cfg.train.remat in ("none", False) else 2
    kernel_flops = kernels.forward * forward_runs + kernels.backward
    kernel_seconds = kernel_flops / accelerator.peak_bf16_flops_per_chip
    return StepCompile(
        layers=layers,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)) + kernel_flops,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=float(cost.get("optimal_seconds", 0.0)) + kernel_seconds,
        compile_seconds=time.time() - started,
        kernel_flops=kernel_flops,
        kernel_seconds=kernel_seconds,
    )


class StepDoesNotFit(errors.UserError):
    """XLA refused to compile the step: it needs more HBM than the chip has."""


def libtpu_environment(accelerator: str) -> None:
    """What libtpu would otherwise look up on a TPU VM (and print a warning per miss), and no
    lock file: this process never touches a TPU, so several may compile at once."""
    for name, value in (
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", accelerator),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_WORKER_ID", "0"),
    ):
        os.environ.setdefault(name, value)
