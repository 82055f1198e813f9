"""`python -m workloads train --config RUN.yaml|RUN.json`: LoRA fine-tune, resumable.

Run it again with the same config after a crash or a preemption and it continues from the
newest intact checkpoint. Exit status: 0 when the last step is done, 143 when SIGTERM stopped it
after saving a checkpoint (run again to continue), 2 on a user error (one line on stderr: a bad
config, another trainer on the run directory, no intact checkpoint, a full disk), 3 when a
step's loss or gradient norm was not finite (one line naming the step; nothing of it was
saved, and running again from the same checkpoint would do the same). A trainer whose gs:// run
directory another trainer took over (this one was frozen or cut off from GCS past the run lock's
lease) exits at once with status 2 and one line: the unit does not restart it into a fight with
its successor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from workloads.common import cli_options
from workloads.contract import runconfig


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cli_options.add_config(parser, required=True)
    parser.add_argument(
        "--fresh-optimizer-state",
        action="store_true",
        help="resume from a checkpoint that has lost its optimizer_state/ with a new AdamW "
        "state (moments and schedule step start over); without it that is an error",
    )


def main(args: argparse.Namespace) -> int:
    cfg = runconfig.load(args.config)
    from workloads.train import hosts

    # A worker of a multi-host slice joins the others before anything touches a device.
    hosts.join(hosts.from_env())
    from workloads.train import guards, trainer

    if getattr(args, "traceback", False) or os.environ.get("WORKLOADS_TRACEBACK") == "1":
        hold: Any = contextlib.nullcontext()
    else:
        hold = guards.HeldBackgroundErrors()
    with hold:
        result = trainer.train(
            cfg, fresh_optimizer_state=args.fresh_optimizer_state, on_lock_lost=_stop_at_once
        )
    return result.exit_status


def _stop_at_once(lost: Exception) -> None:
    """Ends the process where the lost lock is found out, on whatever thread: raising would
    leave Orbax's writer threads to finish a save in flight, and the interpreter's exit would
    wait for them, into the run directory its successor now writes."""
    print(f"error: {lost}", file=sys.stderr, flush=True)
    os._exit(2)
