"""`python -m workloads demo` end to end (short): tiny model, synthetic data, a stopped and
resumed training run, merge, verification; the summary prints the merge's logits figure.

Run as the README's first command is: from a directory of the user's (a fresh clone) with the
default, relative --workdir runs/demo (Orbax refuses relative checkpoint paths)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import time

import pytest

from workloads import cli
from workloads.cli import demo
from workloads.common import gcs_server


@dataclasses.dataclass(frozen=True)
class ReadmeDemo:
    workdir: pathlib.Path  # absolute: the default, relative runs/demo from where it ran
    out: str  # what it printed
    served: bool


# .ci/run's demo step runs the README's command (`python -m workloads demo`, serving included)
# and keeps what it printed in this file; the test asserts on that run instead of training and
# merging the same pipeline a second time. Unset (a developer's pytest), the test runs a short
# demo itself.
PRINTED_VAR = "GEMMA4_DEMO_PRINTED"


@pytest.fixture
def readme_demo(tmp_path, monkeypatch, capsys) -> ReadmeDemo:
    """The README's demo, run from a directory of the user's with the default --workdir: CI's
    own run (runs/demo.printed beside runs/demo in the clone), else `demo --steps 4 --rows 48
    --no-serve` here (with the two CPU devices the tests' conftest fakes through XLA_FLAGS: the
    demo's mesh must use every visible device, where a user's plain run sees one)."""
    printed = os.environ.get(PRINTED_VAR)
    if printed:
        path = pathlib.Path(printed).resolve()
        assert path.is_file(), f"{PRINTED_VAR}={printed}: no such file (the demo step's output)"
        monkeypatch.chdir(path.parent.parent)
        return ReadmeDemo(path.parent / "demo", path.read_text(), served=True)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["demo", "--steps", "4", "--rows", "48", "--no-serve"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    return ReadmeDemo(pathlib.Path(os.getcwd()) / "runs" / "demo", out, served=False)


@pytest.mark.slow
def test_demo_with_the_default_workdir_prints_the_summary_and_the_merge_figure(readme_demo, capsys):
    workdir, out = readme_demo.workdir, readme_demo.out
    assert "demo summary" in out and re.search(r"loss: first [\d.]+ -> last [\d.]+", out)
    assert re.search(r"tokens/s: \d+ real tokens/s", out)
    steps = int(re.search(r"^  loss: .* over (\d+) steps", out, re.MULTILINE).group(1))
    half = steps // 2
    assert f"resumed: stopped after step {half}, resumed from checkpoint step {half}" in out
    assert f"checkpoints: {workdir / 'run' / 'checkpoints'}" in out
    figure = re.search(r"logits merged vs LoRA model: max \|diff\| ([0-9.e+-]+)", out)
    assert figure and float(figure.group(1)) < 1e-4, out[-2000:]
    assert (workdir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "merged" / "model.safetensors.index.json").is_file()
    # The run config it wrote reproduces the training from any directory: absolute paths.
    assert f"output_dir: {workdir / 'run'}\n" in (workdir / "run.yaml").read_text()
    if readme_demo.served:
        assert re.search(r"^  served as trained: passed: ", out, re.MULTILINE), out
        assert (workdir / "report" / "report.md").is_file()
    else:
        assert "serving: skipped (--no-serve)" in out
    # What a person reads: the stage lines, the training progress and the summary (a passing
    # run with serving is at most 80 lines too: .ci/run counts the README's command). The
    # tools' own output (the data pipeline's lines, warnings) is in the log the summary names.
    assert len(out.splitlines()) <= 80, out
    assert not re.search(r"^(data|merge|train): |WARNING|Warning", out, re.MULTILINE), out
    assert re.search(rf"^step {steps}/{steps}  loss", out, re.MULTILINE)
    assert f"logs: {workdir / 'demo.log'}" in out
    log = (workdir / "demo.log").read_text()
    rows = re.search(r"wrote (\d+) rows", out).group(1)
    assert f"data: {rows} rows read" in log and "stage load started" in log
    # Both training segments' first step found the step compile-ahead compiled beside the
    # loading (a mismatch compiles it a second time: minutes for the 31B step on a TPU host).
    first_steps = re.findall(r"first step: the train step (.*)", log)
    assert first_steps == ["came from the persistent compilation cache"] * 2, first_steps

    # The same command again is refused in one line, and the demo is left as it was.
    assert cli.main(["demo", "--steps", "4", "--rows", "48"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {workdir} already holds a demo")
    assert (workdir / "merged" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
@pytest.mark.alone
def test_the_two_host_demo_checkpoints_to_a_bucket_and_merges_from_it(
    tmp_path, monkeypatch, capsys
):
    """--hosts 2: two trainer processes share their checkpoints through gs:// on the GCS
    protocol server the demo starts itself (as a slice's workers share a bucket); both hosts'
    shards land in the server's bucket and the merge reads them back from there."""
    monkeypatch.chdir(tmp_path)
    workdir = tmp_path / "runs" / "demo"
    before = {name: os.environ.get(name) for name in gcs_server.ENV_VARS}
    code = cli.main(["demo", "--hosts", "2", "--no-serve", "--steps", "4", "--rows", "48"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "hosts: 2 hosts (mesh fsdp=2 x tp=4" in out
    assert "checkpoints: gs://demo/run/checkpoints/" in out
    assert "run directory: gs://demo/run on the demo's GCS protocol server" in out
    assert "output_dir: gs://demo/run\n" in (workdir / "run.yaml").read_text()
    figure = re.search(r"logits merged vs LoRA model: max \|diff\| ([0-9.e+-]+)", out)
    assert figure and float(figure.group(1)) < 1e-4, out[-2000:]
    # The objects are the server's (filesystem backend: <root>/<bucket>/<object name>), each
    # host's shards included, and nothing of the run is left in the workdir.
    step = workdir / "gcs" / "objects" / "demo" / "run" / "checkpoints" / "4"
    assert (step / "commit_success.txt").is_file()
    for part in ("model_params", "optimizer_state"):
        assert {p.name for p in (step / part).glob("ocdbt.process_*")} == {
            "ocdbt.process_0",
            "ocdbt.process_1",
        }
    assert not (workdir / "run").exists()
    # One row per host on fsdp=2: the hosts' rows form one batch split over the slice (not a
    # "replicated" row that differs per host), so the step is the one host 0 compiled ahead.
    host0 = (workdir / "hosts" / "host0.log").read_text()
    first = re.search(r"first step: .*", host0).group(0)  # the first segment's, before resuming
    assert first == "first step: the train step came from the persistent compilation cache"
    # Host 1 resumes on the entry host 0 wrote (JAX writes from process 0 only; CPU processes
    # key entries as a TPU slice's hosts do: hosts.share_cpu_cache_entries), not compiling again.
    host1 = (workdir / "hosts" / "host1.log").read_text()
    resumed = re.findall(r"first step: .*", host1)
    assert len(resumed) == 2, host1[-2000:]
    assert resumed[1] == "first step: the train step came from the persistent compilation cache"
    # The server is gone and this process's variables are as they were.
    assert {name: os.environ.get(name) for name in gcs_server.ENV_VARS} == before


def test_a_bucket_that_is_not_gs_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--no-serve", "--bucket", "s3://mine/run"]) == 2
    assert capsys.readouterr().err == (
        "error: --bucket 's3://mine/run': expected a bucket as gs://NAME (no path)\n"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("bucket", "line"),
    [
        ("gs://Bad_Name!", "'Bad_Name!' is not a GCS bucket name"),
        ("gs://a b", "'a b' is not a GCS bucket name"),
        ("gs://ab", "'ab' is not a GCS bucket name"),
        ("gs://-edge", "'-edge' is not a GCS bucket name"),
        ("gs://192.168.5.4", "'192.168.5.4' is not a GCS bucket name"),
        ("", "expected a bucket as gs://NAME (no path)"),
    ],
)
def test_a_bad_bucket_name_is_one_line_before_anything_runs(
    tmp_path, monkeypatch, capsys, bucket, line
):
    # Such names used to pass: gcsfs then retried for about 50 s and printed tracebacks before
    # the line; an empty one silently meant no bucket.
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    assert cli.main(["demo", "--no-serve", "--bucket", bucket]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --bucket {bucket!r}: {line}") and err.count("\n") == 1
    assert time.monotonic() - started < 5
    assert not (tmp_path / "runs").exists()


def test_gcs_bucket_names_that_pass():
    for name in ("my-bucket", "a_b.example.com", "abc", "x" * 63, "0demo-1"):
        assert demo._check_bucket(f"gs://{name}/") == f"gs://{name}"
    assert demo._check_bucket(None) == ""


def test_a_second_demo_is_refused_in_one_line_naming_the_absolute_workdir(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    workdir = pathlib.Path(os.getcwd()) / "runs" / "demo"
    workdir.mkdir(parents=True)
    (workdir / "run.yaml").write_text("run_name: demo\n")
    (workdir / "notes.txt").write_text("mine")

    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == (
        f"error: {workdir} already holds a demo (run.yaml); pass --overwrite to start over "
        "or --workdir for another directory\n"
    )
    assert (workdir / "run.yaml").read_text() == "run_name: demo\n"
    assert (workdir / "notes.txt").read_text() == "mine"


def test_without_the_serving_venv_the_demo_refuses_before_training_in_one_line(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "nowhere" / "bin" / "python"
    monkeypatch.setenv("GEMMA4_ENGINE_PYTHON", str(missing))

    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {missing}: no serving engine")
    assert "`bash .ci/setup`" in err and "--no-serve" in err
    assert not (tmp_path / "runs").exists()  # nothing written, nothing trained


@pytest.mark.parametrize(("devices", "tp", "fsdp"), [(1, 1, 1), (2, 1, 2), (8, 4, 2)])
def test_the_demos_mesh_uses_every_visible_device(tmp_path, devices, tp, fsdp):
    """A plain run sees one CPU device, the tests' conftest fakes two, a 2-host slice has 8: the
    mesh covers them all and each data-parallel shard gets whole rows."""
    cfg = demo.demo_config(tmp_path, 8, devices=devices, tp=tp)
    assert (cfg.train.mesh.fsdp, cfg.train.mesh.tp) == (fsdp, tp)
    assert cfg.train.mesh.fsdp * cfg.train.mesh.tp == devices
    assert cfg.train.micro_batch % fsdp == 0
