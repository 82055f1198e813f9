"""The `python -m workloads` command line: one subcommand per workload.

Each subcommand lives in its own module that exposes `configure_parser(parser)` and
`main(args) -> int`; modules keep heavy imports (JAX, Tunix, torch) inside functions so that
`--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from workloads.common import cli_options, errors, logs

# name -> (module, one-line help). The order is the order of the pipeline.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "workloads.cli.demo",
        "run the whole pipeline locally on CPU with a tiny random Gemma 4",
    ),
    "make-tiny-model": ("workloads.model.tiny_model", "write a tiny random Gemma 4 checkpoint"),
    "train": ("workloads.train.command", "LoRA fine-tune from a run config (resumable)"),
    "merge": ("workloads.merge.command", "merge LoRA adapters into sharded HF safetensors"),
    "serve": ("workloads.serve.command", "stage merged weights and run the vLLM TPU container"),
    "bench": ("workloads.bench.command", "sweep `vllm bench serve` and aggregate the results"),
    "eval": ("workloads.evaluation.command", "verilog-eval pass@k against the served endpoint"),
    "report": ("workloads.report.command", "cost and quality report next to the paper's figures"),
    "release": (
        "workloads.cli.give_back",
        "delete the training TPU once training and the merge finished",
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Builds the parser; with `only`, imports just that command's module (fast start-up)."""
    parser = cli_options.parser("python -m workloads", __doc__.splitlines()[0])
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback on errors"
    )
    parser.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default=os.environ.get("WORKLOADS_LOG_LEVEL", "info").lower(),
        help="diagnostics on stderr from this level up (or set $WORKLOADS_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=parser.formatter_class
        )
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.configure_parser(command_parser)
            command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; user errors are one line on stderr and exit status 2.

    Besides errors.UserError, that includes a path the user gave that cannot be used as it is
    (not found, a file where a directory is expected or the reverse, no permission, a read-only
    file system) wherever in a workload it is first touched: see errors.path_error_line.
    """
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in COMMANDS else None)
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    show_traceback = args.traceback or os.environ.get("WORKLOADS_TRACEBACK") == "1"
    try:
        return int(args._module.main(args) or 0)
    except errors.UserError as exc:
        if show_traceback:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        # 2 unless the error names its own status (training's non-finite stop is 3).
        return int(getattr(exc, "exit_status", 2))
    except OSError as exc:
        line = errors.path_error_line(exc)
        if line is None:
            raise
        if show_traceback:
            traceback.print_exc()
        print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
