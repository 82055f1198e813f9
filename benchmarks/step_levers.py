"""Levers on the 31B training step, tried with the deviceless compile check: before and after.

    .venv/bin/python benchmarks/step_levers.py [--stack prod] [--depths 6] [--only LEVER,...]

Each lever is the stack's own step (its default: splash kernel, fsdp=1/tp=4, micro-batch 4,
no remat) compiled for its TPU topology by libtpu's compile-only client with one change, at
reduced depth (6 layers by default: the difference a lever makes per layer is what is read),
each compile in its own process:
- `baseline`: the step as it is.
- `split-backward`: the splash kernel's backward as two kernels, dq and dk/dv, that each
  recompute the scores (7 block matmuls per visited block), instead of the fused backward the
  step uses (`use_fused_bwd_kernel`: dq computed inside the dk/dv kernel, 5 matmuls).
- `overlap`: the LIBTPU_INIT_ARGS MaxText sets for v5p to overlap collectives with compute
  (async collective fusion, its multi-step and all-gather variants, compute/collective overlap
  on the TensorCore, async all-gather and collective-permute, data-parallel all-reduce
  optimisation). Whether XLA's cost model sees them at all is the question.
Printed per lever: peak HBM per chip, XLA's FLOPs (kernels as they run), XLA's step-time
estimate, and the collectives of one micro-step read from the compiled HLO
(infra/preflight/hlo_collectives.py: counts, buffer bytes, ring bytes per chip), then the change
against the baseline. With two depths the per-layer slope is extrapolated to the model's depth.

A fourth lever is counted, not compiled: `segment-skip`, skipping kernel blocks across packed
sample boundaries. The pinned kernel decides which key blocks it visits from a static mask
(causal, or the sliding window); samples packed into a row are separated only by segment ids
inside the visited blocks. Counted over the same synthetic CodeV-R1 rows as
benchmarks/packing_efficiency.py, packed by training's own packer, this prints how many of the
visited blocks a mask that knew the segments could skip, and what share of the step's FLOPs
that is at most.

Results are cached in .compile-check/levers/ under the compile check's key of the step (so a
change of the step's code or versions compiles again); a second run prints at once. Every
figure is XLA's estimate for a TPU, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from infra.config import stack_config
from infra.preflight import compile_check, hlo_collectives
from workloads.contract import catalog

ROOT = compile_check.ROOT

# MaxText's v5p settings for overlapping collectives with compute (its benchmarks' xla_flags for
# v5p; each is a libtpu flag, so it goes in through LIBTPU_INIT_ARGS).
OVERLAP_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)
LEVERS = ("baseline", "split-backward", "overlap")
SPLIT_BACKWARD_BLOCK_MATMULS = 7


# --------------------------------------------------------------------------- one compile


def stack(name: str) -> Any:
    """The stack's config, read from its stack file in this checkout."""
    return stack_config.parse_stack_config(
        stack_config.read_stack_file(ROOT / f"Pulumi.{name}.yaml")
    )


def compile_lever(stack_name: str, lever: str, layers: int) -> dict[str, Any]:
    """Compiles the stack's step with `lever` applied, in this process; returns its figures."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    from workloads.train import packed_attention

    cfg = stack(stack_name)
    captured: dict[str, Any] = {}
    real_compile = jax.stages.Lowered.compile

    def keep_compiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        captured["compiled"] = real_compile(self, *args, **kwargs)
        return captured["compiled"]

    jax.stages.Lowered.compile = keep_compiled  # type: ignore[method-assign]
    if lever == "split-backward":
        real_sizes = splash.BlockSizes

        def split_sizes(**kwargs: Any) -> Any:
            kwargs.update(
                use_fused_bwd_kernel=False,
                block_q_dq=kwargs["block_q"],
                block_kv_dq=kwargs["block_kv"],
            )
            return real_sizes(**kwargs)

        splash.BlockSizes = split_sizes
        packed_attention.BACKWARD_BLOCK_MATMULS = SPLIT_BACKWARD_BLOCK_MATMULS
    step = compile_check.compile_depth(cfg)(layers)
    if step.error is not None:
        raise SystemExit(f"step-levers: {lever} at {layers} layers: {step.error}")
    text = captured["compiled"].as_text()
    if os.environ.get("STEP_LEVERS_HLO"):  # to read what the counts come from
        pathlib.Path(os.environ["STEP_LEVERS_HLO"]).write_text(text)
    devices = catalog.accelerator(cfg.training.accelerator).jax_devices
    found = hlo_collectives.count(text, devices=devices)
    return {
        "lever": lever,
        "layers": layers,
        "peak_bytes": step.peak_bytes,
        "flops": step.figures["flops"],
        "kernel_flops": step.figures["kernel_flops"],
        "optimal_seconds": step.figures["optimal_seconds"],
        "compile_seconds": step.compile_seconds,
        "collectives": {
            "count": dict(found.count),
            "buffer_bytes": dict(found.buffer_bytes),
            "ring_bytes": dict(found.ring_bytes),
            "unknown_trip_counts": found.unknown_trip_counts,
        },
    }


def lever_result(stack_name: str, lever: str, layers: int) -> dict[str, Any]:
    """From the cache, or compiled in a child process (each lever its own libtpu flags)."""
    cfg = stack(stack_name)
    key = compile_check.cache_key(compile_check.step_settings(cfg))
    path = compile_check.lever_path(key, lever, layers)
    if path.is_file():
        return json.loads(path.read_text())
    env = dict(os.environ)  # the worker sets what libtpu needs (compile_step.topology_devices)
    if lever == "overlap":
        env["LIBTPU_INIT_ARGS"] = " ".join((env.get("LIBTPU_INIT_ARGS", ""), *OVERLAP_FLAGS))
    print(f"step-levers: compiling {lever} at {layers} layers (minutes)...", file=sys.stderr)
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            lever,
            "--stack",
            stack_name,
            "--depths",
            str(layers),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"step-levers: {lever} at {layers} layers failed: {tail[0]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    compile_check.write_result(path, result)
    return result


# --------------------------------------------------------------------------- segment skipping


def block_visited(q_lo: int, q_hi: int, k_lo: int, k_hi: int, window: int | None) -> bool:
    """Whether a causal (and windowed) mask allows any (q, k) with q in [q_lo, q_hi] and k in
    [k_lo, k_hi] (inclusive): some k <= q, and, with a window, some q - k < window."""
    if k_lo > q_hi:
        return False
    return window is None or max(0, q_lo - k_hi) < window


def visited_blocks(
    segments: list[tuple[int, int]], length: int, block: int, window: int | None
) -> int:
    """Kernel blocks a mask that knows the row's segments ([start, end) spans) would visit:
    a block is needed when one segment has an allowed (q, k) pair inside it."""
    starts = range(0, length, block)
    count = 0
    for q0 in starts:
        for k0 in starts:
            for s, e in segments:
                q_lo, q_hi = max(s, q0), min(e, q0 + block) - 1
                k_lo, k_hi = max(s, k0), min(e, k0 + block) - 1
                if q_lo <= q_hi and k_lo <= k_hi and block_visited(q_lo, q_hi, k_lo, k_hi, window):
                    count += 1
                    break
    return count


def segment_skip(
    length: int, block: int, window: int, samples: int = 10_000, seed: int = 0
) -> dict[str, float]:
    """Mean visited blocks per row and layer kind: the static mask (what the kernel visits) and
    a segment-aware one, over synthetic CodeV-R1 rows packed by training's packer."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import packing_efficiency

    from workloads.data import packing

    mu, sigma = packing_efficiency.lognormal_params(packing_efficiency.MEAN, packing_efficiency.P99)
    rng = np.random.default_rng(seed)
    drawn = np.maximum(1, np.rint(rng.lognormal(mu, sigma, samples))).astype(int)
    lengths = [int(n) for n in drawn if n <= length]
    rows = packing.plan_packed(lengths, length)
    whole = [(0, length)]
    static = {
        "global": visited_blocks(whole, length, block, None),
        "local": visited_blocks(whole, length, block, window),
    }
    aware = {"global": 0.0, "local": 0.0}
    for row in rows:
        spans, at = [], 0
        for index in row:
            spans.append((at, at + lengths[index]))
            at += lengths[index]
        aware["global"] += visited_blocks(spans, length, block, None)
        aware["local"] += visited_blocks(spans, length, block, window)
    return {
        "rows": float(len(rows)),
        "static_global": float(static["global"]),
        "static_local": float(static["local"]),
        "aware_global": aware["global"] / len(rows),
        "aware_local": aware["local"] / len(rows),
    }


# --------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ring_bytes(result: dict[str, Any]) -> float:
    return float(sum(result["collectives"]["ring_bytes"].values()))


def _buffer_bytes(result: dict[str, Any]) -> float:
    return float(sum(result["collectives"]["buffer_bytes"].values()))


def _collective_text(result: dict[str, Any]) -> str:
    calls = sum(result["collectives"]["count"].values())
    return (
        f"{calls} collectives, {_buffer_bytes(result) / 1e9:.1f} GB buffers, "
        f"{_ring_bytes(result) / 1e9:.1f} GB ring"
    )


def _at(results: list[dict[str, Any]], layers: int, value: Any) -> float:
    """The figure at `layers`, from the line through the compiled depths (as the compile check
    extrapolates)."""
    return compile_check.line_at([(r["layers"], value(r)) for r in results], layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--depths", default="6", help="layer counts to compile (default 6)")
    parser.add_argument(
        "--only", default=",".join(LEVERS), help=f"levers to compile (default {','.join(LEVERS)})"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    if args.worker:
        print(json.dumps(compile_lever(args.stack, args.worker, depths[0])))
        return 0
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(LEVERS))
    if unknown:
        parser.error(f"--only: unknown lever(s) {', '.join(unknown)}; known: {', '.join(LEVERS)}")
    cfg = stack(args.stack)
    spec = catalog.model(cfg.model.name)
    accelerator = catalog.accelerator(cfg.training.accelerator)
    print(
        f"stack {args.stack}: {compile_check.describe(compile_check.step_settings(cfg))}, "
        f"{accelerator.name}; per chip and micro-step, XLA's estimates at {depths} layers"
    )
    print()
    print("| lever | layers | peak HBM | TFLOP (kernels) | XLA s | collectives (per micro-step) |")
    print("|---|---:|---:|---:|---:|---|")
    table: dict[str, list[dict[str, Any]]] = {}
    for lever in ["baseline", *[c for c in chosen if c != "baseline"]]:
        for layers in depths:
            r = lever_result(args.stack, lever, layers)
            table.setdefault(lever, []).append(r)
            print(
                f"| {lever} | {layers} | {_gib(r['peak_bytes'])} | {r['flops'] / 1e12:.1f} "
                f"({r['kernel_flops'] / 1e12:.1f}) | {r['optimal_seconds']:.4f} | "
                f"{_collective_text(r)} |",
                flush=True,
            )
    base = table["baseline"]
    print()
    print(f"against the baseline, extrapolated to {spec.layers} layers:")
    for lever, results in table.items():
        if lever == "baseline":
            continue
        for name, value, unit, scale in (
            ("peak HBM", lambda r: r["peak_bytes"], "GiB", 2**30),
            ("XLA time", lambda r: r["optimal_seconds"], "s", 1),
            ("FLOPs", lambda r: r["flops"], "TFLOP", 1e12),
            ("ring bytes", _ring_bytes, "GB", 1e9),
        ):
            before, after = _at(base, spec.layers, value), _at(results, spec.layers, value)
            change = (after - before) / before if before else 0.0
            print(
                f"  {lever:<15} {name:<10} {before / scale:8.3f} -> {after / scale:8.3f} {unit} "
                f"({change:+.1%})"
            )
    ring = _at(base, spec.layers, _ring_bytes)
    buffers = _at(base, spec.layers, _buffer_bytes)
    print(
        f"  collectives of the baseline at {spec.layers} layers: {buffers / 1e9:.1f} GB of "
        f"buffers, {ring / 1e9:.1f} GB sent per chip by a ring, per micro-step"
    )

    from workloads.train import packed_attention

    block = packed_attention.block_size(cfg.data.max_seq_len) or 0
    skip = segment_skip(cfg.data.max_seq_len, block, spec.sliding_window)
    print()
    print(
        f"segment-skip (counted over {skip['rows']:,.0f} packed rows of {cfg.data.max_seq_len} "
        f"tokens, blocks of {block}): global layers visit {skip['static_global']:.0f} blocks, "
        f"{skip['aware_global']:.1f} needed; sliding layers {skip['static_local']:.0f}, "
        f"{skip['aware_local']:.1f} needed"
    )
    globals_, locals_ = spec.global_layers, spec.local_layers
    g_dim, l_dim = spec.global_head_dim, spec.head_dim
    static = globals_ * skip["static_global"] * g_dim + locals_ * skip["static_local"] * l_dim
    aware = globals_ * skip["aware_global"] * g_dim + locals_ * skip["aware_local"] * l_dim
    kernel = _at(base, spec.layers, lambda r: r["kernel_flops"])
    total = _at(base, spec.layers, lambda r: r["flops"]) + compile_check.uncounted_loss_flops(
        compile_check.step_settings(cfg), accelerator.jax_devices
    )
    saved = kernel * (1 - aware / static)
    print(
        f"  at most {saved / 1e12:.1f} of the kernels' {kernel / 1e12:.1f} TFLOP per chip and "
        f"micro-step ({1 - aware / static:.0%}), {saved / total:.1%} of the step's "
        f"{total / 1e12:.1f} TFLOP"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
