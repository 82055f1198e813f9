"""docs/config.md is generated from the schema and the rules, and is current."""

from __future__ import annotations

import pytest

from infra.config import reference as config_reference
from infra.config import validation


def test_the_checked_in_reference_is_current():
    """Fails when a key, default, bound, description or rule changed without regenerating:
    run `.venv/bin/python -m infra.config.reference` and commit docs/config.md."""
    assert config_reference.DOC.read_text() == config_reference.render()


def test_every_key_has_a_row():
    text = config_reference.render()
    keys = list(config_reference.iter_keys())
    assert len(keys) > 60
    for key in keys:
        assert f"| `{key.path}` |" in text, key.path


def test_rows_carry_type_default_bounds_and_choices():
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in config_reference.render().splitlines()
        if line.startswith("| `")
    }
    assert "| int | 1 | >= 1 |" in rows["training.microBatch"]
    assert "`full` \\| `dots` \\| `none`" in rows["training.remat"]
    assert "| required |" in rows["project"]
    assert "| str or null | null |" in rows["data.dataset"]
    assert "> 0, <= 1" in rows["serving.eval.topP"]


def test_checked_by_covers_reads_through_aliases_helpers_and_properties():
    rules = config_reference.rules_by_key()
    # Direct reads and a local alias (mesh = cfg.training.mesh).
    for key in ("training.mesh.fsdp", "training.mesh.tp", "training.accelerator", "model.name"):
        assert "rule_mesh" in rules[key], key
    # Through a helper the rule passes the config to (training_hbm_bytes).
    for key in ("training.remat", "training.attention", "lora.rank"):
        assert "rule_memory" in rules[key], key
    # Through a StackConfig property (cfg.training_bucket_name reads storage.bucketName).
    assert "rule_names" in rules["storage.bucketName"]
    assert "rule_references" in rules["serving.servedModelName"]
    # A local alias of a leaf, used bare (tp = cfg.serving.tensor_parallel_size; if tp < 1).
    assert "rule_serving_tp" in rules["serving.tensorParallelSize"]
    # A key no rule reads has no entry (its schema bounds are its only check).
    assert "training.logEvery" not in rules


def test_every_rule_reads_some_key():
    readers = {name for names in config_reference.rules_by_key().values() for name in names}
    for rule in (*validation.RULES, validation.rule_hf_token):
        assert rule.__name__ in readers, rule.__name__


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(config_reference, "DOC", stale)
    monkeypatch.setattr(config_reference, "ROOT", tmp_path)
    assert config_reference.main(["--check"]) == 1
    assert "config.md: out of date" in capsys.readouterr().err
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0
    assert stale.read_text() == config_reference.render()


@pytest.mark.parametrize("key", ["hfToken"])
def test_the_secret_is_not_a_schema_key(key):
    assert all(k.path != key for k in config_reference.iter_keys())
