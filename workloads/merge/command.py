"""`python -m workloads merge`: LoRA adapters of a training run -> sharded HF safetensors.

Rank, alpha and targets come from the checkpoint's own lora_meta.json. The merge runs on the host
CPU (JAX is pinned to the CPU platform here): it never needs, or holds, an accelerator.
"""

from __future__ import annotations

import argparse
import os

from workloads.common import cli_options, errors, storage
from workloads.contract import runconfig


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cli_options.add_config(
        parser,
        uses="base = model.base, checkpoint = the run's checkpoints, out/step/shard size = the "
        "merge section; a re-run after a finished merge of the same step does nothing (this is "
        "how the VM's merge unit calls it)",
    )
    parser.add_argument(
        "--base", type=storage.absolute, help="base model directory (local or gs://)"
    )
    parser.add_argument(
        "--checkpoint",
        type=storage.absolute,
        help="the run's checkpoints/ directory (or the run directory above it)",
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--out", type=storage.absolute, help="output directory (local or gs://)")
    cli_options.config_default(
        parser.add_argument(
            "--shard-size", default=None, help="largest output file, e.g. 5GB or 512MiB"
        ),
        runconfig.MergeRunSection.model_fields["shard_size"].default,
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="afterwards, re-read the output: the checksum of every shard, and every "
        "non-target tensor byte-identical to the base",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="parts of shards merged at once, each in its own thread (default: one per CPU core, "
        "at most 16)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _from_config(args: argparse.Namespace) -> None:
    """Fills base/checkpoint/out/step/shard size from --config (flags win). A gs:// base is read
    from the run's local staging copy (model.stage_dir, which training already filled), so the
    62.5 GB are not downloaded twice.

    Raises:
        errors.UserError: the config has no merge section, or a required value is missing.
    """
    if args.config:
        cfg = runconfig.load(args.config)
        if cfg.merge is None:
            raise errors.UserError(f"{args.config}: merge: the run config has no merge section")
        if not args.base:
            from workloads.model import base_weights, gemma4

            base = base_weights.model_dir(cfg.model.base, cfg.model.stage_dir)
            args.base = str(gemma4.stage(base, cfg.model.stage_dir))
        args.checkpoint = args.checkpoint or cfg.train.checkpoint_dir
        args.out = args.out or cfg.merge.out
        args.step = cfg.merge.step if args.step is None else args.step
        args.shard_size = args.shard_size or cfg.merge.shard_size
    missing = [f"--{name}" for name in ("base", "checkpoint", "out") if not getattr(args, name)]
    if missing:
        raise errors.UserError(f"merge needs {', '.join(missing)} (or --config RUN.yaml)")
    args.shard_size = args.shard_size or "5GB"


def _already_merged(args: argparse.Namespace) -> str | None:
    """With --config (the VM's merge unit, which runs again after every successful training
    start): a finished merge of the requested checkpoint step is kept, not redone or refused.

    Returns:
        A message when the output already holds that merge, else None.
    """
    from workloads.checkpoint import lora_restore
    from workloads.merge import safetensors_io as st
    from workloads.merge import verify

    if not args.config or args.overwrite:
        return None
    if not storage.exists(runconfig.join(args.out, st.INDEX_FILE)):
        return None
    try:
        meta = verify.read_merge_metadata(args.out)
        checkpoint = lora_restore.find_checkpoint_dir(args.checkpoint)
        step = lora_restore.resolve_step(checkpoint, args.step)
    except errors.UserError:
        return None
    if meta.get("step") == step and meta.get("source_checkpoint") == checkpoint:
        return f"{args.out} already holds the merge of step {step} of {checkpoint}; nothing to do"
    return None


def main(args: argparse.Namespace) -> int:
    # Before anything imports jax: the merge needs no accelerator, and must not grab one that a
    # training or serving process on the same host holds.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from workloads import merge

    _from_config(args)
    done = _already_merged(args)
    if done:
        print(done)
        return 0

    result = merge.merge_lora(
        args.base,
        args.checkpoint,
        args.out,
        step=args.step,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        workers=args.workers,
    )
    print(result.summary())
    if args.verify:
        report = merge.verify_merged(args.out, base=args.base)
        print(report.summary())
        if not report.ok:
            return 1
    return 0
