"""`make-tiny-model`: a random Gemma 4 checkpoint in the real HF layout, small enough for a CPU.

It has the structure of gemma-4-31B (workloads.contract.catalog) at toy size: 5 sliding-window
layers then 1 global layer, k_eq_v on the global layers (one K projection, no v_proj), grouped KV
heads (8 query heads, 4 KV heads, 2 global KV heads), a larger global head size, and a sliding
window of 16 tokens so test sequences cross it. Weights are `model.language_model.*` tensors split
over a few safetensors shards with an index, as in the real checkpoint; config.json describes a
`Gemma4ForConditionalGeneration` that both tunix (via workloads.model.gemma4) and HF transformers
load.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from workloads.common import errors, storage
from workloads.contract import catalog

# Toy sizes with 31B's ratios where they matter (GQA groups, global head size = 2 x head size).
# Head sizes 32 and 64: the smallest vLLM's CPU attention takes (its kernels support 32, 64, 80,
# 96, 112, 128, 160, 192, 224, 256 and 512; 16 fails with "Unsupported CPU attention
# configuration"), so the demo's real vLLM server can load this model.
HIDDEN = 96
INTERMEDIATE = 192
HEADS = 8
KV_HEADS = 4
GLOBAL_KV_HEADS = 2
# The multi-host rehearsal's variant: tp=4 (the v5p-16 and v5p-32 mesh shapes) shards every head
# count, so the global layers need 4 KV heads there.
TP4_GLOBAL_KV_HEADS = 4
HEAD_DIM = 32
GLOBAL_HEAD_DIM = 64
SLIDING_WINDOW = 16
GLOBAL_EVERY = 6
# Gemma 4's RoPE (HF `rope_parameters`): full rotation on sliding layers, a quarter of the
# (proportional) frequencies on global layers.
ROPE_PARAMETERS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
    },
}


def _layer_types(layers: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(layers)
    ]


def catalog_hf_config(spec: catalog.ModelSpec) -> dict[str, Any]:
    """config.json of a catalog model (Gemma 4 31B: the shape facts of google/gemma-4-31B-it),
    text part only; for the 31B mapping tests and the merge benchmark's synthetic checkpoint."""
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {
            "model_type": "gemma4_text",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.embed_dim,
            "intermediate_size": spec.mlp_dim,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "num_global_key_value_heads": spec.num_global_kv_heads,
            "head_dim": spec.head_dim,
            "global_head_dim": spec.global_head_dim,
            "attention_k_eq_v": True,
            "sliding_window": spec.sliding_window,
            "layer_types": _layer_types(spec.layers),
            "rope_parameters": ROPE_PARAMETERS,
            "final_logit_softcapping": 30.0,
            "hidden_size_per_layer_input": 0,
        },
    }


def _special_ids(out_dir: pathlib.Path) -> dict[str, Any]:
    """Ids of bos/eos/pad and of the tokens generation stops on, from the tokenizer just written."""
    from workloads.data import tokenizer

    added = {
        t["content"]: t["id"]
        for t in json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    ids: dict[str, Any] = {}
    for name in ("bos", "eos", "pad"):
        token = next(
            (t for t, n in tokenizer.GEMMA4_SPECIAL_TOKENS.items() if n == f"{name}_token"), None
        )
        if token not in added:
            raise errors.UserError(f"{out_dir}: the tokenizer has no {name} token")
        ids[name] = added[token]
    ids["stop"] = [added[t] for t in tokenizer.STOP_TOKENS if t in added]
    return ids


def hf_config(
    vocab_size: int,
    layers: int,
    dtype: str,
    ids: dict[str, Any],
    global_kv_heads: int = GLOBAL_KV_HEADS,
) -> dict[str, Any]:
    """config.json of the tiny model (Gemma4ForConditionalGeneration, text only)."""
    text = {
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_global_key_value_heads": global_kv_heads,
        "head_dim": HEAD_DIM,
        "global_head_dim": GLOBAL_HEAD_DIM,
        "attention_k_eq_v": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": _layer_types(layers),
        "rope_parameters": ROPE_PARAMETERS,
        # HF's defaults differ from Gemma 4 31B's config.json for these two.
        "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "dtype": dtype,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": None,
        "audio_config": None,
        "tie_word_embeddings": True,
        "dtype": dtype,
    }


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """HF-layout tensors (out, in) with `model.language_model.` keys, float32 numpy."""
    import numpy as np

    text = cfg["text_config"]
    rng = np.random.default_rng(seed)
    d, f = text["hidden_size"], text["intermediate_size"]

    def dense(out: int, inp: int) -> Any:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> Any:
        # Not exactly ones, so a norm that is mapped to the wrong place changes the logits.
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    p = "model.language_model."
    w = {
        f"{p}embed_tokens.weight": (0.1 * rng.standard_normal((text["vocab_size"], d))).astype(
            np.float32
        ),
        f"{p}norm.weight": norm(d),
    }
    for i, kind in enumerate(text["layer_types"]):
        glob = kind == "full_attention"
        h = text["global_head_dim"] if glob else text["head_dim"]
        k = text["num_global_key_value_heads"] if glob else text["num_key_value_heads"]
        n = text["num_attention_heads"]
        layer = f"{p}layers.{i}."
        w[f"{layer}self_attn.q_proj.weight"] = dense(n * h, d)
        w[f"{layer}self_attn.k_proj.weight"] = dense(k * h, d)
        if not (glob and text["attention_k_eq_v"]):
            w[f"{layer}self_attn.v_proj.weight"] = dense(k * h, d)
        w[f"{layer}self_attn.o_proj.weight"] = dense(d, n * h)
        w[f"{layer}self_attn.q_norm.weight"] = norm(h)
        w[f"{layer}self_attn.k_norm.weight"] = norm(h)
        w[f"{layer}mlp.gate_proj.weight"] = dense(f, d)
        w[f"{layer}mlp.up_proj.weight"] = dense(f, d)
        w[f"{layer}mlp.down_proj.weight"] = dense(d, f)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            w[f"{layer}{name}.weight"] = norm(d)
        w[f"{layer}layer_scalar"] = np.ones((1,), np.float32)
    return w


def write_shards(out_dir: pathlib.Path, tensors: dict[str, Any], shards: int) -> list[str]:
    """Writes `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` (one file:
    `model.safetensors`, no index). Returns the file names."""
    import safetensors.numpy

    names = sorted(tensors)
    if shards <= 1:
        safetensors.numpy.save_file(
            {k: tensors[k] for k in names},
            str(out_dir / "model.safetensors"),
            metadata={"format": "pt"},
        )
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        # Even split: no file is empty while shards <= tensors.
        part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        safetensors.numpy.save_file(
            {k: tensors[k] for k in part}, str(out_dir / file), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, file))
        files.append(file)
    total = sum(int(t.nbytes) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def write_tiny_model(
    out_dir: str | pathlib.Path,
    *,
    seed: int = 0,
    layers: int = 6,
    dtype: str = "float32",
    shards: int = 2,
    global_kv_heads: int = GLOBAL_KV_HEADS,
) -> pathlib.Path:
    """Writes a random tiny Gemma 4 checkpoint (config, generation config, weights, tokenizer).

    Args:
        out_dir: directory to create; in an existing one the checkpoint's own files are replaced.
        seed: seed of the random weights (same seed, same bytes).
        layers: decoder layers, a positive multiple of 6 (HF forces the last layer global).
        dtype: "float32" (exact tests) or "bfloat16" (like the real checkpoint).
        shards: number of safetensors files (1: a single model.safetensors, no index).
        global_kv_heads: KV heads of the global layers, a divisor of the 8 query heads; tensor
            parallelism must divide it, so the v5p-16/32 mesh shape (tp=4) needs 4
            (TP4_GLOBAL_KV_HEADS) where the default keeps 31B's ratio.

    Returns:
        The output directory.

    Raises:
        errors.UserError: on a bad layer count, dtype or shard count.
    """
    import ml_dtypes

    from workloads.data import tokenizer

    if layers <= 0 or layers % GLOBAL_EVERY:
        raise errors.UserError(
            f"--layers {layers}: must be a positive multiple of {GLOBAL_EVERY} "
            "(5 sliding layers then 1 global; HF forces the last layer global)"
        )
    if dtype not in ("float32", "bfloat16"):
        raise errors.UserError(f"--dtype {dtype}: must be float32 or bfloat16")
    if shards < 1:
        raise errors.UserError(f"--shards {shards}: must be at least 1")
    if global_kv_heads < 1 or HEADS % global_kv_heads:
        raise errors.UserError(
            f"global_kv_heads={global_kv_heads}: must divide the {HEADS} query heads (1, 2, 4, 8)"
        )
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = tokenizer.write_tokenizer_files(out)
    ids = _special_ids(out)
    cfg = hf_config(vocab_size, layers, dtype, ids, global_kv_heads)
    tensors = random_weights(cfg, seed)
    if shards > len(tensors):
        raise errors.UserError(f"--shards {shards}: more than the {len(tensors)} tensors")
    if dtype == "bfloat16":
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    # Weights of an earlier write with another shard count would be loaded too (tunix reads
    # every *.safetensors): replace them all.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    write_shards(out, tensors, shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["stop"],
        "pad_token_id": ids["pad"],
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 64,
        "top_p": 0.95,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "out_dir", type=storage.absolute, help="directory to write the checkpoint into"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers, a multiple of 6")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weight dtype",
    )
    parser.add_argument("--shards", type=int, default=2, help="safetensors files")


def main(args: argparse.Namespace) -> int:
    out = write_tiny_model(
        args.out_dir, seed=args.seed, layers=args.layers, dtype=args.dtype, shards=args.shards
    )
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote tiny Gemma 4 ({args.layers} layers, {args.dtype}) to {out}: {', '.join(files)}")
    return 0
