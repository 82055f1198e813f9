"""No import cycle between the modules of infra/, workloads/ and localcloud/, inits included.

tests/infra/test_layers.py keeps infra's folders pointing one way; this keeps modules so, inside a
folder too. A cycle works only by the order in which its modules happen to be imported first: the
day a caller imports its other end first, a name is read from a half-run module.

The graph holds module-level imports only: an import inside a function runs when the function
does, after every module has finished loading, and one under `if TYPE_CHECKING:` never runs.
An edge is what an import statement runs:
- `import a.b.c` runs a, a.b and a.b.c; `from a.b import n` runs a and a.b and reads a name from
  a.b's namespace, and runs a.b.n when n is a submodule.
- A module's own enclosing packages have already started when its body runs, so the implicit
  edges to them are left out; an explicit `from <own package> import n` is kept: it reads a name
  from an init that may still be running (infra/remote/steps.py once did, through
  infra/remote/__init__.py -> fleet -> steps). Import the submodule by its full path instead.
"""

from __future__ import annotations

import ast
import itertools
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = ("infra", "workloads", "localcloud")


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module under ROOTS (a package under its own name)."""
    found = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is loaded (class bodies do; functions not)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def _with_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imports_of(name: str, path: pathlib.Path, modules: dict[str, object]) -> dict[str, int]:
    """Module name -> first line importing it, for the project modules `name` runs on loading."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    own = set(_with_packages(package)) if package else set()
    edges: dict[str, int] = {}

    def add(target: str, line: int, explicit: bool = False) -> None:
        for each in _with_packages(target):
            keep = explicit and each == target
            if each in modules and each != name and (each not in own or keep):
                edges.setdefault(each, line)

    for node in module_level_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
            continue
        source = node.module or ""
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join([*base, source] if source else base)
        add(source, node.lineno, explicit=True)
        for alias in node.names:
            if f"{source}.{alias.name}" in modules:
                add(f"{source}.{alias.name}", node.lineno)
    return edges


def import_graph(root: pathlib.Path = REPO) -> dict[str, dict[str, int]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        # Recursive: the graph is a few hundred modules deep at most, well under Python's limit.
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, group) for group in groups]


def _one_cycle(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest way round from the group's first module back to itself (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return [*paths[node], start]
                if nxt in group and nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no way round {sorted(group)}")  # Tarjan's groups are strongly connected


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


def test_no_module_level_import_cycle() -> None:
    graph = import_graph()
    found = [describe(graph, c) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_check_sees_a_cycle_through_a_package_init(tmp_path: pathlib.Path) -> None:
    """The check itself: the shape infra/remote once had is reported, with its lines."""
    _write(
        tmp_path,
        {
            "infra/__init__.py": "",
            "infra/remote/__init__.py": '"""Doc."""\nfrom infra.remote.fleet import deploy\n',
            "infra/remote/fleet.py": "from infra.remote.steps import prepare\n",
            "infra/remote/steps.py": "import os\nfrom infra.remote import release\n",
            "infra/remote/release.py": "",
        },
    )
    graph = import_graph(tmp_path)
    assert [describe(graph, c) for c in cycles(graph)] == [
        "infra.remote (line 2) -> infra.remote.fleet (line 1) -> infra.remote.steps (line 2)"
        " -> infra.remote"
    ]


def test_the_check_reads_only_what_runs_on_loading(tmp_path: pathlib.Path) -> None:
    """Imports in functions and under TYPE_CHECKING, and full paths to siblings, make no cycle."""
    _write(
        tmp_path,
        {
            "workloads/__init__.py": "",
            "workloads/train/__init__.py": "from workloads.train import lora\n",
            "workloads/train/lora.py": (
                "from typing import TYPE_CHECKING\n"
                "from workloads.train.hosts import n\n"
                "if TYPE_CHECKING:\n    from workloads.merge import parts\n"
                "def f():\n    from workloads.merge import parts\n"
            ),
            "workloads/train/hosts.py": "n = 1\n",
            "workloads/merge/__init__.py": "",
            "workloads/merge/parts.py": "from workloads.train import lora\n",
        },
    )
    assert cycles(import_graph(tmp_path)) == []
    (tmp_path / "workloads/train/hosts.py").write_text("from ..merge import parts\nn = 1\n")
    graph = import_graph(tmp_path)
    assert [describe(graph, c) for c in cycles(graph)] == [
        "workloads.merge.parts (line 1) -> workloads.train.lora (line 2)"
        " -> workloads.train.hosts (line 1) -> workloads.merge.parts"
    ]
