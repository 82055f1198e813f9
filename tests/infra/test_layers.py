"""infra/'s folders depend one way: each imports only folders below it (and infra/errors.py).

The order, bottom to top, is LAYERS; the modules at infra/'s top level (program.py, __main__.py
and the shims of moved provider modules) may import any folder. preflight/ stands above ops/:
its checks read the stack through ops' stack client (and the IAM check reads the roles the
components declare), while nothing in ops needs preflight (program.py, at the top, reads the
compile check's cached verdict). A new folder must be
given its place here; an import that runs back up fails this test with the importing file.
"""

from __future__ import annotations

import ast
import pathlib

INFRA = pathlib.Path(__file__).parents[2] / "infra"
# Bottom to top. errors.py is a module, not a folder: every layer may raise its classes.
LAYERS = ("errors", "config", "vm", "remote", "tpu", "resources", "components", "ops", "preflight")
TOP = len(LAYERS)


def layer_of(parts: list[str]) -> int:
    """The layer of infra module `parts` (without the leading "infra")."""
    if not parts:
        return TOP
    head = parts[0]
    if head in LAYERS:
        return LAYERS.index(head)
    return TOP  # a module at infra/'s top level


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every infra import in a file, function-level ones included."""
    module = ["infra", *path.relative_to(INFRA).with_suffix("").parts]
    package = module[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base]).strip(".")
            if base == "infra":  # `from infra import remote`: the names are the modules
                found += [(node.lineno, f"infra.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, m) for line, m in found if m == "infra" or m.startswith("infra.")]


def arrows_up() -> list[str]:
    problems = []
    for path in sorted(INFRA.rglob("*.py")):
        rel = path.relative_to(INFRA)
        own_parts = list(rel.with_suffix("").parts) if len(rel.parts) > 1 else [rel.stem]
        own = layer_of(own_parts if len(rel.parts) > 1 else [])
        for line, target in imported_modules(path):
            other = layer_of(target.split(".")[1:])
            if len(rel.parts) > 1 and target.split(".")[1:2] == [rel.parts[0]]:
                continue  # within its own folder
            if other >= own and own != TOP:
                problems.append(f"infra/{rel}:{line} imports {target} (layer {other} >= {own})")
    return problems


def test_every_folder_of_infra_has_a_layer() -> None:
    folders = {p.name for p in INFRA.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= set(LAYERS), f"give {sorted(folders - set(LAYERS))} a place in LAYERS"


def test_no_import_runs_back_up_between_infra_folders() -> None:
    assert arrows_up() == []


def test_the_check_sees_an_arrow_up(tmp_path: pathlib.Path, monkeypatch) -> None:
    """The check itself: a module of tpu/ that imported ops/ would be reported."""
    fake = tmp_path / "infra"
    (fake / "tpu").mkdir(parents=True)
    (fake / "tpu" / "api.py").write_text("from infra.ops import stack_outputs\n")
    (fake / "ops").mkdir()
    (fake / "ops" / "cost.py").write_text("from infra.tpu import api\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "INFRA", fake)
    assert arrows_up() == ["infra/tpu/api.py:1 imports infra.ops (layer 7 >= 4)"]
