"""The run-config schema: unknown keys, one line per problem, sizes, YAML/JSON loading."""

import json

import pytest

from workloads.common import errors
from workloads.contract import runconfig


def _minimal() -> dict:
    return {
        "run_name": "smoke",
        "model": {"base": "gs://bucket/models/gemma-4-31b"},
        "data": {"dataset": "gs://bucket/data/codev_r1.jsonl"},
        "train": {"output_dir": "gs://bucket/checkpoints/smoke"},
    }


def test_defaults_are_the_papers_recipe():
    cfg = runconfig.parse(_minimal())
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (64, 64.0, 0.05)
    assert cfg.lora.targets == runconfig.DEFAULT_LORA_TARGETS
    assert (cfg.train.learning_rate, cfg.train.weight_decay, cfg.train.warmup_steps) == (
        1e-4,
        0.001,
        100,
    )
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.data.max_seq_len) == (1, 8, 3072)
    assert cfg.train.max_grad_norm is None
    assert (cfg.train.mesh.fsdp, cfg.train.mesh.tp) == (1, 4)
    assert cfg.train.checkpoint_dir == "gs://bucket/checkpoints/smoke/checkpoints"


def test_every_problem_is_reported_at_once_one_line_each():
    data = _minimal()
    data["lora"] = {"rank": 0, "targts": ["q_einsum"]}
    data["data"]["max_seq_len"] = 3000
    del data["train"]
    with pytest.raises(errors.UserError) as info:
        runconfig.parse(data, source="run.yaml")
    lines = str(info.value).splitlines()
    assert len(lines) == 4
    assert any(line.startswith("run.yaml: lora.targts: unknown key") for line in lines)
    assert any(line.startswith("run.yaml: lora.rank: 0: a positive integer") for line in lines)
    assert any(line.startswith("run.yaml: data.max_seq_len:") and "128" in line for line in lines)
    assert any(line.startswith("run.yaml: train: missing: required") for line in lines)


def test_unknown_lora_target_names_the_allowed_ones():
    data = _minimal()
    data["lora"] = {"targets": ["q_proj"]}
    with pytest.raises(errors.UserError, match=r"lora.targets: .*q_proj.*one or more of q_einsum"):
        runconfig.parse(data)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GB", 1_500_000_000),
        (42, 42),
        ("100", 100),
    ],
)
def test_parse_size(text, expected):
    assert runconfig.parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="'5 parsecs'"):
        runconfig.parse_size("5 parsecs")


def test_load_yaml_and_json_round_trip(tmp_path):
    cfg = runconfig.parse(_minimal())
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(cfg.to_yaml())
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    assert runconfig.load(yaml_path) == cfg
    assert runconfig.load(json_path) == cfg


def test_load_reports_missing_and_unparsable_files(tmp_path):
    with pytest.raises(errors.UserError, match=r"nope\.yaml: file not found"):
        runconfig.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_name: [unclosed\n")
    with pytest.raises(errors.UserError, match=r"bad\.yaml: not valid YAML"):
        runconfig.load(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(errors.UserError, match="expected a mapping"):
        runconfig.load(listy)
