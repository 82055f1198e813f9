"""`python -m workloads report` from fixture summaries: Markdown, JSON and PNG plots; the main
tests run with the summaries and the report local and in gs:// (on the GCS protocol server),
where the VMs leave them."""

import json

import pytest
import yaml

from workloads import cli
from workloads.common import storage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("training.png", "serving.png", "tco.png", "quality.png")


@pytest.fixture
def summaries(tmp_path):
    train = tmp_path / "run" / "train_summary.json"
    train.parent.mkdir()
    train.write_text(
        json.dumps(
            {
                "run_name": "t",
                "steps": 1244,
                "wall_seconds": 3.0 * 3600,
                "real_tokens": 9_180_000,
                "computed_tokens": 9_500_000,
                "tokens_per_second": 850.0,
                "computed_tokens_per_second": 880.0,
                "final_loss": 0.4,
                "first_loss": 1.2,
                "accelerator": "v5p-8",
            }
        )
    )
    bench = tmp_path / "bench" / "summary.json"
    bench.parent.mkdir()
    bench.write_text(
        json.dumps(
            [
                {
                    "input_len": i,
                    "output_len": o,
                    "request_rate": r,
                    "completed": 200,
                    "output_throughput": tps,
                    "median_ttft_ms": 60.0,
                    "p99_ttft_ms": 90.0,
                    "median_tpot_ms": 20.0,
                    "p99_tpot_ms": 30.0,
                    "median_itl_ms": 20.0,
                    "p99_itl_ms": 40.0,
                }
                for i, o, r, tps in [
                    (512, 256, 4, 900.0),
                    (512, 256, 64, 2400.0),
                    (4096, 512, 4, 700.0),
                    (4096, 512, 64, 1300.0),
                ]
            ]
        )
    )
    evaluation = tmp_path / "eval" / "summary.json"
    evaluation.parent.mkdir()
    evaluation.write_text(
        json.dumps(
            {
                "problems": 156,
                "n": 5,
                "pass_at": {"1": 0.65, "5": 0.8},
                "temperature": 0.8,
                "top_p": 0.95,
                "max_tokens": 1024,
                "model": "gemma-ft",
                "status_counts": {".": 520, "A": 2, "C": 60, "F": 3, "R": 150, "S": 40, "T": 5},
                "truncated_samples": 4,
                "reference_failures": ["Prob099_m2014_q6c"],
            }
        )
    )
    return {"train": train, "bench": bench, "eval": evaluation}


@pytest.fixture(params=["local", "gs"])
def where(request, tmp_path) -> str:
    """Where the summaries and the report live: the test's directory or a gs:// bucket."""
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("gcs_bucket")


def _placed(summaries, root: str) -> dict[str, str]:
    """The summaries' paths under root, `<dir>/<file>` as in the fixture (uploaded when root is
    a bucket; the fixture's own files when it is the test's directory)."""
    placed = {}
    for key, path in summaries.items():
        target = f"{root}/{path.parent.name}/{path.name}"
        if target != str(path):
            storage.upload_file(str(path), target)
        placed[key] = target
    return placed


def test_report_from_summaries(summaries, where):
    placed = _placed(summaries, where)
    out = f"{where}/report"
    argv = [
        "report",
        "--train-summary",
        placed["train"],
        "--bench-summary",
        placed["bench"],
        "--eval-summary",
        placed["eval"],
        "--out",
        out,
        "--serve-accelerator",
        "v6e-8",
    ]
    assert cli.main(argv) == 0
    for name in FIGURES:
        assert storage.read_bytes(f"{out}/{name}").startswith(PNG_MAGIC), name
    report = json.loads(storage.read_text(f"{out}/report.json"))
    ours, paper_tpu, paper_gpu = report["platforms"]
    assert ours["train_machine"] == "v5p-8"  # recorded by training
    assert ours["train_cost"] == pytest.approx(16.80 * 3)
    assert ours["tco"]["24"] == pytest.approx(16.80 * 3 + 24 * 21.52)
    assert [round(p["train_cost"], 2) for p in (paper_tpu, paper_gpu)] == [56.11, 119.23]

    md = storage.read_text(f"{out}/report.md")
    assert "| cost | $50.40 | $56.11 | $119.23 |" in md
    assert "| real tokens/s | 850.0 | 763.0 | not reported |" in md
    # The paper padded 1,244 x 8 samples to 3,072 tokens in 3.34 h. No "6N MFU" row: it would
    # overstate a LoRA step (throughput is given as real and computed tokens/s).
    assert "| computed tokens/s (padding included) | 880.0 | 2,542.6 | not reported |" in md
    assert "MFU" not in md
    assert "| real tokens trained | 9,180,000 | not reported | not reported |" in md
    assert "resumed" not in md
    assert "| 4096 / 512 | 1,300.0 | $4.60 | 1,206.0 | $4.96 | 728.0 | $8.44 |" in md
    not_reported = " | ".join(["not reported"] * 4)
    assert f"| 512 / 256 | 2,400.0 | $2.49 | {not_reported} |" in md
    assert "| 1 | $71.92 | $77.63 | $141.35 |" in md
    assert "| 24 | $566.88 | $572.59 | $650.11 |" in md
    assert "| pass@1 | 0.650 | 0.641 |" in md and "| pass@5 | 0.800 | 0.795 |" in md
    assert "| metric | this run | paper (TPU-trained) |" in md
    assert "How the 780 samples ended" in md
    for line in (
        "| passed | 520 | `.` pass: 520 |",
        "| failed to compile | 100 | `C` compile error: 60, `S` syntax error: 40 |",
        "| timed out | 5 | `T` timeout: 5 |",
        "| mismatched | 150 | `R` runtime mismatch: 150 |",
        "| aborted | 2 | `A` simulation aborted: 2 |",
        "| refused by the sandbox | 3 | `F` forbidden construct: 3 |",
        "| no code in the answer | 0 |  |",
        "Answers cut off by the token limit: 4.",
        "The reference solution itself fails on 1 problems (Prob099_m2014_q6c)",
    ):
        assert line in md, line
    assert report["quality"]["outcomes"]["failed to compile"] == 100
    for name in FIGURES:
        assert f"({name})" in md


def test_missing_inputs_are_not_measured(tmp_path):
    out = tmp_path / "report"
    assert cli.main(["report", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| cost | not measured | $56.11 | $119.23 |" in md
    assert "| 1 | not measured | $77.63 | $141.35 |" in md
    assert "| pass@1 | not measured | 0.641 |" in md
    assert "How the samples ended: not measured." in md
    for name in FIGURES:
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_report_finds_summaries_through_the_run_config(summaries, where, tmp_path):
    _placed(summaries, where)
    config = {
        "run_name": "t",
        "model": {"base": "b"},
        "data": {"dataset": "d.jsonl"},
        "train": {"output_dir": f"{where}/run"},
        "bench": {"results_dir": f"{where}/bench"},
        "eval": {"problems_dir": "p", "results_dir": f"{where}/no-eval-yet"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["report", "--config", str(path)]) == 0
    out = f"{where}/run/report"
    report = json.loads(storage.read_text(f"{out}/report.json"))
    assert report["inputs"]["train"] == f"{where}/run/train_summary.json"
    assert report["inputs"]["eval"] is None
    assert report["platforms"][0]["serving"][0]["usd_per_m_output_tokens"] is None
    md = storage.read_text(f"{out}/report.md")
    assert "serving machine not given" in md
    assert "| pass@1 | not measured | 0.641 |" in md


def test_unknown_accelerator_and_missing_file_are_user_errors(where, capsys):
    assert cli.main(["report", "--out", where, "--serve-accelerator", "v9z-8"]) == 2
    assert "unknown; known: v5p-8" in capsys.readouterr().err
    assert cli.main(["report", "--out", where, "--eval-summary", f"{where}/x.json"]) == 2
    err = capsys.readouterr().err
    assert f"{where}/x.json" in err and "file not found" in err
    assert len(err.strip().splitlines()) == 1, err


def test_run_config_accelerators_are_the_defaults_and_flags_win(summaries, tmp_path):
    # A summary that recorded no catalog machine: only the run config can price it.
    train = json.loads(summaries["train"].read_text())
    train["accelerator"] = "cpu"
    summaries["train"].write_text(json.dumps(train))
    config = {
        "run_name": "t",
        "model": {"base": "b"},
        "data": {"dataset": "d.jsonl"},
        "train": {"output_dir": str(summaries["train"].parent), "accelerator": "v5p-8"},
        "serve": {"model_dir": "gs://b/merged", "accelerator": "v6e-8"},
        "bench": {"results_dir": str(summaries["bench"].parent)},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "from-config"
    assert cli.main(["report", "--config", str(path), "--out", str(out)]) == 0
    ours = json.loads((out / "report.json").read_text())["platforms"][0]
    assert (ours["train_machine"], ours["serve_machine"]) == ("v5p-8", "v6e-8")
    assert ours["train_cost"] == pytest.approx(16.80 * 3)
    assert ours["serving"][-1]["usd_per_m_output_tokens"] == pytest.approx(21.52 / (1300 * 0.0036))
    assert ours["tco"]["1"] == pytest.approx(16.80 * 3 + 21.52)
    md = (out / "report.md").read_text()
    assert "serving machine not given" not in md and "no catalog rate" not in md

    # Flags still win over the run config.
    flagged = tmp_path / "flagged"
    argv = [
        "report",
        "--config",
        str(path),
        "--out",
        str(flagged),
        "--train-accelerator",
        "v5p-16",
        "--serve-accelerator",
        "v5p-8",
    ]
    assert cli.main(argv) == 0
    ours = json.loads((flagged / "report.json").read_text())["platforms"][0]
    assert (ours["train_machine"], ours["serve_machine"]) == ("v5p-16", "v5p-8")
    assert ours["serve_hourly_usd"] == 16.80


def test_a_resumed_training_is_flagged_as_covering_its_last_segment(summaries, tmp_path):
    train = json.loads(summaries["train"].read_text())
    train.update(resumed_from_step=600, steps_this_run=644)
    summaries["train"].write_text(json.dumps(train))
    out = tmp_path / "report"
    argv = ["report", "--train-summary", str(summaries["train"]), "--out", str(out)]
    assert cli.main(argv) == 0
    md = (out / "report.md").read_text()
    assert (
        "- training resumed from step 600: train_summary.json covers only the last segment "
        "(644 of 1244 steps)" in md
    )
    assert json.loads((out / "report.json").read_text())["notes"][0].startswith("training resumed")


def test_a_multi_segment_training_is_priced_on_its_totals(summaries, tmp_path):
    # Preempted after 600 steps and resumed from the checkpoint at 600: the summary's
    # wall_seconds, real_tokens and tokens_per_second are totals over both processes.
    train = json.loads(summaries["train"].read_text())
    train.update(
        wall_seconds=3.5 * 3600,
        tokens_per_second=9_180_000 / (3.5 * 3600),
        segments=2,
        steps_run=1262,
        resumed_from_step=600,
        steps_this_run=644,
        last_segment={"start_step": 600, "end_step": 1244, "wall_seconds": 1.8 * 3600},
    )
    summaries["train"].write_text(json.dumps(train))
    out = tmp_path / "report"
    argv = ["report", "--train-summary", str(summaries["train"]), "--out", str(out)]
    assert cli.main(argv) == 0
    ours = json.loads((out / "report.json").read_text())["platforms"][0]
    assert ours["train_hours"] == pytest.approx(3.5)
    assert ours["train_cost"] == pytest.approx(16.80 * 3.5)
    assert ours["train_tokens"] == 9_180_000
    md = (out / "report.md").read_text()
    assert "| cost | $58.80 |" in md
    assert "covers only the last segment" not in md
    assert (
        "- training ran in 2 segments (stopped and resumed): wall time and cost cover all of "
        "them (1262 steps run for 1244 kept)" in md
    )


def test_the_report_keeps_the_stages_from_boot_to_the_first_step(summaries, tmp_path):
    summary = json.loads(summaries["train"].read_text())
    t0 = 1_764_079_200.0  # 2025-11-25 14:00:00 UTC
    summary["stages"] = [
        {"stage": "boot", "source": "startup", "start": t0, "seconds": 20.0, "state": "done"},
        {
            "stage": "venv",
            "source": "startup",
            "start": t0 + 20,
            "seconds": 8.5,
            "state": "done",
            "note": "restored from gs://b/venv/train-0123.tar.gz",
        },
        {"stage": "load", "source": "trainer", "start": t0 + 60, "seconds": 45.0, "state": "done"},
        {"stage": "compile", "source": "trainer", "start": t0 + 105, "seconds": 250.0},
        {"stage": "first_step", "source": "trainer", "start": t0 + 105, "seconds": 262.5},
    ]
    summary["stages"][3]["state"] = summary["stages"][4]["state"] = "done"
    summaries["train"].write_text(json.dumps(summary))
    out = tmp_path / "report"
    argv = ["report", "--train-summary", str(summaries["train"]), "--out", str(out)]
    assert cli.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [row["stage"] for row in report["stages"]] == [
        "boot",
        "venv",
        "load",
        "compile",
        "first_step",
    ]
    md = (out / "report.md").read_text()
    assert "### From boot to the first step" in md
    assert (
        "| venv | startup | 2025-11-25 14:00:20 | 8.5 | "
        "restored from gs://b/venv/train-0123.tar.gz |" in md
    )
    assert "| compile | trainer | 2025-11-25 14:01:45 | 250.0 |  |" in md
    assert "Kernel start to the end of the first training step: 367.5 s." in md


def test_a_bad_stage_row_is_one_line(summaries, tmp_path, capsys):
    summary = json.loads(summaries["train"].read_text())
    summary["stages"] = [{"stage": "boot", "start": "yesterday", "state": "done"}]
    summaries["train"].write_text(json.dumps(summary))
    argv = ["report", "--train-summary", str(summaries["train"]), "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "stages" in err and "yesterday" in err and "Traceback" not in err


THROUGHPUT = {
    "profile": "throughput",
    "weight_quantization": "fp8",
    "kv_cache_dtype": "fp8",
    "tensor_parallel_size": 4,
    "data_parallel_size": 2,
}
PAPER = {**THROUGHPUT, "profile": "paper", "weight_quantization": "off", "kv_cache_dtype": "auto"}


def _with_serving(path, numerics, pass_at_1):
    data = json.loads(path.read_text())
    data["serving"] = numerics
    data["pass_at"] = {"1": pass_at_1, "5": 0.8}
    path.write_text(json.dumps(data))


def _report(summaries, tmp_path, *extra):
    out = tmp_path / "report"
    argv = [
        "report",
        "--bench-summary",
        str(summaries["bench"]),
        "--eval-summary",
        str(summaries["eval"]),
        "--out",
        str(out),
        "--serve-accelerator",
        "v6e-8",
        *extra,
    ]
    assert cli.main(argv) == 0
    return (out / "report.md").read_text()


def test_a_quantized_profile_is_judged_against_the_same_models_bf16_pass_at_1(summaries, tmp_path):
    _with_serving(summaries["eval"], THROUGHPUT, 0.62)
    baseline = tmp_path / "bf16" / "summary.json"
    baseline.parent.mkdir()
    baseline.write_text(summaries["eval"].read_text())
    _with_serving(baseline, PAPER, 0.65)
    text = _report(summaries, tmp_path, "--baseline-eval-summary", str(baseline))
    assert "## Quality, throughput and cost per serving profile" in text
    assert (
        "| profile throughput (weights fp8, KV cache fp8, 2 x TP 4) | 0.620 | 2,400.0 | $2.49 |"
        in text
    )
    assert "| profile paper (weights bf16, KV cache bf16, 2 x TP 4) (baseline) | 0.650 |" in text
    assert (
        "Quantized vs bf16 serving of the same model: pass@1 0.620 vs 0.650, +3.0 points lost."
        in text
    )


def test_a_quantized_profile_without_a_baseline_says_it_is_not_judged(summaries, tmp_path):
    _with_serving(summaries["eval"], THROUGHPUT, 0.62)
    text = _report(summaries, tmp_path)
    assert "Quantized serving, not judged: no bf16 eval of the same model" in text


def test_a_bf16_profile_needs_no_judgement(summaries, tmp_path):
    _with_serving(summaries["eval"], PAPER, 0.65)
    text = _report(summaries, tmp_path)
    assert "| profile paper (weights bf16, KV cache bf16, 2 x TP 4) | 0.650 |" in text
    assert "Quantized" not in text
