"""The serving venv (vLLM's CPU build, installed by .ci/setup) for the tests that run real vLLM."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from workloads.cli import demo_serving

ENGINE = demo_serving.engine_python()
HAVE_ENGINE = os.access(ENGINE, os.X_OK)
needs_engine = pytest.mark.skipif(
    not HAVE_ENGINE,
    reason=f"no serving venv at {ENGINE}: `bash .ci/setup` installs vLLM's CPU build there",
)

# Runs in the serving venv: parses each (parser, argv) case with vLLM's own parsers (the OpenAI
# server's, as `vllm serve` builds it, and `vllm bench serve`'s) and prints one result per case:
# null when vLLM accepts the list, else its error message.
_PARSE_CASES = r"""
import contextlib, io, json, sys
from vllm.benchmarks.serve import add_cli_args
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

results = []
for kind, argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if kind == "serve":
                parser = make_arg_parser(FlexibleArgumentParser())
                validate_parsed_serve_args(parser.parse_args(argv))
            else:
                parser = FlexibleArgumentParser()
                add_cli_args(parser)
                parser.parse_args(argv)
        results.append(None)
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        results.append(lines[-1] if lines else "exit")
    except Exception as exc:
        results.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(results))
"""


def parse_with_vllm(cases: list[tuple[str, list[str]]]) -> list[str | None]:
    """vLLM's verdict on each ("serve" | "bench", argv) case, from one run of the serving venv's
    Python (importing vLLM takes tens of seconds on 2 cores: one import for all cases)."""
    proc = subprocess.run(
        [str(ENGINE), "-c", _PARSE_CASES],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: list[Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results
