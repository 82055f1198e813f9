"""Compares training-step settings of the prod stack with the deviceless compile check.

    .venv/bin/python benchmarks/compile_sweep.py [--depths 6,12] [--stack prod]

For each slice, attention path (dense mask or splash kernel), mesh (fsdp x tp), micro-batch and
remat policy in SETTINGS, the prod stack's 31B LoRA step (8 rows per optimizer step) is compiled
for the slice's topology (the v5p-8, and the multi-host v5p-16 and v5p-32) with libtpu's
compile-only client at reduced depths and extrapolated to 60 layers
(infra/preflight/compile_check.py).
Prints a Markdown table: per-chip peak HBM, the estimated time per micro-step as a band (XLA's
cost model with the attention kernels, which XLA does not see, at 80% of peak; XLA's part
calibrated on the paper's measured step with the kernels at 50%; their geometric mean in the
middle: `compile_check.Estimate.band`), the real tokens/s it implies for padded rows (the
paper's layout) and for packed rows, and the share of the chips' peak by XLA's FLOP count.
Everything is an estimate, not a TPU measurement. Results are cached in .compile-check/, so a
second run prints at once.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from infra.config import model as config
from infra.config import stack_config
from infra.preflight import compile_check
from workloads.contract import catalog

# (accelerator, fsdp, tp, micro-batch, remat, attention): tunix's dense-mask attention at the
# settings chosen before the kernel existed, then the splash kernel over the remat policies,
# micro-batches and the meshes that multiply to the v5p-8's 4 devices (a micro-batch must split
# over fsdp), then the multi-host slices with the mesh validation accepts there (tp=4 within a
# host, fsdp over the hosts; the micro-batch a multiple of fsdp and of the hosts).
SETTINGS = (
    ("v5p-8", 1, 4, 1, "full", "dense"),
    ("v5p-8", 1, 4, 2, "none", "dense"),
    ("v5p-8", 1, 4, 1, "full", "kernel"),
    ("v5p-8", 1, 4, 2, "full", "kernel"),
    ("v5p-8", 1, 4, 2, "dots", "kernel"),
    ("v5p-8", 1, 4, 2, "none", "kernel"),
    ("v5p-8", 1, 4, 4, "dots", "kernel"),
    ("v5p-8", 1, 4, 4, "none", "kernel"),
    ("v5p-8", 2, 2, 2, "none", "kernel"),
    ("v5p-8", 2, 2, 4, "none", "kernel"),
    ("v5p-8", 4, 1, 4, "none", "kernel"),
    ("v5p-16", 2, 4, 8, "none", "kernel"),
    ("v5p-32", 4, 4, 8, "none", "kernel"),
)
# Rows per optimizer step in every setting (the paper's effective batch): gradient accumulation
# is ROWS_PER_STEP / micro-batch, at least 1.
ROWS_PER_STEP = 8


def sweep_config(
    stack: str,
    accelerator: str,
    fsdp: int,
    tp: int,
    micro_batch: int,
    remat: str,
    attention: str,
    *,
    validate: bool = False,
) -> config.StackConfig:
    mapping = copy.deepcopy(
        stack_config.read_stack_file(compile_check.ROOT / f"Pulumi.{stack}.yaml")
    )
    mapping["training"] = {
        **mapping["training"],
        "accelerator": accelerator,
        "mesh": {"fsdp": fsdp, "tp": tp},
        "microBatch": micro_batch,
        "gradAccum": max(1, ROWS_PER_STEP // micro_batch),
        "remat": remat,
        "attention": attention,
    }
    return stack_config.parse_stack_config(mapping, validate=validate)


def row(
    stack: str,
    accelerator: str,
    fsdp: int,
    tp: int,
    micro_batch: int,
    remat: str,
    attention: str,
    depths: tuple[int, ...],
) -> str:
    head = f"| {accelerator} | {attention} | {fsdp} | {tp} | {micro_batch} | {remat} |"
    if micro_batch % fsdp:
        return f"{head} n/a: {micro_batch} row(s) cannot split over fsdp={fsdp} | | | | |"
    cfg = sweep_config(stack, accelerator, fsdp, tp, micro_batch, remat, attention)
    est = compile_check.check(
        stack,
        cfg,
        compile_fn=compile_check.compile_depth(cfg),
        depths=depths,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if est is None or not est.fits:
        why = compile_check.verdict_line(est) if est else "nothing compiled"
        return f"{head} does not fit: {why} | | | | |"
    fast, middle, slow = est.band
    padded = est.computed_tokens_per_s * compile_check.REAL_FRACTION[False]
    packed_slow, packed, packed_fast = (
        est.computed_tokens_per_step * compile_check.REAL_FRACTION[True] / t
        for t in (slow, middle, fast)
    )
    return (
        f"{head} {est.peak_bytes / 2**30:.1f} GiB ({est.headroom:.0%} free) | "
        f"{middle:.3f} s ({fast:.3f}-{slow:.3f}) | {padded:,.0f} | "
        f"{packed:,.0f} ({packed_slow:,.0f}-{packed_fast:,.0f}) | {est.peak_share_band[1]:.0%} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="prod")
    parser.add_argument(
        "--depths",
        default="6,12",
        help="layer counts to compile (default 6,12); a depth is "
        "compiled only when its result is not cached",
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated 1-based rows of SETTINGS to run (default all)"
    )
    args = parser.parse_args()
    depths = tuple(int(d) for d in args.depths.split(","))
    chosen = [SETTINGS[int(i) - 1] for i in args.only.split(",")] if args.only else list(SETTINGS)
    print(
        f"stack {args.stack}, depths {depths} extrapolated to 60 layers, {ROWS_PER_STEP} rows per "
        f"optimizer step; XLA estimates "
        f"(paper, measured: {catalog.PAPER.train_tokens_per_s_tpu:,.0f} real tokens/s)\n"
    )
    print(
        "| slice | attention | fsdp | tp | micro-batch | remat | peak HBM per chip | "
        "est. s per micro-step (band) | est. real tok/s, padded | est. real tok/s, packed (band) | "
        "share of peak |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for setting in chosen:
        print(row(args.stack, *setting, depths), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
