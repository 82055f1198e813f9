"""Each VM's pinned software provides every third-party module its systemd units import.

The startup scripts install a pinned stack per role (infra/vm/startup.py) and the deployment adds
the workloads wheel with its core dependencies only. This test follows the `python -m workloads
<command>` lines of each role's rendered units through the `workloads` modules they import
(at module level and inside functions) and checks that every third-party module comes from a
pinned requirement, a core dependency, or their dependencies (read from the installed
distributions' metadata in this venv). A missing pin fails here instead of on a TPU VM.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from infra.config import stack_config
from infra.remote import RemoteLayout
from infra.vm import roles, startup
from tests.fixtures import pulumi_mocks
from tests.infra.conftest import make_run_config
from workloads import cli

ROOT = pathlib.Path(__file__).resolve().parents[3]
ROLE_REQUIREMENTS = {
    "train": (*startup.train_requirements(), *startup.train_no_deps()),
    "serve": startup.serve_requirements(),
}
# Installed with `pip install --no-deps`: their own requirements stay off the VM.
WITHOUT_DEPS = {startup.normalized_name(n) for n in startup.no_deps()[0]}


def _module_path(name: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _optional_try(node: ast.Try) -> bool:
    """A try whose ImportError handler carries on without the module (an optional import)."""
    for handler in node.handlers:
        names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
        catches = any(isinstance(n, ast.Name) and "ImportError" in n.id for n in names)
        if catches and not any(isinstance(s, ast.Raise) for s in ast.walk(handler)):
            return True
    return False


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """Absolute names of the modules `module` imports (type-only and optional imports left out)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Try) and _optional_try(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            # `from workloads.x import y` may import the submodule y.
            found.update(f"{name}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def third_party_imports(roots: list[str]) -> dict[str, str]:
    """Top-level third-party module -> a workloads module that imports it, from `roots` on."""
    seen: set[str] = set()
    todo = list(roots)
    external: dict[str, str] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_path(module)
        if path is None:
            continue
        parent = module.rpartition(".")[0]
        if parent.startswith("workloads"):
            todo.append(parent)  # importing a submodule runs its package's __init__
        for name in _imports(path, module):
            top = name.split(".")[0]
            if top == "workloads":
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                external.setdefault(top, module)
    return external


def provided(requirements: tuple[str, ...]) -> set[str]:
    """Distributions installed by the pins, the wheel's core dependencies and their dependencies
    (as far as this venv's metadata knows them)."""
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(r).name for r in (*requirements, *core) if not r.startswith("-")]
    result: set[str] = set()
    while todo:
        name = startup.normalized_name(todo.pop())
        if name in result:
            continue
        result.add(name)
        if name in WITHOUT_DEPS:
            continue
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return result


def role_commands(role: str) -> list[str]:
    """The `python -m workloads <command>` modules of the role's rendered units."""
    plan = roles.role(role).plan_units(make_run_config(serve=True), RemoteLayout("/"))
    commands = {
        match
        for text in plan.units.values()
        for match in re.findall(r"-m workloads ([a-z-]+)", text)
    }
    return sorted(cli.COMMANDS[c][0] for c in commands)


@pytest.mark.parametrize("role", ["train", "serve"])
def test_the_pinned_stack_provides_every_import_of_the_roles_commands(role):
    commands = role_commands(role)
    expected = (
        ["workloads.merge.command", "workloads.train.command"]
        if role == "train"
        else [
            "workloads.bench.command",
            "workloads.evaluation.command",
            "workloads.report.command",
            "workloads.serve.command",
        ]
    )
    assert commands == expected
    have = provided(ROLE_REQUIREMENTS[role])
    distributions = md.packages_distributions()
    missing = {}
    for module, importer in third_party_imports(["workloads.__main__", *commands]).items():
        dists = {startup.normalized_name(d) for d in distributions.get(module, [])}
        if not dists & have:
            missing[module] = importer
    assert missing == {}, (
        f"the {role} VM would lack these modules (module: imported by); pin them in "
        f"infra/vm/startup.py: {missing}"
    )


def test_the_scan_sees_lazy_imports():
    # The scan is only useful if it follows imports inside functions (heavy ones are lazy).
    external = third_party_imports(["workloads.report.command"])
    assert "matplotlib" in external
    assert "numpy" not in provided(("pyyaml==6.0.2",))


def closure(requirements: tuple[str, ...]) -> dict[str, str]:
    """Every distribution the requirements pull in, extras followed (jax[tpu] brings libtpu),
    as this venv's metadata knows them: name -> the requirement that brought it."""
    todo = [(Requirement(r), r) for r in requirements if not r.startswith("-")]
    found: dict[str, str] = {}
    while todo:
        req, why = todo.pop()
        name = startup.normalized_name(req.name)
        if name in found:
            continue
        found[name] = why
        if name in WITHOUT_DEPS:
            continue
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            dep = Requirement(text)
            extras = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(env) for env in extras):
                todo.append((dep, name))
    return found


@pytest.mark.parametrize("role", ["train", "serve"])
def test_everything_a_vm_installs_is_pinned_by_the_lock(role):
    """The VM installs its top-level pins with the whole lock as constraints (`-c`), as CI does:
    every distribution below them is pinned too, so nothing floats to the day's newest."""
    lock = startup.pinned_versions()
    pulled = closure(ROLE_REQUIREMENTS[role])
    assert {"pydantic", "pyyaml", "jinja2", "fsspec"} <= set(pulled)  # the wheel's own deps
    if role == "train":
        assert {"libtpu", "jaxlib", "requests"} <= set(pulled)  # via jax[tpu]
    floating = {name: why for name, why in pulled.items() if name not in lock}
    assert floating == {}, f"not in constraints.txt (name: pulled in by): {floating}"
    # CPU-only test packages are constraints, never requirements: they stay off the VMs.
    assert not {"torch", "pytest", "hypothesis", "ruff", "mypy"} & set(pulled)
    # Nor what google-tunix lists but the modules used here never import (pyproject's
    # [tool.gemma4-tpu.no-deps]): about 0.5 GB.
    unused_by_tunix = {"numba", "llvmlite", "pyarrow", "datasets", "tensorflow-datasets", "sympy"}
    assert not unused_by_tunix & set(pulled)
    if role == "train":
        assert "google-tunix" in pulled


def test_the_rendered_script_installs_with_the_whole_lock():
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("prod"))
    for script in (
        startup.render_train(cfg, roles.TRAIN, has_hf_secret=True),
        startup.render_serve(cfg, roles.SERVE),
    ):
        block = script.split("readonly -a CONSTRAINTS=(\n", 1)[1].split("\n)\n", 1)[0]
        shipped = [line.strip() for line in block.splitlines()]
        assert shipped == list(startup.lock())
        assert len(shipped) == len(startup.pinned_versions())
        assert 'uv_install "$VENV_DIR" -r "$requirements" -c "$constraints"' in script
        assert f"readonly UV_REQUIREMENT={startup.pinned('uv')}" in script
    train = startup.render_train(cfg, roles.TRAIN, has_hf_secret=True)
    block = train.split("readonly -a NO_DEPS=(\n", 1)[1].split("\n)\n", 1)[0]
    assert [line.strip() for line in block.splitlines()] == list(startup.train_no_deps())
    assert startup.train_no_deps() == (
        f"google-tunix=={startup.pinned_versions()['google-tunix']}",
    )
    assert 'uv_install "$VENV_DIR" --no-deps -c "$constraints" "${NO_DEPS[@]}"' in train


def test_pip_and_the_build_backend_are_pinned_once():
    """pip and setuptools are in the lock (pip freeze leaves them out); the build backend
    pyproject requires is the lock's; both VM venvs get the lock's pip (the deploy installs each
    release with it) and the controller installs both from the lock before building."""
    import tomllib

    pins = startup.pinned_versions()
    assert {"pip", "setuptools"} <= pins.keys()
    build = tomllib.loads(startup.PYPROJECT_FILE.read_text())["build-system"]["requires"]
    assert build == [f"setuptools=={pins['setuptools']}"]
    pip = f"pip=={pins['pip']}"
    assert pip in startup.train_requirements() and pip in startup.serve_requirements()
