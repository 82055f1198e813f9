"""`python -m workloads eval` end to end: fake endpoint, the test problems, real iverilog."""

import itertools
import json
import pathlib
import shutil
import threading
import uuid

import pytest
import yaml

from tests.evaluation import verilog_samples as vs
from workloads import cli
from workloads.common import storage
from workloads.contract import runconfig

pytestmark = pytest.mark.skipif(shutil.which("iverilog") is None, reason="needs Icarus Verilog")


def _answers():
    """Majority: always right (fenced). Counter: right, wrong, right... ([BEGIN]/[DONE]).
    Delay: thinks, then never raises done (the testbench's TIMEOUT guard)."""
    counter = itertools.cycle([vs.COUNTER_OK, vs.COUNTER_WRONG, vs.COUNTER_OK])
    lock = threading.Lock()

    def answer(body):
        spec = body["messages"][-1]["content"]
        if "at least two of the three inputs" in spec:
            return f"Here you go:\n```verilog\n{vs.MAJORITY_OK}```\n"
        if "binary counter" in spec:
            with lock:
                return f"[BEGIN]\n{next(counter)}[DONE]\n"
        return f"<think>three flops</think>\n```verilog\n{vs.DELAY_NEVER_DONE}```"

    return answer


def test_eval_end_to_end_and_resume(openai_server, problems_dir, tmp_path, capsys):
    openai_server.answer = _answers()
    out = tmp_path / "results"
    argv = [
        "eval",
        "--problems",
        problems_dir,
        "--endpoint",
        openai_server.url,
        "--out",
        str(out),
        "-n",
        "3",
        "--ks",
        "1,2",
        "--sim-timeout",
        "5",
        "--jobs",
        "4",
    ]
    assert cli.main(argv) == 0
    assert len(openai_server.requests) == 9
    assert {r["model"] for r in openai_server.requests} == {"test-model"}  # from /v1/models
    assert openai_server.requests[0]["messages"][0]["role"] == "system"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 3 and summary["n"] == 3
    assert summary["pass_at"]["1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert summary["pass_at"]["2"] == pytest.approx((1 + 1 + 0) / 3)
    assert (summary["temperature"], summary["top_p"], summary["max_tokens"], summary["model"]) == (
        0.8,
        0.95,
        1024,
        "test-model",
    )
    assert summary["status_counts"] == {".": 5, "R": 1, "T": 3}
    assert summary["reference_failures"] == []

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["problem"], r["passed"]) for r in rows] == [
        ("Prob001_majority3", 3),
        ("Prob002_count16", 2),
        ("Prob003_delay3", 0),
    ]
    assert rows[0]["reference_samples"] == 57
    assert rows[1]["samples"][0]["extraction"] == "begin-done"
    assert "removed thinking" in rows[2]["samples"][0]["notes"]
    assert rows[2]["samples"][0]["status"] == "T" and "TIMEOUT" in rows[2]["samples"][0]["log_tail"]
    assert sorted(p.name for p in (out / "samples").iterdir()) == [
        "Prob001_majority3.json",
        "Prob002_count16.json",
        "Prob003_delay3.json",
    ]
    markdown = (out / "summary.md").read_text()
    assert "| pass@1 | 0.556 | 0.641 |" in markdown
    assert "| Prob002_count16 | 2/3 |" in markdown

    # A rerun finds every problem finished: no requests, same scores.
    openai_server.requests.clear()
    assert cli.main(argv) == 0
    assert openai_server.requests == []
    assert json.loads((out / "summary.json").read_text())["pass_at"] == summary["pass_at"]


def test_eval_reads_the_run_config(openai_server, problems_dir, tmp_path):
    openai_server.answer = _answers()
    config = {
        "run_name": "t",
        "model": {"base": str(tmp_path / "base")},
        "data": {"dataset": str(tmp_path / "data.jsonl")},
        "train": {"output_dir": str(tmp_path / "run")},
        "serve": {
            "model_dir": str(tmp_path / "merged"),
            "served_model_name": "gemma-ft",
            "profile": "throughput",
            "kv_cache_dtype": "auto",
        },
        "eval": {
            "problems_dir": problems_dir,
            "results_dir": str(tmp_path / "eval"),
            "endpoint": openai_server.url,
            "n": 2,
            "ks": [1, 2],
            "sim_timeout_s": 5,
            "temperature": 0.2,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["eval", "--config", str(path), "--only", "majority"]) == 0
    assert {(r["model"], r["temperature"]) for r in openai_server.requests} == {("gemma-ft", 0.2)}
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert (summary["problems"], summary["n"], summary["pass_at"]) == (1, 2, {"1": 1.0, "2": 1.0})
    # The scores are recorded with the profile and the numerics they were served under (an
    # explicit key overriding the profile's value included).
    assert summary["serving"] == {
        "profile": "throughput",
        "weight_quantization": "fp8",
        "kv_cache_dtype": "auto",
        "tensor_parallel_size": 4,
        "data_parallel_size": 2,
    }
    assert (
        "Served with: profile throughput (weights fp8, KV cache bf16, 2 x TP 4)."
        in (tmp_path / "eval" / "summary.md").read_text()
    )


def test_a_list_with_no_k_within_n_is_refused(problems_dir, tmp_path, capsys):
    argv = [
        "eval",
        "--problems",
        problems_dir,
        "--endpoint",
        "http://127.0.0.1:9/v1",
        "--out",
        str(tmp_path),
        "-n",
        "3",
        "--ks",
        "5,10",
    ]
    assert cli.main(argv) == 2
    assert "pass@k with k=[5, 10] needs at least that many samples; n is 3" in (
        capsys.readouterr().err
    )


def test_greedy_evaluation_reports_pass_at_1(openai_server, problems_dir, tmp_path, caplog):
    """n = 1 at temperature 0 with the default ks (1, 5): pass@1 is reported, pass@5 is left out
    with one line, instead of the whole eval failing on pass@5."""
    openai_server.answer = _answers()
    out = tmp_path / "results"
    argv = ["eval", "--problems", problems_dir, "--endpoint", openai_server.url]
    argv += ["--out", str(out), "-n", "1", "--temperature", "0", "--sim-timeout", "5"]
    assert cli.main(argv) == 0
    assert len(openai_server.requests) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["n"], summary["temperature"]) == (1, 0)
    assert summary["pass_at"] == {"1": pytest.approx((1 + 1 + 0) / 3)}
    assert "pass@k for k=[5] left out: n is 1 sample(s) per problem; reporting pass@1" in (
        caplog.text
    )


def test_missing_problems_dir_is_refused(tmp_path, capsys):
    assert cli.main(["eval", "--out", str(tmp_path)]) == 2
    assert "eval needs --problems" in capsys.readouterr().err


@pytest.mark.parametrize("store", ["memory", "gs"])
def test_problems_from_and_results_to_a_bucket(openai_server, problems_dir, request, store):
    """gs:// in production: on a bucket of the GCS protocol server, and on memory:// (fsspec's
    stand-in). The problems are staged to local files for iverilog; every result file is
    uploaded."""
    if store == "gs":
        bucket = request.getfixturevalue("gcs_bucket")
    else:
        bucket = f"memory://eval-bucket-{uuid.uuid4().hex[:8]}"
    fs, _ = storage.filesystem(bucket)
    try:
        for path in pathlib.Path(problems_dir).iterdir():
            if "majority3" in path.name:
                storage.write_bytes_atomic(
                    f"{bucket}/dataset_spec-to-rtl/{path.name}", path.read_bytes()
                )
        openai_server.answer = _answers()
        argv = [
            "eval",
            "--problems",
            f"{bucket}/dataset_spec-to-rtl",
            "--out",
            f"{bucket}/eval",
            "--endpoint",
            openai_server.url,
            "-n",
            "2",
            "--ks",
            "1,2",
            "--sim-timeout",
            "5",
        ]
        assert cli.main(argv) == 0
        names = storage.list_files(f"{bucket}/eval")
        assert names == [
            "results.jsonl",
            "samples/Prob001_majority3.json",
            "summary.json",
            "summary.md",
        ]
        summary = json.loads(storage.read_text(f"{bucket}/eval/summary.json"))
        assert summary["pass_at"] == {"1": 1.0, "2": 1.0}
        assert "| pass@1 | 1.000 | 0.641 |" in storage.read_text(f"{bucket}/eval/summary.md")
    finally:
        if store == "memory" and fs.exists(bucket):
            fs.rm(bucket, recursive=True)


def test_the_defaults_are_the_papers():
    section = runconfig.EvalRunSection(problems_dir="p", results_dir="r")
    assert (section.n, section.temperature, section.top_p) == (5, 0.8, 0.95)
    assert (section.max_tokens, section.sim_timeout_s, section.ks) == (1024, 60, (1, 5))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--endpoint", "not a url"],
            "endpoint 'not a url': not an http(s) URL; expected e.g. http://127.0.0.1:8000/v1",
        ),
        (["--request-timeout", "-5"], "--request-timeout -5.0: need a number of seconds > 0"),
        (["--request-timeout", "nan"], "--request-timeout nan: need a number of seconds > 0"),
        (["--sim-timeout", "-1"], "eval: sim_timeout_s: -1.0: Input should be greater than 0"),
        (["-n", "0"], "eval: n: 0: Input should be greater than or equal to 1"),
        (["--top-p", "1.5"], "eval: top_p: 1.5: Input should be less than or equal to 1"),
        (["--jobs", "0"], "--jobs 0: need at least 1 parallel simulation"),
    ],
)
def test_bad_settings_end_in_one_line(problems_dir, tmp_path, capsys, extra, expected):
    argv = ["eval", "--problems", problems_dir, "--out", str(tmp_path / "out"), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(expected) and "\n" not in err, err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_without_the_sandbox_eval_refuses_to_judge(
    openai_server, problems_dir, tmp_path, capsys, monkeypatch
):
    """bubblewrap missing: one line naming the package, exit 2, no generated code run."""
    from workloads.evaluation import sandbox

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("iverilog", "vvp", "setpriv", "ldd"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    sandbox.current.cache_clear()
    sandbox.require.cache_clear()
    try:
        argv = ["eval", "--problems", problems_dir, "--endpoint", openai_server.url]
        assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    finally:
        sandbox.current.cache_clear()
        sandbox.require.cache_clear()
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "bwrap not found on PATH; generated code runs only inside the sandbox: "
        "apt-get install bubblewrap"
    ), err
    assert "\n" not in err
    assert openai_server.requests == []  # refused before sampling, too
