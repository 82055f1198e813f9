"""Declared dependencies are the imported ones: every third-party import of `workloads` and
`infra` comes from a distribution pyproject.toml declares, and every declared runtime dependency
is imported somewhere (or is a documented runtime plugin). Also: `workloads` never imports
`infra` (the VMs get `workloads` alone), neither package has an import cycle, lazy or not, and
the infra extra alone runs the program and `infra.ops`, and the recover extra alone (the recovery
controller's install) runs `infra.ops recover`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from infra.vm import startup

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("workloads", "infra", "localcloud")
# Declared, never imported by name, needed at run time: what they plug into says why.
RUNTIME_PLUGINS = {
    "gcsfs": "fsspec's gs:// filesystem, loaded by protocol name",
    "jaxlib": "jax's compiled half, loaded by jax",
    "libtpu": "the TPU compiler/runtime jax loads as a plugin",
}
RUNTIME_EXTRAS = ("infra", "workloads", "compile", "demo")


def _name(requirement: str) -> str:
    """The distribution a requirement line names, normalized as pip does (infra.vm.startup)."""
    return startup.normalized_name(re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0])


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in RUNTIME_EXTRAS:
        names |= {_name(r) for r in project["optional-dependencies"][extra]}
    return names | {_name(r) for r in startup.no_deps()[0]}  # google-tunix, installed --no-deps


def _imports() -> dict[str, set[str]]:
    """Absolute module names imported anywhere in the packages -> the files importing them."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from google.cloud import tpu_v2`: the name may be a module of its own.
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                for name in names:
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _distribution_files() -> dict[str, str]:
    """Installed module path without suffix (relative to site-packages: `google/api_core/
    exceptions`, `yaml/__init__`, `ml_dtypes/_ml_dtypes_ext`) -> distribution name."""
    owners = {}
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            text = str(file)
            if text.endswith((".py", ".so")):
                owners[text.split(".", 1)[0]] = _name(dist.metadata["Name"])
    return owners


def _owner(module: str, owners: dict[str, str]) -> str | None:
    """The distribution that installs `module`, found by its file among the installed files of
    every distribution without importing it (namespace packages like google.* resolve by the
    deepest module that has a file)."""
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        stem = "/".join(parts[:depth])
        for candidate in (stem, f"{stem}/__init__"):
            if candidate in owners:
                return owners[candidate]
    return None


def _third_party(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    return {
        name: files
        for name, files in imports.items()
        if name.split(".")[0] not in sys.stdlib_module_names
        and name.split(".")[0] not in PACKAGES
        and name.split(".")[0] != "__future__"
    }


def test_every_import_comes_from_a_declared_distribution():
    owners = _distribution_files()
    declared = _declared()
    missing = {}
    for module, files in _third_party(_imports()).items():
        owner = _owner(module, owners)
        assert owner is not None, f"{module} (imported by {sorted(files)}) is not installed"
        if owner not in declared:
            missing[module] = (owner, sorted(files)[0])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declared_dependency_is_imported_or_a_documented_plugin():
    owners = _distribution_files()
    used = {_owner(module, owners) for module in _third_party(_imports())}
    unused = sorted(_declared() - used - set(RUNTIME_PLUGINS))
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


def test_workloads_never_imports_infra():
    offenders = {
        module: sorted(f for f in files if f.startswith("workloads/"))
        for module, files in _imports().items()
        if module.split(".")[0] == "infra"
    }
    assert not {m: f for m, f in offenders.items() if f}, offenders


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Project module -> project modules it imports anywhere: at module level, inside functions
    and under TYPE_CHECKING alike. A cycle through a lazy import is still a cycle: it only moves
    the problem to whoever imports the two modules in the other order."""
    modules = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            # A module's own ancestor packages are initialised before it: never a cycle.
            edges |= {
                t for t in targets if t in modules and t != name and not name.startswith(t + ".")
            }
        graph[name] = edges
    return graph


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    graph = _import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(n for n in graph if n.split(".")[0] == package):
        if start not in state and (cycle := visit(start)):
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")


def test_constraints_pin_every_declared_package_at_the_version_installed_here():
    """constraints.txt is the one source of pins: CI installs with it, the VMs are pinned from
    it (infra.vm.startup), so what the tests ran is what the VMs run."""
    pins = startup.pinned_versions()
    assert not _declared() - set(pins), "declared but not pinned in constraints.txt"
    wrong = {}
    for dist in importlib.metadata.distributions():
        name = _name(dist.metadata["Name"])
        if name in pins and dist.version.split("+")[0] != pins[name]:
            wrong[name] = (dist.version, pins[name])
    assert not wrong, f"installed != constraints.txt: {wrong}"
    for requirement in (*startup.train_requirements()[1:], *startup.serve_requirements()):
        name, _, version = requirement.partition("==")
        assert pins[_name(name)] == version, requirement


def test_the_build_requirements_are_exact_pins_of_what_is_installed_here():
    """pip builds the project in an isolated environment that constraints.txt does not reach
    (the recovery controller's `pip install -e src[recover]`): only an exact pin there makes the
    build tools of every install the same."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for requirement in requires:
        name, sep, version = requirement.partition("==")
        assert sep and version, f"{requirement}: not an exact pin"
        assert importlib.metadata.version(name) == version, requirement


# What a laptop that only runs `pulumi up` installs: the core and the infra extra, never the
# training stack. These must start without it.
INFRA_ONLY_MODULES = (
    "infra.program",
    "infra.ops",
    "infra.ops.recover",
    "infra.ops.cost",
    "infra.preflight",
    "workloads.train.metrics",  # recover reads the run's train_summary.json through it
)


def _workloads_only_modules() -> list[str]:
    """Top-level modules of the distributions only the workloads extra brings."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    infra_side = {_name(r) for r in project["dependencies"]}
    infra_side |= {_name(r) for r in project["optional-dependencies"]["infra"]}
    only = {_name(r) for r in project["optional-dependencies"]["workloads"]} - infra_side
    modules = {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if any(_name(d) in only for d in dists) and module.isidentifier()
    }
    assert {"jax", "flax", "numpy", "safetensors"} <= modules  # the mapping found them
    return sorted(modules)


def test_the_infra_extra_alone_runs_the_program_and_the_operator_commands():
    blocked = _workloads_only_modules()
    script = f"""
import importlib, importlib.abc, sys
BLOCKED = set({blocked!r})
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} (only the workloads extra installs it)")
sys.meta_path.insert(0, Absent())
for module in {INFRA_ONLY_MODULES!r}:
    importlib.import_module(module)
# The whole program, as the controller's `pulumi up` runs it (under mocks here).
from tests.fixtures import pulumi_mocks
for stack in ("dev", "prod"):
    recording = pulumi_mocks.run_program(
        stack, pulumi_mocks.stack_file_config(stack), hf_token="hf_x"
    )
    assert recording.resources, stack
mapping = pulumi_mocks.stack_file_config("dev")
mapping["recovery"] = {{"enabled": True}}
recording = pulumi_mocks.run_program("dev", mapping, hf_token="hf_x")
assert recording.of_type("gcp:compute/instance:Instance")
from infra.ops import cli as ops
sys.exit(ops.main(["recover", "--help"]))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--max-recoveries" in run.stdout


# Imports every Tunix module the project imports while every top-level module whose distributions
# all lie outside `allowed` is refused, as on a VM that never installed them.
_BLOCKED_IMPORT = """
import importlib, importlib.metadata as md, json, sys
allowed, modules = set(json.loads(sys.argv[1])), json.loads(sys.argv[2])
norm = lambda n: n.replace("_", "-").replace(".", "-").lower()
owners = md.packages_distributions()
class Refuse:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        dists = {norm(d) for d in owners.get(top, ())}
        if dists and not dists & allowed:
            raise ModuleNotFoundError(f"{top} (from {sorted(dists)}) is not installed", name=top)
        return None
sys.meta_path.insert(0, Refuse())
for module in modules:
    importlib.import_module(module)
print("imported", len(modules))
"""


def _installed_without_deps() -> set[str]:
    """What .ci/setup and the training VM install: the runtime extras and core with their
    dependencies, [tool.gemma4-tpu.no-deps] `needs` with theirs, its `packages` alone."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = [*project["dependencies"], *startup.no_deps()[1]]
    for extra in RUNTIME_EXTRAS:
        roots += project["optional-dependencies"][extra]
    todo, found = [Requirement(r).name for r in roots], set()
    while todo:
        name = startup.normalized_name(todo.pop())
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [Requirement(t).name for t in requires if "extra ==" not in t]
    return found | {startup.normalized_name(n) for n in startup.no_deps()[0]}


def test_tunix_modules_import_with_the_declared_set_and_without_what_tunix_lists():
    """google-tunix is installed --no-deps: every Tunix module the project imports must load
    from what the install declares, with numba, pyarrow, datasets, tensorflow-datasets, ...
    refused (a new Tunix that imports one of them fails here, not on a TPU VM)."""
    modules = sorted(m for m in _imports() if m.split(".")[0] == "tunix")
    assert "tunix.sft.peft_trainer" in modules and "tunix.models.gemma4.model" in modules
    allowed = _installed_without_deps()
    assert not {"numba", "llvmlite", "pyarrow", "datasets", "tensorflow-datasets"} & allowed
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, json.dumps(sorted(allowed)), json.dumps(modules)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"imported {len(modules)}"


def test_the_recover_extra_alone_runs_the_recovery_controllers_command():
    """The controller installs the core and the `recover` extra only (no pulumi-gcp, no JAX):
    `python -m infra.ops recover` must import and parse with nothing else."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    kept = {_name(r) for r in project["dependencies"]} | {_name(r) for r in extras["recover"]}
    dropped = {_name(r) for r in (*extras["infra"], *extras["workloads"])} - kept
    assert "pulumi-gcp" in dropped
    blocked = sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if module.isidentifier() and all(_name(d) in dropped for d in dists)
    )
    script = f"""
import importlib, importlib.abc, sys
BLOCKED = set({blocked!r})
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} (not in the recover extra)")
sys.meta_path.insert(0, Absent())
import infra.ops.recover, infra.tpu.record
from infra.ops import cli as ops
sys.exit(ops.main(["recover", "--help"]))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--request" in run.stdout and "--journal" in run.stdout
