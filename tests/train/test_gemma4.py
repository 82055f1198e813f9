"""workloads.model.gemma4 and workloads.model.lora: HF config -> tunix config, mesh checks, LoRA
specs."""

from __future__ import annotations

import json

import pytest

from workloads.common import errors
from workloads.contract import catalog
from workloads.model import tiny_model


def gemma4_31b_hf_config() -> dict:
    """The text_config facts of google/gemma-4-31B-it (workloads.contract.catalog)."""
    return tiny_model.catalog_hf_config(catalog.model("gemma-4-31b"))


def test_31b_config_maps_to_tunix_gemma4_31b():
    from tunix.models.gemma4 import model as gemma4

    from workloads.model import gemma4 as model

    ours = model.tunix_config_from_hf(gemma4_31b_hf_config(), dtype="bfloat16")
    theirs = gemma4.ModelConfig.gemma4_31b()
    for field in (
        "num_layers",
        "num_embed",
        "embed_dim",
        "hidden_dim",
        "num_heads",
        "head_dim",
        "num_kv_heads",
        "num_global_kv_heads",
        "global_key_size",
        "k_eq_v_global",
        "sliding_window_size",
        "final_logit_softcap",
        "per_layer_input_dim",
        "frac_shared_layers",
        "local_base_frequency",
        "global_base_frequency",
        "global_rope_proportion",
        "local_rope_proportion",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field
    pattern = theirs.attention_pattern
    assert ours.attention_pattern == tuple(pattern[i % len(pattern)] for i in range(60))
    model.check_tp(ours, 4)
    with pytest.raises(
        errors.UserError, match=r"tp=8 does not divide the model's global KV heads \(4\)"
    ):
        model.check_tp(ours, 8)


def test_moe_checkpoint_is_refused():
    from workloads.model import gemma4 as model

    hf = gemma4_31b_hf_config()
    hf["text_config"]["enable_moe_block"] = True
    with pytest.raises(errors.UserError, match="enable_moe_block=True is not supported"):
        model.tunix_config_from_hf(hf)


def test_wrong_key_prefix_is_refused(tiny_model_dir, tmp_path):
    import safetensors.numpy

    from workloads.model import gemma4 as model

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    tensors = {}
    for file in sorted(tiny_model_dir.glob("*.safetensors")):
        for key, value in safetensors.numpy.load_file(file).items():
            tensors[key.replace("model.language_model.", "model.")] = value
    safetensors.numpy.save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(errors.UserError, match=r"keys under 'model\.language_model\.'"):
        model.load_model(bad, mesh=None, dtype="float32")


def test_fit_spec_drops_axes_that_do_not_divide():
    import jax

    from workloads.model import gemma4 as model
    from workloads.model import lora

    mesh = model.make_mesh(1, 2)
    assert lora.fit_spec(("fsdp", None), (64, 4), mesh) == ("fsdp", None)
    assert lora.fit_spec((None, "tp"), (4, 3), mesh) == (None, None)  # 3 heads over tp=2
    assert lora.fit_spec(("tp",), (8, 16), mesh) == ("tp", None)
    assert lora.fit_spec((("fsdp", "tp"),), (6,), mesh) == (("fsdp", "tp"),)
    assert lora.fit_spec(("nope",), (6,), mesh) == (None,)
    del jax


def test_target_regex_matches_whole_module_names():
    import re

    from workloads.model import lora

    regex = lora.target_regex(["k_einsum", "gate_proj"])
    assert re.fullmatch(regex, "layers/5/attn/k_einsum")
    assert re.fullmatch(regex, "layers/0/mlp/gate_proj")
    assert not re.fullmatch(regex, "layers/0/attn/kv_einsum")
    assert not re.fullmatch(regex, "layers/0/attn/q_einsum")


def test_lora_on_a_tp_mesh_shards_heads_and_fits(tiny_model_dir):
    from flax import nnx

    from workloads.contract import runconfig
    from workloads.model import gemma4 as model
    from workloads.model import lora

    mesh = model.make_mesh(1, 2)
    with mesh:
        base = model.load_model(tiny_model_dir, mesh=mesh, dtype="float32")
    settings = runconfig.LoraRunSection(
        rank=4, alpha=8.0, dropout=0.0, targets=runconfig.ALL_LORA_TARGETS
    )
    lora_model = lora.apply_lora(base, settings, mesh=mesh, seed=0)
    specs = {}
    for path, var in nnx.iter_graph(lora_model):
        if isinstance(var, nnx.LoRAParam):
            specs["/".join(map(str, path))] = tuple(var.get_value().sharding.spec)
    assert len(specs) == 6 * 7 * 2 - 2 * 5 - 2  # kv on 5 sliding layers, k on the global one
    assert specs["layers/0/attn/kv_einsum/w_lora_b"] == (None, None, "tp", None)  # (r, 2, K, H)
    assert specs["layers/5/attn/k_einsum/w_lora_b"] == (None, "tp", None)  # (r, Kg, Hg)
    assert specs["layers/0/mlp/gate_proj/kernel_lora_b"] == (None, "tp")
    # The adapted model holds the loaded base arrays themselves, not copies the init program
    # returned (a second copy of the weights in HBM, placed as the compiler chose: here without
    # the size-1 fsdp axis, so the trainer's step no longer matched compile-ahead's).
    loaded = {p: v.get_value() for p, v in nnx.iter_graph(base) if isinstance(v, nnx.Param)}
    kept = {
        p: v.get_value()
        for p, v in nnx.iter_graph(lora_model)
        if isinstance(v, nnx.Param) and not isinstance(v, nnx.LoRAParam)
    }
    assert kept.keys() == loaded.keys() and len(kept) > 0
    assert all(kept[p] is loaded[p] for p in kept)
    kernel = kept[("layers", 0, "mlp", "gate_proj", "kernel")]
    assert tuple(kernel.sharding.spec) == ("fsdp", "tp")


def test_tiny_model_layout(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert text["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["num_global_key_value_heads"],
    ) == (8, 4, 2)
    assert text["attention_k_eq_v"] and text["sliding_window"] == 16
    index = json.loads((tiny_model_dir / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert all(k.startswith("model.language_model.") for k in keys)
    assert "model.language_model.layers.5.self_attn.v_proj.weight" not in keys  # k_eq_v
    assert "model.language_model.layers.4.self_attn.v_proj.weight" in keys
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"]


def test_make_tiny_model_refuses_a_layer_count_hf_would_change(tmp_path):
    from workloads.model import tiny_model

    with pytest.raises(errors.UserError, match="multiple of 6"):
        tiny_model.write_tiny_model(tmp_path / "m", layers=8)


def test_tiny_model_logits_match_hugging_face(tiny_model_dir):
    """Tunix (this project's loader) and HF transformers compute the same logits from the tiny
    checkpoint, over 40 tokens (more than the sliding window): f32, atol 1e-4."""
    import numpy as np
    import torch
    import transformers

    from workloads.model import gemma4 as model
    from workloads.train import step

    tokens = np.random.default_rng(1).integers(0, 1000, (2, 40)).astype(np.int32)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32
    )
    with torch.no_grad():
        expected = hf(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    mesh = model.make_mesh(2, 1)
    with mesh:
        ours = model.load_model(tiny_model_dir, mesh=mesh, dtype="float32")
        segments = np.ones_like(tokens)
        positions = np.tile(np.arange(40, dtype=np.int32), (2, 1))
        logits, _ = ours(tokens, positions, None, step.attention_mask(segments))
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=1e-4)
