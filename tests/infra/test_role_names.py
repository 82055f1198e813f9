"""The VM roles are named in one place: infra/vm/roles.py, the table of VmRole objects.

Everywhere else in infra/ code asks a role's trait (has_training_metrics, has_serving_port,
releasable, recovered_by_controller), one of its methods, or `roles.role(name)`; it never compares
with, or passes, the string "train" or "serve". A new literal fails this test with its file and
line: read the role from the table instead (or, if the string is genuinely not a role, add it to
NOT_ROLES below with the reason).
"""

from __future__ import annotations

import ast
import pathlib

INFRA = pathlib.Path(__file__).parents[2] / "infra"
TABLE = "vm/roles.py"
ROLE_NAMES = ("train", "serve")
# Literals that spell a role's name but are not a role: file -> (how many, why). The count keeps
# a new role literal in the same file from passing unseen.
NOT_ROLES = {
    # The run config's own sections (workloads/contract/runconfig.py: RunConfig.train, .serve),
    # keys of the data this module renders; the config floor is below the role table.
    "config/runconfig_render.py": (2, "run-config section keys"),
}


def role_literals(infra: pathlib.Path = INFRA) -> dict[str, list[int]]:
    """File (relative to infra/) -> lines of every string literal "train" or "serve", outside
    the table."""
    found: dict[str, list[int]] = {}
    for path in sorted(infra.rglob("*.py")):
        rel = path.relative_to(infra).as_posix()
        if rel == TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in ROLE_NAMES:
                found.setdefault(rel, []).append(node.lineno)
    return found


def problems(infra: pathlib.Path = INFRA) -> list[str]:
    lines = []
    for rel, at in role_literals(infra).items():
        allowed = NOT_ROLES.get(rel, (0, ""))[0]
        if len(at) != allowed:
            where = ", ".join(str(n) for n in at)
            lines.append(
                f"infra/{rel}: {len(at)} role-name literals (lines {where}), {allowed} allowed: "
                f"read the role from infra/{TABLE}"
            )
    return lines


def test_no_code_outside_the_role_table_names_a_role() -> None:
    assert problems() == []


def test_every_exception_still_exists() -> None:
    """An allowance that no longer matches anything goes (the file changed or moved)."""
    found = role_literals()
    assert {rel: len(found.get(rel, [])) for rel in NOT_ROLES} == {
        rel: count for rel, (count, _why) in NOT_ROLES.items()
    }


def test_the_table_names_the_roles() -> None:
    from infra.vm import roles

    assert roles.names() == ROLE_NAMES


def test_the_check_sees_a_role_literal(tmp_path: pathlib.Path) -> None:
    """The check itself: `if info.role == "train"` in ops/ is reported, the table is not."""
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "cli.py").write_text('def f(info):\n    return info.role == "train"\n')
    (tmp_path / "vm").mkdir()
    (tmp_path / "vm" / "roles.py").write_text('NAME = "serve"\n')
    assert problems(tmp_path) == [
        "infra/ops/cli.py: 1 role-name literals (lines 2), 0 allowed: read the role from "
        "infra/vm/roles.py"
    ]
