"""The cost model: pure functions over the catalog's hourly rates (workloads/contract/catalog.py).

    train_cost      = hourly rate x training wall hours
    $/1M tokens     = hourly rate / (tokens per second x 3600 / 1e6)
    TCO(H)          = train_cost + H x serving hourly rate

`paper_tables` recomputes the paper's own tables from its inputs (catalog.PAPER and the rates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from workloads.contract import catalog

TCO_HOURS: tuple[int, ...] = (1, 8, 24)
# The paper's long-context serving point: 4096 input / 512 output tokens.
PAPER_SERVE_SHAPE: tuple[int, int] = (4096, 512)
OURS = "this run"  # the label of our column


def train_cost(hourly_usd: float, hours: float) -> float:
    """USD for `hours` of a machine billed at `hourly_usd`.

    Raises:
        ValueError: a negative rate or duration.
    """
    if hourly_usd < 0 or hours < 0:
        raise ValueError(
            f"need a non-negative rate and duration, got {hourly_usd} $/h for {hours} h"
        )
    return hourly_usd * hours


def usd_per_million_tokens(hourly_usd: float, tokens_per_second: float) -> float:
    """USD per 1M tokens for a machine at `hourly_usd` producing `tokens_per_second`.

    Raises:
        ValueError: a throughput that is not positive.
    """
    if tokens_per_second <= 0:
        raise ValueError(f"tokens per second must be positive, got {tokens_per_second}")
    return hourly_usd / (tokens_per_second * 3600 / 1e6)


def tco(train_cost_usd: float, serving_hourly_usd: float, serving_hours: float) -> float:
    """Total cost of ownership: training once plus `serving_hours` of serving."""
    return train_cost_usd + serving_hours * serving_hourly_usd


@dataclasses.dataclass(frozen=True)
class Platform:
    """One column of the comparison: who trained and served on what, and what it cost.

    None marks a figure that was not measured (the report says so instead of inventing one).
    """

    label: str
    train_machine: str | None
    train_hourly_usd: float | None
    train_hours: float | None
    train_cost: float | None
    train_tokens_per_s: float | None
    train_usd_per_m_tokens: float | None
    serve_machine: str | None
    serve_hourly_usd: float | None
    # (input_len, output_len) -> (peak output tokens/s, $/1M output tokens or None)
    serving: Mapping[tuple[int, int], tuple[float, float | None]]
    tco: Mapping[int, float]
    train_tokens: int | None = None  # real (non-padding) tokens trained on
    # Padding included: what the chips computed (the paper padded every sample to 3,072 tokens).
    train_computed_tokens_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["serving"] = [
            {
                "input_len": i,
                "output_len": o,
                "output_tokens_per_s": tps,
                "usd_per_m_output_tokens": usd,
            }
            for (i, o), (tps, usd) in sorted(self.serving.items())
        ]
        data["tco"] = {str(h): v for h, v in self.tco.items()}
        return data


def _tco_table(
    train: float | None, serve_rate: float | None, hours: Iterable[int]
) -> dict[int, float]:
    if train is None or serve_rate is None:
        return {}
    return {h: tco(train, serve_rate, h) for h in hours}


def paper_tables(hours: Sequence[int] = TCO_HOURS) -> tuple[Platform, Platform]:
    """The paper's TPU (v5p-8 train, v6e-8 serve) and GPU (a3-highgpu-2g) columns."""
    paper = catalog.PAPER
    v5p, v6e = catalog.ACCELERATORS["v5p-8"], catalog.ACCELERATORS["v6e-8"]
    gpu = catalog.GPU_A3_HIGHGPU_2G
    tpu_train = train_cost(v5p.hourly_usd, paper.train_hours_tpu)
    gpu_train = train_cost(gpu.hourly_usd, paper.train_hours_gpu)
    tpu = Platform(
        label="paper TPU",
        train_machine=v5p.name,
        train_hourly_usd=v5p.hourly_usd,
        train_hours=paper.train_hours_tpu,
        train_cost=tpu_train,
        train_tokens_per_s=paper.train_tokens_per_s_tpu,
        train_usd_per_m_tokens=usd_per_million_tokens(v5p.hourly_usd, paper.train_tokens_per_s_tpu),
        serve_machine=v6e.name,
        serve_hourly_usd=v6e.hourly_usd,
        serving={
            PAPER_SERVE_SHAPE: (
                paper.serve_long_ctx_tok_s_tpu,
                usd_per_million_tokens(v6e.hourly_usd, paper.serve_long_ctx_tok_s_tpu),
            )
        },
        tco=_tco_table(tpu_train, v6e.hourly_usd, hours),
        train_computed_tokens_per_s=paper.train_steps * 8 * 3072 / (paper.train_hours_tpu * 3600),
    )
    gpu_column = Platform(
        label="paper GPU",
        train_machine=gpu.name,
        train_hourly_usd=gpu.hourly_usd,
        train_hours=paper.train_hours_gpu,
        train_cost=gpu_train,
        train_tokens_per_s=None,  # the paper gives the GPU's hours, not its throughput
        train_usd_per_m_tokens=None,
        serve_machine=gpu.name,
        serve_hourly_usd=gpu.hourly_usd,
        serving={
            PAPER_SERVE_SHAPE: (
                paper.serve_long_ctx_tok_s_gpu,
                usd_per_million_tokens(gpu.hourly_usd, paper.serve_long_ctx_tok_s_gpu),
            )
        },
        tco=_tco_table(gpu_train, gpu.hourly_usd, hours),
    )
    return tpu, gpu_column


def peak_throughput(bench_rows: Iterable[Mapping[str, Any]]) -> dict[tuple[int, int], float]:
    """Peak output tokens/s per (input_len, output_len) over all request rates of a bench sweep."""
    peaks: dict[tuple[int, int], float] = {}
    for row in bench_rows:
        throughput = row.get("output_throughput")
        if not throughput or throughput <= 0:
            continue
        shape = (int(row["input_len"]), int(row["output_len"]))
        peaks[shape] = max(peaks.get(shape, 0.0), float(throughput))
    return dict(sorted(peaks.items()))


def our_platform(
    *,
    train_summary: Mapping[str, Any] | None,
    train_accelerator: str | None,
    bench_rows: Sequence[Mapping[str, Any]] | None,
    serve_accelerator: str | None,
    hours: Sequence[int] = TCO_HOURS,
) -> Platform:
    """Our column, from what the runs recorded; figures without their inputs stay None.

    The training figures are train_summary.json's wall_seconds, real_tokens and
    tokens_per_second: totals over all segments of a preempted and resumed run (summaries
    with a "segments" key; older ones cover only the last process, which the report notes).

    Raises:
        KeyError: an accelerator name the catalog does not know.
    """
    train_rate = catalog.accelerator(train_accelerator).hourly_usd if train_accelerator else None
    serve_rate = catalog.accelerator(serve_accelerator).hourly_usd if serve_accelerator else None
    train_hours = tokens_per_s = cost = per_m = tokens = computed_per_s = None
    if train_summary is not None:
        wall = train_summary.get("wall_seconds")
        train_hours = float(wall) / 3600 if wall else None
        tokens_per_s = train_summary.get("tokens_per_second") or None
        tokens = train_summary.get("real_tokens") or None
        computed_per_s = train_summary.get("computed_tokens_per_second") or None
    if train_rate is not None and train_hours is not None:
        cost = train_cost(train_rate, train_hours)
    if train_rate is not None and tokens_per_s:
        per_m = usd_per_million_tokens(train_rate, float(tokens_per_s))
    serving = {
        shape: (tps, usd_per_million_tokens(serve_rate, tps) if serve_rate is not None else None)
        for shape, tps in peak_throughput(bench_rows or ()).items()
    }
    return Platform(
        label=OURS,
        train_machine=train_accelerator,
        train_hourly_usd=train_rate,
        train_hours=train_hours,
        train_cost=cost,
        train_tokens_per_s=float(tokens_per_s) if tokens_per_s else None,
        train_usd_per_m_tokens=per_m,
        serve_machine=serve_accelerator,
        serve_hourly_usd=serve_rate,
        serving=serving,
        tco=_tco_table(cost, serve_rate, hours),
        train_tokens=int(tokens) if tokens else None,
        train_computed_tokens_per_s=float(computed_per_s) if computed_per_s else None,
    )
