"""Fixtures of the data tests: the tiny tokenizer and run configs over small JSONL files."""

import json

import pytest

from tests.fixtures.tokenizer import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 - fixtures
from workloads.contract import runconfig


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def make_config(tmp_path):
    """make_config(dataset, **data_fields, micro_batch=N) -> RunConfig."""

    def make(dataset, *, micro_batch=1, **data):
        return runconfig.parse(
            {
                "run_name": "data-test",
                "model": {"base": str(tmp_path / "model")},
                "data": {"dataset": str(dataset), **data},
                "train": {"output_dir": str(tmp_path / "run"), "micro_batch": micro_batch},
            }
        )

    return make
