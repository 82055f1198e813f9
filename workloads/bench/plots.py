"""PNG plots of a sweep: throughput and TTFT against request rate, the paper's v6e-8 beside ours.

matplotlib (the 'workloads' extra) is imported inside the functions, and figures are drawn on
the Agg canvas directly (no pyplot state), so this works headless and from any thread.
"""

from __future__ import annotations

import io
import math
from typing import Any

from workloads.bench import results
from workloads.common import errors, storage
from workloads.contract import catalog, runconfig

THROUGHPUT_PNG = "throughput_vs_rate.png"
TTFT_PNG = "ttft_vs_rate.png"


def _figure() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise errors.UserError("plots need matplotlib: install the 'workloads' extra") from None
    figure = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(figure)
    return figure


def _rate_axis(rows: list[dict[str, Any]]) -> tuple[list[float], dict[float, int]]:
    """Rates on evenly spaced positions (1, 2, 4, ... inf), so a burst gets a place too."""
    rates = sorted({row["request_rate"] for row in rows})
    return rates, {rate: i for i, rate in enumerate(rates)}


def _label_rates(axes: Any, rates: list[float]) -> None:
    axes.set_xticks(range(len(rates)))
    axes.set_xticklabels(["burst" if math.isinf(r) else results.format_rate(r) for r in rates])
    axes.set_xlabel("request rate (requests/s; burst = all at once)")
    axes.grid(True, alpha=0.3)


def _shapes(rows: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    shapes: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in results.sort_rows(rows):
        shapes.setdefault((row["input_len"], row["output_len"]), []).append(row)
    return shapes


def _png(figure: Any) -> bytes:
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def throughput_figure(rows: list[dict[str, Any]], paper: catalog.PaperRun = catalog.PAPER) -> Any:
    """Output tokens/s against request rate, one line per (input, output) shape; the paper's
    v6e-8 and 2x H100 long-context peaks as horizontal references (the v6e-8 one in the colour
    of our line for the same shape, so the eye compares like with like)."""
    figure = _figure()
    axes = figure.add_subplot()
    rates, position = _rate_axis(rows)
    colors = {}
    for (input_len, output_len), points in _shapes(rows).items():
        points = [p for p in points if p["output_throughput"] is not None]
        (line,) = axes.plot(
            [position[p["request_rate"]] for p in points],
            [p["output_throughput"] for p in points],
            marker="o",
            label=f"ours: {input_len} in / {output_len} out",
        )
        colors[(input_len, output_len)] = line.get_color()
    tpu, gpu = paper.serve_long_ctx_tok_s_tpu, paper.serve_long_ctx_tok_s_gpu
    axes.axhline(
        tpu,
        color=colors.get(results.PAPER_SHAPE, "black"),
        linestyle="--",
        label=f"paper v6e-8 peak, 4096 in / 512 out ({tpu:g})",
    )
    axes.axhline(
        gpu, color="grey", linestyle=":", label=f"paper 2x H100 peak, 4096 in / 512 out ({gpu:g})"
    )
    _label_rates(axes, rates)
    axes.set_ylabel("output tokens/s")
    axes.set_title("vLLM on TPU: output throughput vs request rate")
    axes.legend(fontsize="small")
    return figure


def ttft_figure(rows: list[dict[str, Any]], paper: catalog.PaperRun = catalog.PAPER) -> Any:
    """Median TTFT (solid) and p99 (dashed) against request rate per context length (log y),
    with the paper's v6e-8 median TTFT points where our sweep has that rate."""
    figure = _figure()
    axes = figure.add_subplot()
    rates, position = _rate_axis(rows)
    colors = {}
    for (input_len, output_len), points in _shapes(rows).items():
        xs = [position[p["request_rate"]] for p in points]
        (line,) = axes.plot(
            xs,
            [p["median_ttft_ms"] for p in points],
            marker="o",
            label=f"ours: {input_len} in / {output_len} out (p50; p99 dashed)",
        )
        axes.plot(
            xs,
            [p["p99_ttft_ms"] for p in points],
            linestyle="--",
            alpha=0.5,
            color=line.get_color(),
        )
        colors[(input_len, output_len)] = line.get_color()
    if 4.0 in position:
        # Filled with the colour of our 4096 / 512 line (black when we did not run that shape).
        axes.plot(
            [position[4.0]],
            [paper.ttft_ms_median_qps4_4096],
            marker="*",
            markersize=16,
            color=colors.get(results.PAPER_SHAPE, "black"),
            markeredgecolor="black",
            linestyle="none",
            label=f"paper v6e-8: 4096 in, 4 req/s, p50 {paper.ttft_ms_median_qps4_4096:g} ms",
        )
    if math.inf in position:
        axes.plot(
            [position[math.inf]],
            [paper.ttft_ms_median_burst_128],
            marker="X",
            markersize=11,
            color="black",
            linestyle="none",
            label=f"paper v6e-8: 128 in burst, p50 {paper.ttft_ms_median_burst_128:g} ms",
        )
    _label_rates(axes, rates)
    axes.set_yscale("log")
    axes.set_ylabel("time to first token (ms)")
    axes.set_title("vLLM on TPU: TTFT vs request rate per context length")
    axes.legend(fontsize="small")
    return figure


def write_plots(results_dir: str, rows: list[dict[str, Any]]) -> list[str]:
    """Writes both PNGs into results_dir (local or gs://); returns their paths."""
    written = []
    for name, draw in ((THROUGHPUT_PNG, throughput_figure), (TTFT_PNG, ttft_figure)):
        path = runconfig.join(results_dir, name)
        storage.write_bytes_atomic(path, _png(draw(rows)))
        written.append(path)
    return written
