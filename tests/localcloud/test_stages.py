"""The rehearsal's stages have one list, localcloud.stages.STAGES: what it runs, its docstring and
docs/rehearsal.md name the same stages.

Read from the sources (no container is started): the names localcloud/rehearse.py passes to its
stage timer, the numbered list of its docstring, and the first column of the docs' table.
"""

from __future__ import annotations

import ast
import pathlib
import re

from localcloud.stages import STAGES

ROOT = pathlib.Path(__file__).resolve().parents[2]
REHEARSE = ROOT / "localcloud" / "rehearse.py"
DOCS = ROOT / "docs" / "rehearsal.md"


def stages_run(source: str) -> set[str]:
    """The names given to `<timer>.stage(...)`: literals, or the literals a loop feeds it."""
    tree = ast.parse(source)
    loops: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            if isinstance(node.iter, ast.Tuple | ast.List):
                items = [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]
                loops[node.target.id] = [str(i) for i in items]
            elif "STAGES" in ast.unparse(node.iter):
                loops[node.target.id] = list(STAGES)
    names: set[str] = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "stage"
            and node.args
        ):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant):
            names.add(str(arg.value))
        elif isinstance(arg, ast.Name) and arg.id in loops:
            names.update(loops[arg.id])
        elif "STAGES" in ast.unparse(arg):
            names.update(STAGES)  # read from the tuple itself
        else:
            raise AssertionError(
                f"rehearse.py line {node.lineno}: a stage name this test cannot read"
            )
    return names


def documented_stages(markdown: str) -> list[str]:
    """The first column of the table under '## The stages'."""
    section = re.split(r"^## The stages$", markdown, flags=re.M)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [row.strip("|").split("|")[0].strip() for row in rows[2:]]  # after header, rule
    return [cell.strip("`") for cell in cells]


def docstring_stages(source: str) -> list[str]:
    """The stage names of the docstring's numbered list (` 1. plan ...`)."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    return re.findall(r"^\s*\d+\.\s+(\w+)", doc, re.M)


def test_the_rehearsal_runs_the_stages_of_stages_py() -> None:
    assert stages_run(REHEARSE.read_text()) == set(STAGES)


def test_the_docs_table_lists_the_stages_in_their_order() -> None:
    assert documented_stages(DOCS.read_text()) == list(STAGES)


def test_the_rehearsal_docstring_lists_the_stages_or_points_to_them() -> None:
    source = REHEARSE.read_text()
    listed = docstring_stages(source)
    doc = ast.get_docstring(ast.parse(source)) or ""
    assert listed == list(STAGES) or (not listed and "localcloud/stages.py" in doc)


def test_the_checks_read_what_they_claim() -> None:
    """The readers themselves, on a made-up rehearsal and page."""
    source = (
        '"""Stages:\n 1. plan  x\n 2. boot  y\n"""\n'
        'with r.stage("plan"):\n    pass\n'
        'for job in ("eval", "bench"):\n    with r.stage(job):\n        pass\n'
    )
    assert stages_run(source) == {"plan", "eval", "bench"}
    assert docstring_stages(source) == ["plan", "boot"]
    page = "## The stages\n\n| stage | what |\n|---|---|\n| plan | a |\n| boot | b |\n\n## Next\n"
    assert documented_stages(page) == ["plan", "boot"]
