"""Compile-ahead: the training step compiled from abstract shapes beside the weight loading
(workloads.train.compile_ahead), found by the first real step in the persistent cache; a
failure in the background is one line, never a hang."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from workloads.train import compile_ahead

# Runs a 1-step training in a fresh process (fresh persistent cache, 4 CPU devices) and prints
# when the background compile and the loading ran, and what the log said.
_DRIVER = r"""
import json, sys, time
from workloads.contract import runconfig
from workloads.train import compile_ahead, trainer
cfg = runconfig.parse(json.loads(sys.argv[1]))
loading = {}
build = trainer.build_lora_model
def timed_build(*args, **kwargs):
    loading["start"] = time.monotonic()
    try:
        return build(*args, **kwargs)
    finally:
        loading["end"] = time.monotonic()
trainer.build_lora_model = timed_build
outcomes = []
start = compile_ahead.start
def kept_start(*args, **kwargs):
    ahead = start(*args, **kwargs)
    outcomes.append(ahead.outcome)
    return ahead
compile_ahead.start = kept_start
lines = []
trainer.train(cfg, log=lines.append)
o = outcomes[0]
print("RESULT " + json.dumps({"lines": lines, "loading": loading,
      "ahead": {"start": o.started, "end": o.finished, "error": o.error}}))
"""


@pytest.mark.slow
def test_the_step_compiles_beside_loading_and_the_first_step_finds_it(base_config, tmp_path):
    cfg = json.loads(json.dumps(base_config))
    cfg["lora"]["dropout"] = 0.0
    cfg["train"].update(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        grad_accum=1,
        mesh={"fsdp": 2, "tp": 2},
        compile_cache_dir=str(tmp_path / "cache"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    ahead, loading, lines = result["ahead"], result["loading"], result["lines"]
    assert ahead["error"] is None
    # (a) the compile ran while the weights were loading: the two intervals overlap.
    assert ahead["start"] < loading["end"] and loading["start"] < ahead["end"]
    assert any(line.startswith("compile-ahead: train step compiled in") for line in lines)
    # (b) the first step did not compile the step again: JAX served it from the cache, and the
    # cache holds one entry for it (a second compile would have written another key).
    assert "first step: the train step came from the persistent compilation cache" in lines
    entries = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("jit_pure-")]
    assert len(entries) == 1


def test_a_background_failure_is_one_line_and_the_run_goes_on():
    lines: list[str] = []

    def broken() -> None:
        raise ValueError("tracing went wrong\nTraceback (most recent call last): ...")

    ahead = compile_ahead.CompileAhead(broken, lines.append).start()
    started = time.monotonic()
    assert ahead.wait() is None
    assert time.monotonic() - started < 5  # returns at once, no hang
    assert lines == [
        "compile-ahead: failed (ValueError: tracing went wrong); the first step compiles instead"
    ]


def test_a_step_that_does_not_fit_stops_the_run_in_one_line():
    def too_big() -> None:
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.\nmore")

    ahead = compile_ahead.CompileAhead(too_big, lambda line: None).start()
    with pytest.raises(compile_ahead.StepCompileError) as info:
        ahead.wait()
    assert str(info.value) == (
        "the training step does not fit the accelerator: RuntimeError: RESOURCE_EXHAUSTED: "
        "Ran out of memory in memory space hbm."
    )


def test_the_wait_blocks_until_the_compile_ends():
    lines: list[str] = []
    ahead = compile_ahead.CompileAhead(lambda: time.sleep(0.3), lines.append).start()
    assert not ahead.done()
    seconds = ahead.wait()
    assert ahead.done() and seconds is not None and seconds >= 0.3
    assert lines[0].startswith("compile-ahead: train step compiled in 0.3 s")


def test_no_cache_dir_means_no_background_compile(config_for, tmp_path):
    lines: list[str] = []
    cfg = config_for(tmp_path / "run")
    assert cfg.train.compile_cache_dir is None
    assert compile_ahead.start(cfg, {}, None, 1, kernel=False, log=lines.append) is None  # type: ignore[arg-type]
    assert "train.compile_cache_dir unset" in lines[0]


def test_the_cache_report_reads_jax_hits_and_misses_without_printing_them(capfd):
    logger = logging.getLogger("jax._src.compiler")
    level = logger.level
    with compile_ahead.CacheReport() as report:
        logger.debug("Persistent compilation cache hit for 'jit_pure' with key 'k1'")
        logger.debug("PERSISTENT COMPILATION CACHE MISS for 'jit_add' with key 'k2'")
    assert report.hits == ["jit_pure"] and report.misses == ["jit_add"]
    assert report.step_line().startswith("first step: the train step came from the persistent")
    assert logger.level == level and report not in logger.filters
    assert "jit_pure" not in capfd.readouterr().err
    missed = compile_ahead.CacheReport()
    missed.misses.append("jit_pure")
    assert "not in the persistent cache" in missed.step_line()


def test_the_deviceless_check_lays_out_devices_unlike_the_trainer():
    """Why `preflight --compile` cannot seed the VM's cache as it stands: the device assignment
    is part of JAX's cache key, and for the default v5p-8 mesh (fsdp=1, tp=4) the compile check
    orders the devices by id while the trainer's jax.make_mesh orders them along the torus."""
    pytest.importorskip("libtpu")
    import jax

    from workloads.contract import catalog
    from workloads.model import gemma4
    from workloads.train import compile_step

    devices = compile_step.topology_devices(catalog.accelerator("v5p-8"))
    auto = (jax.sharding.AxisType.Auto,) * 2
    trainer_mesh = jax.make_mesh((1, 4), gemma4.MESH_AXES, devices=devices, axis_types=auto)
    check_mesh = compile_step.make_mesh(devices, 1, 4)
    assert [d.id for d in check_mesh.devices.flat] == [0, 1, 2, 3]
    assert [d.id for d in trainer_mesh.devices.flat] == [0, 2, 1, 3]
    assert {d.device_kind for d in devices} == {"TPU v5"}


@pytest.mark.slow
def test_the_trainer_survives_a_background_failure_with_one_line(config_for, tmp_path, monkeypatch):
    """A broken background compile costs the run nothing but the line saying so: the first
    step compiles the step itself and the run finishes."""
    from workloads.train import trainer

    def broken(*args, **kwargs):
        raise RuntimeError("abstract trace failed\nlong XLA dump ...")

    monkeypatch.setattr(compile_ahead, "lower_step", broken)
    cfg = config_for(
        tmp_path / "run", train={"max_steps": 1, "compile_cache_dir": str(tmp_path / "cache")}
    )
    lines: list[str] = []
    result = trainer.train(cfg, log=lines.append)
    assert result.final_step == 1
    failed = [line for line in lines if line.startswith("compile-ahead: failed")]
    assert failed == [
        "compile-ahead: failed (RuntimeError: abstract trace failed); the first step compiles "
        "instead"
    ]


def test_the_background_compile_is_a_stage_record_of_its_own(tmp_path):
    """compile_ahead's start and end land in the host's stage file beside the others, so a
    boot's records show the compile overlapping the weights' arrival."""
    from workloads.common import stage_records

    path = tmp_path / "stages.jsonl"
    log = stage_records.StageLog(str(path), "trainer", boot="b")
    ahead = compile_ahead.CompileAhead(lambda: time.sleep(0.2), lambda line: None, log).start()
    ahead.wait()
    failed = compile_ahead.CompileAhead(lambda: 1 / 0, lambda line: None, log).start()
    failed.wait()
    records = stage_records.read_records(str(path))
    ends = [r for r in records if r["event"] == "end"]
    assert [(r["stage"], r["ok"]) for r in ends] == [
        ("compile_ahead", True),
        ("compile_ahead", False),
    ]
    assert ends[0]["seconds"] >= 0.2 and "ZeroDivisionError" in ends[1]["note"]
