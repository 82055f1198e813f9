"""`python -m workloads make-tiny-model OUT --seed N --layers L`: the command line writes the
real layout (config for Gemma4ForConditionalGeneration, `model.language_model.*` safetensors,
a tokenizer with Gemma 4's special tokens and chat template), deterministically from the seed."""

from __future__ import annotations

import json

import pytest
import safetensors.numpy

from workloads import cli

SPECIALS = ("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|channel>", "<channel|>")


def weights(out) -> dict:
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(safetensors.numpy.load_file(str(file)))
    return tensors


def test_cli_seed_and_layers_write_the_real_layout(tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "m12"
    assert cli.main(["make-tiny-model", str(out), "--seed", "3", "--layers", "12"]) == 0
    assert "12 layers" in capsys.readouterr().out

    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert config["model_type"] == "gemma4" and text["num_hidden_layers"] == 12
    assert text["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    tensors = weights(out)
    assert all(k.startswith("model.language_model.") for k in tensors)
    assert "model.language_model.layers.11.self_attn.k_proj.weight" in tensors
    assert "model.language_model.layers.11.self_attn.v_proj.weight" not in tensors  # k_eq_v
    assert "model.language_model.layers.12.self_attn.q_proj.weight" not in tensors
    # GQA: 8 query heads, 4 KV heads (sliding), 2 global KV heads of twice the size; head sizes
    # 32 and 64, the smallest vLLM's CPU attention takes.
    assert tensors["model.language_model.layers.0.self_attn.k_proj.weight"].shape == (4 * 32, 96)
    assert tensors["model.language_model.layers.5.self_attn.k_proj.weight"].shape == (2 * 64, 96)

    tok = AutoTokenizer.from_pretrained(str(out))
    for token in SPECIALS:
        assert token in tok.all_special_tokens, token
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1, token
    assert tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    assert text["bos_token_id"] == tok.bos_token_id and text["pad_token_id"] == tok.pad_token_id


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        assert cli.main(["make-tiny-model", str(tmp_path / name), "--seed", str(seed)]) == 0
    a, b, c = (weights(tmp_path / n) for n in "abc")
    for file in (tmp_path / "a").glob("*.safetensors"):
        assert file.read_bytes() == (tmp_path / "b" / file.name).read_bytes()
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert a[key].tobytes() == b[key].tobytes() != c[key].tobytes()


@pytest.mark.parametrize("argv", [["--layers", "7"], ["--shards", "0"], ["--shards", "500"]])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv):
    assert cli.main(["make-tiny-model", str(tmp_path / "m"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --"), err


def test_every_shard_holds_tensors_and_the_index_lists_them_all(tmp_path):
    out = tmp_path / "m"
    assert cli.main(["make-tiny-model", str(out), "--shards", "60"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == 60 and sorted(set(index["weight_map"].values())) == files
    assert all(safetensors.numpy.load_file(str(out / f)) for f in files)


def test_bfloat16_checkpoint_loads_in_tunix(tmp_path):
    import ml_dtypes
    import numpy as np

    from workloads.model import gemma4
    from workloads.train import step

    out = tmp_path / "bf16"
    assert cli.main(["make-tiny-model", str(out), "--dtype", "bfloat16", "--layers", "6"]) == 0
    tensors = weights(out)
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert json.loads((out / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"
    loaded = gemma4.load_model(out, mesh=None, dtype="bfloat16")
    tokens = np.arange(40, dtype=np.int32)[None]
    logits, _ = loaded(tokens, tokens, None, step.attention_mask(np.ones_like(tokens)))
    assert logits.shape == (1, 40, loaded.config.num_embed)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
