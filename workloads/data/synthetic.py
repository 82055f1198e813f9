"""A learnable CodeV-R1-style JSONL for the demo and the tests.

Each row asks for a small Verilog module whose name, widths and table entries are all spelled out
in the prompt, so a tiny model can learn to copy them into a fixed per-kind template within a few
dozen steps. Responses look like CodeV-R1's: a `<think>` block, then usually an `<answer>` with a
fenced ```verilog block; some rows have no `<answer>`, fence with another language or leave the
code unfenced, and all of them clean (workloads.data.codev.clean_response) to the same
```verilog block. A few rows are empty after cleaning and a few are far longer than any
max_seq_len used here, so the drop counters have something to count. Lengths vary (multiplexers
and lookup tables with 2..16 entries, 0..6 extra requirement lines) so packing matters.
"""

from __future__ import annotations

import dataclasses
import json
import random

from workloads.common import errors, storage

_ADJECTIVES = ("fast", "main", "tiny", "wide", "core", "aux", "low", "top", "edge", "sync")
_NOUNS = ("unit", "block", "path", "stage", "cell", "port", "slice", "node", "lane", "bank")
_WIDTHS = (4, 8, 12, 16, 24, 32)
_REQUIREMENTS = (
    "Use synchronous logic clocked on the rising edge of clk.",
    "Keep the port names exactly as given.",
    "Do not instantiate any other module.",
    "The design must be synthesizable.",
    "Use non-blocking assignments in sequential blocks.",
    "Use blocking assignments in combinational blocks.",
    "Declare every port in the module header.",
    "Do not add extra ports.",
)
_THOUGHTS = (
    "The module name and the widths are given in the request.",
    "I need to declare the ports first and then describe the logic.",
    "A case statement is the clearest way to write this.",
    "The reset should clear the register to zero.",
    "Let me double-check the bit widths of every port.",
    "This is purely combinational apart from the clocked part.",
    "I will keep the code short and synthesizable.",
    "Nothing else is required beyond the described behaviour.",
)


@dataclasses.dataclass(frozen=True)
class SyntheticSummary:
    """What write_synthetic_codev wrote; the counts are exact.

    Attributes:
        rows: rows in the file.
        normal: rows that clean to a non-empty answer and are short (a few hundred tokens).
        empty: rows whose prompt or cleaned answer is empty.
        too_long: rows of more than `too_long_chars` characters (far above any max_seq_len here).
        without_answer: normal rows without an `<answer>` block.
    """

    rows: int
    normal: int
    empty: int
    too_long: int
    without_answer: int


def _lines(*lines: str) -> str:
    return "\n".join(lines)


def _module(rng: random.Random) -> tuple[str, str]:
    """One (request, verilog code) pair; the code follows from the request alone."""
    name = f"{rng.choice(_ADJECTIVES)}_{rng.choice(_NOUNS)}"
    width = rng.choice(_WIDTHS)
    top = width - 1
    kind = rng.randrange(6)
    if kind == 0:
        request = (
            f"Write a Verilog module named {name} that implements a {width}-bit up counter "
            "with a synchronous active-high reset. Ports: clk, rst, and the output count."
        )
        code = _lines(
            f"module {name} (",
            "    input clk,",
            "    input rst,",
            f"    output reg [{top}:0] count",
            ");",
            "    always @(posedge clk) begin",
            "        if (rst)",
            f"            count <= {width}'d0;",
            "        else",
            f"            count <= count + {width}'d1;",
            "    end",
            "endmodule",
        )
    elif kind == 1:
        request = (
            f"Write a Verilog module named {name} that adds two {width}-bit inputs a and b "
            "and outputs their sum on sum."
        )
        code = _lines(
            f"module {name} (",
            f"    input [{top}:0] a,",
            f"    input [{top}:0] b,",
            f"    output [{top}:0] sum",
            ");",
            "    assign sum = a + b;",
            "endmodule",
        )
    elif kind == 2:
        request = (
            f"Write a Verilog module named {name}: a {width}-bit register with clock clk, "
            "enable en, input d and output q. q takes d on a rising edge of clk when en "
            "is high."
        )
        code = _lines(
            f"module {name} (",
            "    input clk,",
            "    input en,",
            f"    input [{top}:0] d,",
            f"    output reg [{top}:0] q",
            ");",
            "    always @(posedge clk) begin",
            "        if (en)",
            "            q <= d;",
            "    end",
            "endmodule",
        )
    elif kind == 3:
        request = (
            f"Write a Verilog module named {name} that shifts its {width}-bit register left "
            "by one bit on every rising edge of clk, shifting in the input bit din. "
            "The register is the output q."
        )
        code = _lines(
            f"module {name} (",
            "    input clk,",
            "    input din,",
            f"    output reg [{top}:0] q",
            ");",
            "    always @(posedge clk) begin",
            f"        q <= {{q[{top - 1}:0], din}};",
            "    end",
            "endmodule",
        )
    elif kind == 4:
        inputs = rng.randint(2, 12)
        sel_bits = max(1, (inputs - 1).bit_length())
        request = (
            f"Write a Verilog module named {name}: a {inputs}-to-1 multiplexer of "
            f"{width}-bit inputs in0 to in{inputs - 1}, a {sel_bits}-bit select sel and "
            "the output out. Unused select values give zero."
        )
        code = _lines(
            f"module {name} (",
            *(f"    input [{top}:0] in{i}," for i in range(inputs)),
            f"    input [{sel_bits - 1}:0] sel,",
            f"    output reg [{top}:0] out",
            ");",
            "    always @(*) begin",
            "        case (sel)",
            *(f"            {sel_bits}'d{i}: out = in{i};" for i in range(inputs)),
            f"            default: out = {width}'d0;",
            "        endcase",
            "    end",
            "endmodule",
        )
    else:
        entries = rng.randint(2, 16)
        addr_bits = max(1, (entries - 1).bit_length())
        values = [rng.randrange(min(2**width, 256)) for _ in range(entries)]
        table = ", ".join(f"{i}: {v}" for i, v in enumerate(values))
        request = (
            f"Write a Verilog module named {name}: a lookup table with a {addr_bits}-bit "
            f"address addr and a {width}-bit output data. Contents (address: value): "
            f"{table}. Other addresses give zero."
        )
        code = _lines(
            f"module {name} (",
            f"    input [{addr_bits - 1}:0] addr,",
            f"    output reg [{top}:0] data",
            ");",
            "    always @(*) begin",
            "        case (addr)",
            *(f"            {addr_bits}'d{i}: data = {width}'d{v};" for i, v in enumerate(values)),
            f"            default: data = {width}'d0;",
            "        endcase",
            "    end",
            "endmodule",
        )
    return request, code


def _prompt(rng: random.Random, request: str) -> str:
    extra = rng.sample(_REQUIREMENTS, rng.randint(0, 6))
    if not extra:
        return request
    return request + "\n\nRequirements:\n" + "".join(f"- {line}\n" for line in extra)


def _thinking(rng: random.Random) -> str:
    return " ".join(rng.choice(_THOUGHTS) for _ in range(rng.randint(1, 6)))


def _response(rng: random.Random, code: str, *, with_answer: bool) -> str:
    think = f"<think>\n{_thinking(rng)}\n</think>\n"
    style = rng.randrange(4)
    if style == 0:  # unfenced inside the answer (or after the thinking)
        body = f"Here is the module.\n{code}\n"
    elif style == 1:  # fenced with another language tag
        body = f"```systemverilog\n{code}\n```\n"
    else:
        body = f"```verilog\n{code}\n```\n"
    if with_answer:
        return f"{think}<answer>\n{body}</answer>"
    return think + body


def synthetic_rows(
    n: int, seed: int, *, empty: int = 3, too_long: int = 3, too_long_chars: int = 60_000
) -> tuple[list[dict[str, str]], SyntheticSummary]:
    """The rows write_synthetic_codev writes, in memory.

    Raises:
        errors.UserError: on counts that do not fit in n.
    """
    if n < 1 or empty < 0 or too_long < 0 or empty + too_long > n:
        raise errors.UserError(
            f"synthetic data: need n >= 1 and empty + too_long <= n "
            f"(got n={n}, empty={empty}, too_long={too_long})"
        )
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not security
    special = rng.sample(range(n), empty + too_long)
    empty_at, too_long_at = set(special[:empty]), set(special[empty:])
    rows: list[dict[str, str]] = []
    without_answer = 0
    for index in range(n):
        request, code = _module(rng)
        if index in empty_at:
            # Three ways to be empty: no prompt, no response, or thinking only (no code left).
            kind = index % 3
            prompt = "" if kind == 0 else _prompt(rng, request)
            if kind == 0:
                response = _response(rng, code, with_answer=True)
            elif kind == 1:
                response = ""
            else:
                response = f"<think>\n{_thinking(rng)}\n</think>\n"
        elif index in too_long_at:
            prompt = request + "\n\nRequirements:\n"
            while len(prompt) < too_long_chars:
                prompt += f"- {rng.choice(_REQUIREMENTS)}\n"
            response = _response(rng, code, with_answer=True)
        else:
            with_answer = rng.random() >= 0.2
            without_answer += not with_answer
            prompt = _prompt(rng, request)
            response = _response(rng, code, with_answer=with_answer)
        rows.append({"prompt": prompt, "response": response})
    summary = SyntheticSummary(
        rows=n,
        normal=n - empty - too_long,
        empty=empty,
        too_long=too_long,
        without_answer=without_answer,
    )
    return rows, summary


def write_synthetic_codev(
    path: str,
    n: int,
    seed: int = 0,
    *,
    empty: int = 3,
    too_long: int = 3,
    too_long_chars: int = 60_000,
) -> SyntheticSummary:
    """Writes a CodeV-R1-style JSONL (fields `prompt`, `response`) to a local path or gs://.

    Args:
        path: output file; written atomically.
        n: rows in total, including the empty and too-long ones.
        seed: everything (content, order, which rows are special) follows from it.
        empty: rows that are empty after cleaning (no prompt, no response, or thinking only).
        too_long: rows with a prompt of more than `too_long_chars` characters.
        too_long_chars: length that makes a row too long for any max_seq_len used with this data.

    Returns:
        The exact counts of what was written.

    Raises:
        errors.UserError: on counts that do not fit in n.
    """
    rows, summary = synthetic_rows(
        n, seed, empty=empty, too_long=too_long, too_long_chars=too_long_chars
    )
    storage.write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return summary
