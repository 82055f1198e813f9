"""Relative paths work everywhere: the command line resolves every path option once, at its edge,
and `runconfig.load` resolves a config's relative local paths, both against the current working
directory through one helper (storage.absolute); gs:// URLs are left as they are."""

from __future__ import annotations

import argparse
import os
import typing

import pytest
import yaml

from workloads import cli
from workloads.common import storage
from workloads.contract import runconfig

# Every path option of every command: (command line, argparse dest, the relative path given).
PATH_OPTIONS = [
    (["demo"], "workdir", "runs/demo"),  # the default: the README's first command
    (["demo", "--workdir", "w"], "workdir", "w"),
    (["make-tiny-model", "tiny"], "out_dir", "tiny"),
    (["train", "--config", "run.yaml"], "config", "run.yaml"),
    (["merge", "--config", "run.yaml"], "config", "run.yaml"),
    (["merge", "--base", "base"], "base", "base"),
    (["merge", "--checkpoint", "run/checkpoints"], "checkpoint", "run/checkpoints"),
    (["merge", "--out", "merged"], "out", "merged"),
    (["serve", "--config", "run.yaml"], "config", "run.yaml"),
    (["bench", "--config", "run.yaml"], "config", "run.yaml"),
    (["bench", "--aggregate-only", "results"], "aggregate_only", "results"),
    (["eval", "--config", "run.yaml"], "config", "run.yaml"),
    (["eval", "--problems", "problems"], "problems", "problems"),
    (["eval", "--out", "results"], "out", "results"),
    (["report", "--config", "run.yaml"], "config", "run.yaml"),
    (
        ["report", "--train-summary", "t/train_summary.json"],
        "train_summary",
        "t/train_summary.json",
    ),
    (["report", "--bench-summary", "b/summary.json"], "bench_summary", "b/summary.json"),
    (
        ["report", "--baseline-eval-summary", "e/summary.json"],
        "baseline_eval_summary",
        "e/summary.json",
    ),
    (["report", "--eval-summary", "e/summary.json"], "eval_summary", "e/summary.json"),
    (["report", "--out", "report"], "out", "report"),
    (["release", "--config", "run.yaml"], "config", "run.yaml"),
]

# String options that are not paths (names, URLs, patterns, sizes, machine types).
NOT_PATHS = {
    ("demo", "bucket"),  # a gs:// bucket only (checked by the demo)
    ("eval", "endpoint"),
    ("eval", "model"),
    ("eval", "only"),
    ("eval", "api_key_env"),
    ("merge", "shard_size"),
    ("report", "train_accelerator"),
    ("report", "serve_accelerator"),
}


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(argv[0]).parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "dest", "given"), PATH_OPTIONS, ids=[" ".join(a) for a, _, _ in PATH_OPTIONS]
)
def test_every_path_option_comes_out_absolute(argv, dest, given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert getattr(_parse(argv), dest) == os.path.join(os.getcwd(), given)


def test_every_string_option_is_a_resolved_path_or_listed_as_no_path():
    """A new path option without `type=storage.absolute` fails here (and would fail for users
    with a relative path, as --workdir did with Orbax)."""
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    paths, strings = set(), set()
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.nargs == 0 or action.choices or action.type not in (None, storage.absolute):
                continue  # flags, choices, ints, floats, lists
            (paths if action.type is storage.absolute else strings).add((name, action.dest))
    assert strings == NOT_PATHS
    assert paths == {(argv[0], dest) for argv, dest, _ in PATH_OPTIONS}


def test_urls_and_absolute_paths_are_left_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _parse(["merge", "--base", "gs://b/base", "--checkpoint", "/abs/run", "--out", ""])
    assert (args.base, args.checkpoint, args.out) == ("gs://b/base", "/abs/run", "")
    assert storage.absolute("hf://google/gemma") == "hf://google/gemma"
    assert storage.absolute("a/../b/./c") == os.path.join(os.getcwd(), "b", "c")


def test_home_is_expanded(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert storage.absolute("~/runs/demo") == "/home/someone/runs/demo"


def _config(**paths: str) -> dict:
    return {
        "run_name": "rel",
        "model": {"base": paths["base"], "stage_dir": "stage"},
        "data": {"dataset": paths["dataset"]},
        "train": {"output_dir": paths["output_dir"], "compile_cache_dir": "cache"},
        "merge": {"out": "gs://bucket/merged"},
        "serve": {
            "model_dir": "org/name",
            "local_dir": "~/merged",
            "compile_cache_dir": "xla",
            "engine_python": ".venv-serve/bin/python",
        },
        "bench": {"results_dir": "bench", "scratch_dir": "/dev/shm/gemma4-bench"},
        "eval": {"problems_dir": "problems", "results_dir": "eval"},
    }


def test_load_resolves_relative_paths_against_the_working_directory(tmp_path, monkeypatch):
    """Against the directory the command runs in, not the config file's (configs/ here)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/someone")
    (tmp_path / "configs").mkdir()
    data = _config(base="runs/demo/model", dataset="data/x.jsonl", output_dir="runs/rel")
    (tmp_path / "configs" / "run.yaml").write_text(yaml.safe_dump(data))
    cwd = os.getcwd()

    cfg = runconfig.load("configs/run.yaml")

    assert cfg.model.base == f"{cwd}/runs/demo/model"
    assert cfg.model.stage_dir == f"{cwd}/stage"
    assert cfg.data.dataset == f"{cwd}/data/x.jsonl"
    assert cfg.train.output_dir == f"{cwd}/runs/rel"
    assert cfg.train.checkpoint_dir == f"{cwd}/runs/rel/checkpoints"  # what Orbax gets
    assert cfg.train.compile_cache_dir == f"{cwd}/cache"
    assert cfg.merge is not None and cfg.merge.out == "gs://bucket/merged"
    assert cfg.serve is not None
    assert cfg.serve.model_dir == "org/name"  # may be a hub id: serve decides
    assert (cfg.serve.local_dir, cfg.serve.compile_cache_dir) == (
        "/home/someone/merged",
        f"{cwd}/xla",
    )
    assert cfg.serve.engine_python == f"{cwd}/.venv-serve/bin/python"
    assert cfg.bench is not None
    assert (cfg.bench.results_dir, cfg.bench.scratch_dir) == (
        f"{cwd}/bench",
        "/dev/shm/gemma4-bench",
    )
    assert cfg.eval is not None
    assert (cfg.eval.problems_dir, cfg.eval.results_dir) == (f"{cwd}/problems", f"{cwd}/eval")


def test_every_config_path_field_is_covered_by_the_load_test():
    """The fields `load` resolves are exactly those the test above checks."""
    resolved = set()
    for section, model in (
        ("model", runconfig.ModelRunSection),
        ("data", runconfig.DataRunSection),
        ("train", runconfig.TrainingRunSection),
        ("merge", runconfig.MergeRunSection),
        ("serve", runconfig.ServingRunSection),
        ("bench", runconfig.BenchRunSection),
        ("eval", runconfig.EvalRunSection),
    ):
        for name, field in model.model_fields.items():
            # ConfigPath, or ConfigPath | None (pydantic keeps the Annotated inside the union).
            if field.metadata == list(runconfig.ConfigPath.__metadata__) or (
                runconfig.ConfigPath in typing.get_args(field.annotation)
            ):
                resolved.add(f"{section}.{name}")
    assert resolved == {
        "model.base",
        "model.stage_dir",
        "data.dataset",
        "train.output_dir",
        "train.compile_cache_dir",
        "merge.out",
        "serve.local_dir",
        "serve.compile_cache_dir",
        "serve.engine_python",
        "bench.results_dir",
        "bench.scratch_dir",
        "eval.problems_dir",
        "eval.results_dir",
    }


def test_parse_leaves_paths_as_written(tmp_path, monkeypatch):
    """infra renders configs for a VM: this machine's directory must not leak into them."""
    monkeypatch.chdir(tmp_path)
    cfg = runconfig.parse(_config(base="model", dataset="d.jsonl", output_dir="runs/rel"))
    assert (cfg.model.base, cfg.data.dataset, cfg.train.output_dir) == (
        "model",
        "d.jsonl",
        "runs/rel",
    )
    assert cfg.serve is not None and cfg.serve.local_dir == "~/merged"
