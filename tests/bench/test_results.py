"""Parsing vLLM --save-result files and the aggregation arithmetic."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from tests.bench.vllm_results import dumps, vllm_result
from workloads.bench import results
from workloads.common import errors
from workloads.contract import catalog


def _write_raw(root, *results_):
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for result in results_:
        rate = results.parse_rate(result["request_rate"])
        name = results.point_name(int(result["input_len"]), int(result["output_len"]), rate)
        (raw / name).write_text(dumps(result))
    return raw


@pytest.mark.parametrize(
    ("shape", "rate", "name"),
    [
        ((512, 256), 1.0, "512x256_r1.json"),
        ((4096, 512), math.inf, "4096x512_rinf.json"),
        ((1024, 512), 2.5, "1024x512_r2.5.json"),
        ((15360, 512), 64, "15360x512_r64.json"),
    ],
)
def test_point_names_round_trip(shape, rate, name):
    assert results.point_name(*shape, rate) == name
    assert results.parse_point_name(f"gs://b/raw/{name}") == (*shape, float(rate))
    assert results.parse_point_name("vllm-1.0qps-merged-20261121.json") is None


def test_rates_as_vllm_saves_them():
    assert results.parse_rate("inf") == math.inf and results.parse_rate(4) == 4.0
    assert results.parse_rate(0.5) == 0.5 and results.parse_rate("2") == 2.0
    with pytest.raises(ValueError):
        results.parse_rate(None)


def test_a_row_takes_the_documented_keys():
    result = vllm_result(
        input_len=4096,
        output_len=512,
        request_rate=4,
        num_prompts=200,
        completed=198,
        duration=80.0,
        ttft_ms=61.0,
        tpot_ms=25.0,
    )
    row = results.row_from_result(result, source="gs://b/raw/4096x512_r4.json")
    assert {k: row[k] for k in results.SUMMARY_KEYS} == {
        "input_len": 4096,
        "output_len": 512,
        "request_rate": 4.0,
        "completed": 198,
        "output_throughput": 198 * 512 / 80.0,  # = total_output_tokens / duration = 1267.2
        "median_ttft_ms": 61.0,
        "p99_ttft_ms": 183.0,
        "median_tpot_ms": 25.0,
        "p99_tpot_ms": 75.0,
        "median_itl_ms": 25.0,
        "p99_itl_ms": 75.0,
    }
    assert row["failed"] == 2 and row["num_prompts"] == 200 and row["duration"] == 80.0


def test_shape_comes_from_the_file_name_else_the_metadata():
    result = vllm_result(input_len=1024, output_len=512, request_rate=math.inf)
    row = results.row_from_result(result, source="/x/vllm-infqps-merged-20261121.json")
    assert (row["input_len"], row["output_len"], row["request_rate"]) == (1024, 512, math.inf)
    plain = vllm_result(input_len=1, output_len=1, request_rate=1, metadata=False)
    with pytest.raises(errors.UserError, match="unknown shape"):
        results.row_from_result(plain, source="/x/whatever.json")


def test_missing_keys_and_bad_json_are_named():
    result = vllm_result(input_len=512, output_len=256, request_rate=1, percentiles=("90",))
    with pytest.raises(
        errors.UserError, match=r"512x256_r1\.json: missing p99_ttft_ms, p99_tpot_ms"
    ):
        results.row_from_result(result, source="512x256_r1.json")
    with pytest.raises(errors.UserError, match="not a vLLM result file"):
        results.load_result("[1, 2]", source="f.json")
    with pytest.raises(errors.UserError, match="invalid JSON"):
        results.load_result("{oops", source="f.json")


def test_appended_results_count_the_last_one():
    first = vllm_result(input_len=512, output_len=256, request_rate=1, ttft_ms=10)
    second = vllm_result(input_len=512, output_len=256, request_rate=1, ttft_ms=12)
    parsed = results.load_result(dumps(first) + "\n" + dumps(second), source="f.json")
    assert parsed["median_ttft_ms"] == 12


def test_nan_becomes_null_and_inf_stays_inf_in_summary_json():
    result = vllm_result(input_len=512, output_len=1, request_rate=math.inf)
    result["median_tpot_ms"] = float("nan")  # vLLM has no TPOT for one-token outputs
    row = results.row_from_result(json.loads(json.dumps(result)), source="512x1_rinf.json")
    (back,) = json.loads(results.to_json([row]))
    assert back["median_tpot_ms"] is None and back["request_rate"] == "inf"


def test_aggregation_sorts_dedups_finds_peaks_and_compares_with_the_paper(tmp_path):
    rows = [
        results.row_from_result(r, source="x.json")
        for r in (
            vllm_result(input_len=4096, output_len=512, request_rate=math.inf, duration=100),
            vllm_result(input_len=4096, output_len=512, request_rate=4, duration=200, ttft_ms=70),
            vllm_result(input_len=4096, output_len=512, request_rate=16, duration=80),
            vllm_result(input_len=512, output_len=256, request_rate=1, duration=400),
            vllm_result(input_len=4096, output_len=512, request_rate=16, duration=160),  # re-run
        )
    ]
    rows = results.sort_rows(rows)
    assert [(r["input_len"], r["request_rate"]) for r in rows] == [
        (512, 1.0),
        (4096, 4.0),
        (4096, 16.0),
        (4096, math.inf),
    ]
    assert rows[2]["output_throughput"] == 200 * 512 / 160  # the later duplicate won
    peaks = results.peaks(rows)
    assert peaks[(4096, 512)]["request_rate"] == math.inf
    assert peaks[(4096, 512)]["output_throughput"] == 200 * 512 / 100 == 1024.0
    assert peaks[(512, 256)]["output_throughput"] == 200 * 256 / 400 == 128.0
    comparison = results.paper_comparison(rows)
    assert comparison == [
        ("peak output tok/s, 4096 in / 512 out", 1024.0, catalog.PAPER.serve_long_ctx_tok_s_tpu),
        (
            "median TTFT ms at 4 req/s, 4096 in / 512 out",
            70.0,
            catalog.PAPER.ttft_ms_median_qps4_4096,
        ),
    ]
    markdown = results.to_markdown(rows)
    assert "| 4096 | 512 | inf | 200 | 1024.00 | 50.00 | 150.00 |" in markdown
    assert f"| 1024.00 | 1206 | {1024 / 1206:.2f} |" in markdown
    assert f"| 70.00 | 61 | {70 / 61:.2f} |" in markdown
    table = list(csv.DictReader(io.StringIO(results.to_csv(rows))))
    assert list(table[0])[:11] == list(results.SUMMARY_KEYS)
    assert table[-1]["request_rate"] == "inf" and table[0]["output_throughput"] == "128.00"


def test_read_and_write_summary_from_a_results_dir(tmp_path):
    _write_raw(
        tmp_path,
        vllm_result(input_len=512, output_len=256, request_rate=2),
        vllm_result(input_len=512, output_len=256, request_rate=math.inf),
    )
    (tmp_path / "raw" / "512x256_r2.pytorch.json").write_text("[]")
    rows = results.read_rows(str(tmp_path))
    assert [r["request_rate"] for r in rows] == [2.0, math.inf]
    written = results.write_summary(str(tmp_path), rows)
    assert [p.rsplit("/", 1)[-1] for p in written] == ["summary.json", "summary.csv", "summary.md"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [set(row) >= set(results.SUMMARY_KEYS) for row in summary] == [True, True]
    assert summary[1]["request_rate"] == "inf"
    with pytest.raises(errors.UserError, match="no vLLM result files"):
        results.read_rows(str(tmp_path / "empty"))
