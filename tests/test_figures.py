"""One home per figure: a measured time appears in docs/benchmarks.md and nowhere else.

The README and the other pages link to benchmarks.md instead of repeating its numbers: a figure
copied twice is rounded twice and updated once (the rehearsal's stage times once disagreed
between three pages). docs/config.md is exempt: it is generated from the settings, and a
setting's default is configured, not measured.

What counts as a measured time is its form, not its number, since a timeout is written the same
way as a measurement; a duration (ms, s, seconds, min, minutes, h, hours) is refused when it is
1. fractional ("60.8 s", "3.34 h"): the project's settings and constants are whole seconds,
   minutes or hours, and a clock prints fractions;
2. a range ("325 to 381 s", "2-3 minutes"): a setting has one value, runs that differed have two;
3. said to be from this machine ("50 s here");
4. alone in a table cell ("| 34 s |"): a column of times is a column of measurements.
Inline code is skipped (commands and settings). ALLOWED holds the few durations of these forms
that are not measurements of ours, each with its reason; PENDING the measured ones still on
pages another change is moving, each with what moves where.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOME = "docs/benchmarks.md"
EXEMPT = {HOME, "docs/config.md"}

_NUM = r"\d+(?:\.\d+)?"
_UNIT = r"(?:ms|s|sec|seconds?|min|minutes?|h|hours?)\b"
MEASURED = re.compile(
    "|".join(
        [
            rf"(?<![\w.])\d+\.\d+\s?{_UNIT}",  # 1. fractional
            rf"(?<![\w.]){_NUM}\s?(?:-|–|to)\s?{_NUM}\s?{_UNIT}",  # 2. a range
            rf"(?<![\w.])~?{_NUM}\s?{_UNIT}\s+here\b",  # 3. from this machine
            rf"(?<=\|)\s*(?:~|about\s)?{_NUM}\s?{_UNIT}\s*(?=\|)",  # 4. a table cell of a time
        ]
    )
)

# (page, the figure as the page writes it) -> why it is not a measurement of ours.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/development.md", "2.5 minutes"): (
        "a bound worked out from the storage client's retry schedule (6 tries, their backoff "
        "and its connect and read timeouts), not a run's time"
    ),
}

# (page, figure) -> the change moving it to benchmarks.md. Pages edited by another change now:
# once that change links to benchmarks.md instead, the entry goes (a stale entry fails).
_DEV_STORAGE = (
    "docs/development.md's TensorStore timings through the fault proxy (2026-11-27, f27875d) "
    "move to a benchmarks.md section; the page keeps the bounds and links there"
)
PENDING: dict[tuple[str, str], str] = {
    ("docs/development.md", "2-3 minutes"): (
        "the default test run's compile of the dev and prod steps: to benchmarks.md's compile "
        "section, linked"
    ),
    ("docs/development.md", "6.0 s"): _DEV_STORAGE,
    ("docs/development.md", "40.0 s"): _DEV_STORAGE,
    ("docs/development.md", "10.1 s"): _DEV_STORAGE,
    ("docs/operations.md", "0.3 s"): (
        "the checksum cost is already benchmarks.md#checkpoint-checksums: keep the link, drop "
        "the number"
    ),
}


def pages(root: pathlib.Path = ROOT) -> list[str]:
    found = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p.relative_to(root).as_posix() for p in found if p.exists()]


def figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) of every measured-looking duration outside inline code."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        prose = re.sub(r"`[^`]*`", "``", line)
        found += [(number, m.group(0).strip()) for m in MEASURED.finditer(prose)]
    return found


def misplaced(root: pathlib.Path = ROOT) -> tuple[list[str], set[tuple[str, str]]]:
    """The figures outside their home, and the allowed or pending entries that matched one."""
    problems, used = [], set()
    for page in pages(root):
        if page in EXEMPT:
            continue
        for line, figure in figures((root / page).read_text()):
            key = (page, figure)
            if key in ALLOWED or key in PENDING:
                used.add(key)
            else:
                problems.append(f"{page}:{line}: {figure!r}")
    return problems, used


def test_measured_times_live_only_in_benchmarks_md() -> None:
    problems, _ = misplaced()
    assert not problems, (
        f"measured times outside {HOME} (move them there and link to its section; a setting's "
        "value goes in inline code or in whole units): " + "; ".join(problems)
    )


def test_every_allowed_or_pending_figure_is_still_there() -> None:
    _, used = misplaced()
    stale = (set(ALLOWED) | set(PENDING)) - used
    assert not stale, f"remove these entries, their figures are gone: {sorted(stale)}"


def test_the_forms_it_refuses_and_those_it_leaves() -> None:
    refused = (
        "took 60.8 s; 3.34 h of training; 325 to 381 s; about 2-3 minutes; ~50 s here\n"
        "| deploy | the script | 34 s |\n"
    )
    assert [f for _, f in figures(refused)] == [
        "60.8 s",
        "3.34 h",
        "325 to 381 s",
        "2-3 minutes",
        "~50 s here",
        "34 s",
    ]
    left = (
        "a timeout of 600 s; renewed every 30 s; 3 h at most; `sleep 2.5s`; python 3.11's venv\n"
        "| the metadata server answers 503 for 20 s | it retries |\n"
        "v5p-8, 2026-11-28, steps 5-12\n"
    )
    assert figures(left) == []
