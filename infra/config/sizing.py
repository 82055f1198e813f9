"""Memory estimates of a stack: HBM per chip of a training step and of vLLM, /dev/shm per host.

Deliberately simple sums, each documented next to the numbers it uses, and on the safe side:
infra/config/validation.py refuses a stack whose estimate exceeds the catalog's capacity, and the
deviceless compile check (infra/preflight/compile_check.py) gives XLA's own figure for the training
step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from infra.config import model as config_mod
from workloads.contract import catalog, settings
from workloads.train import vocab_loss

StackConfig = config_mod.StackConfig
GB = catalog.GB
GIB = catalog.GIB

LORA_STATE_BYTES_PER_PARAM = 16  # f32 param + f32 grad + two f32 AdamW moments
XLA_RESERVE_BYTES = 1 * GIB  # runtime and XLA scratch per device
ESTIMATE_MARGIN = 1.10  # fragmentation and temporaries the simple sum does not see
# Without remat a layer keeps several activation tensors of [T, D] instead of 1: XLA's compile of
# the 31B step with no remat (README, Benchmarks) keeps about 6.5 per row and layer; 7 is on the
# safe side of it.
NO_REMAT_FACTOR = 7
VLLM_ACTIVATION_RESERVE_BYTES = 2 * GIB  # vLLM's profiled peak activations per chip


def lora_param_count(model: catalog.ModelSpec, rank: int, targets: Iterable[str]) -> int:
    """LoRA parameters: r * (fan_in + fan_out) per adapted matrix (A is in x r, B is r x out)."""
    d, f, n, h = model.embed_dim, model.mlp_dim, model.num_heads, model.head_dim
    per_module = {
        "q_einsum": (model.layers, d + n * h),
        "kv_einsum": (model.local_layers, d + 2 * model.num_kv_heads * h),
        "k_einsum": (model.global_layers, d + model.num_global_kv_heads * model.global_head_dim),
        "attn_vec_einsum": (model.layers, n * h + d),
        "gate_proj": (model.layers, d + f),
        "up_proj": (model.layers, d + f),
        "down_proj": (model.layers, f + d),
    }
    return sum(layers * rank * fan for t, (layers, fan) in per_module.items() if t in set(targets))


def training_hbm_bytes(cfg: StackConfig) -> int:
    """Estimated HBM per JAX device of one training step (a deliberate over-estimate).

    weights / (fsdp * tp)                             bf16 base weights, sharded over the mesh
    + LoRA params * 16 B                              param, grad, 2 AdamW moments (replicated)
    + rows * T * D * 2 B * layers                     layer inputs kept by per-layer remat
    + rows * (N / tp) * T * T * 4 B                   one layer's f32 attention scores (dense
                                                      attention only: the kernel keeps none)
    + rows * T * (F / tp) * 2 B * 3                   one layer's MLP activations
    + rows * C * V * 4 B * 2                          f32 logits and their gradient, for one
                                                      chunk of C positions (the loss computes
                                                      the vocabulary C positions at a time)
    times 1.10, plus 1 GiB of runtime reserve. rows = microBatch / fsdp.
    """
    model = cfg.model_spec
    if model is None:
        return 0
    mesh = cfg.training.mesh
    devices = max(1, mesh.fsdp * mesh.tp)
    rows = max(1, math.ceil(cfg.training.micro_batch / max(1, mesh.fsdp)))
    t = max(0, cfg.data.max_seq_len)
    weights = model.weight_bytes / devices
    lora = (
        lora_param_count(model, max(0, cfg.lora.rank), cfg.lora.targets)
        * LORA_STATE_BYTES_PER_PARAM
    )
    saved = rows * t * model.embed_dim * 2 * model.layers
    if cfg.training.remat != "full":  # "dots" keeps most of what "none" keeps
        saved *= NO_REMAT_FACTOR
    attention = rows * (model.num_heads / mesh.tp) * t * t * 4
    if cfg.training.attention == "kernel":
        attention = 0
    mlp = rows * t * (model.mlp_dim / mesh.tp) * 2 * 3
    logits = rows * min(t, vocab_loss.CHUNK_POSITIONS) * model.vocab_size * 4 * 2
    return int(
        (weights + lora + saved + attention + mlp + logits) * ESTIMATE_MARGIN + XLA_RESERVE_BYTES
    )


def serving_kv_bytes_per_token_per_chip(
    model: catalog.ModelSpec, tp: int, dtype_bytes: int = 2
) -> int:
    """KV cache bytes one token needs on one chip: each chip holds ceil(kv_heads / tp) heads
    (vLLM replicates KV heads when tp exceeds them); K and V both stored, `dtype_bytes` per value
    (2 for bf16, 1 for an fp8 KV cache)."""
    local = model.local_layers * 2 * math.ceil(model.num_kv_heads / tp) * model.head_dim
    glob = (
        model.global_layers * 2 * math.ceil(model.num_global_kv_heads / tp) * model.global_head_dim
    )
    return (local + glob) * dtype_bytes


def serving_weight_bytes_per_chip(model: catalog.ModelSpec, tp: int, quantization: str) -> int:
    """Served weights on one chip of a replica: the checkpoint / tp at the quantization's bytes
    per weight. The token embedding stays at bf16 in the sum (on the safe side: the Qwix rule
    may or may not reach it), everything else is scaled from the bf16 checkpoint size."""
    embedding = model.vocab_size * model.embed_dim * 2
    scale = settings.WEIGHT_QUANTIZATION_BYTES[quantization] / 2
    return int((embedding + (model.weight_bytes - embedding) * scale) / max(1, tp))


def serving_hbm_bytes(cfg: StackConfig) -> int:
    """Estimated HBM per chip for vLLM, the same on every chip of every replica:

    weights / tp at weightQuantization's bytes      (serving_weight_bytes_per_chip)
    + KV cache of minConcurrentSequences x maxModelLen tokens at kvCacheDtype's bytes, per
      replica (each replica holds its own sequences' cache on its own tp chips)
    + 2 GiB of activations.
    The compiled programs load outside this budget, in the (1 - hbmUtilization) rest of the chip
    (settings.MAX_HBM_UTILIZATION bounds it)."""
    model = cfg.model_spec
    tp = max(1, cfg.serving.tensor_parallel_size)
    if model is None:
        return 0
    kv = (
        serving_kv_bytes_per_token_per_chip(
            model, tp, settings.KV_CACHE_DTYPE_BYTES[cfg.serving.kv_cache_dtype]
        )
        * cfg.serving.max_model_len
        * cfg.serving.min_concurrent_sequences
    )
    weights = serving_weight_bytes_per_chip(model, tp, cfg.serving.weight_quantization)
    return int(weights + kv + VLLM_ACTIVATION_RESERVE_BYTES)


def serving_kv_tokens_per_replica(cfg: StackConfig, hbm_bytes_per_chip: int) -> int:
    """Tokens of KV cache one replica holds once weights and activations are placed in its
    chips' hbmUtilization share (what the batch can grow into); 0 when nothing is left."""
    model = cfg.model_spec
    if model is None:
        return 0
    tp = max(1, cfg.serving.tensor_parallel_size)
    budget = hbm_bytes_per_chip * cfg.serving.hbm_utilization
    fixed = (
        serving_weight_bytes_per_chip(model, tp, cfg.serving.weight_quantization)
        + VLLM_ACTIVATION_RESERVE_BYTES
    )
    per_token = serving_kv_bytes_per_token_per_chip(
        model, tp, settings.KV_CACHE_DTYPE_BYTES[cfg.serving.kv_cache_dtype]
    )
    return max(0, int((budget - fixed) // per_token))


def training_shm_bytes(cfg: StackConfig) -> int:
    """/dev/shm of one training host: staged base weights, the merged shards (written there before
    upload when merge is on) and the configured working set."""
    model = cfg.model_spec
    if model is None:
        return 0
    merged = model.weight_bytes if cfg.merge.enabled else 0
    return int(model.weight_bytes + merged + cfg.training.shm_working_set_gb * GB)


def serving_shm_bytes(cfg: StackConfig) -> int:
    """/dev/shm of the serving host: staged merged weights and the working set (XLA cache)."""
    model = cfg.model_spec
    if model is None:
        return 0
    return int(model.weight_bytes + cfg.serving.shm_working_set_gb * GB)
