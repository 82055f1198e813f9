"""Fixtures of the training tests: a synthetic CodeV-R1 file, run configs, one reference run, and
less optimised XLA compiles for tests that compile a large program to run it once.

Every training test uses the same model, mesh shape, shapes and optimizer settings as the
reference run unless it is about one of them, so XLA compiles the train step once per session
(the persistent compilation cache in tests/conftest.py also serves the subprocesses).
"""

from __future__ import annotations

import copy
import os
import pathlib
from typing import Any

import pytest

STEPS = 8
SAVE_EVERY = 4


@pytest.fixture
def unoptimized_compiles():
    """XLA compiles with `jax_disable_most_optimizations` (LLVM at -O0, no expensive passes)
    during the test: for tests that compile a large program to run it once or a few times, where
    compiling is most of the CPU time (about 40% less for the LoRA model's loss and gradients).
    Only the machine code changes, not what it computes; an executable compiled here may still
    be reused from JAX's in-memory caches by a later test (the persistent cache keys on it)."""
    import jax

    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


@pytest.fixture(scope="session")
def codev_jsonl(tmp_path_factory) -> pathlib.Path:
    """80 synthetic CodeV-R1 rows (3 empty, 3 far too long)."""
    from workloads.data import synthetic

    path = tmp_path_factory.mktemp("data") / "codev.jsonl"
    synthetic.write_synthetic_codev(str(path), 80, seed=0)
    return path


@pytest.fixture(scope="session")
def base_config(tiny_model_dir, codev_jsonl) -> dict[str, Any]:
    """The reference run config as a dict (output_dir to be filled in)."""
    return {
        "run_name": "test-run",
        "model": {"base": str(tiny_model_dir), "dtype": "float32"},
        "data": {
            "dataset": str(codev_jsonl),
            "max_rows": None,
            "max_seq_len": 256,
            "packing": True,
            "seed": 0,
        },
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.05},
        "train": {
            "output_dir": "",
            "micro_batch": 2,
            "grad_accum": 2,
            "max_steps": STEPS,
            "learning_rate": 5e-3,
            "warmup_steps": 1,
            "mesh": {"fsdp": 1, "tp": 2},
            "remat": True,
            "save_every": SAVE_EVERY,
            "keep_checkpoints": 3,
        },
    }


def _make_config(base: dict[str, Any], output_dir: pathlib.Path | str, **sections: dict[str, Any]):
    from workloads.contract import runconfig

    data = copy.deepcopy(base)
    data["train"]["output_dir"] = str(output_dir)
    for name, updates in sections.items():
        data[name].update(updates)
    return runconfig.parse(data)


@pytest.fixture(scope="session")
def config_for(base_config):
    """`config_for(output_dir, train={...}, lora={...})`: the base RunConfig with output_dir set
    and sections updated (one level deep)."""
    return lambda output_dir, **sections: _make_config(base_config, output_dir, **sections)


@pytest.fixture(scope="session")
def reference_run(config_for, tmp_path_factory):
    """An uninterrupted in-process run of the base config: 8 steps on a tensor-parallel mesh
    (fsdp=1, tp=2, the production layout at toy scale), checkpoints at 4 and 8."""
    from workloads.common import stage_records
    from workloads.train import trainer

    out = tmp_path_factory.mktemp("reference") / "run"
    # As on a VM: the startup script recorded its stages in the host's file before the trainer.
    stages_file = out.parent / "stages.jsonl"
    startup = stage_records.StageLog(str(stages_file), "startup")
    startup.start("venv")
    startup.end("venv", note="restored from gs://b/venv/train-0123.tar.gz")
    os.environ[stage_records.STAGES_ENV] = str(stages_file)
    try:
        return trainer.train(config_for(out), log=lambda line: None)
    finally:
        del os.environ[stage_records.STAGES_ENV]
