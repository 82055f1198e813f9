"""PNG figures of the report (matplotlib, Agg backend): ours next to the paper's.

Each function returns PNG bytes; a figure whose inputs were not measured is still drawn with
the paper's values and says "not measured" where ours would be.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from workloads.contract import catalog
from workloads.report import costs

_COLORS = {costs.OURS: "#1a73e8", "paper TPU": "#9aa0a6", "paper GPU": "#e8710a"}


def _missing(label: str) -> str:
    return "not measured" if label == costs.OURS else "not reported"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "the report's plots need matplotlib: install the 'workloads' extra"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _bars(
    ax: Any,
    labels: Sequence[str],
    values: Sequence[float | None],
    fmt: str,
    ticks: Sequence[str] | None = None,
) -> None:
    """Bars with value labels; a None value becomes a "not measured" note at zero height.
    `ticks` (default: the labels) are the x tick texts."""
    positions = range(len(labels))
    heights = [v or 0.0 for v in values]
    ax.bar(positions, heights, color=[_COLORS.get(lbl, "#5f6368") for lbl in labels])
    top = max(heights) if any(heights) else 1.0
    for x, value, label in zip(positions, values, labels, strict=True):
        text = fmt.format(value) if value is not None else _missing(label)
        ax.text(x, (value or 0.0) + top * 0.02, text, ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(positions), list(ticks or labels))
    ax.set_ylim(0, top * 1.18)


def training_figure(platforms: Sequence[costs.Platform]) -> bytes:
    """Training cost (USD) and USD per 1M training tokens, per platform."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [p.label for p in platforms]
    ticks = [f"{p.label}\n{p.train_machine}" if p.train_machine else p.label for p in platforms]
    _bars(left, labels, [p.train_cost for p in platforms], "${:.2f}", ticks)
    left.set_title("LoRA fine-tune: cost")
    left.set_ylabel("USD")
    _bars(right, labels, [p.train_usd_per_m_tokens for p in platforms], "${:.2f}", ticks)
    right.set_title("LoRA fine-tune: USD per 1M training tokens")
    right.set_ylabel("USD / 1M tokens")
    return _png(fig)


def _legend_label(label: str, machines: Sequence[str | None]) -> str:
    """`paper TPU: v5p-8 + v6e-8`: the platform and the machines its figures come from."""
    named = list(dict.fromkeys(m for m in machines if m))
    return f"{label}: {' + '.join(named)}" if named else label


def serving_plot(platforms: Sequence[costs.Platform]) -> Any:
    """The serving figure: per (input, output) shape, one bar per platform that measured it,
    centred on the shape's tick; our missing figures say "not measured" inside the axes."""
    plt = _pyplot()
    shapes = sorted({shape for p in platforms for shape in p.serving})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes) + 2), 4))
    groups = [
        [p for p in platforms if shape in p.serving or p.label == costs.OURS] for shape in shapes
    ]
    width = 0.8 / max((len(group) for group in groups), default=1)
    top = max((usd for p in platforms for _, usd in p.serving.values() if usd), default=1.0)
    for j, group in enumerate(groups):
        for i, platform in enumerate(group):
            x = j + (i - (len(group) - 1) / 2) * width
            usd = platform.serving.get(shapes[j], (None, None))[1]
            if usd is None:
                ax.text(
                    x,
                    top * 0.02,
                    _missing(platform.label),
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
                continue
            ax.bar(x, usd, width, color=_COLORS.get(platform.label, "#5f6368"))
            ax.text(x, usd + top * 0.02, f"${usd:.2f}", ha="center", va="bottom", fontsize=8)
    # One legend entry per platform, also for one that has no bar (ours not measured yet).
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(p.label, "#5f6368")) for p in platforms
    ]
    ax.legend(
        handles, [_legend_label(p.label, [p.serve_machine]) for p in platforms], fontsize="small"
    )
    ax.set_xticks(range(len(shapes)), [f"{i} in\n{o} out" for i, o in shapes])
    ax.set_xlim(-0.5, max(len(shapes), 1) - 0.5)
    ax.set_xlabel("input / output tokens per request")
    ax.set_ylabel("USD / 1M output tokens\n(at peak throughput)")
    ax.set_title("Serving cost per context length")
    ax.set_ylim(0, top * 1.3)
    return fig


def serving_figure(platforms: Sequence[costs.Platform]) -> bytes:
    """USD per 1M output tokens at peak throughput, per (input, output) shape and platform."""
    return _png(serving_plot(platforms))


def tco_figure(
    platforms: Sequence[costs.Platform], hours: Sequence[int] = costs.TCO_HOURS
) -> bytes:
    """Training plus H hours of serving, for each H, per platform."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(platforms))
    top = max((v for p in platforms for v in p.tco.values()), default=1.0)
    for i, platform in enumerate(platforms):
        xs = [j + (i - (len(platforms) - 1) / 2) * width for j in range(len(hours))]
        values = [platform.tco.get(h) for h in hours]
        ax.bar(
            xs,
            [v or 0.0 for v in values],
            width,
            label=_legend_label(platform.label, [platform.train_machine, platform.serve_machine]),
            color=_COLORS.get(platform.label, "#5f6368"),
        )
        for x, value in zip(xs, values, strict=True):
            text = f"${value:.2f}" if value is not None else _missing(platform.label)
            ax.text(
                x,
                (value or 0.0) + top * 0.02,
                text,
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=0 if value is not None else 90,
            )
    ax.set_xticks(range(len(hours)), [f"{h} h serving" for h in hours])
    ax.set_ylabel("USD (training + serving)")
    ax.set_title("Total cost of ownership: training once + H hours of serving")
    ax.set_ylim(0, top * 1.2)
    ax.legend(fontsize="small")
    return _png(fig)


def quality_figure(pass_at: Mapping[str, float] | None) -> bytes:
    """pass@1 and pass@5 on verilog-eval spec-to-rtl, ours next to the paper's."""
    plt = _pyplot()
    paper = {"1": catalog.PAPER.pass_at_1, "5": catalog.PAPER.pass_at_5}
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = list(paper)
    width = 0.38
    ours = [(pass_at or {}).get(k) for k in ks]
    for offset, label, values in (
        (-width / 2, costs.OURS, ours),
        (width / 2, "paper TPU", [paper[k] for k in ks]),
    ):
        xs = [j + offset for j in range(len(ks))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=label, color=_COLORS[label])
        for x, value in zip(xs, values, strict=True):
            text = f"{value:.3f}" if value is not None else _missing(label)
            ax.text(x, (value or 0.0) + 0.02, text, ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(ks)), [f"pass@{k}" for k in ks])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("unbiased pass@k (fraction of problems)")
    ax.set_title("verilog-eval spec-to-rtl")
    ax.legend()
    return _png(fig)
