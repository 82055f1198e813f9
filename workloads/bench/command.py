"""`python -m workloads bench --config RUN.yaml [--aggregate-only DIR]`: the serving sweep.

For every (input_len, output_len) in bench.shapes and every rate in bench.request_rates, runs
`vllm bench serve` (the standard client, inside the serving container, against 127.0.0.1) with
the random dataset and saves vLLM's own result file to `<results_dir>/raw/<in>x<out>_r<rate>.json`.
A point whose file is already in results_dir is skipped, so a re-run resumes the sweep. Then the
files are aggregated into summary.json/.csv/.md and the PNG plots next to raw/. With
serve.weights_from bucket the client gets `--tokenizer <scratch_dir>/tokenizer`, a local copy of
the merged model's non-weight files: it would load its tokenizer from the gs:// `--model`.

`--aggregate-only DIR` only does the last step, for a results dir (local or gs://) with a raw/.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import subprocess
import sys

from workloads.bench import plots, results
from workloads.common import cli_options, errors, logs, storage
from workloads.contract import runconfig
from workloads.serve import argv as argv_lib
from workloads.serve import merged_weights, readiness

LOG = logs.get("bench")
# Under bench.scratch_dir: the merged model's tokenizer and config when the weights stream from
# the bucket (serve.weights_from bucket).
TOKENIZER_DIR = "tokenizer"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cli_options.add_config(
        parser, uses="uses its serve and bench sections; not needed with --aggregate-only"
    )
    parser.add_argument(
        "--aggregate-only",
        metavar="DIR",
        type=storage.absolute,
        help="only aggregate DIR/raw/*.json into tables and plots in DIR",
    )


def aggregate(results_dir: str) -> list[str]:
    """Tables and plots from `<results_dir>/raw`; returns the files written."""
    rows = results.read_rows(results_dir)
    written = results.write_summary(results_dir, rows) + plots.write_plots(results_dir, rows)
    LOG.info(f"aggregated {len(rows)} point(s) into {', '.join(written)}")
    return written


def sweep_points(bench: runconfig.BenchRunSection) -> list[tuple[int, int, float]]:
    return [(i, o, rate) for i, o in bench.shapes for rate in bench.request_rates]


def run_sweep(
    serve: runconfig.ServingRunSection, bench: runconfig.BenchRunSection, *, docker: str = "docker"
) -> list[str]:
    """Runs the missing sweep points; returns the names of the points that failed."""
    source = argv_lib.model_source(serve)
    url = argv_lib.local_url(serve)
    readiness.wait_ready(
        url, serve.served_model_name, timeout_s=bench.ready_timeout_s, poll_s=serve.ready_poll_s
    )
    raw_local = pathlib.Path(bench.scratch_dir, results.RAW)
    raw_local.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if source.kind == "bucket":
        # The client tokenizes locally; the weights stream from gs://, which transformers cannot
        # read. Under scratch_dir, so the container sees it at the same path (/dev/shm).
        tokenizer = merged_weights.stage_tokenizer_files(
            source.location, str(pathlib.Path(bench.scratch_dir, TOKENIZER_DIR))
        )
    raw_remote = runconfig.join(bench.results_dir, results.RAW)
    failed = []
    points = sweep_points(bench)
    for number, (input_len, output_len, rate) in enumerate(points, 1):
        name = results.point_name(input_len, output_len, rate)
        target = runconfig.join(raw_remote, name)
        if storage.exists(target):
            LOG.info(f"[{number}/{len(points)}] {name}: already in {raw_remote}, skipped")
            continue
        local = raw_local / name
        local.unlink(missing_ok=True)
        command = argv_lib.bench_argv(
            serve,
            bench,
            source,
            input_len=input_len,
            output_len=output_len,
            request_rate=rate,
            result_dir=str(raw_local),
            result_filename=name,
            tokenizer=tokenizer,
            docker=docker,
        )
        LOG.info(f"[{number}/{len(points)}] {name}: {shlex.join(command)}")
        code = subprocess.run(command, check=False).returncode
        if code != 0 or not local.is_file():
            why = (
                f"exit status {code}"
                if code != 0
                else f"no result file at {local} (is bench.scratch_dir under the container's "
                "/dev/shm mount?)"
            )
            LOG.info(f"[{number}/{len(points)}] {name}: failed ({why})")
            failed.append(f"{name} ({why})")
            continue
        text = local.read_text()
        results.row_from_result(results.load_result(text, source=str(local)), source=name)
        storage.write_text_atomic(target, text)
    return failed


def _check_results_dir(path: str) -> None:
    """--aggregate-only takes the directory a bench run wrote (its raw/*.json): a missing path or
    a file is named, as one line, before anything is read.

    Raises:
        errors.UserError: `path` does not exist or is not a directory.
    """
    expected = f"expected a bench results directory (holding {results.RAW}/*.json)"
    fs, inner = storage.filesystem(path)
    if not fs.exists(inner):
        raise errors.UserError(f"--aggregate-only {path}: not found; {expected}")
    if not fs.isdir(inner):
        raise errors.UserError(f"--aggregate-only {path}: is a file; {expected}")


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 when every point has a result; 1 when points failed or the server was not
    ready (a re-run retries them); 2 for configuration and result-file problems."""
    if args.aggregate_only:
        _check_results_dir(args.aggregate_only)
        aggregate(args.aggregate_only)
        return 0
    if not args.config:
        raise errors.UserError("bench: give --config RUN.yaml (or --aggregate-only DIR)")
    cfg = runconfig.load(args.config)
    serve, bench = cfg.serve, cfg.bench
    if serve is None or bench is None:
        missing = " and ".join(name for name in ("serve", "bench") if getattr(cfg, name) is None)
        raise errors.UserError(
            f"{args.config}: {missing}: missing section (bench needs serve "
            "for the container and port, and bench for the sweep)"
        )
    try:
        failed = run_sweep(serve, bench)
    except readiness.NotReadyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    failures = (
        f"{len(failed)} sweep point(s) failed: {'; '.join(failed)}; re-run to retry only those"
    )
    try:
        aggregate(bench.results_dir)
    except errors.UserError as exc:
        if not failed:
            raise
        print(f"error: {failures}\n{exc}", file=sys.stderr)
        return 1
    if failed:
        print(f"error: {failures}", file=sys.stderr)
        return 1
    return 0
