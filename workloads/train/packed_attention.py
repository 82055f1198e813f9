"""Packed training rows through JAX's splash attention kernel (Pallas, TPU) instead of a dense mask.

Tunix's Gemma 4 attention takes packed rows only through its dense path: a `[rows, L, L]`
boolean mask, and `[rows, L, heads, L]` float32 scores in HBM per layer, in the forward pass and
again in the backward pass. Its own flash path takes no segment ids, so samples packed into one
row would see each other. Here the attention of each decoder layer is swapped (per instance, as
`model.set_remat` swaps the decoder layers) for a subclass that, while `packed_rows(segment_ids)`
is active, computes the projections exactly as tunix does and runs splash attention with segment
ids: causal within each sample on global layers, causal within each sample and the sliding window
on local layers, with the model's grouped KV heads (and k = v on global layers) as they are. The
kernel skips key blocks its mask rules out, so a sliding layer reads about window/L of the keys.

Anything else (decoding with a cache, one-token steps, no segment ids in context, a row length
no kernel block divides) goes to tunix's own code unchanged. Off TPU the trainer does not swap
at all: the dense-mask path is the reference the kernel is tested against (interpret mode).

XLA's cost analysis does not look inside a Pallas kernel, so each kernel call also records its
own FLOPs (the key blocks it visits, from the kernel's mask info) in `KernelCosts`, which the
deviceless compile check adds to XLA's figures.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax
    from flax import nnx

# Block matmuls per visited (query block, key block) pair and head, as the kernels run them
# (see `_record_costs`).
FORWARD_BLOCK_MATMULS = 2
BACKWARD_BLOCK_MATMULS = 5
# Largest first: fewer, longer kernel steps; the row length must be a multiple of the block.
BLOCK_SIZES = (512, 256, 128)

_SEGMENTS: contextvars.ContextVar[Any] = contextvars.ContextVar("packed_segments", default=None)
_COSTS: contextvars.ContextVar[KernelCosts | None] = contextvars.ContextVar(
    "kernel_costs", default=None
)


@dataclasses.dataclass
class KernelCosts:
    """FLOPs of the splash kernels traced into one step, per chip (one shard of heads and rows).

    forward: the forward kernels (q k^T and p v over the visited key blocks).
    backward: the fused backward kernel, 5 matmuls per visited block (see `_record_costs`).
    """

    forward: float = 0.0
    backward: float = 0.0


@contextlib.contextmanager
def packed_rows(segment_ids: jax.Array) -> Iterator[None]:
    """While active, swapped attention layers run the kernel with these [rows, L] segment ids
    (1..k per sample, 0 for padding)."""
    token = _SEGMENTS.set(segment_ids)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


@contextlib.contextmanager
def recording_costs() -> Iterator[KernelCosts]:
    """Collects the FLOPs of every kernel traced while active (the compile check's accounting)."""
    costs = KernelCosts()
    token = _COSTS.set(costs)
    try:
        yield costs
    finally:
        _COSTS.reset(token)


def use_kernel(model: nnx.Module, *, interpret: bool = False) -> int:
    """Swaps every Gemma 4 attention module of `model` for the packed-rows kernel version.

    Args:
        interpret: run the Pallas kernel in interpret mode (any backend; for the CPU tests).

    Returns:
        The number of attention modules swapped.
    """
    from tunix.models.gemma4 import model as gemma4_model

    kernel_class = _kernel_attention_class(interpret)
    swapped = 0
    for _, module in model.iter_modules():
        if isinstance(module, gemma4_model.Attention):
            module.__class__ = kernel_class
            swapped += 1
    return swapped


def block_size(length: int) -> int | None:
    """The kernel block for rows of `length` tokens; None: no block divides it (dense path)."""
    return next((b for b in BLOCK_SIZES if length % b == 0), None)


@functools.cache
def _kernel_attention_class(interpret: bool) -> type:
    from tunix.models.gemma4 import model as gemma4_model

    class PackedKernelAttention(gemma4_model.Attention):
        """tunix's Gemma 4 attention with packed rows through the splash kernel."""

        def block(
            self,
            x: Any,
            segment_pos: Any,
            cache: Any,
            attn_mask: Any,
            kv_shared_cache: Any = None,
        ) -> Any:
            segments = _SEGMENTS.get()
            length = x.shape[1]
            if (
                segments is None
                or cache is not None
                or kv_shared_cache is not None
                or length == 1
                or block_size(length) is None
            ):
                return super().block(x, segment_pos, cache, attn_mask, kv_shared_cache)
            query, key, value = _projections(self, x, segment_pos)
            window = (
                self.config.sliding_window_size
                if self.attn_type == gemma4_model.AttentionType.LOCAL_SLIDING
                else None
            )
            encoded = splash_attention(
                query,
                key,
                value,
                segments,
                window=window,
                act_btnh=self.config.shd_config.act_btnh,
                interpret=interpret,
            )
            out = self.attn_vec_einsum(encoded)
            out = gemma4_model.shard(out, self.config.shd_config.act_btd)
            return {"v": value, "k": key}, out, (key, value)

    return PackedKernelAttention


def _projections(attn: Any, x: jax.Array, segment_pos: jax.Array) -> tuple[Any, Any, Any]:
    """Queries, keys and values of tunix's Gemma 4 attention for a step without a KV cache:
    the same modules in the same order (LoRA sits inside the einsum modules), so the kernel path
    and tunix's dense path see identical q, k, v."""
    import jax
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gemma4_model

    x = x.astype(attn.config.dtype)
    act = attn.config.shd_config.act_btnh
    rope = {
        "base_frequency": attn.rope_base_frequency,
        "scale_factor": attn.rope_scale_factor,
        "rope_proportion": attn.rope_proportion,
    }
    query = gemma4_model.shard(attn.q_einsum(x), act)
    query = gemma4_model.apply_rope(attn._query_norm(query), segment_pos, **rope)
    if hasattr(attn, "k_einsum"):  # k = v: global layers of the larger models
        key = attn.k_einsum(x)
        value = key
    else:
        key, value = attn.kv_einsum(x)
    key = gemma4_model.shard(key, act)
    value = gemma4_model.shard(value, act)
    # Values are RMS-normalised without a learned scale; keys get their norm and rotary position.
    value = value * jax.lax.rsqrt(jnp.mean(jnp.square(value), axis=-1, keepdims=True) + 1e-06)
    key = gemma4_model.apply_rope(attn._key_norm(key), segment_pos, **rope)
    return query, key, value


def splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segment_ids: jax.Array,
    *,
    window: int | None,
    act_btnh: tuple[str | None, ...] = (None, None, None, None),
    interpret: bool = False,
) -> jax.Array:
    """Attention of packed rows: [B, T, N, H] queries over [B, T, K, H] keys and values (K
    divides N: grouped heads), causal within a segment, and within `window` tokens when given.

    Under a mesh (tunix's `with mesh:`), the kernel runs per shard of rows and heads as
    `act_btnh` shards them; the sequence is never split.
    """
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.interpreters import pxla
    from jax.sharding import PartitionSpec

    rows, length, heads, head_dim = query.shape
    block = block_size(length)
    if block is None:
        raise ValueError(f"row length {length} is not a multiple of any of {BLOCK_SIZES}")
    one: masks.Mask = (
        masks.CausalMask((length, length))
        if window is None
        else masks.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
    )
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        # dq inside the dk/dv kernel: each visited block's scores are computed once in the
        # backward pass (5 block matmuls, not 7; benchmarks/step_levers.py measured the change).
        use_fused_bwd_kernel=True,
    )
    mesh = pxla.thread_resources.env.physical_mesh
    b_axis, _, n_axis, _ = act_btnh

    def shards(axis: str | None) -> int:
        return int(mesh.shape[axis]) if not mesh.empty and axis in mesh.shape else 1

    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([one] * heads),
        block_sizes=sizes,
        head_shards=shards(n_axis),
        q_seq_shards=1,
        interpret=interpret,
    )
    _record_costs(one, rows // shards(b_axis), heads // shards(n_axis), head_dim, block)

    def run(kern: Any, q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        def one_row(q1: Any, k1: Any, v1: Any, s1: Any) -> Any:
            return kern(q1, k1, v1, segment_ids=splash.SegmentIds(q=s1, kv=s1))

        return jax.vmap(one_row)(q, k, v, seg)

    # The kernel's layout: heads before positions.
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (query, key, value))
    if mesh.empty:
        out = run(kernel, q, k, v, segment_ids)
    else:
        heads_spec = PartitionSpec(b_axis, n_axis, None, None)
        kernel_spec = kernel.manual_sharding_spec(
            jax.sharding.NamedSharding(mesh, PartitionSpec(n_axis, None))
        )
        out = jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(kernel_spec, heads_spec, heads_spec, heads_spec, PartitionSpec(b_axis)),
            out_specs=heads_spec,
            check_vma=False,
        )(kernel, q, k, v, segment_ids)
    return out.transpose(0, 2, 1, 3)


def _record_costs(mask: Any, rows: int, heads: int, head_dim: int, block: int) -> None:
    """Adds this call's kernel FLOPs (per chip) to the active `recording_costs`, if any.

    Forward: two matmuls (q k^T, p v) of block x block x head_dim per visited (query block, key
    block) pair and head. Backward: the kernel's fused backward (`use_fused_bwd_kernel`)
    recomputes the scores once per visited block and derives all three gradients from them:
    q k^T, dp = do v^T, dv = p^T do, dk = ds^T q and dq = ds k, five matmuls. (Its split
    backward, a dq kernel and a dk/dv kernel that each recompute the scores, runs seven.) A
    block is visited when the mask allows any entry of it, as the kernel decides from the same
    mask.
    """
    costs = _COSTS.get()
    if costs is None:
        return
    length = mask.shape[0]
    starts = range(0, length, block)
    visited = sum(bool(mask[q : q + block, k : k + block].any()) for q in starts for k in starts)
    per_block = 2 * block * block * head_dim
    per_chip = rows * heads * visited
    costs.forward += FORWARD_BLOCK_MATMULS * per_block * per_chip
    costs.backward += BACKWARD_BLOCK_MATMULS * per_block * per_chip
