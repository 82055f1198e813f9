"""The Gemma 4 base model on JAX: HF config.json -> tunix ModelConfig, the device mesh, loading.

Tunix's safetensors loader reads only the weights, so the architecture comes from the checkpoint's
own config.json (the `text_config` of a `Gemma4ForConditionalGeneration` checkpoint). MERGE loads
merged checkpoints through the same functions, so training and verification see one model.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import struct
from typing import TYPE_CHECKING, Any

from workloads.common import errors, storage

if TYPE_CHECKING:  # heavy imports stay inside the functions
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model

CONFIG_FILE = "config.json"
HF_PREFIX = "model.language_model."
MESH_AXES = ("fsdp", "tp")
DTYPES = ("bfloat16", "float32")
REMAT_POLICIES = ("full", "dots", "none")

# HF config keys of features this project does not train (the E-series and the MoE model), with
# the value that means "off". A checkpoint that turns one on is refused with a clear message.
_UNSUPPORTED = {
    "enable_moe_block": False,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
    "attention_bias": False,
}


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text part of an HF Gemma 4 config (the top level for a text-only `gemma4_text` one)."""
    inner = hf_config.get("text_config")
    return dict(inner) if isinstance(inner, dict) else dict(hf_config)


def read_hf_config(model_dir: str | pathlib.Path) -> dict[str, Any]:
    """Reads `config.json` of a local or gs:// model directory.

    Raises:
        errors.UserError: the file is missing or not JSON.
    """
    path = f"{str(model_dir).rstrip('/')}/{CONFIG_FILE}"
    try:
        return json.loads(storage.read_text(path))
    except json.JSONDecodeError as exc:
        raise errors.UserError(f"{path}: not valid JSON: {exc}") from None


def tunix_config_from_hf(
    hf_config: dict[str, Any], *, dtype: str = "float32"
) -> gemma4_model.ModelConfig:
    """Builds the tunix ModelConfig of a dense Gemma 4 text model from its HF config.json.

    Args:
        hf_config: the parsed config.json (top level with `text_config`, or a text config).
        dtype: parameter and activation dtype, "bfloat16" or "float32".

    Raises:
        errors.UserError: a required key is missing or the checkpoint uses a feature (MoE,
            per-layer inputs, shared KV layers) that this project does not train.
    """
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gemma4_model

    text = text_config(hf_config)
    for key, off in _UNSUPPORTED.items():
        if text.get(key, off) not in (off, None):
            raise errors.UserError(
                f"config.json: text_config.{key}={text[key]!r} is not supported (only dense "
                f"Gemma 4 text models like gemma-4-31B; expected {off!r})"
            )
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    )
    missing = [k for k in required if k not in text]
    if missing:
        raise errors.UserError(f"config.json: text_config lacks {', '.join(missing)}")
    if dtype not in DTYPES:
        raise errors.UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")

    layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)
    ]
    if len(layer_types) != layers:
        raise errors.UserError(
            f"config.json: text_config.layer_types has {len(layer_types)} entries "
            f"for {layers} layers"
        )
    kinds = {
        "sliding_attention": gemma4_model.AttentionType.LOCAL_SLIDING,
        "full_attention": gemma4_model.AttentionType.GLOBAL,
    }
    unknown = sorted({t for t in layer_types if t not in kinds})
    if unknown:
        raise errors.UserError(
            f"config.json: unknown layer_types {unknown}; allowed: {', '.join(kinds)}"
        )

    rope = text.get("rope_parameters") or {}
    local_rope = rope.get("sliding_attention", {})
    global_rope = rope.get("full_attention", {})
    jdtype = jnp.dtype(dtype)
    return gemma4_model.ModelConfig(
        num_layers=layers,
        num_embed=int(text["vocab_size"]),
        embed_dim=int(text["hidden_size"]),
        hidden_dim=int(text["intermediate_size"]),
        num_heads=int(text["num_attention_heads"]),
        head_dim=int(text["head_dim"]),
        num_kv_heads=int(text["num_key_value_heads"]),
        num_global_kv_heads=text.get("num_global_key_value_heads"),
        global_key_size=int(text.get("global_head_dim") or text["head_dim"]),
        k_eq_v_global=bool(text.get("attention_k_eq_v", False)),
        sliding_window_size=text.get("sliding_window"),
        final_logit_softcap=text.get("final_logit_softcapping"),
        attention_pattern=tuple(kinds[t] for t in layer_types),
        local_base_frequency=int(local_rope.get("rope_theta", 10_000)),
        global_base_frequency=int(global_rope.get("rope_theta", 1_000_000)),
        local_rope_proportion=float(local_rope.get("partial_rotary_factor", 1.0)),
        global_rope_proportion=float(global_rope.get("partial_rotary_factor", 0.25)),
        param_dtype=jdtype,
        dtype=jdtype,
    )


def head_counts(cfg: gemma4_model.ModelConfig) -> dict[str, int]:
    """Every head count a tensor-parallel axis shards, by name."""
    counts = {"query heads": cfg.num_heads, "KV heads": cfg.num_kv_heads}
    if cfg.num_global_kv_heads is not None:
        counts["global KV heads"] = cfg.num_global_kv_heads
    return counts


def check_tp(cfg: gemma4_model.ModelConfig, tp: int) -> None:
    """Tensor parallelism shards heads: tp must divide every head count.

    Raises:
        errors.UserError: naming the head count tp does not divide.
    """
    bad = [f"{name} ({n})" for name, n in head_counts(cfg).items() if n % tp]
    if bad:
        allowed = [
            d
            for d in range(1, cfg.num_heads + 1)
            if all(n % d == 0 for n in head_counts(cfg).values())
        ]
        raise errors.UserError(
            f"train.mesh.tp={tp} does not divide the model's {', '.join(bad)}; "
            f"allowed tp: {', '.join(map(str, allowed))}"
        )


def make_mesh(fsdp: int, tp: int) -> jax.sharding.Mesh:
    """The (fsdp, tp) training mesh over all devices, with Auto axes (what tunix expects).

    Raises:
        errors.UserError: fsdp * tp is not the number of devices.
    """
    import jax

    devices = jax.device_count()
    if fsdp * tp != devices:
        raise errors.UserError(
            f"train.mesh fsdp={fsdp} x tp={tp} = {fsdp * tp} does not match the {devices} "
            f"available {jax.devices()[0].platform.upper()} device(s); "
            f"fsdp * tp must equal {devices}"
        )
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((fsdp, tp), MESH_AXES, axis_types=(auto, auto))


def _safetensors_keys(model_dir: pathlib.Path) -> list[str]:
    """Tensor names of every *.safetensors file, read from the headers only."""
    keys: list[str] = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        keys.extend(k for k in header if k != "__metadata__")
    return keys


def _check_layout(model_dir: pathlib.Path, cfg: gemma4_model.ModelConfig) -> None:
    """Fails early, in one line, on a directory tunix would load into garbage or crash on."""
    keys = set(_safetensors_keys(model_dir))
    if not keys:
        raise errors.UserError(f"{model_dir}: no *.safetensors files")
    expected = [f"{HF_PREFIX}embed_tokens.weight", f"{HF_PREFIX}norm.weight"] + [
        f"{HF_PREFIX}layers.{i}.self_attn.q_proj.weight" for i in range(cfg.num_layers)
    ]
    missing = [k for k in expected if k not in keys]
    if missing:
        raise errors.UserError(
            f"{model_dir}: safetensors lack {missing[0]} (and {len(missing) - 1} more); the loader "
            f"needs the Gemma4ForConditionalGeneration layout with keys under '{HF_PREFIX}'"
        )


def stage(model_dir: str, stage_dir: str) -> pathlib.Path:
    """A local copy of the model: a gs:// directory is copied once into stage_dir and reused."""
    if not storage.is_remote(model_dir):
        if not pathlib.Path(model_dir).is_dir():
            raise errors.UserError(f"{model_dir}: model directory not found")
        return pathlib.Path(model_dir)
    print(f"staging {model_dir} -> {stage_dir} (files already there are reused)", flush=True)
    return pathlib.Path(storage.stage_directory(model_dir, stage_dir))


def load_model(
    model_dir: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None,
    dtype: str = "float32",
) -> gemma4_model.Gemma4:
    """Loads a Gemma 4 text model from a local HF safetensors directory.

    Args:
        model_dir: local directory with config.json and `model.language_model.*` safetensors.
        mesh: the mesh the weights are sharded over (None: the first device).
        dtype: "bfloat16" or "float32" (parameters and activations).

    Returns:
        The tunix `Gemma4` nnx module; its `.config` is the tunix ModelConfig.

    Raises:
        errors.UserError: a missing directory, config or unexpected layout.
    """
    import jax.numpy as jnp
    from tunix.models.gemma4 import params_safetensors

    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise errors.UserError(f"{model_dir}: model directory not found")
    cfg = tunix_config_from_hf(read_hf_config(str(model_dir)), dtype=dtype)
    _check_layout(model_dir, cfg)
    # One dtype per file is what tunix's fast loader needs; it casts to `dtype` on load.
    return params_safetensors.create_model_from_safe_tensors(
        str(model_dir), cfg, mesh, jnp.dtype(dtype)
    )


def set_remat(model: nnx.Module, policy: str | bool) -> None:
    """Sets what the backward pass recomputes of each decoder layer (runconfig.RematPolicy):
    "full" (tunix's per-decoder-layer remat), "dots" (remat with JAX's policy that saves the
    outputs of matmuls without batch dimensions, i.e. the weight matmuls, and recomputes the
    attention scores, norms and activation functions) or "none". Set it after adding LoRA:
    Qwix creates the adapters in an eager forward pass, which cannot create parameters inside
    `nnx.remat`.

    Raises:
        errors.UserError: an unknown policy.
    """
    from tunix.models.gemma4 import model as gemma4_model

    if isinstance(policy, bool):
        policy = "full" if policy else "none"
    if policy not in REMAT_POLICIES:
        raise errors.UserError(f"train.remat={policy!r} is not one of {', '.join(REMAT_POLICIES)}")
    mode = gemma4_model.RematConfig.DECODER if policy == "full" else gemma4_model.RematConfig.NONE
    layer_class = _dots_remat_layer() if policy == "dots" else gemma4_model.DecoderLayer
    for _, module in model.iter_modules():
        config = getattr(module, "config", None)
        if isinstance(config, gemma4_model.ModelConfig):
            config.remat_config = mode
        if isinstance(module, gemma4_model.DecoderLayer):
            module.__class__ = layer_class


@functools.cache
def _dots_remat_layer() -> type:
    """tunix's DecoderLayer whose call is rematerialised with the save-the-weight-matmuls
    policy (tunix's own remat switch takes no policy)."""
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model

    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    class DotsRematDecoderLayer(gemma4_model.DecoderLayer):
        def __call__(
            self,
            x: Any,
            segment_pos: Any,
            cache: Any,
            attn_mask: Any,
            per_layer_input: Any = None,
            kv_shared_cache: Any = None,
        ) -> Any:
            block = nnx.remat(gemma4_model.DecoderLayer.block, policy=policy, graph_updates=False)
            return block(self, x, segment_pos, cache, attn_mask, per_layer_input, kv_shared_cache)

    return DotsRematDecoderLayer


def parameter_count(model: nnx.Module) -> int:
    """Number of scalar parameters (base weights plus LoRA weights, if any)."""
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def set_compilation_cache(path: str | None) -> None:
    """Turns on JAX's persistent compilation cache at `path` (local or gs://); None: off."""
    if not path:
        return
    import jax

    if not storage.is_remote(path):
        os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
