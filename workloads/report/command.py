"""`python -m workloads report`: what the run cost and how the model scores, next to the paper.

Reads train_summary.json (training wall time and tokens/s; totals over all segments of a
resumed run), the bench summary.json (output tokens/s per shape and request rate) and the eval
summary.json (pass@k, and how many samples failed in which way), given as paths or found
through a run config, and writes report.md, report.json and four PNGs into --out (local or
gs://). A figure whose inputs are missing is written as "not measured", never estimated.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from workloads.common import cli_options, errors, logs, storage
from workloads.contract import catalog, runconfig
from workloads.contract import settings as settings_lib
from workloads.evaluation import judge
from workloads.report import costs, summaries

MISSING = "not measured"
NOT_REPORTED = "not reported"  # a figure the paper does not give


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cli_options.add_config(
        parser,
        uses="finds the three summaries in train.output_dir, bench.results_dir and "
        "eval.results_dir",
    )
    parser.add_argument(
        "--train-summary", type=storage.absolute, help="train_summary.json (local or gs://)"
    )
    parser.add_argument(
        "--bench-summary", type=storage.absolute, help="bench summary.json (local or gs://)"
    )
    parser.add_argument(
        "--eval-summary", type=storage.absolute, help="eval summary.json (local or gs://)"
    )
    parser.add_argument(
        "--baseline-eval-summary",
        type=storage.absolute,
        help="eval summary.json of the same model served at bf16 (serving.profile paper): a "
        "quantizing profile's pass@1 is judged against it",
    )
    parser.add_argument(
        "--out",
        type=storage.absolute,
        help="report directory (default with --config: <train.output_dir>/report)",
    )
    parser.add_argument(
        "--train-accelerator",
        help="training machine, e.g. v5p-8 (default: what "
        "train_summary.json recorded); known: " + ", ".join(catalog.ACCELERATORS),
    )
    parser.add_argument("--serve-accelerator", help="serving machine of the bench run, e.g. v6e-8")


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(storage.read_text(path))
    except json.JSONDecodeError as exc:
        raise errors.UserError(f"{path}: {what} is not valid JSON ({exc})") from None


def _inputs(args: argparse.Namespace) -> tuple[dict[str, str | None], str]:
    """Where each summary is (None = not available) and the output directory."""
    found: dict[str, str | None] = {"train": None, "bench": None, "eval": None}
    out = args.out
    if args.config:
        config = runconfig.load(args.config)
        candidates = {
            "train": runconfig.join(config.train.output_dir, "train_summary.json"),
            "bench": runconfig.join(config.bench.results_dir, "summary.json")
            if config.bench
            else None,
            "eval": runconfig.join(config.eval.results_dir, "summary.json")
            if config.eval
            else None,
        }
        for key, path in candidates.items():
            found[key] = path if path and storage.exists(path) else None
        out = out or runconfig.join(config.train.output_dir, "report")
    for key, path in (
        ("train", args.train_summary),
        ("bench", args.bench_summary),
        ("eval", args.eval_summary),
    ):
        if path:
            if not storage.exists(path):
                raise errors.UserError(f"--{key}-summary {path}: file not found")
            found[key] = path
    if not out:
        raise errors.UserError("report needs --out (or --config, which defaults it)")
    return found, out


def _accelerator(name: str | None, flag: str) -> str | None:
    if name is not None and name not in catalog.ACCELERATORS:
        raise errors.UserError(
            f"{flag} {name!r}: unknown; known: {', '.join(catalog.ACCELERATORS)}"
        )
    return name


def main(args: argparse.Namespace) -> int:
    found, out = _inputs(args)
    if args.config:
        # The run config records the machines (infra writes them): flags still win.
        config = runconfig.load(args.config)
        if args.train_accelerator is None:
            args.train_accelerator = config.train.accelerator
        if args.serve_accelerator is None and config.serve is not None:
            args.serve_accelerator = config.serve.accelerator
    train_summary = _read_json(found["train"], "the train summary") if found["train"] else None
    bench_rows = _read_json(found["bench"], "the bench summary") if found["bench"] else None
    eval_summary = _read_json(found["eval"], "the eval summary") if found["eval"] else None
    if bench_rows is not None and not (
        isinstance(bench_rows, list) and all(isinstance(r, dict) for r in bench_rows)
    ):
        raise errors.UserError(f"{found['bench']}: expected a list of rows (bench summary.json)")
    if found["train"]:
        train_summary = summaries.check_train_summary(train_summary, found["train"])
    if eval_summary is not None and not isinstance(eval_summary, dict):
        raise errors.UserError(f"{found['eval']}: expected a JSON object")
    baseline = None
    if getattr(args, "baseline_eval_summary", None):
        if not storage.exists(args.baseline_eval_summary):
            raise errors.UserError(
                f"--baseline-eval-summary {args.baseline_eval_summary}: file not found"
            )
        baseline = _read_json(args.baseline_eval_summary, "the baseline eval summary")
        if not isinstance(baseline, dict):
            raise errors.UserError(f"{args.baseline_eval_summary}: expected a JSON object")

    train_acc = _accelerator(args.train_accelerator, "--train-accelerator")
    notes: list[str] = []
    if train_acc is None and train_summary is not None:
        recorded = train_summary.get("accelerator")
        if recorded in catalog.ACCELERATORS:
            train_acc = recorded
        else:
            notes.append(
                f"training ran on {recorded or 'an unrecorded machine'}, which has no "
                "catalog rate: training cost not measured (pass --train-accelerator)"
            )
    recorded_train = train_summary or {}
    segments = recorded_train.get("segments")
    if isinstance(segments, int) and segments > 1:
        notes.append(
            f"training ran in {segments} segments (stopped and resumed): wall time and cost "
            f"cover all of them ({recorded_train.get('steps_run', '?')} steps run for "
            f"{recorded_train.get('steps', '?')} kept); tokens count each kept step once"
        )
    elif segments is None and recorded_train.get("resumed_from_step"):
        # A summary written before segments were recorded.
        notes.append(
            f"training resumed from step {recorded_train['resumed_from_step']}: "
            "train_summary.json covers only the last segment "
            f"({recorded_train.get('steps_this_run', '?')} of "
            f"{recorded_train.get('steps', '?')} steps), so its wall time, tokens and cost are "
            "that segment's, not the whole run's"
        )
    serve_acc = _accelerator(args.serve_accelerator, "--serve-accelerator")
    if bench_rows and serve_acc is None:
        notes.append(
            "serving machine not given: serving cost not measured (pass --serve-accelerator)"
        )

    ours = costs.our_platform(
        train_summary=train_summary,
        train_accelerator=train_acc,
        bench_rows=bench_rows,
        serve_accelerator=serve_acc,
    )
    paper_tpu, paper_gpu = costs.paper_tables()
    platforms = [ours, paper_tpu, paper_gpu]
    pass_at = eval_summary.get("pass_at") if eval_summary else None

    from workloads.report import plots  # matplotlib is heavy: only when writing

    figures: dict[str, Callable[[], bytes]] = {
        "training.png": lambda: plots.training_figure(platforms),
        "serving.png": lambda: plots.serving_figure(platforms),
        "tco.png": lambda: plots.tco_figure(platforms),
        "quality.png": lambda: plots.quality_figure(pass_at),
    }
    for name, draw in figures.items():
        storage.write_bytes_atomic(runconfig.join(out, name), draw())
    report = {
        "inputs": found,
        "platforms": [p.to_json() for p in platforms],
        "quality": {
            "this run": pass_at,
            "paper TPU": {"1": catalog.PAPER.pass_at_1, "5": catalog.PAPER.pass_at_5},
            "outcomes": _outcome_counts(eval_summary),
            "serving": (eval_summary or {}).get("serving"),
            "bf16 baseline": (baseline or {}).get("pass_at"),
        },
        "eval": eval_summary,
        "stages": (train_summary or {}).get("stages"),
        "notes": notes,
    }
    storage.write_text_atomic(
        runconfig.join(out, "report.json"), json.dumps(report, indent=2) + "\n"
    )
    storage.write_text_atomic(
        runconfig.join(out, "report.md"),
        render_markdown(
            platforms,
            found,
            eval_summary,
            notes,
            stage_rows=(train_summary or {}).get("stages"),
            baseline=baseline,
        ),
    )
    logs.get("report").info(f"wrote {out}/report.md")
    return 0


def _usd(value: float | None, missing: str = MISSING) -> str:
    return f"${value:,.2f}" if value is not None else missing


def _num(value: float | None, fmt: str = "{:,.1f}", missing: str = MISSING) -> str:
    return fmt.format(value) if value is not None else missing


def _gap(platform: costs.Platform) -> str:
    """How a missing figure reads: ours was not measured, the paper's was not reported."""
    return MISSING if platform.label == costs.OURS else NOT_REPORTED


def _stage_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    """The boot that trained, stage by stage (train_summary.json `stages`), and its time from
    the kernel's start to the end of the first step."""
    if not rows:
        return []
    lines = [
        "",
        "### From boot to the first step",
        "",
        "Stages of the VM boot that trained, as its startup script and the trainer recorded "
        "them (compile: time JAX spent compiling, part of the first step).",
        "",
        "| stage | source | started (UTC) | seconds | note |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row["start"]))
        took = _num(row.get("seconds"), "{:,.1f}")
        if row.get("state") not in (None, "done"):
            took += f" ({row['state']})"
        note = str(row.get("note") or "").replace("|", "\\|")
        source = row.get("source") or ""
        lines.append(f"| {row['stage']} | {source} | {started} | {took} | {note} |")
    by = {row["stage"]: row for row in rows}
    boot, first = by.get("boot"), by.get("first_step")
    if boot and first and first.get("seconds") is not None:
        total = first["start"] + first["seconds"] - boot["start"]
        lines += ["", f"Kernel start to the end of the first training step: {total:,.1f} s."]
    return lines


def render_markdown(
    platforms: list[costs.Platform],
    found: dict[str, str | None],
    eval_summary: dict[str, Any] | None,
    notes: list[str],
    stage_rows: list[dict[str, Any]] | None = None,
    baseline: dict[str, Any] | None = None,
) -> str:
    """The report text: one table per figure, each next to the paper's, and the PNGs."""
    head = "| | " + " | ".join(p.label for p in platforms) + " |"
    rule = "|---" * (len(platforms) + 1) + "|"

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [
        "# Gemma 4 LoRA fine-tune: cost and quality",
        "",
        "Our figures come from this run's records; the paper's are recomputed from its inputs with "
        "the same formulas (rates from workloads/contract/catalog.py). Missing inputs are shown as "
        f'"{MISSING}".',
        "",
        "| input | source |",
        "|---|---|",
    ]
    for key, label in (
        ("train", "training summary"),
        ("bench", "serving benchmark"),
        ("eval", "verilog-eval summary"),
    ):
        lines.append(f"| {label} | {found[key] or MISSING} |")
    if notes:
        lines += [""] + [f"- {note}" for note in notes]

    lines += [
        "",
        "## Training",
        "",
        "train_cost = hourly rate x wall hours; $/1M tokens = rate / (tokens/s x 3600 / 1e6).",
        "",
        head,
        rule,
        row("machine", [p.train_machine or _gap(p) for p in platforms]),
        row("hourly rate", [_usd(p.train_hourly_usd, _gap(p)) for p in platforms]),
        row("wall hours", [_num(p.train_hours, "{:.2f}", _gap(p)) for p in platforms]),
        row("real tokens trained", [_num(p.train_tokens, "{:,}", _gap(p)) for p in platforms]),
        row("real tokens/s", [_num(p.train_tokens_per_s, missing=_gap(p)) for p in platforms]),
        row(
            "computed tokens/s (padding included)",
            [_num(p.train_computed_tokens_per_s, missing=_gap(p)) for p in platforms],
        ),
        row("cost", [_usd(p.train_cost, _gap(p)) for p in platforms]),
        row("$/1M training tokens", [_usd(p.train_usd_per_m_tokens, _gap(p)) for p in platforms]),
        "",
        "![training cost](training.png)",
        *_stage_lines(stage_rows),
    ]

    shapes = sorted({shape for p in platforms for shape in p.serving})
    lines += [
        "",
        "## Serving",
        "",
        "Peak output tokens/s over the request rates of each shape; $/1M output tokens = serving "
        "rate / (tokens/s x 3600 / 1e6).",
        "",
        "| input / output tokens | "
        + " | ".join(f"{p.label} tok/s | {p.label} $/1M" for p in platforms)
        + " |",
        "|---" * (2 * len(platforms) + 1) + "|",
    ]
    for shape in shapes:
        cells = []
        for p in platforms:
            tps, usd = p.serving.get(shape, (None, None))
            cells += [_num(tps, missing=_gap(p)), _usd(usd, _gap(p))]
        lines.append(f"| {shape[0]} / {shape[1]} | " + " | ".join(cells) + " |")
    if not platforms[0].serving:
        lines.append(f"| (no bench results) | {MISSING} |")
    lines += ["", "![serving cost](serving.png)"]

    lines += [
        "",
        "## Total cost of ownership",
        "",
        "TCO(H) = training cost + H x serving hourly rate.",
        "",
        "| hours of serving | " + " | ".join(p.label for p in platforms) + " |",
        rule,
    ]
    for hours in costs.TCO_HOURS:
        lines.append(
            f"| {hours} | " + " | ".join(_usd(p.tco.get(hours), _gap(p)) for p in platforms) + " |"
        )
    lines += ["", "![total cost of ownership](tco.png)"]

    pass_at = (eval_summary or {}).get("pass_at") or {}
    paper = {"1": catalog.PAPER.pass_at_1, "5": catalog.PAPER.pass_at_5}
    lines += ["", "## Quality (verilog-eval spec-to-rtl)", ""]
    if eval_summary:
        lines.append(
            f"{eval_summary.get('problems')} problems, n={eval_summary.get('n')}, temperature "
            f"{eval_summary.get('temperature')}, top_p {eval_summary.get('top_p')}, "
            f"model `{eval_summary.get('model')}`."
        )
        lines.append("")
    lines += ["| metric | this run | paper (TPU-trained) |", "|---|---|---|"]
    for k in sorted(set(paper) | set(pass_at), key=int):
        ours = pass_at.get(k)
        lines.append(
            f"| pass@{k} | {_num(ours, '{:.3f}')} | "
            f"{_num(paper.get(k), '{:.3f}') if k in paper else 'n/a'} |"
        )
    lines += ["", *_outcome_lines(eval_summary), "", "![pass@k](quality.png)", ""]
    lines += profile_lines(eval_summary, baseline, platforms[0])
    return "\n".join(lines)


def _peak(platform: costs.Platform) -> tuple[float | None, float | None]:
    """The best output tokens/s over the bench shapes, and its $/1M tokens."""
    measured = [v for v in platform.serving.values() if v[0] is not None]
    return max(measured, key=lambda v: v[0] or 0.0) if measured else (None, None)


def profile_lines(
    eval_summary: dict[str, Any] | None,
    baseline: dict[str, Any] | None,
    platform: costs.Platform,
) -> list[str]:
    """Quality next to throughput and cost per serving profile, and, for a profile that quantizes,
    one line on how much pass@1 it lost against the same model's bf16 eval.

    Args:
        eval_summary: this run's eval summary (its `serving` record names the profile).
        baseline: an eval summary of the same model served at bf16, or None.
        platform: this run's column (its bench results and rates).

    Returns:
        Markdown lines (empty without an eval summary).
    """
    if not eval_summary:
        return []
    numerics = eval_summary.get("serving")
    tps, usd = _peak(platform)
    lines = [
        "## Quality, throughput and cost per serving profile",
        "",
        "| served with | pass@1 | peak output tok/s | $/1M output tokens |",
        "|---|---|---|---|",
        f"| {settings_lib.served_with(numerics)} | "
        f"{_num((eval_summary.get('pass_at') or {}).get('1'), '{:.3f}')} | {_num(tps)} | "
        f"{_usd(usd)} |",
    ]
    if baseline:
        lines.append(
            f"| {settings_lib.served_with(baseline.get('serving'))} (baseline) | "
            f"{_num((baseline.get('pass_at') or {}).get('1'), '{:.3f}')} | {MISSING} | {MISSING} |"
        )
    lines.append("")
    if settings_lib.quantizes(numerics):
        ours = (eval_summary.get("pass_at") or {}).get("1")
        base = (baseline or {}).get("pass_at", {}).get("1") if baseline else None
        if baseline is None or settings_lib.quantizes(baseline.get("serving")) or base is None:
            lines.append(
                "Quantized serving, not judged: no bf16 eval of the same model to compare with "
                "(pass --baseline-eval-summary with an eval run under serving.profile paper)."
            )
        elif ours is not None:
            lines.append(
                f"Quantized vs bf16 serving of the same model: pass@1 {ours:.3f} vs {base:.3f}, "
                f"{(base - ours) * 100:+.1f} points lost."
            )
        lines.append("")
    return lines


def _outcome_counts(eval_summary: dict[str, Any] | None) -> dict[str, int] | None:
    counts = (eval_summary or {}).get("status_counts")
    return judge.group_counts(counts) if isinstance(counts, dict) else None


def _outcome_lines(eval_summary: dict[str, Any] | None) -> list[str]:
    """How the judged samples ended (the eval's status counts, grouped), so that a reader sees
    why the scores are what they are."""
    groups = _outcome_counts(eval_summary)
    if groups is None:
        return [f"How the samples ended: {MISSING}."]
    counts: dict[str, int] = (eval_summary or {})["status_counts"]
    lines = [
        f"How the {sum(groups.values())} samples ended (iverilog verdicts; status letters as in "
        "the eval's summary.md):",
        "",
        "| outcome | samples | by status |",
        "|---|---|---|",
    ]
    for outcome, total in groups.items():
        letters = judge.STATUS_GROUPS.get(outcome)
        detail = ", ".join(
            f"`{s}` {judge.STATUS_MEANINGS.get(s, '?')}: {n}"
            for s, n in sorted(counts.items())
            if (s in letters if letters is not None else s not in judge.STATUS_MEANINGS)
        )
        lines.append(f"| {outcome} | {total} | {detail} |")
    truncated = (eval_summary or {}).get("truncated_samples")
    if truncated:
        lines += ["", f"Answers cut off by the token limit: {truncated}."]
    broken = (eval_summary or {}).get("reference_failures")
    if broken:
        lines += [
            "",
            f"The reference solution itself fails on {len(broken)} problems "
            f"({', '.join(broken)}); their samples count as failures.",
        ]
    return lines
