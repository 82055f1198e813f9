"""Qwix LoRA on the tunix Gemma 4 model: targets, sharding that fits the mesh, LoRA dropout RNG.

Qwix derives each adapter's sharding from the weight it adapts (A takes the input dim's axis,
B the output dim's). On a mesh where such an axis does not divide the adapter's dim, placing the
weights (and the AdamW moments that copy their specs) would fail, so those axes are dropped to
replicated. Dropout draws from an RNG stream that is re-keyed from (seed, micro-step) before
every micro-step, so a resumed run sees the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from workloads.model import tracer_sharding

if TYPE_CHECKING:
    import jax
    from flax import nnx

    from workloads.contract import runconfig

DROPOUT_STREAM = "dropout"


def target_regex(targets: Iterable[str]) -> str:
    """The Qwix module-path regex of the given tunix module names (`layers/3/attn/q_einsum`).

    Names match whole path components, so `k_einsum` never matches `q_einsum` or `kv_einsum`.
    """
    names = "|".join(re.escape(t) for t in targets)
    return rf"(?:.*/)?(?:{names})"


def fit_spec(spec: Sequence[Any], shape: Sequence[int], mesh: jax.sharding.Mesh) -> tuple[Any, ...]:
    """A partition spec that `shape` can take on `mesh`: every mesh axis that is missing from the
    mesh or does not divide its dim is dropped (that dim is replicated instead)."""
    fitted = []
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        size = 1
        keep = []
        for axis in axes:
            if axis in mesh.shape and dim % (size * mesh.shape[axis]) == 0:
                keep.append(axis)
                size *= mesh.shape[axis]
        fitted.append(tuple(keep) if len(keep) > 1 else keep[0] if keep else None)
    return tuple(fitted)


def fix_lora_sharding(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Rewrites LoRA sharding specs that do not fit the mesh (see fit_spec) and places every
    LoRA weight on the mesh according to its spec; AdamW's moments inherit the specs."""
    import jax
    from flax import nnx

    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.LoRAParam):
            continue
        value = var.get_value()
        spec = fit_spec(tuple(var.get_metadata("out_sharding", None) or ()), value.shape, mesh)
        var.set_metadata(out_sharding=spec)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        var.set_value(jax.device_put(value, sharding))


def apply_lora(
    model: nnx.Module,
    lora: runconfig.LoraRunSection,
    *,
    mesh: jax.sharding.Mesh,
    seed: int,
) -> nnx.Module:
    """Adds LoRA adapters (rank, alpha, dropout, targets from the run config) to a loaded model.

    Returns:
        A new module (Qwix clones the model) whose adapters are `nnx.LoRAParam`s, placed on the
        mesh with specs that fit it, with a dropout RNG stream when lora.dropout > 0.
    """
    import jax
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    tracer_sharding.install()  # this process's traces of the model (see the module)
    provider = qwix.LoraProvider(
        module_path=target_regex(lora.targets),
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
    )
    # One eager forward pass creates the adapters; the batch must split over the fsdp axis.
    rows, length = mesh.shape["fsdp"], 8
    dummy = {
        "tokens": jnp.ones((rows, length), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
        "cache": None,
        "attention_mask": jnp.ones((rows, length, length), jnp.bool_),
    }

    def add_adapters(base: nnx.Module) -> nnx.Module:
        # The init pass uses a dropout stream too, if any; it is re-keyed before every step.
        return qwix.apply_lora_to_model(
            base, provider, **dummy, rngs=nnx.Rngs(params=seed, dropout=seed)
        )

    graphdef, base_state = nnx.split(model)

    def adapters(state: Any) -> Any:
        return nnx.state(add_adapters(nnx.merge(graphdef, state)), nnx.LoRAParam)

    with mesh:
        # The init pass is traced twice and never run op by op: once for the adapted model's
        # structure (shapes only), once compiled into one program that returns only the new
        # adapters. Run eagerly it compiled 216 one-op programs, each one persistent-cache
        # lookup too (an object read per program when the cache is in a bucket): a 4-device tiny
        # model loaded in 26.8 s on 2 cores without a cache, 8.5 s this way. A host of a slice
        # could not run it eagerly anyway (its arrays span other hosts' devices).
        # A plain jax.jit of the state, not nnx.jit of the module: nnx.jit returns the input
        # module's state too, so every base weight came back as a copy (a second copy of the
        # weights in HBM while it ran), placed as the compiler chose (a mesh axis of size 1
        # dropped from its spec), and the trainer's step then no longer matched the one
        # compile-ahead had compiled from the specs (a cache miss: the step compiled twice).
        # The adapted model holds the loaded arrays themselves.
        lora_model = nnx.eval_shape(add_adapters, model)
        nnx.update(lora_model, base_state, jax.jit(adapters)(base_state))
        fix_lora_sharding(lora_model, mesh)
    if lora.dropout > 0:
        # Qwix unsets the init RNGs; dropout needs a stream of its own on every module.
        lora_model.set_attributes(qwix_rngs=nnx.Rngs(dropout=seed))
    return lora_model


def seed_dropout(model: nnx.Module, seed: int, micro_step: int, mesh: jax.sharding.Mesh) -> None:
    """Re-keys the LoRA dropout stream to a function of (seed, micro_step) (no-op without dropout).

    The key and counter are placed replicated on the mesh, as the train step returns them, so
    the step's input shardings never change (a change would compile the step again).
    """
    import jax
    import jax.numpy as jnp

    rngs = _dropout_rngs(model)
    if rngs is None:
        return
    stream = getattr(rngs, DROPOUT_STREAM)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if jax.process_count() == 1:
        key = jax.random.fold_in(jax.random.key(seed), micro_step)
        stream.key.set_value(jax.device_put(key, replicated))
        stream.count.set_value(jax.device_put(jnp.zeros((), jnp.uint32), replicated))
        return
    # On a slice no host can place a value it computed alone on every host's devices: every
    # host computes the same key in one small compiled call whose output is replicated.
    key, count = _replicated_key(replicated)(seed, micro_step)
    stream.key.set_value(key)
    stream.count.set_value(count)


@functools.cache
def _replicated_key(replicated: jax.sharding.NamedSharding) -> Callable[[int, int], Any]:
    import jax
    import jax.numpy as jnp

    def make(seed: Any, micro_step: Any) -> Any:
        key = jax.random.fold_in(jax.random.key(seed), micro_step)
        return key, jnp.zeros((), jnp.uint32)

    return jax.jit(make, out_shardings=(replicated, replicated))


def _dropout_rngs(model: nnx.Module) -> nnx.Rngs | None:
    from flax import nnx

    rngs = getattr(model, "qwix_rngs", None)
    if isinstance(rngs, nnx.Rngs) and DROPOUT_STREAM in rngs:
        return rngs
    return None


def lora_state(model: nnx.Module) -> nnx.State:
    """The adapters only: what training optimises and what the checkpoints hold."""
    from flax import nnx

    return nnx.state(model, nnx.LoRAParam)
