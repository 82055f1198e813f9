"""`python -m workloads demo`: the whole pipeline locally on a CPU with a tiny random Gemma 4.

Steps, each printed as it runs: write a tiny Gemma 4 checkpoint (real layout and structure),
write a small CodeV-R1-style dataset, LoRA-train it with the same code path as a TPU run
(`workloads.train`), stopping halfway as a preempted VM would and resuming from the checkpoint,
merge the adapters and verify the shards and logits; then serve the merged model with the real
vLLM engine (the CPU build of the serving image's release), check that it serves what was trained,
evaluate, benchmark and report (workloads.cli.demo_serving), and print a summary. --no-serve stops
after the merge. Everything lands under --workdir (default runs/demo); the run config it used is
written there too, so `python -m workloads train|serve|eval|bench|report --config
runs/demo/run.yaml` runs each step again.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import time
from typing import Any

from workloads.common import errors, storage
from workloads.contract import runconfig

# What the demo owns inside its workdir (--overwrite removes exactly these, nothing else).
_OWNED = (
    "model",
    "data",
    "run",
    "merged",
    "serve",
    "eval",
    "bench",
    "report",
    "run.yaml",
    "loss.png",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir",
        default="runs/demo",
        type=storage.absolute,
        help="where everything goes (a relative path is under the current directory)",
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--rows", type=int, default=240, help="synthetic dataset rows")
    parser.add_argument(
        "--no-serve",
        action="store_true",
        help="stop after the merge: no vLLM serving, eval, benchmark or report (for a machine "
        "without the serving venv that `bash .ci/setup` installs)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous demo in --workdir (only the demo's own files)",
    )


def demo_config(
    workdir: pathlib.Path,
    steps: int,
    devices: int = 1,
    serving: dict[str, Any] | None = None,
) -> runconfig.RunConfig:
    """The demo's run config: the recipe's structure at toy scale (packing on, AdamW with warm-up
    and cosine decay, gradient accumulation, remat, checkpoints every quarter of the run).

    Args:
        devices: JAX devices visible (several when XLA_FLAGS fakes them): the mesh must use all
            of them, so the data-parallel axis takes them and the micro-batch is a multiple.
        serving: the serve, bench and eval sections (demo_serving.serving_sections); None = no
            serving (--no-serve).
    """
    micro_batch = devices * max(1, 2 // devices)
    return runconfig.parse(
        {
            "run_name": "demo",
            "model": {"base": str(workdir / "model"), "dtype": "float32"},
            "data": {
                "dataset": str(workdir / "data" / "codev_synthetic.jsonl"),
                "max_rows": None,
                "max_seq_len": 256,
                "packing": True,
                "seed": 0,
            },
            "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.05},
            "train": {
                "output_dir": str(workdir / "run"),
                "micro_batch": micro_batch,
                "grad_accum": 2,
                "max_steps": steps,
                "learning_rate": 3e-3,
                "warmup_steps": max(1, steps // 10),
                "weight_decay": 0.001,
                "mesh": {"fsdp": devices, "tp": 1},
                "remat": True,
                "save_every": max(1, steps // 4),
                "keep_checkpoints": 2,
                "log_every": 1,
                "compile_cache_dir": str(workdir / "jax_cache"),
            },
            "merge": {"out": str(workdir / "merged")},
            **(serving or {}),
        },
        source="demo config",
    )


def plot_loss(records: list[dict[str, Any]], out: pathlib.Path, *, resumed_at: int | None) -> None:
    """Loss per optimizer step as a PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, marker="o", markersize=3, linewidth=1.5, label="training loss")
    if resumed_at:
        ax.axvline(
            resumed_at + 0.5,
            color="grey",
            linestyle="--",
            linewidth=1,
            label=f"stopped and resumed after step {resumed_at}",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean NLL of the model turn")
    ax.set_title("Demo: LoRA on a tiny Gemma 4 (CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# The merged tiny model must reproduce the LoRA model's logits this closely (float32;
# a wrong head order, swapped k/v or a missing transpose gives errors of order 1).
MERGE_TOLERANCE = 1e-4


def merge_and_verify(workdir: pathlib.Path, cfg: runconfig.RunConfig) -> dict[str, Any]:
    """Merges the run's LoRA checkpoint into HF safetensors shards under workdir/merged, checks
    the shards (checksums, non-targets byte-identical to the base) and that the merged model
    without LoRA gives the LoRA model's logits.

    Returns:
        Lines for the summary.

    Raises:
        RuntimeError: the verification failed (the demo must not report success).
    """
    from workloads import merge

    out = str(workdir / "merged")
    result = merge.merge_lora(cfg.model.base, cfg.train.checkpoint_dir, out, progress=False)
    report = merge.verify_merged(out, base=cfg.model.base)
    logits = merge.compare_logits(cfg.model.base, cfg.train.checkpoint_dir, out)
    if not report.ok:
        raise RuntimeError(report.summary())
    if not logits.max_abs_diff < MERGE_TOLERANCE:
        raise RuntimeError(f"{logits.summary()}: above the tolerance {MERGE_TOLERANCE:g}")
    return {
        "merge": result.summary(),
        "verify": report.summary(),
        "logits": f"{logits.summary()} (tolerance {MERGE_TOLERANCE:g})",
    }


def _refuse_existing(workdir: pathlib.Path, overwrite: bool) -> list[str]:
    """The demo's own files already in workdir (an error without --overwrite)."""
    present = [name for name in _OWNED if (workdir / name).exists()]
    if present and not overwrite:
        raise errors.UserError(
            f"{workdir} already holds a demo ({', '.join(present)}); pass "
            "--overwrite to start over or --workdir for another directory"
        )
    return present


def _prepare_workdir(workdir: pathlib.Path, overwrite: bool) -> None:
    present = _refuse_existing(workdir, overwrite)
    for name in present:
        path = workdir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    workdir.mkdir(parents=True, exist_ok=True)


def main(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise errors.UserError(f"--steps {args.steps}: the demo needs at least 2 steps")
    started = time.time()
    workdir = pathlib.Path(args.workdir)
    from workloads.cli import demo_serving

    # Before anything is written or trained: no earlier demo in the way, and the serving venv is
    # there unless the user opted out.
    _refuse_existing(workdir, args.overwrite)
    engine = None if args.no_serve else demo_serving.require_engine()
    _prepare_workdir(workdir, args.overwrite)
    total = 4 if engine is None else 8

    def say(text: str) -> None:
        print(f"[demo {time.time() - started:5.1f}s] {text}", flush=True)

    from workloads.data import synthetic
    from workloads.model import tiny_model

    say(
        f"1/{total} writing a tiny random Gemma 4 (6 layers: 5 sliding + 1 global, k_eq_v, GQA) ..."
    )
    tiny_model.write_tiny_model(workdir / "model", seed=0)
    say(f"1/{total} wrote {workdir / 'model'}")
    say(f"2/{total} writing {args.rows} synthetic CodeV-R1-style rows ...")
    written = synthetic.write_synthetic_codev(
        str(workdir / "data" / "codev_synthetic.jsonl"), args.rows, seed=0
    )
    say(
        f"2/{total} wrote {written.rows} rows ({written.empty} empty and {written.too_long} too "
        "long on purpose: the pipeline must drop them)"
    )
    # The demo is the CPU pipeline (an accelerator in this machine is left alone).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    serving = (
        None
        if engine is None
        else demo_serving.serving_sections(workdir, engine, demo_serving.free_port())
    )
    cfg = demo_config(workdir, args.steps, devices=jax.device_count(), serving=serving)
    config_path = workdir / "run.yaml"
    config_path.write_text(cfg.to_yaml())

    from workloads.train import trainer

    half = args.steps // 2
    say(
        f"3/{total} training {args.steps} steps; stopping after step {half} as a preempted VM "
        "would ..."
    )
    first = trainer.train(cfg, stop_after_steps=half, log=say, handle_sigterm=True)
    say(
        f"3/{total} stopped at step {first.final_step} with a checkpoint; restarting the same "
        "run ..."
    )
    second = trainer.train(cfg, log=say)
    if second.resumed_from != first.final_step:
        raise RuntimeError(
            f"expected to resume from step {first.final_step}, resumed from {second.resumed_from}"
        )
    summary = second.summary

    say(f"4/{total} merge and verification ...")
    merged = merge_and_verify(workdir, cfg)
    say(f"4/{total} merged into {workdir / 'merged'}: {merged['logits']}")
    plot_loss(second.records, workdir / "loss.png", resumed_at=first.final_step)
    served = (
        [] if engine is None else demo_serving.serve_and_evaluate(config_path, cfg, workdir, say)
    )

    wall = time.time() - started
    losses = [r["loss"] for r in second.records]
    # Totals over both processes (train_summary.json sums the run's segments).
    tokens = summary["real_tokens"]
    seconds = summary["wall_seconds"]
    run_dir = pathlib.Path(cfg.train.output_dir)
    steps = summary["checkpoint_steps"]
    config = config_path
    lines = [
        "",
        "demo summary",
        f"  loss: first {losses[0]:.3f} -> last {losses[-1]:.3f} over {len(losses)} steps "
        f"(min {min(losses):.3f})",
        f"  tokens/s: {tokens / seconds:.0f} real tokens/s ({tokens} tokens in {seconds:.1f} s of "
        f"training over {summary['segments']} segments, first-step compilation included)",
        f"  resumed: stopped after step {first.final_step}, resumed from checkpoint step "
        f"{second.resumed_from}",
        f"  checkpoints: {', '.join(str(run_dir / 'checkpoints' / str(s)) for s in steps)}",
        f"  metrics: {run_dir / 'metrics.jsonl'}, TensorBoard: {run_dir / 'tensorboard'}",
        f"  summary: {run_dir / 'train_summary.json'}",
        f"  loss curve: {workdir / 'loss.png'}",
        f"  run config: {config} (python -m workloads train --config {config})",
    ]
    lines += [f"  {key}: {value}" for key, value in merged.items()]
    lines += served
    if engine is None:
        lines.append("  serving: skipped (--no-serve)")
    lines.append(f"  wall time: {wall:.0f} s")
    print("\n".join(lines), flush=True)
    return 0
