"""Golden argv lists for `docker run ... vllm serve`, `docker exec ... vllm bench serve`, stop."""

import json
import math

import pytest

from workloads.common import errors
from workloads.contract import catalog, runconfig
from workloads.serve import argv


def _serve(**overrides) -> runconfig.ServingRunSection:
    return runconfig.ServingRunSection(**{"model_dir": "gs://bucket/merged/run1", **overrides})


def test_staged_model_is_served_offline_from_shm_with_the_papers_flags():
    serve = _serve()
    source = argv.model_source(serve)
    assert source == argv.ModelSource("remote", "gs://bucket/merged/run1", "/dev/shm/models/merged")
    assert argv.serve_argv(serve, source) == [
        "docker",
        "run",
        "--rm",
        "--name",
        "gemma4-vllm",
        "--privileged",
        "--network",
        "host",
        "--shm-size",
        "16G",
        "-v",
        "/dev/shm:/dev/shm",
        "-v",
        "/dev/shm/vllm-xla-cache:/root/.cache/vllm/xla_cache",
        "-e",
        "VLLM_XLA_CACHE_PATH=/root/.cache/vllm/xla_cache",
        "-e",
        "VLLM_ENGINE_READY_TIMEOUT_S=1800",
        "-e",
        "HF_HUB_OFFLINE=1",
        "-e",
        "TRANSFORMERS_OFFLINE=1",
        "--entrypoint",
        "vllm",
        catalog.VLLM_TPU_IMAGE,
        "serve",
        "/dev/shm/models/merged",
        "--served-model-name",
        "gemma-4-31b-verilog",
        "--tensor-parallel-size",
        "8",
        "--data-parallel-size",
        "1",
        "--max-model-len",
        "16384",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "4096",
        "--gpu-memory-utilization",
        "0.9",
        "--kv-cache-dtype",
        "auto",
        "--disable_chunked_mm_input",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]


def test_hub_model_gets_the_token_by_name_only_and_no_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    serve = _serve(
        model_dir="hf://google/gemma-4-31B-it",
        port=8100,
        tensor_parallel_size=4,
        max_model_len=8192,
        image="vllm/vllm-tpu@sha256:" + "abc123" * 10 + "abcd",
        extra_args=("--block-size", "256"),
    )
    source = argv.model_source(serve)
    assert source.from_hub and source.serve_path == "google/gemma-4-31B-it"
    got = argv.serve_argv(serve, source)
    assert got == [
        "docker",
        "run",
        "--rm",
        "--name",
        "gemma4-vllm",
        "--privileged",
        "--network",
        "host",
        "--shm-size",
        "16G",
        "-v",
        "/dev/shm:/dev/shm",
        "-v",
        "/dev/shm/vllm-xla-cache:/root/.cache/vllm/xla_cache",
        "-e",
        "VLLM_XLA_CACHE_PATH=/root/.cache/vllm/xla_cache",
        "-e",
        "VLLM_ENGINE_READY_TIMEOUT_S=1800",
        "-e",
        "HF_TOKEN",
        "-e",
        "HF_HOME=/dev/shm/huggingface",
        "--entrypoint",
        "vllm",
        "vllm/vllm-tpu@sha256:" + "abc123" * 10 + "abcd",
        "serve",
        "google/gemma-4-31B-it",
        "--served-model-name",
        "gemma-4-31b-verilog",
        "--tensor-parallel-size",
        "4",
        "--data-parallel-size",
        "1",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "4096",
        "--gpu-memory-utilization",
        "0.9",
        "--kv-cache-dtype",
        "auto",
        "--disable_chunked_mm_input",
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--block-size",
        "256",
    ]
    assert not any("hf_secret_value_123" in a for a in got)
    assert "HF_HUB_OFFLINE=1" not in got


def test_bare_org_name_is_a_hub_id_only_when_no_such_local_path_exists():
    serve = _serve(model_dir="google/gemma-4-31B-it")
    assert argv.model_source(serve, exists=lambda p: False).kind == "hub"
    local = argv.model_source(serve, exists=lambda p: True)
    assert local.kind == "local" and local.serve_path.endswith("/google/gemma-4-31B-it")


def test_local_model_outside_shm_is_mounted_read_only_at_the_same_path():
    serve = _serve(
        model_dir="/data/merged", compile_cache_dir="/var/cache/xla", container_name="v2"
    )
    source = argv.model_source(serve)
    assert source == argv.ModelSource("local", "/data/merged", "/data/merged")
    got = argv.serve_argv(serve, source, docker="/usr/bin/docker")
    assert got[:16] == [
        "/usr/bin/docker",
        "run",
        "--rm",
        "--name",
        "v2",
        "--privileged",
        "--network",
        "host",
        "--shm-size",
        "16G",
        "-v",
        "/dev/shm:/dev/shm",
        "-v",
        "/var/cache/xla:/root/.cache/vllm/xla_cache",
        "-v",
        "/data/merged:/data/merged:ro",
    ]
    assert got[got.index("serve") + 1] == "/data/merged"
    in_shm = _serve(model_dir="file:///dev/shm/merged")
    assert "-v" not in argv.serve_argv(in_shm, argv.model_source(in_shm))[14:]


def test_stop_and_remove():
    serve = _serve(stop_timeout_s=45)
    assert argv.stop_argv(serve) == ["docker", "stop", "-t", "45", "gemma4-vllm"]
    assert argv.remove_argv(serve) == ["docker", "rm", "-f", "gemma4-vllm"]


def test_bench_argv_for_a_burst_and_a_fractional_rate():
    serve = _serve(port=8001)
    bench = runconfig.BenchRunSection(
        results_dir="gs://bucket/bench", num_prompts=64, extra_args=("--seed", "7")
    )
    source = argv.model_source(serve)
    got = argv.bench_argv(
        serve,
        bench,
        source,
        input_len=4096,
        output_len=512,
        request_rate=math.inf,
        result_dir="/dev/shm/gemma4-bench/raw",
        result_filename="4096x512_rinf.json",
    )
    assert got == [
        "docker",
        "exec",
        "gemma4-vllm",
        "vllm",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--endpoint",
        "/v1/completions",
        "--model",
        "/dev/shm/models/merged",
        "--served-model-name",
        "gemma-4-31b-verilog",
        "--dataset-name",
        "random",
        "--random-input-len",
        "4096",
        "--random-output-len",
        "512",
        "--ignore-eos",
        "--request-rate",
        "inf",
        "--num-prompts",
        "64",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        "/dev/shm/gemma4-bench/raw",
        "--result-filename",
        "4096x512_rinf.json",
        "--metadata",
        "input_len=4096",
        "output_len=512",
        "--seed",
        "7",
    ]
    fractional = argv.bench_argv(
        serve,
        bench,
        source,
        input_len=512,
        output_len=256,
        request_rate=2.5,
        result_dir="/r",
        result_filename="f.json",
    )
    assert fractional[fractional.index("--request-rate") + 1] == "2.5"


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("10.1.2.3", "http://10.1.2.3:8000"),
        ("::", "http://127.0.0.1:8000"),
        ("::1", "http://[::1]:8000"),
    ],
)
def test_local_url(host, url):
    assert argv.local_url(_serve(host=host)) == url


@pytest.mark.parametrize("image", ["vllm/vllm-tpu", "vllm/vllm-tpu:latest", "localhost:5000/vllm"])
def test_an_unpinned_image_is_rejected_by_the_run_config(image):
    data = {
        "run_name": "x",
        "model": {"base": "b"},
        "data": {"dataset": "d"},
        "train": {"output_dir": "o"},
        "serve": {"model_dir": "m", "image": image},
    }
    with pytest.raises(errors.UserError, match=r"serve\.image: .*not pinned"):
        runconfig.parse(data)


def _run_config_with_image(image: str) -> dict:
    return {
        "run_name": "x",
        "model": {"base": "b"},
        "data": {"dataset": "d"},
        "train": {"output_dir": "o"},
        "serve": {"model_dir": "m", "image": image},
    }


@pytest.mark.parametrize(
    "image", ["vllm/vllm-tpu:v0.11.1", "vllm/vllm-tpu:v0.18.0", "vllm/vllm-tpu:v0.19.0"]
)
def test_a_release_without_gemma4_is_rejected_by_the_run_config(image):
    with pytest.raises(errors.UserError, match=r"serve\.image: .*too old for Gemma 4") as info:
        runconfig.parse(_run_config_with_image(image))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "image",
    [
        catalog.VLLM_TPU_IMAGE,
        "vllm/vllm-tpu:v0.20.0",
        "vllm/vllm-tpu@sha256:" + "0" * 64,
        "registry.example.com/team/vllm-tpu:v0.11.1",
    ],
)
def test_images_that_may_serve_gemma4_pass_the_run_config(image):
    serve = runconfig.parse(_run_config_with_image(image)).serve
    assert serve is not None and serve.image == image


def test_one_argument_list_two_launchers():
    """The TPU container and the local process get the same vLLM flags; only the program in
    front differs (and the local server gets the CPU KV cache size and offline mode by env)."""
    serve = _serve(
        model_dir="/data/merged",
        launcher="process",
        engine_python="/repo/.venv-serve/bin/python",
        kv_cache_dtype="fp8",
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        hbm_utilization=0.25,
        cpu_kv_cache_gib=1.5,
        extra_args=("--dtype", "float32"),
    )
    source = argv.model_source(serve)
    in_container = argv.serve_argv(serve, source)
    local = argv.process_serve_argv(serve, source)
    assert local[:5] == [
        "/repo/.venv-serve/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/data/merged",
    ]
    flags = argv.engine_args(serve)
    assert local[5:] == flags == in_container[in_container.index("/data/merged", 20) + 1 :]
    assert flags[flags.index("--kv-cache-dtype") + 1] == "fp8"
    assert flags[flags.index("--max-num-seqs") + 1] == "16"
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "1024"
    assert flags[flags.index("--gpu-memory-utilization") + 1] == "0.25"
    assert flags[-2:] == ["--dtype", "float32"]
    assert argv.process_env(serve, source) == {
        "VLLM_CPU_KVCACHE_SPACE": "1.5",
        "VLLM_ENGINE_READY_TIMEOUT_S": "1800",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    kwargs = {
        "input_len": 128,
        "output_len": 32,
        "request_rate": 4.0,
        "result_dir": "/w/raw",
        "result_filename": "128x32_r4.json",
    }
    bench = runconfig.BenchRunSection(results_dir="/w/bench", num_prompts=8)
    local_bench = argv.bench_argv(serve, bench, source, **kwargs)
    docker_bench = argv.bench_argv(
        serve.model_copy(update={"launcher": "docker"}), bench, source, **kwargs
    )
    assert local_bench[:3] == ["/repo/.venv-serve/bin/python", "-c", argv.BENCH_SERVE_SHIM]
    assert docker_bench[:6] == ["docker", "exec", "gemma4-vllm", "vllm", "bench", "serve"]
    assert local_bench[3:] == docker_bench[6:] == argv.bench_args(serve, bench, source, **kwargs)


def test_the_throughput_profile_is_googles_v6e_configuration():
    """serving.profile throughput: 2 replicas of TP 4, fp8 weights by the Qwix rule and fp8 KV,
    async scheduling as flags; the batched kernel and the engine timeout as variables of the
    container (and of the local process)."""
    serve = _serve(profile="throughput")
    source = argv.model_source(serve)
    flags = argv.engine_args(serve)
    assert flags[flags.index("--tensor-parallel-size") + 1] == "4"
    assert flags[flags.index("--data-parallel-size") + 1] == "2"
    assert flags[flags.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--async-scheduling" in flags and "--block-size" not in flags
    assert json.loads(flags[flags.index("--additional-config") + 1]) == {
        "quantization": {
            "qwix": {
                "rules": [
                    {
                        "module_path": ".*",
                        "weight_qtype": "float8_e4m3fn",
                        "act_qtype": "float8_e4m3fn",
                    }
                ]
            }
        }
    }
    container = argv.serve_argv(serve, source)
    env = [container[i + 1] for i, a in enumerate(container) if a == "-e"]
    assert "USE_BATCHED_RPA_KERNEL=1" in env and "VLLM_ENGINE_READY_TIMEOUT_S=1800" in env
    assert argv.process_env(serve, source)["USE_BATCHED_RPA_KERNEL"] == "1"


def test_explicit_keys_override_the_profile():
    serve = _serve(
        profile="throughput", weight_quantization="off", async_scheduling=False, block_size=256
    )
    flags = argv.engine_args(serve)
    assert "--additional-config" not in flags
    assert "--no-async-scheduling" in flags
    assert flags[flags.index("--block-size") + 1] == "256"
    assert flags[flags.index("--kv-cache-dtype") + 1] == "fp8"  # still the profile's


def test_the_paper_profile_leaves_the_engine_its_own_choices():
    flags = argv.engine_args(_serve())
    assert not {
        "--additional-config",
        "--async-scheduling",
        "--no-async-scheduling",
        "--block-size",
    } & set(flags)
    assert "USE_BATCHED_RPA_KERNEL" not in argv.engine_env(_serve())


def test_weights_from_the_bucket_stream_the_gs_model_with_the_runai_streamer():
    staged = _serve()
    bucket = _serve(model_dir="gs://bucket/merged/run1/", weights_from="bucket")
    source = argv.model_source(bucket)
    assert source == argv.ModelSource(
        "bucket", "gs://bucket/merged/run1/", "gs://bucket/merged/run1"
    )
    staged_argv = argv.serve_argv(staged, argv.model_source(staged))
    bucket_argv = argv.serve_argv(bucket, source)
    # The same command but the model (the gs:// URI, not the staged copy) and the load format;
    # the URI is no host path, so nothing more is mounted.
    at = staged_argv.index("/dev/shm/models/merged")
    assert bucket_argv[:at] == staged_argv[:at]
    assert bucket_argv[at] == "gs://bucket/merged/run1"
    flags = staged_argv[at + 1 :]
    knobs_end = flags.index("--disable_chunked_mm_input")
    assert bucket_argv[at + 1 :] == [
        *flags[:knobs_end],
        "--load-format",
        "runai_streamer",
        *flags[knobs_end:],
    ]
    assert "--load-format" not in staged_argv
    assert argv.process_serve_argv(bucket, source)[3:5] == ["--model", "gs://bucket/merged/run1"]


@pytest.mark.parametrize("model_dir", ["/dev/shm/models/merged", "hf://google/gemma-4-31b-it"])
def test_weights_from_the_bucket_need_a_gs_model_dir(model_dir):
    with pytest.raises(errors.UserError) as info:
        runconfig.parse(
            {
                "run_name": "r",
                "serve": {"model_dir": model_dir, "weights_from": "bucket"},
            }
        )
    lines = [line for line in str(info.value).splitlines() if "serve." in line]
    assert lines == [
        f"run config: serve.model_dir: {model_dir!r}: weights_from bucket streams the merged "
        "model from gs://, so model_dir must be a gs:// directory; use a gs:// model_dir or "
        "weights_from: staged"
    ]
    runconfig.ServingRunSection(model_dir=model_dir)  # staged (the default) takes either
