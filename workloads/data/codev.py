"""CodeV-R1 rows: streaming the JSONL (local or gs://), checking its fields, cleaning responses.

A CodeV-R1 response is a DeepSeek-R1 distillation: `<think>...</think>`, then the answer, usually
inside `<answer>...</answer>` with the Verilog in a fenced block. The recipe trains on the answer
only, with the Verilog re-fenced as one ```verilog block (the paper's recipe);
`clean_response` does that.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

from workloads import errors, storage

REQUIRED_FIELDS = ("prompt", "response")

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
# A fenced block: opening ``` with an optional language tag on its line, then the body.
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_MODULE = re.compile(r"\b(?:macro)?module\b.*?\bendmodule\b", re.DOTALL)
_VERILOG_TAGS = frozenset({"", "verilog", "systemverilog", "v", "sv"})


@dataclasses.dataclass(frozen=True)
class Row:
    """One JSONL row: `line` is its 1-based line number in the file."""

    line: int
    prompt: str
    response: str


def iter_rows(path: str, max_rows: int | None = None) -> Iterator[Row]:
    """Streams the first `max_rows` rows (blank lines are skipped, not counted).

    Raises:
        errors.UserError: the file is missing, a line is not a JSON object, a row lacks `prompt`
            or `response` (the message lists the fields found), or a field is not a string.
    """
    count = 0
    if max_rows is not None and max_rows <= 0:
        return
    for number, line in enumerate(storage.iter_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise errors.UserError(f"{path}: line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise errors.UserError(
                f"{path}: line {number}: expected a JSON object with fields "
                f"'prompt' and 'response', got {type(record).__name__}"
            )
        missing = [f for f in REQUIRED_FIELDS if f not in record]
        if missing:
            found = ", ".join(repr(k) for k in record) or "none"
            raise errors.UserError(
                f"{path}: line {number}: CodeV-R1 rows need the fields 'prompt' and 'response'; "
                f"missing {', '.join(repr(m) for m in missing)}; fields found: {found}"
            )
        values = []
        for field in REQUIRED_FIELDS:
            value = record[field]
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise errors.UserError(
                    f"{path}: line {number}: field {field!r} must be a string, "
                    f"got {type(value).__name__}"
                )
            values.append(value)
        yield Row(line=number, prompt=values[0], response=values[1])
        count += 1
        if max_rows is not None and count >= max_rows:
            return


def strip_thinking(text: str) -> str:
    """Removes `<think>...</think>` blocks, text before a stray `</think>` (the opening tag was
    in the prompt) and everything after an unterminated `<think>` (thinking never finished)."""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text


def extract_verilog(text: str) -> str:
    """The Verilog in an answer, without fences; "" if there is none.

    Fenced blocks tagged verilog/systemverilog/v/sv (or untagged) are taken whole and joined; with
    none of those, every `module ... endmodule` in the text is taken (this covers unfenced code and
    code fenced with another language tag).
    """
    blocks = [
        body.strip("\n")
        for tag, body in _FENCE.findall(text)
        if tag.lower() in _VERILOG_TAGS and body.strip()
    ]
    if blocks:
        return "\n\n".join(blocks)
    return "\n\n".join(match.group(0) for match in _MODULE.finditer(text))


def clean_response(response: str) -> str:
    """The training target of a CodeV-R1 response: one ```verilog block, or "" when no Verilog.

    The `<answer>` block is preferred; without one, the response with its thinking removed is used.
    Thinking is removed first so that an `<answer>` mentioned while thinking is never taken.
    """
    text = strip_thinking(response)
    answers = _ANSWER_BLOCK.findall(text)
    if answers:
        text = "\n\n".join(answers)
    code = extract_verilog(text).strip("\n")
    if not code.strip():
        return ""
    return f"```verilog\n{code}\n```"
