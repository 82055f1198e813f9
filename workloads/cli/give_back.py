"""`python -m workloads release`: give the training TPU back once its work is done.

Run by the training VM's `gemma4-release.service` after training (and the merge, when the run
has one) succeeded, when the stack sets `training.releaseWhenDone: true`. It checks that the
run really finished (train_summary.json; the merge's index and merge_metadata.json), records the
release in the run directory (`released.json`: `pulumi up` reads it and does not create the node
again for this run; a new runName trains again), then asks Cloud TPU to delete this node
(`gcloud compute tpus tpu-vm delete --async`: the request outlives the VM that sends it).

The record is written before the request on purpose: if the request fails, the next `pulumi up`
sees the record and deletes the node itself (it is no longer declared), so the intent is never
lost. A run that has not finished is a user error (exit status 2: the unit does not retry).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess

from workloads.common import cli_options, errors, logs, storage
from workloads.contract import runconfig

LOG = logs.get("release")
ZONE_ENV = "GEMMA4_ZONE"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cli_options.add_config(parser, required=True)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check and print what would be recorded and run, change nothing",
    )


def missing_outputs(cfg: runconfig.RunConfig) -> list[str]:
    """What a finished run has written and this one has not (empty: the run is done)."""
    from workloads.serve import merged_weights  # lazy: keeps `--help` instant
    from workloads.train import metrics

    wanted = [runconfig.join(cfg.train.output_dir, metrics.SUMMARY_FILE)]
    if cfg.merge is not None:
        # What a finished merge leaves last; the serving VM waits for the same files.
        wanted += [runconfig.join(cfg.merge.out, name) for name in merged_weights.MARKERS]
    return [path for path in wanted if not storage.exists(path)]


def node_zone(release: runconfig.ReleaseRunSection) -> str:
    """The zone this VM runs in: GEMMA4_ZONE (the startup script's, from the metadata server;
    a fallback zone when the stack's first had no capacity), else the stack's first zone."""
    return os.environ.get(ZONE_ENV) or release.zone


def delete_argv(release: runconfig.ReleaseRunSection, gcloud: str = "gcloud") -> list[str]:
    """The request that deletes the node (asynchronously: it returns once accepted)."""
    return [
        gcloud,
        "compute",
        "tpus",
        "tpu-vm",
        "delete",
        release.node,
        f"--zone={node_zone(release)}",
        f"--project={release.project}",
        "--quiet",
        "--async",
    ]


def main(args: argparse.Namespace) -> int:
    cfg = runconfig.load(args.config)
    release = cfg.release
    if release is None:
        raise errors.UserError(
            f"{args.config}: no release section (the stack's training.releaseWhenDone is false)"
        )
    missing = missing_outputs(cfg)
    if missing:
        raise errors.UserError(
            f"run {cfg.run_name} has not finished: {missing[0]} is missing"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; nothing released"
        )
    record = {
        "run_name": cfg.run_name,
        "project": release.project,
        "zone": node_zone(release),
        "node": release.node,
        "released_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    gcloud = shutil.which("gcloud") or "gcloud"
    argv = delete_argv(release, gcloud)
    if args.dry_run:
        print(f"would record {release.marker}: {json.dumps(record, sort_keys=True)}")
        print(f"would run: {shlex.join(argv)}")
        return 0
    storage.write_text_atomic(release.marker, json.dumps(record, indent=1, sort_keys=True) + "\n")
    LOG.info(f"run {cfg.run_name} finished; recorded {release.marker}; deleting {release.node}")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.UserError(f"`{shlex.join(argv)}` could not run: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        LOG.error(f"`{shlex.join(argv)}` failed ({proc.returncode}): {last}")
        return 1  # systemd retries; the record stands, so the next `pulumi up` deletes the node
    LOG.info(f"deletion of {release.node} requested; this VM stops shortly")
    return 0
