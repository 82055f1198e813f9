"""The README is a quickstart: short, its first command the demo, every link of it resolving.

The manual lives in docs/ and is checked by its strict MkDocs build (`.ci/run`); the README is
outside that build, so its links and their anchors are checked here.
"""

from __future__ import annotations

import pathlib
import re
import unicodedata

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 160
# The demo's command must be on the first screen of the README, as a new user opens it.
FIRST_SCREEN_LINES = 40
# `[text](target)` or `![alt](target "title")`; the target up to whitespace or `)`.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def _fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, content) of every fenced code block, in order."""
    blocks, start, body = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if start is None:
                start, body = number, []
            else:
                blocks.append((start, "\n".join(body)))
                start = None
        elif start is not None:
            body.append(line)
    return blocks


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading: inline markup dropped, then
    its default slugify."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*_]", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: pathlib.Path) -> set[str]:
    return {
        _slug(m.group(1))
        for _, line in _outside_code(page.read_text())
        if (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line))
    }


def _relative_links() -> list[tuple[int, str]]:
    return [
        (number, target)
        for number, line in _outside_code(README.read_text())
        for target in LINK.findall(line)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)  # https:, mailto:, ...
    ]


def test_the_readme_is_a_quickstart_of_at_most_160_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): move the manual's text to docs/"
    )


def test_the_readmes_first_command_block_runs_the_demo():
    blocks = _fenced_blocks(README.read_text())
    assert blocks, "README.md has no command block"
    start, first = blocks[0]
    assert "python -m workloads demo" in first, "README's first command is not the demo"
    assert start <= FIRST_SCREEN_LINES, f"README's first command starts on line {start}"
    # .ci/run runs the README's first command verbatim, as a new user would.
    ci = (ROOT / ".ci" / "run").read_text()
    demo = next(line for line in ci.splitlines() if "-m workloads demo" in line).strip()
    assert demo in first, f".ci/run runs {demo!r}, which README's first command block lacks"


def test_every_relative_link_of_the_readme_resolves():
    links = _relative_links()
    assert links, "README.md links to no page of docs/"
    broken = []
    for number, target in links:
        path, _, anchor = target.partition("#")
        file = (ROOT / path).resolve() if path else README
        if not file.exists():
            broken.append(f"README.md:{number}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"README.md:{number}: {target}: no heading makes #{anchor}")
    assert broken == []


def test_the_slugs_are_those_mkdocs_makes():
    # Known anchors of MkDocs' default toc slugify (checked against a strict build).
    assert _slug("What `pulumi up` builds") == "what-pulumi-up-builds"
    assert (
        _slug("How a setting travels: stack file -> run config -> VM")
        == "how-a-setting-travels-stack-file-run-config-vm"
    )
    assert _slug("The recovery controller's memory") == "the-recovery-controllers-memory"
