"""`python -m workloads demo`: the whole pipeline locally on a CPU with a tiny random Gemma 4.

Steps, each printed as it runs: write a tiny Gemma 4 checkpoint (real layout and structure),
write a small CodeV-R1-style dataset, LoRA-train it with the same code path as a TPU run
(`workloads.train`), stopping halfway as a preempted VM would and resuming from the checkpoint,
merge the adapters and verify the shards and logits; then serve the merged model with the real
vLLM engine (the CPU build of the serving image's release), check that it serves what was trained,
evaluate, benchmark and report (workloads.cli.demo_serving), and print a summary. --no-serve stops
after the merge. --hosts 2 (or 4) trains as a multi-host slice rehearsed on this machine: that
many trainer processes of 4 CPU devices each, joined by JAX's distributed runtime on the v5p-16
(v5p-32) mesh shape fsdp=hosts x tp=4, preempted halfway by a SIGTERM to the last host (every host
stops at the step JAX agrees on and saves) and started again. A slice's hosts must share their
checkpoints, as a bucket is shared on the VMs: with --hosts 2 or 4 the run directory
(checkpoints, metrics, lock) goes to gs://demo/run on a GCS protocol server the demo starts on
127.0.0.1 (fsouza's fake-gcs-server, from the dev extra; its objects under WORKDIR/gcs), or under
a real bucket given by --bucket; the merge reads the checkpoints back from there. Everything else
lands under --workdir (default runs/demo); the run config it used is written there too, so
`python -m workloads train|serve|eval|bench|report --config runs/demo/run.yaml` runs each step
again (a run directory on the demo's own server only while a server serves WORKDIR/gcs).

The terminal shows the stage lines, the training progress (a step line every 1/8 of the run and
each segment's first) and the summary; the tools' and engines' own output goes to WORKDIR/demo.log
and the vLLM server's to WORKDIR/serve/vllm.log, which the summary names
(workloads.cli.demo_console).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import time
from typing import TYPE_CHECKING, Any

from workloads.cli import demo_console
from workloads.common import errors, storage
from workloads.contract import runconfig

if TYPE_CHECKING:
    from collections.abc import Callable

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
    "hosts",
    "gcs",
    "demo.log",
)
# CPU devices per rehearsed host and the tensor-parallel width of a v5p slice's 4-chip workers.
DEVICES_PER_HOST = 4
HOST_TP = 4
# The bucket on the demo's own GCS protocol server and the run directory's prefix in a bucket.
LOCAL_BUCKET = "demo"
RUN_PREFIX = "run"


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
        "--hosts",
        type=int,
        default=1,
        choices=(1, 2, 4),
        help="train as a multi-host slice rehearsed here: this many trainer processes of "
        f"{DEVICES_PER_HOST} CPU devices each on JAX's distributed runtime, mesh fsdp=HOSTS x "
        f"tp={HOST_TP} (2: the v5p-16 shape, 4: v5p-32); their logs go to WORKDIR/hosts/, "
        f"their checkpoints to gs://{LOCAL_BUCKET}/{RUN_PREFIX} on a GCS protocol server the demo "
        "starts on 127.0.0.1 (objects in WORKDIR/gcs/), or to --bucket",
    )
    parser.add_argument(
        "--bucket",
        default=None,
        metavar="gs://NAME",
        help="keep the run directory (checkpoints, metrics, lock) in this real bucket, under "
        f"gs://NAME/gemma4-demo/{RUN_PREFIX}, instead of the demo's local server (--hosts > 1) "
        "or WORKDIR/run; needs credentials that may write it",
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
    tp: int = 1,
    output_dir: str = "",
) -> runconfig.RunConfig:
    """The demo's run config: the recipe's structure at toy scale (packing on, AdamW with warm-up
    and cosine decay, gradient accumulation, remat, checkpoints every quarter of the run).

    Args:
        devices: JAX devices visible (several when XLA_FLAGS fakes them): the mesh must use all
            of them, so the data-parallel axis takes them and the micro-batch is a multiple.
        serving: the serve, bench and eval sections (demo_serving.serving_sections); None = no
            serving (--no-serve).
        tp: the tensor-parallel axis; the data-parallel one takes the rest of the devices.
        output_dir: the run directory (a gs:// URL for a slice); default workdir/run.
    """
    fsdp = devices // tp
    micro_batch = fsdp * max(1, 2 // fsdp)
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
                "output_dir": output_dir or str(workdir / "run"),
                "micro_batch": micro_batch,
                "grad_accum": 2,
                "max_steps": steps,
                "learning_rate": 3e-3,
                "warmup_steps": max(1, steps // 10),
                "weight_decay": 0.001,
                "mesh": {"fsdp": fsdp, "tp": tp},
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


@dataclasses.dataclass
class _Trained:
    """What the demo's training did: stopped once, then resumed to the end."""

    stopped_at: int
    resumed_from: int
    summary: dict[str, Any]
    records: list[dict[str, Any]]


def _train_here(
    cfg: runconfig.RunConfig, half: int, say: Any, tag: str, console: demo_console.Console
) -> _Trained:
    """One process: stop after `half` steps (as a preemption would) and run again."""
    from workloads.train import trainer

    console.new_segment()
    first = trainer.train(cfg, stop_after_steps=half, log=console.trainer_say, handle_sigterm=True)
    say(f"{tag} stopped at step {first.final_step} with a checkpoint; restarting the same run ...")
    console.new_segment()
    second = trainer.train(cfg, log=console.trainer_say)
    if second.resumed_from != first.final_step:
        raise RuntimeError(
            f"expected to resume from step {first.final_step}, resumed from {second.resumed_from}"
        )
    return _Trained(first.final_step, second.resumed_from, second.summary, second.records)


def _train_on_hosts(
    cfg: runconfig.RunConfig,
    config_path: pathlib.Path,
    hosts: int,
    half: int,
    workdir: pathlib.Path,
    say: Any,
    tag: str,
) -> _Trained:
    """`hosts` trainer processes (`python -m workloads train`) joined as one slice; once step
    `half` is logged the last host gets a SIGTERM (a preemption notice reaches one worker): all
    stop at the step JAX agrees on and save it, then all start again and resume from it.

    Raises:
        RuntimeError: a host failed (its log named), or the run did not stop and resume.
    """
    import signal
    import sys

    from workloads.checkpoint import lora_restore
    from workloads.train import hosts as hosts_lib
    from workloads.train import metrics as metrics_lib
    from workloads.train import trainer

    argv = [sys.executable, "-m", "workloads", "train", "--config", str(config_path)]
    log_dir = str(workdir / "hosts")
    metrics_path = runconfig.join(cfg.train.output_dir, metrics_lib.METRICS_FILE)

    def run(stop_after: int | None) -> list[int]:
        procs = hosts_lib.launch_local(
            hosts,
            argv,
            port=hosts_lib.free_port(),
            devices_per_host=DEVICES_PER_HOST,
            log_dir=log_dir,
        )
        signalled = False
        while any(p.poll() is None for p in procs.values()):
            if (
                stop_after is not None
                and not signalled
                and _logged_step(metrics_path) >= stop_after
            ):
                procs[hosts - 1].send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.2)
        return [p.returncode for p in procs.values()]

    say(f"{tag} starting {hosts} trainer processes on JAX's distributed runtime (logs: {log_dir})")
    codes = run(half)
    if any(code not in (0, trainer.EXIT_PREEMPTED) for code in codes):
        raise RuntimeError(f"a host failed (exit statuses {codes}); see {log_dir}/host<i>.log")
    stopped = max(lora_restore.saved_steps(cfg.train.checkpoint_dir), default=0)
    say(
        f"{tag} SIGTERM to host {hosts - 1}: every host stopped at step {stopped} (exit statuses "
        f"{codes}); starting all {hosts} again ..."
    )
    codes = run(None)
    if any(codes):
        raise RuntimeError(f"a host failed (exit statuses {codes}); see {log_dir}/host<i>.log")
    summary = trainer.read_summary(cfg.train.output_dir)
    resumed = summary.get("resumed_from_step")
    if resumed != stopped:
        raise RuntimeError(f"expected to resume from step {stopped}, resumed from {resumed}")
    records = [json.loads(line) for line in storage.read_text(metrics_path).splitlines() if line]
    return _Trained(stopped, stopped, summary, records)


def _logged_step(metrics_path: str) -> int:
    """The newest step in metrics.jsonl, a local file or an object (0 before the first)."""
    if not storage.exists(metrics_path):
        return 0
    steps = [0]
    for line in storage.read_text(metrics_path).splitlines():
        with contextlib.suppress(ValueError):
            steps.append(int(json.loads(line).get("step", 0)))
    return max(steps)


@dataclasses.dataclass(frozen=True)
class _RunStorage:
    """Where the run directory is: its path or URL, and the summary's words for it ('' for the
    local workdir/run)."""

    run_dir: str
    description: str = ""


def _check_bucket(bucket: str | None) -> str:
    """--bucket as gs://NAME without a trailing slash ('' when not given).

    Checked against GCS's naming rules here, before anything runs: a name GCS refuses would
    otherwise reach gcsfs, whose retries last about 50 s and print tracebacks before the line.
    An empty --bucket is refused, not taken for "no bucket".

    Raises:
        errors.UserError: not gs://NAME, or NAME is not a GCS bucket name.
    """
    if bucket is None:
        return ""
    name = bucket.removeprefix("gs://").rstrip("/")
    if not bucket.startswith("gs://") or not name or "/" in name:
        raise errors.UserError(f"--bucket {bucket!r}: expected a bucket as gs://NAME (no path)")
    if not _is_bucket_name(name):
        raise errors.UserError(
            f"--bucket {bucket!r}: {name!r} is not a GCS bucket name (3-63 lowercase letters, "
            "digits, '-', '_' and '.', starting and ending with a letter or a digit)"
        )
    return f"gs://{name}"


def _is_bucket_name(name: str) -> bool:
    """GCS's rules: lowercase letters, digits, '-', '_' and '.', a letter or digit at both ends,
    3-63 characters (up to 222 with dots, each dot-separated part at most 63); not an IP
    address; not starting with "goog"."""
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*[a-z0-9]", name):
        return False
    parts = name.split(".")
    if len(name) > (222 if len(parts) > 1 else 63) or len(name) < 3:
        return False
    if any(not part or len(part) > 63 for part in parts):
        return False
    if len(parts) == 4 and all(part.isdigit() for part in parts):
        return False  # an IP address
    return not name.startswith("goog")


def _run_storage(
    hosts: int,
    bucket: str,
    overwrite: bool,
    workdir: pathlib.Path,
    stack: contextlib.ExitStack,
    say: Callable[[str], None],
) -> _RunStorage:
    """The run directory: under a real bucket when given; for a slice (hosts > 1) in the bucket
    of a GCS protocol server started here for the demo's duration (entered on `stack`), since
    every host must see every checkpoint; otherwise workdir/run.

    Raises:
        errors.UserError: the bucket already holds a demo run (without --overwrite); the server's
            package is missing or the server did not start.
    """
    if bucket:
        run_dir = f"{bucket}/gemma4-demo/{RUN_PREFIX}"
        if storage.exists(run_dir):
            if not overwrite:
                raise errors.UserError(
                    f"{run_dir} already holds a demo run; pass --overwrite to replace it"
                )
            storage.remove_tree(run_dir)
        return _RunStorage(run_dir, f"{run_dir} (--bucket)")
    if hosts == 1:
        return _RunStorage(str(workdir / "run"))
    from workloads.common import gcs_server

    try:
        server = stack.enter_context(gcs_server.serving(workdir / "gcs" / "objects", LOCAL_BUCKET))
    except (RuntimeError, OSError) as exc:
        raise errors.UserError(
            f"the local GCS protocol server did not start ({errors.exception_line(exc)}); "
            "pass --bucket gs://NAME to use a real bucket"
        ) from None
    run_dir = f"gs://{LOCAL_BUCKET}/{RUN_PREFIX}"
    say(f"checkpoints go to {run_dir} on a GCS protocol server at {server.url}")
    return _RunStorage(
        run_dir,
        f"{run_dir} on the demo's GCS protocol server (fake-gcs-server at {server.url}, "
        f"objects in {workdir / 'gcs'})",
    )


def main(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise errors.UserError(f"--steps {args.steps}: the demo needs at least 2 steps")
    started = time.time()
    workdir = pathlib.Path(args.workdir)
    from workloads.cli import demo_serving

    # Before anything is written or trained: a usable --bucket, no earlier demo in the way, and
    # the serving venv is there unless the user opted out.
    bucket = _check_bucket(args.bucket)
    _refuse_existing(workdir, args.overwrite)
    engine = None if args.no_serve else demo_serving.require_engine()
    _prepare_workdir(workdir, args.overwrite)

    # The terminal gets the stage lines, the training progress and the summary; the tools' and
    # engines' own output goes to WORKDIR/demo.log (workloads.cli.demo_console). The local GCS
    # protocol server (a slice's shared storage) runs until the demo ends.
    with (
        demo_console.captured(workdir / demo_console.LOG_NAME, started) as console,
        contextlib.ExitStack() as stack,
    ):
        where = _run_storage(args.hosts, bucket, args.overwrite, workdir, stack, console.say)
        lines = _demo(args, workdir, engine, where, started, console)
        console.show("\n".join(lines))
    return 0


def _demo(
    args: argparse.Namespace,
    workdir: pathlib.Path,
    engine: Any,
    where: _RunStorage,
    started: float,
    console: demo_console.Console,
) -> list[str]:
    """The demo's steps once the workdir and the run directory's storage are ready; returns the
    summary's lines."""
    from workloads.cli import demo_serving

    say = console.say

    total = 4 if engine is None else 8
    from workloads.data import synthetic
    from workloads.model import tiny_model

    hosts = args.hosts
    say(
        f"1/{total} writing a tiny random Gemma 4 (6 layers: 5 sliding + 1 global, k_eq_v, GQA) ..."
    )
    # tp=4 on a slice's mesh must divide every head count: the global layers get 4 KV heads.
    global_kv = tiny_model.GLOBAL_KV_HEADS if hosts == 1 else tiny_model.TP4_GLOBAL_KV_HEADS
    tiny_model.write_tiny_model(workdir / "model", seed=0, global_kv_heads=global_kv)
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

    serving = (
        None
        if engine is None
        else demo_serving.serving_sections(workdir, engine, demo_serving.free_port())
    )
    if hosts == 1:
        import jax

        cfg = demo_config(
            workdir,
            args.steps,
            devices=jax.device_count(),
            serving=serving,
            output_dir=where.run_dir,
        )
    else:
        cfg = demo_config(
            workdir,
            args.steps,
            devices=hosts * DEVICES_PER_HOST,
            serving=serving,
            tp=HOST_TP,
            output_dir=where.run_dir,
        )
    config_path = workdir / "run.yaml"
    config_path.write_text(cfg.to_yaml())

    half = args.steps // 2
    say(
        f"3/{total} training {args.steps} steps; stopping after step {half} as a preempted VM "
        "would ..."
    )
    run = (
        _train_here(cfg, half, say, f"3/{total}", console)
        if hosts == 1
        else _train_on_hosts(cfg, config_path, hosts, half, workdir, say, f"3/{total}")
    )
    summary = run.summary

    say(f"4/{total} merge and verification ...")
    merged = merge_and_verify(workdir, cfg)
    say(f"4/{total} merged into {workdir / 'merged'}: {merged['logits']}")
    plot_loss(run.records, workdir / "loss.png", resumed_at=run.stopped_at)
    served = (
        [] if engine is None else demo_serving.serve_and_evaluate(config_path, cfg, workdir, say)
    )

    wall = time.time() - started
    losses = [r["loss"] for r in run.records]
    # Totals over both processes (train_summary.json sums the run's segments).
    tokens = summary["real_tokens"]
    seconds = summary["wall_seconds"]
    run_dir = cfg.train.output_dir
    steps = summary["checkpoint_steps"]
    config = config_path
    mesh, ckpt_dir = cfg.train.mesh, cfg.train.checkpoint_dir
    lines = [
        "",
        "demo summary",
        f"  hosts: {hosts} host{'s' if hosts > 1 else ''} (mesh fsdp={mesh.fsdp} x tp={mesh.tp}"
        + (
            f", {hosts} processes on JAX's distributed runtime, logs in {workdir / 'hosts'})"
            if hosts > 1
            else ", one process)"
        ),
        f"  loss: first {losses[0]:.3f} -> last {losses[-1]:.3f} over {len(losses)} steps "
        f"(min {min(losses):.3f})",
        f"  tokens/s: {tokens / seconds:.0f} real tokens/s ({tokens} tokens in {seconds:.1f} s of "
        f"training over {summary['segments']} segments, first-step compilation included)",
        f"  resumed: stopped after step {run.stopped_at}, resumed from checkpoint step "
        f"{run.resumed_from}",
        f"  checkpoints: {', '.join(runconfig.join(ckpt_dir, str(s)) for s in steps)}",
        *([f"  run directory: {where.description}"] if where.description else []),
        f"  metrics: {runconfig.join(run_dir, 'metrics.jsonl')}, TensorBoard: "
        f"{runconfig.join(run_dir, 'tensorboard')}",
        f"  summary: {runconfig.join(run_dir, 'train_summary.json')}",
        f"  loss curve: {workdir / 'loss.png'}",
        f"  run config: {config} (python -m workloads train --config {config})",
    ]
    lines += [f"  {key}: {value}" for key, value in merged.items()]
    lines += served
    if engine is None:
        lines.append("  serving: skipped (--no-serve)")
    logs = [f"{workdir / demo_console.LOG_NAME} (the tools' and libraries' own output)"]
    if engine is not None:
        logs.append(f"{workdir / 'serve' / 'vllm.log'} (the vLLM server)")
    if hosts > 1:
        logs.append(f"{workdir / 'hosts'}/host<i>.log (each trainer process)")
    lines.append(f"  logs: {', '.join(logs)}")
    lines.append(f"  wall time: {wall:.0f} s")
    return lines
