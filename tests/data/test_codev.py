"""CodeV-R1 rows: reading (local and fsspec memory:// standing in for gs://) and cleaning."""

import gzip
import re
import time

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.data.conftest import write_jsonl
from workloads.common import errors
from workloads.data import codev

CODE = "module m (input a, output y);\n    assign y = a;\nendmodule"
FENCED = f"```verilog\n{CODE}\n```"


@pytest.mark.parametrize(
    "response",
    [
        # <answer> preferred; prose around the code goes.
        f"<think>\nreasoning\n</think>\n<answer>\nHere it is:\n{FENCED}\nDone.\n</answer>",
        # No <answer>: thinking removed, the rest used.
        f"<think>\nreasoning\n</think>\n\n```verilog\n{CODE}\n```\n",
        # The opening <think> was in the prompt: everything up to </think> goes.
        f"reasoning without an opening tag\n</think>\n{FENCED}",
        # Fenced with another Verilog tag, or untagged.
        f"<answer>```systemverilog\n{CODE}\n```</answer>",
        f"<answer>\n```\n{CODE}\n```\n</answer>",
        # Unfenced, or fenced with another language: module...endmodule is extracted.
        f"<think>x</think><answer>\nThe design:\n{CODE}\nThat is all.</answer>",
        f"<answer>\n```python\n{CODE}\n```\n</answer>",
        # An <answer> mentioned while thinking is not taken;
        # an unterminated <answer> runs to the end.
        f"<think>I will write <answer>wrong</answer> later</think><answer>\n{FENCED}",
        # Blank lines around the code go.
        f"<answer>\n```verilog\n\n\n{CODE}\n\n```\n</answer>",
    ],
)
def test_clean_response_gives_one_verilog_block(response):
    assert codev.clean_response(response) == FENCED


def test_several_verilog_blocks_become_one():
    other = "module n;\nendmodule"
    response = f"<answer>\n```verilog\n{CODE}\n```\nand\n```verilog\n{other}\n```\n</answer>"
    assert codev.clean_response(response) == f"```verilog\n{CODE}\n\n{other}\n```"


@pytest.mark.parametrize(
    "response",
    [
        "",
        "   \n",
        "<think>\nonly thinking, never finished",
        f"<think>\n{FENCED}\n</think>\n",  # code only inside the thinking
        "<think>x</think><answer>I cannot write this module.</answer>",
        "<answer>\n```verilog\n\n```\n</answer>",
    ],
)
def test_responses_without_verilog_clean_to_empty(response):
    assert codev.clean_response(response) == ""


def test_unterminated_think_drops_the_rest():
    assert codev.strip_thinking(f"{FENCED}\n<think>\nmore") == f"{FENCED}\n"


# The regex-based cleaning this module had before its scans were made linear: the reference the
# linear scans must agree with on every input.
_OLD_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_OLD_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
_OLD_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_OLD_MODULE = re.compile(r"\b(?:macro)?module\b.*?\bendmodule\b", re.DOTALL)


def _old_clean_response(response: str) -> str:
    text = _OLD_THINK.sub("", response)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    answers = _OLD_ANSWER.findall(text)
    if answers:
        text = "\n\n".join(answers)
    blocks = [
        body.strip("\n")
        for tag, body in _OLD_FENCE.findall(text)
        if tag.lower() in {"", "verilog", "systemverilog", "v", "sv"} and body.strip()
    ]
    code = "\n\n".join(blocks) or "\n\n".join(m.group(0) for m in _OLD_MODULE.finditer(text))
    code = code.strip("\n")
    return f"```verilog\n{code}\n```" if code.strip() else ""


# Pieces a response is made of, in the combinations that stress the scans: tags opened and not
# closed, keywords glued to words, fences without a line break, tags and tag-like characters.
_PIECES = st.sampled_from(
    [
        "<think>", "</think>", "<answer>", "</answer>", "```", "```verilog", "```python", " ```v ",
        "module", "macromodule", "endmodule", "xmodule", "module_", "endmodule1", "m;",
        " ", "\n", "\t", "x", "é", "_", "`", "<", ">", "/", "think", "answer",
    ]
)  # fmt: skip
_RESPONSES = st.one_of(st.lists(_PIECES, max_size=30).map("".join), st.text(max_size=60))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_RESPONSES)
def test_linear_cleaning_agrees_with_the_regex_cleaning(response):
    assert codev.clean_response(response) == _old_clean_response(response)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_RESPONSES, _RESPONSES)
def test_cleaning_agrees_after_any_prefix(prefix, response):
    """A scan that starts mid-text (after a match) sees the character before its start."""
    assert codev.clean_response(prefix + response) == _old_clean_response(prefix + response)


@pytest.mark.parametrize(
    "loop",
    ["module ", "macromodule ", "<think>", "```", "```verilog" + "x" * 1000, "</think><think>"],
)
def test_a_10_mb_repetition_loop_cleans_in_seconds(loop):
    """A model stuck repeating itself writes megabytes of one token. The regexes this module used
    took 22 minutes on 1.4 MB of `module ` (quadratic: 10 MB would take hours); the bounded
    searches take about a second on a busy 2-core machine."""
    response = "<answer>\n" + loop * (10_000_000 // len(loop))
    started = time.perf_counter()
    codev.clean_response(response)
    assert time.perf_counter() - started < 5


def test_rows_stream_with_limits_and_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "p1", "response": "r1"}\n\n'
        '{"prompt": "p2", "response": null, "extra": 1}\n'
        '{"prompt": "p3", "response": "r3"}\n'
    )
    rows = list(codev.iter_rows(str(path)))
    assert [(r.line, r.prompt, r.response) for r in rows] == [
        (1, "p1", "r1"),
        (3, "p2", ""),
        (4, "p3", "r3"),
    ]
    assert [r.prompt for r in codev.iter_rows(str(path), max_rows=2)] == ["p1", "p2"]


def test_wrong_fields_error_lists_the_fields_found(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "i", "output": "o", "id": 3}])
    with pytest.raises(errors.UserError) as info:
        list(codev.iter_rows(path))
    message = str(info.value)
    assert "\n" not in message
    assert "line 1" in message and "'prompt'" in message and "'response'" in message
    assert "fields found: 'instruction', 'output', 'id'" in message


def test_a_later_row_with_wrong_fields_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "response": "r"}, {"prompt": "p"}])
    with pytest.raises(
        errors.UserError,
        match=r"line 2: .*missing 'response'; fields found: "
        r"'prompt'",
    ):
        list(codev.iter_rows(path))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"prompt": "p", "response": 3}\n', r"line 1: field 'response' must be a string, got int"),
        ('{"prompt": "p", "response": "r"}\nnot json\n', r"line 2: not valid JSON"),
        ('["prompt", "response"]\n', r"line 1: expected a JSON object"),
    ],
)
def test_malformed_rows(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(errors.UserError, match=match):
        list(codev.iter_rows(str(path)))


def test_missing_file(tmp_path):
    with pytest.raises(errors.UserError, match=r"nope\.jsonl: file not found"):
        list(codev.iter_rows(str(tmp_path / "nope.jsonl")))


def test_remote_path_through_fsspec():
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/bucket/codev.jsonl", b'{"prompt": "p", "response": "r"}\n' * 3)
    assert len(list(codev.iter_rows("memory://bucket/codev.jsonl"))) == 3
    with pytest.raises(errors.UserError, match="file not found"):
        list(codev.iter_rows("memory://bucket/missing.jsonl"))


def test_a_gzip_dataset_is_read_as_its_text(tmp_path):
    """A .jsonl.gz (or a gzip file under any name) streams the same rows as the plain file."""
    text = '{"prompt": "p1", "response": "r1"}\n{"prompt": "p2", "response": "r2"}\n'
    plain = tmp_path / "d.jsonl"
    plain.write_text(text)
    for name in ("d.jsonl.gz", "d_compressed.jsonl"):
        (tmp_path / name).write_bytes(gzip.compress(text.encode()))
        assert list(codev.iter_rows(str(tmp_path / name))) == list(codev.iter_rows(str(plain)))
    fsspec.filesystem("memory").pipe_file("/bucket/d.jsonl.gz", gzip.compress(text.encode()))
    assert len(list(codev.iter_rows("memory://bucket/d.jsonl.gz"))) == 2


@pytest.mark.parametrize(
    ("content", "match"),
    [
        # Latin-1, not UTF-8: the line and the byte are named.
        (b'{"prompt": "p", "response": "r"}\n{"prompt": "caf\xe9", "response": "r"}\n',
         r"d\.jsonl: line 2: not UTF-8 text \(byte 0xE9 at offset 15\)"),
        # JSON can spell half a surrogate pair; no tokenizer encodes it.
        (b'{"prompt": "p", "response": "x\\udc00y"}\n',
         r"line 1: field 'response' holds a lone surrogate \('\\udc00' at character 1\)"),
        # mtime=0: the same bytes in every process (pytest-xdist's workers must collect the
        # same test ids, and a parameter's id is made from its bytes).
        (gzip.compress(b'{"prompt": "p", "response": "r"}\n' * 100, mtime=0)[:40],
         r"d\.jsonl: damaged gzip data"),
    ],
    ids=["latin-1", "lone-surrogate", "damaged-gzip"],
)  # fmt: skip
def test_undecodable_datasets_are_one_line(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(errors.UserError, match=match) as info:
        list(codev.iter_rows(str(path)))
    assert "\n" not in str(info.value)


def test_a_directory_or_a_path_under_a_file_is_named(tmp_path):
    with pytest.raises(errors.UserError, match=r"is a directory, expected a file"):
        list(codev.iter_rows(str(tmp_path)))
    (tmp_path / "f").write_text("")
    with pytest.raises(errors.UserError, match=r"f/d\.jsonl: file not found \(.*/f is a file"):
        list(codev.iter_rows(str(tmp_path / "f" / "d.jsonl")))
    fsspec.filesystem("memory").pipe_file("/bucket/dir/x.jsonl", b"")
    with pytest.raises(errors.UserError, match=r"memory://bucket/dir: is a directory"):
        list(codev.iter_rows("memory://bucket/dir"))
