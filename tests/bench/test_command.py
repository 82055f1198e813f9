"""`python -m workloads bench` end to end: a fake vLLM container, the sweep, resume, aggregate."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import yaml

from tests.bench.vllm_results import dumps, vllm_result
from tests.serve.conftest import write_merged_model
from workloads import cli
from workloads.bench import command as bench_command
from workloads.bench import plots, results
from workloads.common import storage
from workloads.contract import runconfig
from workloads.serve import argv


@pytest.fixture
def serving(tmp_path, fake_docker, free_port):
    """A run config with serve + bench sections and the fake vLLM container running."""
    write_merged_model(str(tmp_path / "merged"))
    data = {
        "run_name": "bench-test",
        "model": {"base": "gs://bucket/base"},
        "data": {"dataset": "gs://bucket/data.jsonl"},
        "train": {"output_dir": "gs://bucket/run"},
        "serve": {
            "model_dir": str(tmp_path / "merged"),
            "port": free_port,
            "compile_cache_dir": str(tmp_path / "xla"),
            "ready_poll_s": 0.05,
        },
        "bench": {
            "shapes": [[64, 32], [128, 32]],
            "request_rates": [1, 4, "inf"],
            "num_prompts": 5,
            "results_dir": str(tmp_path / "results"),
            "scratch_dir": str(tmp_path / "scratch"),
            "ready_timeout_s": 20,
        },
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    serve = runconfig.load(str(config)).serve
    container = subprocess.Popen(
        argv.serve_argv(serve, argv.model_source(serve)), stdout=subprocess.DEVNULL
    )
    yield str(config)
    container.terminate()
    container.wait(timeout=10)


def _data(config: str) -> dict:
    return yaml.safe_load(open(config))


def test_the_sweep_runs_every_point_uploads_and_aggregates(serving, fake_docker, tmp_path):
    assert cli.main(["bench", "--config", serving]) == 0
    raw = tmp_path / "results" / "raw"
    names = sorted(p.name for p in raw.iterdir())
    assert names == sorted(f"{i}x32_r{r}.json" for i in (64, 128) for r in ("1", "4", "inf"))
    execs = [c for c in fake_docker.calls() if c[0] == "exec"]
    assert len(execs) == 6 and execs[0][:6] == [
        "exec",
        "gemma4-vllm",
        "vllm",
        "bench",
        "serve",
        "--backend",
    ]
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert [(r["input_len"], r["request_rate"]) for r in summary] == [
        (64, 1),
        (64, 4),
        (64, "inf"),
        (128, 1),
        (128, 4),
        (128, "inf"),
    ]
    assert all(r["completed"] == 5 and r["output_throughput"] == 5 * 32 / 100 for r in summary)
    for name in ("summary.csv", "summary.md", plots.THROUGHPUT_PNG, plots.TTFT_PNG):
        assert (tmp_path / "results" / name).stat().st_size > 100

    # Resumable: a second run executes nothing and aggregates again.
    assert cli.main(["bench", "--config", serving]) == 0
    assert len([c for c in fake_docker.calls() if c[0] == "exec"]) == 6


def test_a_failed_point_is_reported_and_retried_alone_on_the_next_run(
    serving, fake_docker, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FAKE_BENCH_FAIL", "128x32_r4.json")
    assert cli.main(["bench", "--config", serving]) == 1  # systemd retries
    err = capsys.readouterr().err
    assert "error: 1 sweep point(s) failed: 128x32_r4.json (exit status 1)" in err
    assert len(json.loads((tmp_path / "results" / "summary.json").read_text())) == 5
    monkeypatch.delenv("FAKE_BENCH_FAIL")
    assert cli.main(["bench", "--config", serving]) == 0
    execs = [c for c in fake_docker.calls() if c[0] == "exec"]
    assert len(execs) == 7 and "128x32_r4.json" in execs[-1]
    assert len(json.loads((tmp_path / "results" / "summary.json").read_text())) == 6


def test_results_go_to_a_remote_results_dir(serving, tmp_path, memory_url):
    data = _data(serving)
    data["bench"].update(
        results_dir=f"{memory_url}/bench", shapes=[[64, 32]], request_rates=["inf"]
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    assert cli.main(["bench", "--config", serving]) == 0
    names = [rel.rsplit("/", 1)[-1] for rel in storage.list_files(f"{memory_url}/bench")]
    assert sorted(names) == sorted(
        [
            "64x32_rinf.json",
            "summary.json",
            "summary.csv",
            "summary.md",
            plots.THROUGHPUT_PNG,
            plots.TTFT_PNG,
        ]
    )


def test_no_server_means_a_readiness_error(tmp_path, fake_docker, free_port, capsys):
    data = {
        "run_name": "x",
        "model": {"base": "b"},
        "data": {"dataset": "d"},
        "train": {"output_dir": "o"},
        "serve": {"model_dir": "gs://b/m", "port": free_port, "ready_poll_s": 0.05},
        "bench": {"results_dir": str(tmp_path / "r"), "ready_timeout_s": 1},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    assert cli.main(["bench", "--config", str(tmp_path / "run.yaml")]) == 1
    assert f"http://127.0.0.1:{free_port} not ready after 1 s" in capsys.readouterr().err
    assert fake_docker.calls() == []


def test_aggregate_only(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    for rate in (1, 8):
        result = vllm_result(input_len=4096, output_len=512, request_rate=rate)
        (raw / f"4096x512_r{rate}.json").write_text(dumps(result))
    assert cli.main(["bench", "--aggregate-only", str(tmp_path)]) == 0
    assert "| 4096 | 512 | 8 | 200 |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / plots.TTFT_PNG).stat().st_size > 10_000
    capsys.readouterr()
    expected = "expected a bench results directory (holding raw/*.json)"
    missing = tmp_path / "nothing"
    assert cli.main(["bench", "--aggregate-only", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --aggregate-only {missing}: not found; {expected}\n"
    a_file = tmp_path / "summary.md"
    assert cli.main(["bench", "--aggregate-only", str(a_file)]) == 2
    assert capsys.readouterr().err == f"error: --aggregate-only {a_file}: is a file; {expected}\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["bench", "--aggregate-only", str(empty)]) == 2
    assert "no vLLM result files" in capsys.readouterr().err
    assert cli.main(["bench"]) == 2


def test_the_default_sweep_is_the_papers():
    points = bench_command.sweep_points(runconfig.BenchRunSection(results_dir="gs://b/bench"))
    shapes = [(512, 256), (1024, 512), (4096, 512), (8192, 512), (15360, 512)]
    rates = [1, 2, 4, 8, 16, 32, 64, math.inf]
    assert points == [(i, o, float(r)) for i, o in shapes for r in rates]
    assert results.point_name(*points[-1]) == "15360x512_rinf.json"
