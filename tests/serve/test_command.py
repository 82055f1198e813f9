"""`python -m workloads serve` end to end, with a fake `docker` on PATH playing vLLM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import yaml

from tests.serve.conftest import write_merged_model
from workloads import cli
from workloads.common import storage
from workloads.contract import runconfig
from workloads.serve import argv, command, readiness


def _config(tmp_path, port: int, **serve) -> str:
    data = {
        "run_name": "serve-test",
        "model": {"base": "gs://bucket/base"},
        "data": {"dataset": "gs://bucket/data.jsonl"},
        "train": {"output_dir": "gs://bucket/run"},
        "serve": {
            "local_dir": str(tmp_path / "staged"),
            "compile_cache_dir": str(tmp_path / "xla-cache"),
            "served_model_name": "verilog-test",
            "host": "127.0.0.1",
            "port": port,
            "ready_timeout_s": 20,
            "ready_poll_s": 0.05,
            "model_wait_timeout_s": 5,
            "model_wait_poll_s": 0.05,
            "compile_cache_sync_s": 1,
            "stop_timeout_s": 5,
            **serve,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@contextlib.contextmanager
def _stop_when_ready(monkeypatch, port: int, name: str = "verilog-test", after_s: float = 1.3):
    """Replaces the SIGTERM hook by an event this test sets once the server is ready (plus
    after_s, so that one periodic cache sync runs)."""
    event = threading.Event()
    monkeypatch.setattr(command, "stop_signals", lambda: contextlib.nullcontext(event))
    seen_ready = threading.Event()

    def watch():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not event.is_set():
            if readiness.probe(f"http://127.0.0.1:{port}", name, timeout_s=0.5)[0]:
                seen_ready.set()
                time.sleep(after_s)
                break
            time.sleep(0.05)
        event.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    yield seen_ready
    thread.join(timeout=35)


def test_serve_stages_launches_waits_syncs_and_stops(
    tmp_path, fake_docker, free_port, memory_url, monkeypatch, capsys
):
    files = write_merged_model(f"{memory_url}/merged")
    config = _config(
        tmp_path,
        free_port,
        model_dir=f"{memory_url}/merged",
        compile_cache_gcs=f"{memory_url}/xla-cache",
    )
    with _stop_when_ready(monkeypatch, free_port) as seen_ready:
        assert cli.main(["serve", "--config", config]) == 0
    assert seen_ready.is_set()
    for name, data in files.items():
        assert (tmp_path / "staged" / name).read_bytes() == data
    serve = runconfig.load(config).serve
    calls = fake_docker.calls()
    assert calls[0] == ["rm", "-f", "gemma4-vllm"]
    assert calls[1] == argv.serve_argv(serve, argv.model_source(serve))[1:]
    assert calls[2] == ["stop", "-t", "5", "gemma4-vllm"]
    fs, cache_root = storage.filesystem(f"{memory_url}/xla-cache")
    remote = fs.find(cache_root)
    assert sorted(p.rsplit("/", 1)[-1] for p in remote) == ["jit_decode_16", "jit_prefill_16"]
    out, err = capsys.readouterr()
    assert "INFO compiling token buckets" in out and "INFO Shutting down" in out
    assert "serve: restored 0 compile cache file(s)" in err
    assert "uploaded 2 compile cache file(s)" in err
    assert "ready: http://127.0.0.1" in err

    # A restart (e.g. on a new VM: empty local cache) restores the cache and skips the compile.
    for entry in (tmp_path / "xla-cache").iterdir():
        entry.unlink()
    with _stop_when_ready(monkeypatch, free_port, after_s=0):
        assert cli.main(["serve", "--config", config]) == 0
    out, err = capsys.readouterr()
    assert "restored 2 compile cache file(s)" in err
    assert "INFO XLA cache hit: 2 entries" in out and "compiling" not in out


def test_weights_from_the_bucket_wait_for_the_marker_then_stream_without_staging(
    tmp_path, fake_docker, free_port, gcs_bucket, monkeypatch, capsys
):
    model_dir = f"{gcs_bucket}/merged"
    config = _config(tmp_path, free_port, model_dir=model_dir, weights_from="bucket")
    # The merge finishes after serve started: the marker wait still comes before vLLM.
    writer = threading.Timer(0.3, write_merged_model, args=(model_dir,))
    writer.start()
    try:
        with _stop_when_ready(monkeypatch, free_port) as seen_ready:
            assert cli.main(["serve", "--config", config]) == 0
    finally:
        writer.join()
    assert seen_ready.is_set()
    assert not (tmp_path / "staged").exists()
    serve = runconfig.load(config).serve
    run = fake_docker.calls()[1]
    assert run == argv.serve_argv(serve, argv.model_source(serve))[1:]
    assert run[run.index("serve") + 1] == model_dir
    assert run[run.index("--load-format") + 1] == "runai_streamer"
    out, err = capsys.readouterr()
    assert f"INFO streaming {model_dir}" in out
    assert f"waiting for {model_dir}/model.safetensors.index.json" in err
    assert "serve: staged " not in err and "serve: verified " not in err
    assert f"weights stream from the bucket: vLLM reads {model_dir}" in err
    assert "checksums are not verified on this host" in err


def test_dry_run_names_the_bucket_and_the_missing_host_check(tmp_path, capsys):
    config = _config(tmp_path, 8000, model_dir="gs://bucket/merged/r", weights_from="bucket")
    assert cli.main(["serve", "--config", config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model: gs://bucket/merged/r (bucket)" in out
    assert "stream: wait up to 5 s for model.safetensors.index.json + merge_metadata.json" in out
    assert "stage:" not in out
    assert "serve gs://bucket/merged/r" in out and "--load-format runai_streamer" in out


def test_sigterm_is_forwarded_to_the_container(tmp_path, fake_docker, free_port):
    write_merged_model(str(tmp_path / "merged"))
    config = _config(tmp_path, free_port, model_dir=str(tmp_path / "merged"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads", "serve", "--config", config],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        deadline = time.monotonic() + 30
        while not readiness.probe(f"http://127.0.0.1:{free_port}", "verilog-test")[0]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the command polls every 0.05 s: let it see the server ready too
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "INFO Shutting down" in out
    assert "verified" in err and "stop requested" in err
    assert ["stop", "-t", "5", "gemma4-vllm"] in fake_docker.calls()
    assert not list(fake_docker.state.glob("*.pid"))


def test_a_crashing_container_is_an_error_with_its_log(
    tmp_path, fake_docker, free_port, monkeypatch, capsys
):
    write_merged_model(str(tmp_path / "merged"))
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    config = _config(tmp_path, free_port, model_dir=str(tmp_path / "merged"))
    start = time.monotonic()
    assert cli.main(["serve", "--config", config]) == 1  # run-time failure: systemd restarts
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert "error: the vLLM container exited before http://127.0.0.1" in err
    assert "--- last lines of the container log ---" in err
    assert "Failed to get global TPU topology" in err


def test_a_container_that_never_gets_ready_times_out_and_is_stopped(
    tmp_path, fake_docker, free_port, monkeypatch, capsys
):
    write_merged_model(str(tmp_path / "merged"))
    monkeypatch.setenv("FAKE_VLLM_MODE", "never")
    config = _config(tmp_path, free_port, model_dir=str(tmp_path / "merged"), ready_timeout_s=1)
    assert cli.main(["serve", "--config", config]) == 1
    err = capsys.readouterr().err
    assert "not ready after 1 s (last check: GET /health -> 503)" in err
    assert "Application startup complete" in err  # the log excerpt
    assert fake_docker.subcommands() == ["rm", "run", "stop"]


def test_a_container_that_dies_while_serving_is_an_error(
    tmp_path, fake_docker, free_port, monkeypatch, capsys
):
    write_merged_model(str(tmp_path / "merged"))
    monkeypatch.setenv("FAKE_VLLM_MODE", "die")
    config = _config(tmp_path, free_port, model_dir=str(tmp_path / "merged"))
    assert cli.main(["serve", "--config", config]) == 1
    err = capsys.readouterr().err
    assert "exited with status 1 while serving" in err and "EngineCore died" in err


def test_a_corrupt_model_never_reaches_docker(tmp_path, fake_docker, free_port, capsys):
    write_merged_model(str(tmp_path / "merged"), corrupt="model-00001-of-00002.safetensors")
    config = _config(tmp_path, free_port, model_dir=str(tmp_path / "merged"))
    assert cli.main(["serve", "--config", config]) == 2  # no restart: the weights are bad
    assert "model-00001-of-00002.safetensors: crc32c" in capsys.readouterr().err
    assert fake_docker.calls() == []


def test_an_unfinished_merge_is_waited_for_then_reported(
    tmp_path, fake_docker, free_port, memory_url, capsys
):
    config = _config(tmp_path, free_port, model_dir=f"{memory_url}/merged", model_wait_timeout_s=1)
    assert cli.main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err
    assert f"error: {memory_url}/merged: the merged model is not complete after 1 s" in err
    assert fake_docker.calls() == []


def test_dry_run_prints_the_plan_and_touches_nothing(
    tmp_path, fake_docker, free_port, memory_url, capsys
):
    config = _config(
        tmp_path, free_port, model_dir="gs://bucket/merged", compile_cache_gcs="gs://bucket/xla"
    )
    assert cli.main(["serve", "--config", config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"stage: gs://bucket/merged -> {tmp_path / 'staged'}" in out
    assert "run: docker run --rm --name gemma4-vllm --privileged" in out
    assert "--disable_chunked_mm_input" in out and "-e HF_HUB_OFFLINE=1" in out
    assert "compile cache: gs://bucket/xla <-> " in out
    assert fake_docker.calls() == [] and not (tmp_path / "staged").exists()


def test_dry_run_of_the_process_launcher_shows_the_local_engine_and_its_stop(
    tmp_path, free_port, capsys
):
    config = _config(
        tmp_path,
        free_port,
        model_dir=str(tmp_path / "merged"),
        launcher="process",
        engine_python="/opt/serve/bin/python",
    )
    assert cli.main(["serve", "--config", config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        f"run: /opt/serve/bin/python -m vllm.entrypoints.openai.api_server --model "
        f"{tmp_path / 'merged'} --served-model-name"
    ) in out
    assert "docker" not in out
    assert "stop: SIGTERM to the server's process group, SIGKILL after 5 s" in out


def test_the_process_launcher_without_an_engine_is_one_line(tmp_path, free_port, capsys):
    from tests.serve.conftest import write_merged_model

    write_merged_model(str(tmp_path / "merged"))
    config = _config(
        tmp_path,
        free_port,
        model_dir=str(tmp_path / "merged"),
        launcher="process",
        engine_python=str(tmp_path / "no-venv" / "bin" / "python"),
        model_wait_timeout_s=0,
    )
    assert cli.main(["serve", "--config", config]) == 1
    [line] = [e for e in capsys.readouterr().err.splitlines() if e.startswith("error:")]
    assert line.startswith(f"error: {tmp_path / 'no-venv' / 'bin' / 'python'}: no serving engine")
    assert "`bash .ci/setup`" in line


def test_a_config_without_serve_section_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run_name": "x",
                "model": {"base": "b"},
                "data": {"dataset": "d"},
                "train": {"output_dir": "o"},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "workloads", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"error: {path}: serve: the run config has no serve section\n"


def test_hub_model_skips_staging(tmp_path, fake_docker, free_port, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_in_any_argv")
    config = _config(tmp_path, free_port, model_dir="hf://google/gemma-4-31B-it")
    with _stop_when_ready(monkeypatch, free_port, after_s=0):
        assert cli.main(["serve", "--config", config]) == 0
    run_call = fake_docker.calls()[1]
    assert "HF_TOKEN" in run_call and not any("hf_not_in_any_argv" in a for a in run_call)
    assert not (tmp_path / "staged").exists()


def test_a_stop_signal_in_the_middle_of_a_wait_ends_the_wait(monkeypatch):
    """SIGTERM's handler runs on the main thread between bytecodes, possibly inside the wait the
    serve loop is in. It must end that wait: with threading.Event, set() in the handler could
    block forever on the lock the interrupted wait() held, and serve ignored the stop (seen as
    a rare hang of test_sigterm_is_forwarded_to_the_container)."""
    before = signal.getsignal(signal.SIGTERM)
    with command.stop_signals() as stop:
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        real_sleep = time.sleep

        def signal_lands_here(seconds: float) -> None:
            handler(signal.SIGTERM, None)  # what the interpreter runs when SIGTERM arrives now
            real_sleep(seconds)

        monkeypatch.setattr(command.time, "sleep", signal_lands_here)
        started = time.monotonic()
        assert stop.wait(5) is True
        assert time.monotonic() - started < 1
        monkeypatch.undo()

    with command.stop_signals() as stop:
        assert not stop.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # a real one, delivered to this process
        assert stop.wait(5) is True and stop.is_set()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_local_server_and_its_children_stop_with_it(tmp_path):
    """The process launcher's stop reaches the whole process group (vLLM's API server runs its
    engine core as a child): SIGTERM, then SIGKILL after stop_timeout_s for one that ignores it."""
    import io

    pid_file = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    serve = runconfig.ServingRunSection(
        model_dir=str(tmp_path), launcher="process", stop_timeout_s=1
    )
    server = command.LocalProcess(
        serve, [sys.executable, "-c", script], {"MARK": "1"}, echo=io.StringIO()
    )
    server.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert server.alive() and time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert server.stop() == -signal.SIGKILL  # it ignored SIGTERM
    assert not server.alive()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the engine child outlived the server"
        time.sleep(0.05)
    assert "up" in server.tail()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
