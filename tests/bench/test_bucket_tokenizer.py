"""serving.weightsFrom bucket: vLLM streams the merged model from gs://, and the bench client,
which loads its tokenizer from `--tokenizer` or else from `--model`, is given a local copy of the
model's tokenizer and config (transformers cannot read gs://: `get_tokenizer("gs://...")`
raises)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import yaml

from tests.serve.conftest import write_merged_model
from tests.serve.engine import ENGINE, needs_engine
from workloads import cli
from workloads.bench import command as bench_command
from workloads.common import storage
from workloads.contract import runconfig
from workloads.data import tokenizer as tiny_tokenizer
from workloads.serve import argv, merged_weights

PROMPT = "module counter(input clk);"


@pytest.fixture
def bucket_model(gcs_bucket: str, tmp_path: pathlib.Path) -> str:
    """A merged model in gs:// as the merge leaves it, with the tiny model's real tokenizer."""
    url = f"{gcs_bucket}/merged/run1"
    write_merged_model(url)
    local = tmp_path / "tokenizer-files"
    tiny_tokenizer.write_tokenizer_files(local)
    fs, root = storage.filesystem(url)
    for path in local.iterdir():
        fs.put_file(str(path), f"{root.rstrip('/')}/{path.name}")
    return url


def test_only_the_small_files_are_copied(bucket_model: str, tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "tok"
    assert merged_weights.stage_tokenizer_files(bucket_model, str(dest)) == str(dest)
    names = sorted(p.name for p in dest.iterdir())
    assert "tokenizer.json" in names and "config.json" in names
    assert not [n for n in names if n.endswith(".safetensors")], names
    # Again: nothing to copy, the files stay.
    assert merged_weights.stage_tokenizer_files(bucket_model, str(dest)) == str(dest)


def test_a_model_without_a_tokenizer_is_one_line(gcs_bucket: str, tmp_path: pathlib.Path) -> None:
    url = f"{gcs_bucket}/merged/bare"
    write_merged_model(url)
    fs, root = storage.filesystem(url)
    fs.rm(f"{root}/tokenizer.json")
    with pytest.raises(merged_weights.StagingError, match="no tokenizer file"):
        merged_weights.stage_tokenizer_files(url, str(tmp_path / "tok"))


def test_the_sweep_gives_the_client_the_local_tokenizer(
    bucket_model: str, tmp_path: pathlib.Path, fake_docker, free_port: int
) -> None:
    data = {
        "run_name": "bench-bucket",
        "model": {"base": "gs://bucket/base"},
        "data": {"dataset": "gs://bucket/data.jsonl"},
        "train": {"output_dir": "gs://bucket/run"},
        "serve": {
            "model_dir": bucket_model,
            "weights_from": "bucket",
            "port": free_port,
            "compile_cache_dir": str(tmp_path / "xla"),
            "ready_poll_s": 0.05,
        },
        "bench": {
            "shapes": [[64, 32]],
            "request_rates": ["inf"],
            "num_prompts": 2,
            "results_dir": str(tmp_path / "results"),
            "scratch_dir": str(tmp_path / "scratch"),
            "ready_timeout_s": 20,
        },
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    serve = runconfig.load(str(config)).serve
    assert serve is not None
    container = subprocess.Popen(
        argv.serve_argv(serve, argv.model_source(serve)), stdout=subprocess.DEVNULL
    )
    try:
        assert cli.main(["bench", "--config", str(config)]) == 0
    finally:
        container.terminate()
        container.wait(timeout=10)
    (call,) = [c for c in fake_docker.calls() if c[0] == "exec"]
    local = tmp_path / "scratch" / bench_command.TOKENIZER_DIR
    assert call[call.index("--model") + 1] == bucket_model
    assert call[call.index("--tokenizer") + 1] == str(local)
    assert (local / "tokenizer.json").is_file()


# Runs in the serving venv: parses each argv with `vllm bench serve`'s own parser and loads the
# tokenizer from it as vllm.benchmarks.serve.main does (`args.tokenizer`, else `args.model`,
# through vllm.tokenizers.get_tokenizer); prints the prompt's token ids or the error, per argv.
_LOAD_AS_THE_BENCH_DOES = r"""
import json, sys
from vllm.benchmarks.serve import add_cli_args
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser

prompt, cases = json.load(sys.stdin)
out = []
for argv in cases:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    tokenizer_id = args.tokenizer if args.tokenizer is not None else args.model
    try:
        tokenizer = get_tokenizer(
            tokenizer_id,
            tokenizer_mode=args.tokenizer_mode,
            trust_remote_code=args.trust_remote_code,
        )
        out.append({"ids": list(tokenizer(prompt)["input_ids"])})
    except Exception as exc:
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
"""


@needs_engine
def test_vllms_bench_loads_its_tokenizer_with_the_bucket_mode_argv(
    bucket_model: str, tmp_path: pathlib.Path
) -> None:
    serve = runconfig.ServingRunSection(
        model_dir=bucket_model, weights_from="bucket", launcher="process"
    )
    bench = runconfig.BenchRunSection(results_dir=str(tmp_path / "results"))
    source = argv.model_source(serve)
    assert source.kind == "bucket" and source.serve_path == bucket_model
    local = merged_weights.stage_tokenizer_files(source.location, str(tmp_path / "tok"))

    def flags(tokenizer: str | None) -> list[str]:
        full = argv.bench_argv(
            serve,
            bench,
            source,
            input_len=64,
            output_len=32,
            request_rate=float("inf"),
            result_dir=str(tmp_path / "raw"),
            result_filename="64x32_rinf.json",
            tokenizer=tokenizer,
        )
        assert full[1:3] == ["-c", argv.BENCH_SERVE_SHIM]
        return full[3:]

    proc = subprocess.run(
        [str(ENGINE), "-c", _LOAD_AS_THE_BENCH_DOES],
        input=json.dumps([PROMPT, [flags(local), flags(None)]]),
        capture_output=True,
        text=True,
        timeout=600,
        # As the client runs on the serving VM: offline, the model is no hub id.
        env={**os.environ, **argv.OFFLINE_ENV},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_local, without = json.loads(proc.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    expected = list(AutoTokenizer.from_pretrained(local)(PROMPT)["input_ids"])
    assert with_local == {"ids": expected}
    # What the bench did before: the gs:// model as the tokenizer's name, which cannot load.
    assert "error" in without and bucket_model in without["error"], without
