"""How much of the computed tokens are real, with and without sequence packing.

Sample lengths follow a lognormal fitted to CodeV-R1 as rendered for Gemma 4 (mean 922 tokens,
99th percentile 2553, from the paper's dataset statistics); samples longer than max_seq_len
are dropped, as training does.
Rows are planned and filled by the same code training uses (workloads.data.packing).

    python benchmarks/packing_efficiency.py [--samples 10000] [--max-seq-len 3072] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from workloads.data import packing

MEAN, P99 = 922.0, 2553.0
Z99 = 2.326347874  # standard normal 99th percentile


def lognormal_params(mean: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) with exp(mu + sigma^2/2) = mean and exp(mu + Z99 sigma) = p99 (smaller root)."""
    gap = math.log(p99) - math.log(mean)  # = Z99 sigma - sigma^2 / 2
    sigma = Z99 - math.sqrt(Z99 * Z99 - 2 * gap)
    return math.log(mean) - sigma * sigma / 2, sigma


@dataclasses.dataclass(frozen=True)
class _Sample:
    tokens: np.ndarray
    prompt_len: int


def _fill_rate(rows: list[list[int]], samples: list[_Sample], max_seq_len: int) -> float:
    """Rows per second of build_batch, filling micro-batches of 8 rows."""
    started = time.perf_counter()
    for start in range(0, len(rows), 8):
        packing.build_batch(rows[start : start + 8], samples, max_seq_len)
    return len(rows) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000, help="rows drawn (paper: 10,000)")
    parser.add_argument("--max-seq-len", type=int, default=3072, help="tokens per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    mu, sigma = lognormal_params(MEAN, P99)
    rng = np.random.default_rng(args.seed)
    drawn = np.maximum(1, np.rint(rng.lognormal(mu, sigma, args.samples))).astype(int)
    lengths = [int(n) for n in drawn if n <= args.max_seq_len]
    samples = [_Sample(np.ones(n, np.int32), n // 2) for n in lengths]
    print(
        f"lognormal mu={mu:.4f} sigma={sigma:.4f}: {args.samples} samples drawn, "
        f"{args.samples - len(lengths)} longer than {args.max_seq_len} dropped, "
        f"{len(lengths)} kept; kept mean {statistics.fmean(lengths):.0f}, "
        f"p99 {np.percentile(lengths, 99):.0f}, max {max(lengths)} tokens"
    )
    print()
    print("| layout | rows | real tokens | computed tokens | real | plan rows/s | fill rows/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    real = sum(lengths)
    for name, plan in (
        ("one sample per row", packing.plan_unpacked),
        ("packed (best-fit decreasing)", packing.plan_packed),
    ):
        started = time.perf_counter()
        rows = plan(lengths, args.max_seq_len)
        plan_rate = len(rows) / (time.perf_counter() - started)
        computed = len(rows) * args.max_seq_len
        print(
            f"| {name} | {len(rows)} | {real} | {computed} | {100 * real / computed:.1f}% | "
            f"{plan_rate:,.0f} | {_fill_rate(rows, samples, args.max_seq_len):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
