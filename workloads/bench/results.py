"""`vllm bench serve --save-result` files -> one table (summary.json, .csv, .md).

The result file is one JSON object (vllm/benchmarks/serve.py, `main_async` and `benchmark`):
run info (`date`, `backend`, `model_id`, `num_prompts`, `request_rate` -- a number, or the
string "inf" for a burst --, `burstiness`, `max_concurrency`, `--metadata` KEY=VALUE pairs as
strings), the totals (`duration`, `completed`, `failed`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `output_throughput`, `total_token_throughput`,
`max_output_tokens_per_s`, ...) and per metric in `--percentile-metrics` (ttft, tpot, itl, e2el)
`mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms` and `p<q>_<m>_ms` for each `--metric-percentiles`
q (default 99). Per-request lists (`input_lens`, `ttfts`, ...) are only there with
--save-detailed. `--append-result` appends further objects on new lines: the last one counts.

File layout: `<results_dir>/raw/<in>x<out>_r<rate>.json` per sweep point, and
`summary.json` (a list of rows), `summary.csv`, `summary.md` next to `raw/`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from workloads.common import errors, storage
from workloads.contract import catalog, runconfig
from workloads.serve.argv import format_rate

RAW = "raw"
# The row of summary.json (read by the report), in column order.
SUMMARY_KEYS = (
    "input_len",
    "output_len",
    "request_rate",
    "completed",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)
# Also kept when present: useful context, not part of the contract.
EXTRA_KEYS = (
    "failed",
    "num_prompts",
    "duration",
    "request_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
)
_REQUIRED = (
    "completed",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)
_NAME_RE = re.compile(r"^(\d+)x(\d+)_r([0-9.]+|inf)\.json$")


def parse_rate(value: Any) -> float:
    """A request rate as vLLM saves it (a number, or "inf") -> float.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"request_rate {value!r} is not a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity", "+inf"):
        return math.inf
    if isinstance(value, str):
        return float(value)
    raise ValueError(f'request_rate {value!r} is not a number or "inf"')


def point_name(input_len: int, output_len: int, request_rate: float) -> str:
    """The result file of one sweep point: `512x256_r1.json`, `4096x512_rinf.json`."""
    return f"{input_len}x{output_len}_r{format_rate(request_rate)}.json"


def parse_point_name(name: str) -> tuple[int, int, float] | None:
    """`512x256_r1.json` -> (512, 256, 1.0); None for other names."""
    match = _NAME_RE.match(name.rsplit("/", 1)[-1])
    if not match:
        return None
    return int(match[1]), int(match[2]), parse_rate(match[3])


def load_result(text: str, *, source: str) -> dict[str, Any]:
    """Parses a --save-result file (the last object when several were appended).

    Raises:
        errors.UserError: not JSON, or not an object.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            data = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError as exc:
            raise errors.UserError(
                f"{source}: not a vLLM result file (invalid JSON: {exc})"
            ) from None
    if not isinstance(data, dict):
        raise errors.UserError(f"{source}: not a vLLM result file (expected a JSON object)")
    return data


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return None if math.isnan(number) else number


def row_from_result(
    result: dict[str, Any], *, source: str, shape: tuple[int, int] | None = None
) -> dict[str, Any]:
    """One summary row from a parsed result.

    Args:
        result: from load_result.
        source: file name for error messages (its `<in>x<out>_r<rate>` part gives the shape).
        shape: (input_len, output_len) when known; else the file name, else the
            `--metadata input_len=... output_len=...` pairs.

    Raises:
        errors.UserError: a required key is missing, naming the file and the key.
    """
    missing = [key for key in _REQUIRED if key not in result]
    if missing:
        raise errors.UserError(
            f"{source}: missing {', '.join(missing)} (is it a `vllm bench "
            "serve --save-result` file of a generation benchmark?)"
        )
    if shape is None:
        parsed = parse_point_name(source)
        if parsed is not None:
            shape = parsed[:2]
        elif "input_len" in result and "output_len" in result:
            shape = (int(result["input_len"]), int(result["output_len"]))
        else:
            raise errors.UserError(
                f"{source}: unknown shape: name the file "
                "<in>x<out>_r<rate>.json or save it with "
                "--metadata input_len=N output_len=M"
            )
    output_throughput = result.get("output_throughput")
    if output_throughput is None and result.get("duration") and "total_output_tokens" in result:
        output_throughput = result["total_output_tokens"] / result["duration"]
    try:
        rate = parse_rate(result.get("request_rate", "inf"))
        row: dict[str, Any] = {
            "input_len": int(shape[0]),
            "output_len": int(shape[1]),
            "request_rate": rate,
            "completed": int(result["completed"]),
            "output_throughput": _number(output_throughput),
        }
        for key in SUMMARY_KEYS[5:]:
            row[key] = _number(result[key])
        for key in EXTRA_KEYS:
            if key in result:
                row[key] = _number(result[key])
    except (TypeError, ValueError) as exc:
        raise errors.UserError(f"{source}: unexpected value ({exc})") from None
    return row


def sort_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """By shape, then request rate (inf last); a later duplicate of the same point wins."""
    unique = {(r["input_len"], r["output_len"], r["request_rate"]): r for r in rows}
    return [unique[key] for key in sorted(unique)]


def peaks(rows: Iterable[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """For each shape, the row with the highest output throughput."""
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["input_len"], row["output_len"])
        if row["output_throughput"] is not None and (
            key not in best or row["output_throughput"] > best[key]["output_throughput"]
        ):
            best[key] = row
    return best


def _json_value(key: str, value: Any) -> Any:
    if key == "request_rate" and value == math.inf:
        return "inf"  # as vLLM writes it: JSON has no infinity
    return value


def to_json(rows: list[dict[str, Any]]) -> str:
    """summary.json: a list of rows, `request_rate` a number or "inf", NaN as null."""
    return (
        json.dumps(
            [{k: _json_value(k, v) for k, v in row.items()} for row in rows],
            indent=1,
            allow_nan=False,
        )
        + "\n"
    )


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    extra = [key for key in EXTRA_KEYS if any(key in row for row in rows)]
    return [*SUMMARY_KEYS, *extra]


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key == "request_rate":
        return format_rate(value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def to_csv(rows: list[dict[str, Any]]) -> str:
    columns = _columns(rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(key, row.get(key)) for key in columns])
    return out.getvalue()


_MD_HEADERS = {
    "input_len": "in",
    "output_len": "out",
    "request_rate": "req/s",
    "completed": "done",
    "output_throughput": "out tok/s",
    "median_ttft_ms": "TTFT p50 ms",
    "p99_ttft_ms": "TTFT p99 ms",
    "median_tpot_ms": "TPOT p50 ms",
    "p99_tpot_ms": "TPOT p99 ms",
    "median_itl_ms": "ITL p50 ms",
    "p99_itl_ms": "ITL p99 ms",
}
PAPER_SHAPE = (4096, 512)  # the paper's long-context serving shape


def paper_comparison(
    rows: list[dict[str, Any]],
    paper: catalog.PaperRun = catalog.PAPER,
) -> list[tuple[str, float | None, float]]:
    """(what, ours, paper's) for the paper's v6e-8 serving figures that our sweep measures."""
    best = peaks(rows).get(PAPER_SHAPE)
    at_qps4 = next(
        (
            r
            for r in rows
            if (r["input_len"], r["output_len"]) == PAPER_SHAPE and r["request_rate"] == 4
        ),
        None,
    )
    return [
        (
            "peak output tok/s, 4096 in / 512 out",
            best["output_throughput"] if best else None,
            paper.serve_long_ctx_tok_s_tpu,
        ),
        (
            "median TTFT ms at 4 req/s, 4096 in / 512 out",
            at_qps4["median_ttft_ms"] if at_qps4 else None,
            paper.ttft_ms_median_qps4_4096,
        ),
    ]


def to_markdown(rows: list[dict[str, Any]], paper: catalog.PaperRun = catalog.PAPER) -> str:
    """summary.md: the table, the peak per shape, and the paper's v6e-8 figures beside ours."""
    lines = [
        "# vllm bench serve sweep",
        "",
        "| " + " | ".join(_MD_HEADERS[k] for k in SUMMARY_KEYS) + " |",
        "|" + "---:|" * len(SUMMARY_KEYS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row.get(k)) for k in SUMMARY_KEYS) + " |")
    lines += [
        "",
        "## Peak output throughput per shape",
        "",
        "| in | out | out tok/s | at req/s |",
        "|---:|---:|---:|---:|",
    ]
    for (input_len, output_len), row in sorted(peaks(rows).items()):
        lines.append(
            f"| {input_len} | {output_len} | {row['output_throughput']:.2f} | "
            f"{format_rate(row['request_rate'])} |"
        )
    lines += [
        "",
        "## Beside the paper (v6e-8, base model; 2x H100: "
        f"{paper.serve_long_ctx_tok_s_gpu:g} tok/s)",
        "",
        "| figure | ours | paper | ours / paper |",
        "|---|---:|---:|---:|",
    ]
    for what, ours, theirs in paper_comparison(rows, paper):
        ours_cell = "not measured" if ours is None else f"{ours:.2f}"
        ratio = "" if ours is None else f"{ours / theirs:.2f}"
        lines.append(f"| {what} | {ours_cell} | {theirs:g} | {ratio} |")
    return "\n".join(lines) + "\n"


def read_rows(results_dir: str) -> list[dict[str, Any]]:
    """Rows from every `<results_dir>/raw/*.json` (vLLM's extra `*.pytorch.json` files skipped).

    Raises:
        errors.UserError: there are no result files, or one is malformed.
    """
    raw = runconfig.join(results_dir, RAW)
    try:
        names = [
            n
            for n in storage.list_files(raw)
            if n.endswith(".json") and not n.endswith(".pytorch.json") and "/" not in n
        ]
    except errors.UserError:
        names = []
    if not names:
        raise errors.UserError(f"{raw}: no vLLM result files (*.json) to aggregate")
    rows = [
        row_from_result(
            load_result(storage.read_text(runconfig.join(raw, n)), source=runconfig.join(raw, n)),
            source=runconfig.join(raw, n),
        )
        for n in names
    ]
    return sort_rows(rows)


def write_summary(results_dir: str, rows: list[dict[str, Any]]) -> list[str]:
    """Writes summary.json, summary.csv and summary.md; returns their paths."""
    written = []
    for name, text in (
        ("summary.json", to_json(rows)),
        ("summary.csv", to_csv(rows)),
        ("summary.md", to_markdown(rows)),
    ):
        path = runconfig.join(results_dir, name)
        storage.write_text_atomic(path, text)
        written.append(path)
    return written
