"""The stack config model: stack files, unknown keys, all problems at once, reading from Pulumi."""

from __future__ import annotations

import json

import pulumi
import pydantic
import pytest

from infra.config import model as config
from infra.config import stack_config
from tests.fixtures import pulumi_mocks

STACKS = ("dev", "prod")


@pytest.mark.parametrize("stack", STACKS)
def test_stack_files_pass_validation(stack):
    mapping = stack_config.read_stack_file(pulumi_mocks.ROOT / f"Pulumi.{stack}.yaml")
    cfg = stack_config.parse_stack_config(mapping, has_hf_token=True)
    assert cfg.project == config.PLACEHOLDER_PROJECT
    assert cfg.training.accelerator == "v5p-8"


def test_dev_is_a_cheap_smoke_run():
    cfg = stack_config.parse_stack_config(
        stack_config.read_stack_file(pulumi_mocks.ROOT / "Pulumi.dev.yaml")
    )
    assert cfg.training.provisioning == "spot"
    assert cfg.training.max_steps is not None and 10 <= cfg.training.max_steps <= 100
    assert not cfg.serving.enabled
    assert cfg.shared_bucket


def test_prod_is_the_papers_fine_tune_packed_and_the_papers_run_is_one_key_away():
    mapping = stack_config.read_stack_file(pulumi_mocks.ROOT / "Pulumi.prod.yaml")
    cfg = stack_config.parse_stack_config(mapping)
    # One epoch over the paper's rows, packed; 8 rows per optimizer step.
    assert cfg.training.max_steps is None and cfg.training.epochs == 1
    assert cfg.data.max_rows == 10_000 and cfg.data.max_seq_len == 3072 and cfg.data.packing
    assert cfg.training.micro_batch * cfg.training.grad_accum == 8
    # data.packing false: one sample per row, 8 samples per step, one epoch = the paper's 1,244
    # steps over its 9,959 kept rows; nothing else differs.
    paper = stack_config.parse_stack_config(
        {**mapping, "data": {**mapping["data"], "packing": False}}
    )
    assert not paper.data.packing
    assert paper.training == cfg.training and paper.lora == cfg.lora
    assert 9_959 // (paper.training.micro_batch * paper.training.grad_accum) == 1244
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (64, 64.0, 0.05)
    assert cfg.training.learning_rate == 1e-4 and cfg.training.warmup_steps == 100
    assert cfg.serving.enabled and cfg.serving.accelerator == "v6e-8"
    assert cfg.serving.zone == "asia-northeast1-b" and cfg.serving.zone_fallbacks
    assert cfg.serving.tensor_parallel_size == 8 and cfg.serving.max_model_len == 16384
    # One bucket per VM region.
    assert cfg.training_bucket_location == "us-central1"
    assert cfg.serving_bucket_location == "asia-northeast1"
    assert cfg.training_bucket_name != cfg.serving_bucket_name


def _walk_fields(model: type[pydantic.BaseModel], prefix=""):
    for name, field in model.model_fields.items():
        yield prefix + name, field
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            yield from _walk_fields(annotation, prefix + name + ".")


def test_every_field_is_described_and_unknown_keys_are_forbidden():
    fields = list(_walk_fields(config.StackConfig))
    assert len(fields) > 60
    undocumented = [name for name, field in fields if not (field.description or "").strip()]
    assert undocumented == []
    for name, field in fields:
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            assert annotation.model_config.get("extra") == "forbid", name


def test_typos_are_errors_with_a_suggestion():
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config(
            {"project": "my-project-1", "trainig": {}, "training": {"maxStep": 3}}, validate=False
        )
    problems = info.value.problems
    assert any(p.startswith("trainig: unknown key (did you mean training?)") for p in problems)
    assert any(
        p.startswith("training.maxStep: unknown key (did you mean maxSteps?)") for p in problems
    )


def test_snake_case_keys_are_refused():
    # Keys are camelCase only: one spelling per key.
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config(
            {"project": "my-project-1", "name_prefix": "x"}, validate=False
        )
    assert info.value.problems[0].startswith("name_prefix: unknown key (did you mean namePrefix?)")


def test_type_errors_and_rule_violations_are_reported_together():
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["lora"] = {"rank": "sixty-four", "alpha": -1}
    mapping["training"] = {**mapping["training"], "provisioning": "spott", "zone": "europe-west1-b"}
    mapping["data"] = {"maxSeqLen": 3000}
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config(mapping)
    problems = info.value.problems
    assert len(problems) == 5, problems
    # The schema's problems first, in key order, then the rules' on the rest of the config.
    assert problems[0].startswith("data.maxSeqLen: 3000: a positive multiple of 128")
    assert problems[1].startswith("lora.rank: 'sixty-four': Input should be a valid integer")
    assert problems[2].startswith("lora.alpha: -1: a positive number")
    assert problems[3].startswith("training.provisioning: 'spott': Input should be 'spot'")
    assert problems[4].startswith("training.zone: 'europe-west1-b'")
    # The error message itself is the problems, one per line.
    assert str(info.value).splitlines() == problems


def test_missing_project_names_the_key():
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config({})
    assert info.value.problems[0].startswith("project: missing: required; Google Cloud project id")


def test_reading_the_config_from_pulumi(tmp_path):
    mapping = pulumi_mocks.stack_file_config("prod")
    pulumi.runtime.set_mocks(pulumi_mocks.RecordingMocks(), project="gemma4-tpu", stack="prod")
    values = stack_config.pulumi_config_strings(mapping)
    values["gemma4-tpu:hfToken"] = "hf_x"
    values["gemma4-tpu:servign"] = json.dumps({"enabled": True})  # a top-level typo
    values["other-project:key"] = "ignored"
    pulumi.runtime.set_all_config(values, ["gemma4-tpu:hfToken"])
    assert stack_config.read_pulumi_mapping().keys() == {*mapping.keys(), "servign"}
    with pytest.raises(config.ConfigError) as info:
        stack_config.load_stack_config()
    assert info.value.problems == [
        "servign: unknown key (did you mean serving?): allowed keys here are "
        + ", ".join(sorted(f.alias or n for n, f in config.StackConfig.model_fields.items()))
    ]
    del values["gemma4-tpu:servign"]
    values["gemma4-tpu:project"] = "123456"  # a string key stays a string
    pulumi.runtime.set_all_config(values, ["gemma4-tpu:hfToken"])
    assert stack_config.read_pulumi_mapping()["project"] == "123456"
    values["gemma4-tpu:project"] = "my-project-1"
    pulumi.runtime.set_all_config(values, ["gemma4-tpu:hfToken"])
    cfg, token = stack_config.load_stack_config()
    assert cfg.serving.enabled and isinstance(token, pulumi.Output)


def test_a_plain_text_token_is_refused():
    pulumi.runtime.set_mocks(pulumi_mocks.RecordingMocks(), project="gemma4-tpu", stack="dev")
    values = stack_config.pulumi_config_strings(pulumi_mocks.stack_file_config("dev"))
    values["gemma4-tpu:hfToken"] = "hf_plain"
    pulumi.runtime.set_all_config(values, [])
    with pytest.raises(config.ConfigError) as info:
        stack_config.load_stack_config()
    assert info.value.problems[0].startswith("hfToken: stored in plain text")


def test_stack_file_reader_drops_secrets(tmp_path):
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text(
        "config:\n  gemma4-tpu:project: my-project-1\n  gemma4-tpu:hfToken:\n    secure: AAABBB\n"
        "  gcp:project: elsewhere\n"
    )
    assert stack_config.read_stack_file(path) == {"project": "my-project-1"}
    assert stack_config.stack_file_has_hf_token(path)


@pytest.mark.parametrize("key", ["hfToken", "recoveryPassphrase", "recoverySshKey"])
def test_an_empty_secret_is_refused_in_one_line_naming_it(key):
    """Set but empty (`pulumi config set --secret hfToken ""`): it would pass here and fail only
    on a VM, hours later."""
    pulumi.runtime.set_mocks(pulumi_mocks.RecordingMocks(), project="gemma4-tpu", stack="dev")
    values = stack_config.pulumi_config_strings(pulumi_mocks.stack_file_config("dev"))
    values[f"gemma4-tpu:{key}"] = "  "
    pulumi.runtime.set_all_config(values, [f"gemma4-tpu:{key}"])
    problems: list[str] = []
    assert stack_config._secret_config(key, problems) is not None
    assert problems == [
        f"{key}: empty: set its value with `pulumi config set --secret {key} ...`, or remove it "
        f"(`pulumi config rm {key}`)"
    ]
    if key == "hfToken":  # through the program's own reader too
        with pytest.raises(config.ConfigError) as info:
            stack_config.load_stack_config()
        assert info.value.problems[0].startswith("hfToken: empty:")
