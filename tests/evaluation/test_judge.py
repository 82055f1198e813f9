"""The iverilog judge on the test problems: correct samples pass, broken and hostile ones fail
without harming the run (real iverilog, short timeouts)."""

import os
import pathlib
import shutil
import time

import pytest

from tests.evaluation import official_flow
from tests.evaluation import verilog_samples as vs
from workloads.evaluation import extract, judge, problems

pytestmark = pytest.mark.skipif(shutil.which("iverilog") is None, reason="needs Icarus Verilog")

FAST = judge.Limits(timeout_s=2, output_bytes=64 * 1024)
# The design, then a testbench that dumps waves: judged on the design alone.
HELPFUL_ANSWER = (
    "```verilog\n"
    + vs.MAJORITY_OK
    + "module TopModule_tb;\n  reg a, b, c;\n  wire y;\n"
    + "  TopModule dut (.a(a), .b(b), .c(c), .y(y));\n"
    + '  initial begin $dumpfile("w.vcd"); $dumpvars; {a, b, c} = 3; #1 $finish; end\n'
    + "endmodule\n```\n"
)


@pytest.fixture(scope="module")
def loaded():
    directory = problems.SAMPLE_DIR
    return {p.name.split("_", 1)[1]: p for p in problems.load(str(directory))}


@pytest.fixture(scope="module")
def references(loaded):
    return {key: judge.reference_run(p, limits=FAST) for key, p in loaded.items()}


def test_reference_runs_give_the_sample_counts(references):
    assert {k: r.samples for k, r in references.items()} == {
        "majority3": 57,
        "count16": 282,
        "delay3": 48,
    }
    assert all(r.verdict.status == "." for r in references.values())


@pytest.mark.parametrize(
    ("problem", "code", "passed", "status"),
    [
        ("majority3", vs.MAJORITY_OK, True, "."),
        ("majority3", vs.MAJORITY_WRONG, False, "R"),
        ("count16", vs.COUNTER_OK, True, "."),
        ("count16", vs.COUNTER_WRONG, False, "R"),
        ("delay3", vs.DELAY_OK, True, "."),
        ("delay3", vs.DELAY_NEVER_DONE, False, "T"),  # the testbench's own TIMEOUT guard
        ("count16", vs.MAJORITY_OK, False, "C"),  # wrong ports
    ],
)
def test_functional_verdicts(loaded, references, problem, code, passed, status):
    verdict = judge.judge_sample(
        code, loaded[problem], expected_samples=references[problem].samples, limits=FAST
    )
    assert (verdict.passed, verdict.status) == (passed, status), verdict.reason


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("infinite_loop", "T"),
        ("early_finish", "R"),
        ("stop", "R"),
        ("finish_at_zero", "R"),
        ("huge_output", "O"),
        ("compile_error", "S"),
        ("missing_top", "m"),
        ("writes_file", "F"),
        ("fake_verdict", "F"),
        ("include_file", "F"),
        ("empty", "X"),
        ("forged_verdict_then_fatal", "A"),
        ("forged_verdict_then_finish", "A"),
        ("forged_verdict_then_stop", "A"),
        ("forged_verdict", "R"),
        ("fatal_midway", "A"),
    ],
)
def test_hostile_samples_fail(loaded, references, name, status):
    started = time.monotonic()
    verdict = judge.judge_sample(
        vs.HOSTILE[name],
        loaded["majority3"],
        expected_samples=references["majority3"].samples,
        limits=FAST,
    )
    assert not verdict.passed
    assert verdict.status == status, verdict.reason
    assert time.monotonic() - started < FAST.timeout_s * 2 + 2
    assert len(verdict.log_tail) <= 2000


def test_early_finish_reports_the_short_run(loaded, references):
    verdict = judge.judge_sample(
        vs.HOSTILE["early_finish"], loaded["majority3"], expected_samples=57, limits=FAST
    )
    assert verdict.samples is not None and 0 < verdict.samples < 57
    assert "stopped early" in verdict.reason


def test_a_passing_line_then_an_abort_fails_with_its_reason(loaded, references, tmp_path):
    code = vs.HOSTILE["forged_verdict_then_fatal"]
    # The official flow passes it: its only verdict line says 0 mismatches in 57 samples.
    assert official_flow.status(code, loaded["majority3"], tmp_path) == "."
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert (verdict.passed, verdict.status) == (False, "A")
    assert verdict.reason.startswith(
        "the simulator exited with status 1 after a passing verdict line: FATAL: sample.sv:"
    )
    assert judge.STATUS_MEANINGS["A"] == "simulation aborted"
    assert "Mismatches: 0 in 57 samples" in verdict.log_tail and "testbench" not in verdict.log_tail


@pytest.mark.parametrize("then", ["finish", "stop"])
def test_ending_before_the_testbench_verdict_fails(loaded, tmp_path, then):
    """vvp -n turns $stop into $finish; from a final block either ends the run, exit status 0,
    before the testbench's final block prints its verdict."""
    code = vs.HOSTILE[f"forged_verdict_then_{then}"]
    assert official_flow.status(code, loaded["majority3"], tmp_path) == "."
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert verdict.status == "A"
    assert verdict.reason.startswith("the testbench never printed its verdict")
    assert verdict.reason.endswith("1 verdict line(s) came from the design")


def test_the_testbench_copy_gets_a_fresh_tag(loaded):
    with open(loaded["majority3"].test_path, encoding="utf-8") as handle:
        source = handle.read()
    first, tag = judge._tagged_testbench(source)
    _, other = judge._tagged_testbench(source)
    assert tag and other and tag != other
    assert f'"Mismatches: %1d in %1d samples [testbench {tag}]"' in first
    assert first.replace(f" [testbench {tag}]", "") == source
    untouched = source.replace(judge.VERDICT_FORMAT, '"Errors: %1d of %1d"')
    assert judge._tagged_testbench(untouched) == (untouched, None)


def test_classify_exit_status_and_tag():
    tagged = "Mismatches: 0 in 10 samples [testbench 0a1b]\n"
    forged = "Mismatches: 0 in 10 samples\n"
    ok = {"compile_ok": True, "expected_samples": 10}
    assert judge.classify(tagged, **ok, tag="0a1b")[:2] == (".", "pass")
    assert judge.classify(tagged, **ok, tag="ffff")[0] == "A"  # someone else's tag
    assert judge.classify(forged, **ok, tag=None)[0] == "."  # an untagged testbench
    assert judge.classify(forged + tagged, **ok, tag="0a1b")[1] == (
        "the design printed 1 verdict line(s) of its own"
    )
    status, reason, *_ = judge.classify(tagged, **ok, tag="0a1b", exit_status=1)
    assert (status, reason) == (
        "A",
        "the simulator exited with status 1 after a passing verdict line: "
        "Mismatches: 0 in 10 samples [testbench 0a1b]",
    )
    assert judge.classify("FATAL: x.sv:3: boom\n", **ok, exit_status=1)[1].endswith(
        "status 1: FATAL: x.sv:3: boom"
    )
    assert judge.classify("", **ok, exit_status=-9)[1] == (
        "the simulator was killed by signal 9 SIGKILL"
    )
    # Compile failures and timeouts come first, as in the analyzer.
    assert judge.classify("TIMEOUT\n", **ok, exit_status=None, tag="0a1b")[0] == "T"
    assert judge.classify("a.sv:1: syntax error\n", **ok, exit_status=1)[0] == "S"


def test_status_groups_cover_every_letter():
    letters = [s for group in judge.STATUS_GROUPS.values() for s in group]
    assert sorted(letters) == sorted(judge.STATUS_MEANINGS)
    assert judge.group_counts({".": 3, "S": 1, "C": 2, "A": 1, "F": 1, "O": 1, "?": 4}) == {
        "passed": 3,
        "failed to compile": 3,
        "timed out": 0,
        "mismatched": 0,
        "aborted": 1,
        "refused by the sandbox": 2,
        "no code in the answer": 0,
        "request failed": 0,
        "other": 4,
    }


def test_classify_follows_the_analyzer():
    ok = "Hint: fine\nMismatches: 0 in 10 samples\n"
    assert judge.classify(ok, compile_ok=True, expected_samples=10)[0] == "."
    assert judge.classify(ok, compile_ok=True, expected_samples=11)[0] == "R"
    assert judge.classify(ok, compile_ok=False, expected_samples=10)[0] == "C"
    assert (
        judge.classify("x.sv:1: error: boom\n" + ok, compile_ok=True, expected_samples=10)[0] == "C"
    )
    assert judge.classify("TIMEOUT\n" + ok, compile_ok=True, expected_samples=10)[0] == "T"
    assert judge.classify(ok + ok, compile_ok=True, expected_samples=10)[0] == "R"
    assert judge.classify("Mismatches: 3 in 10 samples", compile_ok=True, expected_samples=10)[
        1:
    ] == ("3 mismatches in 10 samples", 3, 10)
    assert (
        judge.classify("Mismatches: 0 in 0 samples", compile_ok=True, expected_samples=None)[0]
        == "R"
    )
    assert (
        judge.classify(
            "a.sv:3: warning: always_comb process has no sensitivities\n" + ok,
            compile_ok=True,
            expected_samples=10,
        )[0]
        == "n"
    )


@pytest.mark.parametrize("name", sorted(vs.REACHES_OUT))
def test_a_design_that_reaches_into_the_testbench_is_refused(loaded, tmp_path, name):
    code = vs.REACHES_OUT[name]
    # The official flow passes the wrong design: it cleared the counter the verdict reads.
    assert official_flow.status(code, loaded["majority3"], tmp_path) == "."
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert (verdict.passed, verdict.status) == (False, "H")
    assert verdict.reason == "refused: hierarchical reference out of the design: tb.wrong"
    assert verdict.samples is None  # refused before the simulation
    assert judge.STATUS_MEANINGS["H"] == "reaches outside the design"


def test_hierarchical_names_inside_the_design_pass(loaded, tmp_path):
    code = vs.MAJORITY_INTERNAL_NAMES
    assert official_flow.status(code, loaded["majority3"], tmp_path) == "."
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert (verdict.passed, verdict.status) == (True, "."), verdict.reason


@pytest.mark.parametrize("name", sorted(vs.DRIVES_ITS_INPUTS))
def test_a_design_that_drives_its_own_inputs_is_refused(loaded, references, tmp_path, name):
    code = vs.DRIVES_ITS_INPUTS[name]
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert (verdict.passed, verdict.status) == (False, "H"), verdict.reason
    assert verdict.reason == "refused: the design drives its own input port a"
    assert verdict.samples is None  # refused before the simulation


def test_forcing_its_own_inputs_passes_the_official_flow(loaded, tmp_path):
    # Why the judge needs the check: the testbench's nets carry the forced values to the
    # reference too, and a design stuck at 0 matches it.
    code = vs.DRIVES_ITS_INPUTS["forces_them"]
    assert official_flow.status(code, loaded["majority3"], tmp_path) == "."


def test_a_design_that_deposits_into_its_own_inputs_is_refused(loaded, tmp_path):
    code = vs.DEPOSITS_INTO_ITS_INPUTS
    assert official_flow.status(code, loaded["majority3"], tmp_path) == "."
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert (verdict.passed, verdict.status) == (False, "F"), verdict.reason
    assert verdict.reason == "refused before compiling: uses $deposit (after preprocessing)"


@pytest.mark.parametrize("name", ["MAJORITY_READS_ITS_INPUTS", "MAJORITY_THROUGH_AN_INOUT"])
def test_a_design_that_only_reads_its_inputs_passes(loaded, tmp_path, name):
    code = getattr(vs, name)
    verdict = judge.judge_sample(code, loaded["majority3"], expected_samples=57, limits=FAST)
    assert (verdict.passed, verdict.status) == (True, "."), verdict.reason


# verilog-eval's own testbenches keep their counters in a struct `stats1` inside `tb`, and one
# here adds a parameter the verdict depends on, for a defparam to reach.
STATS_TESTBENCH = """\
`timescale 1 ps/1 ps
module stimulus_gen (input clk, output logic a, output logic b, output logic c);
  initial begin
    repeat (20) @(negedge clk) {a, b, c} = $random;
    @(negedge clk) $finish;
  end
endmodule

module tb();
  typedef struct packed {
    int errors;
    int clocks;
  } stats;
  stats stats1;
  parameter int CHECKED = 1;
  logic clk = 0;
  always #5 clk = ~clk;
  logic a, b, c, y_ref, y_dut;
  initial stats1 = '0;
  stimulus_gen stim1 (.clk, .a, .b, .c);
  RefModule good1 (.a, .b, .c, .y(y_ref));
  TopModule top_module1 (.a, .b, .c, .y(y_dut));
  always @(posedge clk) begin
    stats1.clocks++;
    if (CHECKED && y_ref !== y_dut) stats1.errors++;
  end
  final $display("Mismatches: %1d in %1d samples", stats1.errors, stats1.clocks);
endmodule
"""
_WRONG_MAJORITY = vs.MAJORITY_WRONG.replace("endmodule\n", "")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            "  final tb.stats1.errors = 0;\n",
            "refused: hierarchical reference out of the design: tb.stats1.errors",
        ),
        ("  defparam tb.CHECKED = 0;\n", "refused: defparam out of the design: tb.CHECKED"),
    ],
)
def test_verilog_eval_testbench_counters_are_out_of_reach(loaded, tmp_path, line, reason):
    test_path = tmp_path / "Prob900_stats_test.sv"
    test_path.write_text(STATS_TESTBENCH)
    problem = problems.Problem(
        "Prob900_stats", 900, "spec", str(test_path), loaded["majority3"].ref_path
    )
    reference = judge.reference_run(problem, limits=FAST)
    assert reference.samples == 21
    wrong = judge.judge_sample(vs.MAJORITY_WRONG, problem, expected_samples=21, limits=FAST)
    assert wrong.status == "R"
    forging = _WRONG_MAJORITY + line + "endmodule\n"
    assert official_flow.status(forging, problem, tmp_path / "official") == "."
    verdict = judge.judge_sample(forging, problem, expected_samples=21, limits=FAST)
    assert (verdict.passed, verdict.status, verdict.reason) == (False, "H", reason)


def test_judge_all_runs_a_hostile_mix_in_parallel(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # judge's temporary directories land here
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    items = [loaded["majority3"], loaded["count16"], loaded["delay3"]]
    codes = {
        "Prob001_majority3": [
            vs.MAJORITY_OK,
            vs.HOSTILE["infinite_loop"],
            vs.HOSTILE["huge_output"],
            vs.HOSTILE["stop"],
            None,
            vs.MAJORITY_OK,
            extract.extract_code(HELPFUL_ANSWER),
        ],
        "Prob002_count16": [vs.COUNTER_OK, vs.HOSTILE["compile_error"]],
        "Prob003_delay3": [vs.DELAY_NEVER_DONE, vs.DELAY_OK],
    }
    seen = []
    references, verdicts = judge.judge_all(
        items, codes, limits=FAST, workers=4, on_done=lambda *a: seen.append(a[:2])
    )
    assert {k: r.samples for k, r in references.items()} == {
        "Prob001_majority3": 57,
        "Prob002_count16": 282,
        "Prob003_delay3": 48,
    }
    assert [v.status for v in verdicts["Prob001_majority3"]] == [".", "T", "O", "R", "E", ".", "."]
    assert [v.status for v in verdicts["Prob002_count16"]] == [".", "S"]
    assert [v.status for v in verdicts["Prob003_delay3"]] == ["T", "."]
    assert len(seen) == 10  # every sample but the failed request
    assert list(tmp_path.iterdir()) == []  # every sample directory was removed
    # No sandbox survives its timeout; when a sandbox's bwrap is gone, the kernel kills every
    # process of its PID namespace. That kill is asynchronous: on a loaded machine a killed
    # process can still be in /proc for a moment (seen once in CI), so allow it 5 s to go.
    deadline = time.monotonic() + 5
    while True:
        leftovers = [pid for pid in os.listdir("/proc") if pid.isdigit() and _names(pid, tmp_path)]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert leftovers == []


def test_reference_failure_fails_its_samples(loaded, tmp_path):
    broken = tmp_path / "Prob009_broken_ref.sv"
    broken.write_text("module RefModule(input a, output y);\n  assign y = ;\nendmodule\n")
    problem = problems.Problem(
        "Prob009_broken", 9, "spec", loaded["majority3"].test_path, str(broken)
    )
    references, verdicts = judge.judge_all(
        [problem], {"Prob009_broken": [vs.MAJORITY_OK]}, limits=FAST
    )
    assert references["Prob009_broken"].samples is None
    assert not verdicts["Prob009_broken"][0].passed
    assert "reference solution fails" in verdicts["Prob009_broken"][0].reason


def test_missing_tools_is_a_user_error(monkeypatch):
    from workloads.common import errors

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(errors.UserError, match="iverilog and vvp not found"):
        judge.require_tools()


def _names(pid: str, root: pathlib.Path) -> bool:
    """Whether the process's command line names a path under root (bwrap's --bind of the
    sample directory does)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return str(root).encode() in handle.read()
    except OSError:
        return False


def test_the_official_commands_run_in_a_private_directory_per_sample(loaded, monkeypatch):
    calls = []
    real_run = judge._run

    def recording_run(argv, cwd, limits):
        calls.append((list(argv), cwd, sorted(os.listdir(cwd))))
        return real_run(argv, cwd, limits)

    monkeypatch.setattr(judge, "_run", recording_run)
    for _ in range(2):
        verdict = judge.judge_sample(
            vs.MAJORITY_OK, loaded["majority3"], expected_samples=57, limits=FAST
        )
        assert verdict.passed and verdict.samples == 57
    compile_argv = [
        "iverilog",
        "-Wall",
        "-Winfloop",
        "-Wno-timescale",
        "-g2012",
        "-s",
        "tb",
        "-o",
        "sim",
        "sample.sv",
        "test.sv",
        "ref.sv",
    ]
    preprocess_argv = [
        "iverilog",
        "-g2012",
        "-E",
        "-Minclude=sample.includes",
        "-o",
        "sample.preprocessed.sv",
        "sample.sv",
    ]
    alone_argv = ["iverilog", "-g2012", "-Wno-timescale", "-t", "null", "-s", "TopModule"]
    assert [argv for argv, _, _ in calls] == [
        preprocess_argv,
        compile_argv,
        # The design elaborated without the testbench, its netlist dumped for the port check.
        [*alone_argv, "-N", "design.netlist", "sample.sv"],
        ["vvp", "-n", "sim"],
    ] * 2
    assert calls[0][2] == ["sample.sv"]  # the design is preprocessed alone
    assert calls[1][2] == ["ref.sv", "sample.sv", "test.sv"]
    assert calls[0][1] == calls[1][1] == calls[3][1] != calls[4][1]  # one directory per sample
    assert not os.path.exists(calls[0][1])  # removed afterwards


def test_a_sample_gets_a_closed_stdin(tmp_path):
    """Even when our own stdin is a pipe that never ends, a child sees end-of-file at once."""
    read_end, write_end = os.pipe()
    saved = os.dup(0)
    os.dup2(read_end, 0)
    try:
        started = time.monotonic()
        out = judge._run(["sh", "-c", "read line; echo eof"], str(tmp_path), FAST)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    assert (out.text, out.returncode, out.timed_out) == ("eof\n", 0, False)
    assert time.monotonic() - started < FAST.timeout_s
