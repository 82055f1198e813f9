"""vLLM's own argument parsers (the CPU build of the pinned release, in the serving venv) accept
the flags we build for both launchers, and refuse a misspelled one: a flag the pinned vLLM does
not know fails here, not on a billed TPU."""

from __future__ import annotations

import pytest

from tests.serve.engine import needs_engine, parse_with_vllm
from workloads.contract import runconfig
from workloads.serve import argv

pytestmark = needs_engine


def _serve(**overrides) -> runconfig.ServingRunSection:
    return runconfig.ServingRunSection(**{"model_dir": "/dev/shm/models/merged", **overrides})


def _bench() -> runconfig.BenchRunSection:
    return runconfig.BenchRunSection(results_dir="/tmp/bench")


def _docker_engine_argv(serve: runconfig.ServingRunSection) -> list[str]:
    """What `vllm serve MODEL ...` in the TPU container gets, as the server parser takes it
    (`vllm serve` turns its positional model into --model)."""
    full = argv.serve_argv(serve, argv.model_source(serve))
    at = full.index("serve")
    return ["--model", full[at + 1], *full[at + 2 :]]


def _process_engine_argv(serve: runconfig.ServingRunSection) -> list[str]:
    full = argv.process_serve_argv(serve, argv.model_source(serve))
    assert full[1:3] == ["-m", argv.SERVER_MODULE]
    return full[3:]


def _bench_argv(serve: runconfig.ServingRunSection, *, launcher: str) -> list[str]:
    serve = serve.model_copy(update={"launcher": launcher})
    full = argv.bench_argv(
        serve,
        _bench(),
        argv.model_source(serve),
        input_len=512,
        output_len=256,
        request_rate=float("inf"),
        result_dir="/tmp/raw",
        result_filename="512x256_rinf.json",
    )
    if launcher == "docker":
        assert full[3:6] == ["vllm", "bench", "serve"]
        return full[6:]
    assert full[1:3] == ["-c", argv.BENCH_SERVE_SHIM]
    return full[3:]


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str | None]:
    tpu = _serve()  # the TPU VM's defaults: tp 8, 16K context, the knobs' defaults
    fp8 = _serve(kv_cache_dtype="fp8_e5m2", max_num_seqs=64, max_num_batched_tokens=8192)
    demo = _serve(
        launcher="process",
        tensor_parallel_size=1,
        host="127.0.0.1",
        extra_args=("--dtype", "float32", "--hf-overrides", '{"architectures": ["X"]}'),
    )
    misspelled = _serve(extra_args=("--max-num-seqz", "8"))
    # Google's v6e-8 configuration: DP 2 x TP 4, the Qwix fp8 rule, fp8 KV, async scheduling;
    # and its overrides: a block size and async scheduling switched off.
    throughput = _serve(profile="throughput")
    overridden = _serve(profile="throughput", block_size=256, async_scheduling=False)
    # The merged model streamed from its bucket: a gs:// model and --load-format runai_streamer.
    bucket = _serve(model_dir="gs://bucket/merged/run1", weights_from="bucket")
    cases = {
        "tpu serve": ("serve", _docker_engine_argv(tpu)),
        "tpu serve, fp8 kv": ("serve", _docker_engine_argv(fp8)),
        "tpu serve, throughput profile": ("serve", _docker_engine_argv(throughput)),
        "tpu serve, throughput overridden": ("serve", _docker_engine_argv(overridden)),
        "tpu serve, weights from the bucket": ("serve", _docker_engine_argv(bucket)),
        "local serve": ("serve", _process_engine_argv(demo)),
        "tpu bench": ("bench", _bench_argv(tpu, launcher="docker")),
        "local bench": ("bench", _bench_argv(demo, launcher="process")),
        "misspelled serve flag": ("serve", _docker_engine_argv(misspelled)),
        "bad kv dtype": (
            "serve",
            [a if a != "auto" else "fp9" for a in _process_engine_argv(demo)],
        ),
        "misspelled bench flag": ("bench", [*_bench_argv(tpu, launcher="docker"), "--num-promts"]),
    }
    results = parse_with_vllm(list(cases.values()))
    return dict(zip(cases, results, strict=True))


@pytest.mark.parametrize(
    "case",
    [
        "tpu serve",
        "tpu serve, fp8 kv",
        "tpu serve, throughput profile",
        "tpu serve, throughput overridden",
        "tpu serve, weights from the bucket",
        "local serve",
        "tpu bench",
        "local bench",
    ],
)
def test_vllm_accepts_the_flags_we_build(verdicts, case):
    assert verdicts[case] is None, verdicts[case]


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("misspelled serve flag", "--max-num-seqz"),
        ("bad kv dtype", "fp9"),
        ("misspelled bench flag", "--num-promts"),
    ],
)
def test_vllm_refuses_a_flag_it_does_not_know(verdicts, case, named):
    assert verdicts[case] is not None and named in verdicts[case]
