"""Code extraction from model-output fixtures (data/model_outputs), checked by simulating the
extracted code against the majority problem with the real iverilog, and the module pruning."""

import pathlib

import pytest

from workloads.evaluation import extract, judge, problems

OUTPUTS = pathlib.Path(__file__).parent / "data" / "model_outputs"

# fixture -> (method, passes the majority testbench, a note that must be present); the rule
# that decides (see extract.py) in the comment.
CASES = {
    "fenced_with_prose": ("fence", True, None),  # b: the fenced block
    "begin_done": ("begin-done", True, None),  # a: between the markers
    "begin_done_inline": ("begin-done", True, None),  # a: markers on the code's own lines
    # a: the fence lines inside the markers reach the compiler (a syntax error)
    "begin_done_with_fence": ("begin-done", False, None),
    # b: the first block only, the wrong draft; the correction is never judged
    "multiple_fences_corrected": ("fence", False, None),
    "think_then_fence": ("fence", True, "removed thinking"),  # reasoning removed, then b
    "gemma_thought_channel": ("fence", True, "removed thinking"),
    "think_close_only": ("bare", True, "removed thinking"),  # reasoning removed, then c
    "thinking_cut_off": ("none", False, "removed thinking"),  # nothing after the reasoning
    # one fence line: c, from `module TopModule` on; nothing repairs the missing endmodule
    "truncated_no_endmodule": ("bare", False, "has no endmodule"),
    "truncated_mid_statement": ("bare", False, "has no endmodule"),
    # c starts at `module TopModule`: the `define before it is left out
    "bare_with_prose": ("bare", False, None),
    # b: the first block holds the helper alone, no TopModule
    "helper_module_two_fences": ("fence", False, "no module TopModule"),
    "prose_only": ("none", False, "no module"),
    "echoed_markers": ("fence", True, None),  # a needs [BEGIN] at a line start: b
}


@pytest.fixture(scope="module")
def majority(request):
    directory = problems.SAMPLE_DIR
    [problem] = problems.load(str(directory), only="majority")
    return problem, judge.reference_run(problem, limits=judge.Limits(timeout_s=10)).samples


def test_every_fixture_has_a_case():
    assert sorted(p.stem for p in OUTPUTS.glob("*.txt")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_extraction(name, majority):
    method, passes, note = CASES[name]
    problem, reference_samples = majority
    result = extract.extract_code((OUTPUTS / f"{name}.txt").read_text())
    assert result.method == method, result
    if note:
        assert any(note in n for n in result.notes), result.notes
    for leftover in ("[BEGIN]", "[DONE]", "<think>", "</think>", "<|channel>", "<channel|>"):
        assert leftover not in result.code
    verdict = judge.judge_sample(
        result.code,
        problem,
        expected_samples=reference_samples,
        limits=judge.Limits(timeout_s=10),
        official_code=result.official_code,
    )
    assert verdict.passed is passes, (verdict.status, verdict.reason, result.code)


def test_only_the_first_fenced_block_counts():
    result = extract.extract_code((OUTPUTS / "multiple_fences_corrected.txt").read_text())
    assert extract.declared_modules(result.code) == ["TopModule"]
    assert "a | b | c" in result.code  # the first draft
    assert "(a & b)" not in result.code and "module tb" not in result.official_code


def test_bare_text_starts_at_the_top_module_and_ends_at_endmodule():
    result = extract.extract_code((OUTPUTS / "bare_with_prose.txt").read_text())
    assert result.code.startswith("module TopModule")
    assert result.code.rstrip().endswith("endmodule")
    assert "`define MAJ" not in result.code and "This uses a macro" not in result.code


@pytest.mark.parametrize("text", [None, "", "   \n"])
def test_empty_answers(text):
    assert extract.extract_code(text) == extract.Extraction(
        "", "none", ("no module declaration found",)
    )


def test_begin_without_done_is_no_code():
    result = extract.extract_code("[BEGIN]\nmodule TopModule(); endmodule\n")
    assert result.code == "" and any("without a later [DONE]" in n for n in result.notes)


def test_begin_and_done_lines_keep_their_code():
    text = "Sure.\n  [BEGIN]module TopModule();\nendmodule [DONE]\nBye.\n"
    result = extract.extract_code(text)
    assert result.code == "module TopModule();\nendmodule \n"


def _kept(code: str) -> list[str]:
    return extract.declared_modules(extract.extract_code(f"```\n{code}```\n").code)


def test_modules_reachable_from_the_top_are_kept_in_order():
    code = (
        "module leaf(); endmodule\n"
        "module TopModule(); mid u(); endmodule\n"
        "module mid(); leaf l(); endmodule\n"
        "module TopModule_tb(); TopModule dut(); endmodule\n"
        "module unused(); leaf l(); endmodule\n"
    )
    assert _kept(code) == ["leaf", "TopModule", "mid"]


def test_a_name_in_a_comment_or_string_reaches_nothing():
    code = (
        "module TopModule(); // see testbench\n"
        '  initial $display("testbench");\n  /* testbench */\nendmodule\n'
        "module testbench(); TopModule dut(); endmodule\n"
    )
    assert _kept(code) == ["TopModule"]


def test_macros_and_escaped_names_reach_their_modules():
    code = (
        "`define SUB helper\n"
        "module helper(); endmodule\n"
        "module other(); endmodule\n"
        "module TopModule(); `SUB h(); \\other  o(); endmodule\n"
        "module tb_mine(); endmodule\n"
    )
    result = extract.extract_code(f"```\n{code}```\n")
    assert "`define SUB helper" in result.code
    assert extract.declared_modules(result.code) == ["helper", "other", "TopModule"]
    assert "tb_mine" not in result.code and "tb_mine" in result.official_code


def test_recursion_and_cycles_end():
    code = (
        "module TopModule(); a x(); endmodule\n"
        "module a(); b y(); endmodule\n"
        "module b(); a z(); endmodule\n"
    )
    assert _kept(code) == ["TopModule", "a", "b"]


def test_without_a_top_module_nothing_is_dropped():
    answer = "```\nmodule top_module(); endmodule\nmodule tb(); endmodule\n```"
    result = extract.extract_code(answer)
    assert result.code == result.official_code
    assert extract.declared_modules(result.code) == ["top_module", "tb"]


def test_duplicates_of_a_kept_module_stay_for_the_compiler_to_refuse():
    code = "module TopModule(); endmodule\nmodule TopModule(); endmodule\n"
    result = extract.extract_code(f"```\n{code}```\n")
    assert extract.declared_modules(result.code) == ["TopModule", "TopModule"]
    assert "module TopModule is declared 2 times" in result.notes


def test_strip_thinking():
    assert extract.strip_thinking("<think>x</think>answer") == ("answer", True)
    assert extract.strip_thinking("<|channel>thought\nx<channel|>answer") == ("answer", True)
    assert extract.strip_thinking("plain") == ("plain", False)
    assert extract.strip_thinking("ok <think>cut off") == ("ok ", True)


def test_declared_modules_ignores_comments_and_prose():
    source = (
        "// module Fake\nmodule A(input x);\nendmodule\n"
        "  module B #(parameter W=1) ();\nendmodule\n"
    )
    assert extract.declared_modules(source) == ["A", "B"]
