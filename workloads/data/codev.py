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

from workloads.common import errors, storage

REQUIRED_FIELDS = ("prompt", "response")

# Cleaning must take time linear in the response: a model stuck in a loop writes megabytes of
# `module module ...` or `<think><think>...`. A lazy pattern such as `<think>.*?</think>` is linear
# as long as every place it starts at succeeds; one opening without a closing after it is
# retried from every later opening, scanning to the end each time (quadratic: 1.4 MB of
# `module ` took 22 minutes). Each search below is therefore confined to where every start
# succeeds; the helpers that use them say how.
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)  # always succeeds
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
        errors.UserError: the file is missing or not UTF-8 text, a line is not a JSON object, a
            row lacks `prompt` or `response` (the message lists the fields found), or a field is
            not a string or holds a lone surrogate.
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
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                # JSON can spell one half of a surrogate pair ("\\ud800"); no tokenizer can
                # encode the result.
                raise errors.UserError(
                    f"{path}: line {number}: field {field!r} holds a lone surrogate "
                    f"({value[exc.start]!r} at character {exc.start}); only valid Unicode text "
                    "is allowed"
                ) from None
            values.append(value)
        yield Row(line=number, prompt=values[0], response=values[1])
        count += 1
        if max_rows is not None and count >= max_rows:
            return


def strip_thinking(text: str) -> str:
    """Removes `<think>...</think>` blocks, text before a stray `</think>` (the opening tag was
    in the prompt) and everything after an unterminated `<think>` (thinking never finished)."""
    text = _remove_think_blocks(text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text


def _remove_think_blocks(text: str) -> str:
    """Each `<think>` up to the first `</think>` after it removed. Only the text up to the last
    `</think>` is searched: an opening after it has no closing, so it stays either way."""
    last = text.rfind("</think>")
    if last < 0:
        return text
    cut = last + len("</think>")
    return _THINK_BLOCK.sub("", text[:cut]) + text[cut:]


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each fenced block; an unclosed fence runs to the end.

    A fence needs a line break after it. A trailing newline is added before searching so that
    every ``` has one: a fence it completes has an empty body (callers skip those), and the body
    of an unclosed fence only gains a trailing newline (callers strip those).
    """
    return _FENCE.findall(text + "\n")


def _modules(text: str) -> list[str]:
    """Each `module ... endmodule` (or `macromodule ...`). Only the text up to the end of the last
    whole-word `endmodule` is searched: a keyword after it has no end, so it is never taken."""
    end = _last_endmodule_end(text)
    if end is None:
        return []
    return [match.group(0) for match in _MODULE.finditer(text, 0, end)]


def _last_endmodule_end(text: str) -> int | None:
    """Where the last whole-word `endmodule` ends, or None."""
    limit = len(text)
    while (at := text.rfind("endmodule", 0, limit)) >= 0:
        end = at + len("endmodule")
        if not _is_word(text, at - 1) and not _is_word(text, end):
            return end
        limit = end - 1
    return None


def _is_word(text: str, index: int) -> bool:
    """Whether text[index] exists and is a word character (what `\\w` matches)."""
    return 0 <= index < len(text) and (text[index].isalnum() or text[index] == "_")


def extract_verilog(text: str) -> str:
    """The Verilog in an answer, without fences; "" if there is none.

    Fenced blocks tagged verilog/systemverilog/v/sv (or untagged) are taken whole and joined; with
    none of those, every `module ... endmodule` in the text is taken (this covers unfenced code and
    code fenced with another language tag).
    """
    blocks = [
        body.strip("\n")
        for tag, body in _fenced_blocks(text)
        if tag.lower() in _VERILOG_TAGS and body.strip()
    ]
    if blocks:
        return "\n\n".join(blocks)
    return "\n\n".join(_modules(text))


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
