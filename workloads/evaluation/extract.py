"""Pulls the Verilog out of a model's answer the way verilog-eval v2's spec-to-rtl flow does, then
keeps only the design.

Step 1, the answer's code, by the official flow's rules (the first that applies):

a. Markers. A line that begins (after indentation) with `[BEGIN]` opens the code: the rest of
   that line, then every following line up to the first later line that ends with `[DONE]`
   (that line's text before the marker included). Everything in between is code: a ``` fence
   line or a sentence there reaches the compiler. A `[BEGIN]` without a later `[DONE]` (an
   answer cut off by the token limit) yields no code at all.
b. Fences. Without markers, when two or more lines begin with ``` in column 0, the code is the
   lines between the first two of them: the first fenced block only, whatever the later blocks
   hold (a corrected version, the top module, a testbench).
c. Otherwise the text itself, up to and including the first line that begins (after
   indentation) with `endmodule`, leaving out lines that begin with ```. It starts at the first
   line that begins with `module TopModule` when such a line exists in column 0 with no
   column-0 `endmodule` line before it, else at the top (prose included).

Before that, reasoning the server left in the answer (`<think>…</think>`, Gemma 4's
`<|channel>thought…<channel|>`) is removed: the official flow's models put none in the answer,
and a reasoning parser on the server takes it out of the content. Nothing is repaired: a module
cut off before its `endmodule` stays cut off, as it does in the official flow.

Step 2, the design: the module the problem asks for (`TopModule`, which the testbench
instantiates) and every module reachable from it by instantiation (a helper submodule). Modules
nothing reaches are dropped: a testbench the model wrote "to be helpful" (with `$dumpfile`,
`$monitor`, its own `Mismatches` prints), drafts under other names. The official flow compiles
them too but never runs them (iverilog elaborates only the official `tb` and what it
instantiates), so dropping them changes no verdict, keeps the sandbox rules about what actually
runs, and guarantees that a testbench the answer brings never replaces or joins the official
one. Text outside modules (directives, or prose that breaks the compile in the official flow
too) stays; when the code declares no `TopModule` nothing is dropped.

The official compile of the dropped modules can still fail, and then the official flow fails
the sample: a module that does not parse, or a second module named like one of the testbench's
(`tb`, `RefModule`, `stimulus_gen`). `Extraction.official_code` keeps the code as step 1 found
it, so that the judge can parse it the way the official flow compiles it (judge.judge_sample).
"""

from __future__ import annotations

import dataclasses
import re

TOP = "TopModule"

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_CHANNEL_BLOCK = re.compile(r"<\|channel>.*?<channel\|>", re.DOTALL)
_HEADER = re.compile(
    r"^[ \t]*(?:\(\*[^\n]*?\*\)[ \t]*)?(?:macro)?module[ \t\r\n]+([A-Za-z_][\w$]*)", re.MULTILINE
)
_END = re.compile(r"\bendmodule\b(?:[ \t]*:[ \t]*[A-Za-z_][\w$]*)?")
# What cannot name a module: comments and string literals.
_NOT_CODE = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"", re.DOTALL)
_IDENTIFIER = re.compile(r"\\\S+|[A-Za-z_][\w$]*")
_DEFINE = re.compile(r"^[ \t]*`define\b.*$", re.MULTILINE)
_BEGIN, _DONE, _FENCE = "[BEGIN]", "[DONE]", "```"


@dataclasses.dataclass(frozen=True)
class Extraction:
    """What extract_code found.

    Attributes:
        code: the design to compile and simulate; empty when the answer holds no module.
        method: `begin-done`, `fence`, `bare` or `none`: which official rule found the code
            (a, b, c above; `none` when it holds no module).
        notes: what was dropped or is broken, for the per-sample record.
        official_code: the code as the official flow compiles it, before modules were dropped;
            equal to `code` when nothing was dropped.
    """

    code: str
    method: str
    notes: tuple[str, ...] = ()
    official_code: str = ""


@dataclasses.dataclass(frozen=True)
class _Unit:
    text: str
    module: str | None = None  # None: text outside any module


def declared_modules(source: str) -> list[str]:
    """Names of the modules a Verilog source declares, in order."""
    return [m.group(1) for m in _HEADER.finditer(source)]


def strip_thinking(text: str) -> tuple[str, bool]:
    """Removes reasoning blocks; returns the answer text and whether anything was removed."""
    original = text
    text = _THINK_BLOCK.sub("", text)
    text = _CHANNEL_BLOCK.sub("", text)
    # A closing tag without its opening one (a reasoning parser or the template ate it):
    # everything before it was thinking.
    for closing in ("</think>", "<channel|>"):
        if closing in text:
            text = text.rsplit(closing, 1)[1]
    # An opening tag that is never closed: the answer was cut off while thinking.
    for opening in ("<think>", "<|channel>"):
        if opening in text:
            text = text.split(opening, 1)[0]
    return text, text != original


def _between_markers(lines: list[str]) -> list[str] | None:
    """Rule a: None without a [BEGIN] line; [] when no [DONE] follows it."""
    opening = next((i for i, line in enumerate(lines) if line.lstrip().startswith(_BEGIN)), None)
    if opening is None:
        return None
    rest = lines[opening].lstrip().replace(_BEGIN, "")
    code = [rest] if rest.strip() else []
    for line in lines[opening + 1 :]:
        if line.rstrip().endswith(_DONE):
            before = line.rstrip().replace(_DONE, "")
            return code + ([before] if before.strip() else [])
        code.append(line)
    return []


def _first_fenced_block(lines: list[str]) -> list[str] | None:
    """Rule b: None unless two lines open with ``` in column 0."""
    fences = [i for i, line in enumerate(lines) if line.startswith(_FENCE)]
    if len(fences) < 2:
        return None
    return lines[fences[0] + 1 : fences[1]]


def _from_text(lines: list[str], top: str) -> list[str]:
    """Rule c: from the top module's header (or the top) to the first endmodule line."""
    header = f"module {top}"
    column0 = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    start = 0
    if column0 is not None and not any(line.startswith("endmodule") for line in lines[:column0]):
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    stop = next(
        (i for i, line in enumerate(lines) if line.strip().startswith("endmodule")), len(lines)
    )
    return [line for line in lines[start : stop + 1] if not line.startswith(_FENCE)]


def _units(code: str) -> list[_Unit]:
    """Splits code into modules (header to endmodule, or to the next header) and the rest."""
    units: list[_Unit] = []
    headers = list(_HEADER.finditer(code))
    pos = 0
    for i, header in enumerate(headers):
        if header.start() < pos:
            continue  # a `module` line inside the previous module's text
        units.append(_Unit(code[pos : header.start()]))
        next_start = headers[i + 1].start() if i + 1 < len(headers) else len(code)
        end = _END.search(code, header.end())
        pos = next_start if end is None or end.start() > next_start else end.end()
        units.append(_Unit(code[header.start() : pos], header.group(1)))
    units.append(_Unit(code[pos:]))
    return [u for u in units if u.text]


def _names_in(text: str) -> set[str]:
    """Identifiers in code (escaped ones without their backslash), comments and strings aside."""
    return {
        token[1:] if token.startswith("\\") else token
        for token in _IDENTIFIER.findall(_NOT_CODE.sub(" ", text))
    }


def _reachable(units: list[_Unit], top: str) -> set[str]:
    """Module names reachable from top; a macro definition may name modules for anyone."""
    bodies: dict[str, list[str]] = {}
    for unit in units:
        if unit.module is not None:
            bodies.setdefault(unit.module, []).append(unit.text)
    by_macro = {
        name
        for unit in units
        for line in _DEFINE.findall(unit.text)
        for name in _names_in(line)
        if name in bodies
    }
    reached = {top}
    frontier = [top, *by_macro]
    reached.update(by_macro)
    while frontier:
        for text in bodies.get(frontier.pop(), []):
            for name in _names_in(text):
                if name in bodies and name not in reached:
                    reached.add(name)
                    frontier.append(name)
    return reached


def extract_code(text: str | None, *, top: str = TOP) -> Extraction:
    """Finds the Verilog design in one model answer.

    Args:
        text: the answer (the `content` of the chat completion); None counts as empty.
        top: the module the problem asks for (verilog-eval's testbenches instantiate TopModule).

    Returns:
        The design (possibly empty), which rule found it, notes, and the official code.
    """
    answer, had_thinking = strip_thinking(text or "")
    notes = ["removed thinking"] if had_thinking else []
    lines = answer.splitlines()
    region = _between_markers(lines)
    method = "begin-done"
    if region is None:
        region = _first_fenced_block(lines)
        method = "fence"
    if region is None:
        region = _from_text(lines, top)
        method = "bare"
    if method == "begin-done" and not region:
        notes.append("[BEGIN] without a later [DONE]: the official flow takes no code")
    official = "\n".join(region).strip("\n")
    units = _units(official)
    declared = [u.module for u in units if u.module is not None]
    if not declared:
        return Extraction("", "none", tuple([*notes, "no module declaration found"]), "")
    official += "\n"
    for name in sorted({n for n in declared if declared.count(n) > 1}):
        notes.append(f"module {name} is declared {declared.count(name)} times")
    if top not in declared:
        notes.append(f"no module {top}: nothing dropped")
        return Extraction(official, method, tuple(notes), official)
    reached = _reachable(units, top)
    kept = [u for u in units if u.module is None or u.module in reached]
    dropped = [u.module for u in units if u.module is not None and u.module not in reached]
    if dropped:
        notes.append(f"dropped modules {top} does not instantiate: {', '.join(dropped)}")
    notes.extend(
        f"module {u.module} has no endmodule (cut off?)"
        for u in kept
        if u.module is not None and not _END.search(u.text)
    )
    code = "".join(u.text for u in kept).strip("\n") + "\n" if dropped else official
    return Extraction(code, method, tuple(notes), official)
