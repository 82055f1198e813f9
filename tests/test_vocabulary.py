"""One vocabulary: no class name is defined in two modules of infra/ and workloads/.

The same concept has one name per layer: `*Settings` (what a user chooses,
workloads/contract/settings.py), `*RunSection` (the run config, workloads/contract/runconfig.py),
`*StackSection` (the stack config, infra/config/model.py). Two classes of one name in two
modules is how `ModelSection` came to mean two different things to a reader.
"""

from __future__ import annotations

import ast
import collections
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = ("infra", "workloads")

# name -> why two definitions are tolerated for now. Only shims, or pairs with a named owner.
ALLOWED: dict[str, str] = {}


def class_definitions(root: pathlib.Path = REPO) -> dict[str, list[str]]:
    """Every class name defined in ROOTS -> the modules (paths) that define it."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    found[node.name].append(path.relative_to(root).as_posix())
    return found


def duplicates(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: paths for name, paths in found.items() if len(set(paths)) > 1}


def test_no_class_name_is_defined_in_two_modules() -> None:
    clashes = {n: p for n, p in duplicates(class_definitions()).items() if n not in ALLOWED}
    assert not clashes, "class names defined in several modules: " + "; ".join(
        f"{name} in {', '.join(paths)}" for name, paths in sorted(clashes.items())
    )


def test_the_allow_list_holds_only_real_duplicates() -> None:
    stale = set(ALLOWED) - set(duplicates(class_definitions()))
    assert not stale, f"no longer defined twice, drop from ALLOWED: {sorted(stale)}"


def test_the_check_finds_a_clash(tmp_path: pathlib.Path) -> None:
    for top, body in (("infra", "class ModelSection: pass\n"), ("workloads", "class X: pass\n")):
        (tmp_path / top).mkdir()
        (tmp_path / top / "a.py").write_text(body)
    (tmp_path / "workloads" / "b.py").write_text("class ModelSection: pass\n")
    assert duplicates(class_definitions(tmp_path)) == {
        "ModelSection": ["infra/a.py", "workloads/b.py"]
    }
