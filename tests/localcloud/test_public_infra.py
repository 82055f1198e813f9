"""The local cloud uses infra's public functions only: no `from infra... import _name`, no
`<infra module or name>._name` (a private function or method reached through an infra import),
and no class of infra's subclassed inside a function to bend its behaviour. So the rehearsal
runs what `pulumi up` runs through the same doors (the deploy is the provider's public
`deploy`), and infra may change its private helpers without breaking it.

Read from the sources (nothing is imported or run).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCALCLOUD = ROOT / "localcloud"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.expr) -> str | None:
    """The name an expression starts from: `a` of `a.b().c[0].d`."""
    while True:
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def private_uses(source: str) -> list[str]:
    """`line: what` for each private name of infra a source imports or reaches, and each class
    defined inside a function on a base reached through an infra import."""
    tree = ast.parse(source)
    bound: set[str] = set()  # names an infra import binds (modules, classes, functions)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "infra" or alias.name.startswith("infra."):
                    bound.add(alias.asname or alias.name.split(".")[0])
                    found += [
                        f"{node.lineno}: import {alias.name}"
                        for part in alias.name.split(".")
                        if _private(part)
                    ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "infra":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(alias.name) or any(_private(p) for p in node.module.split(".")):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and _root_name(node.value) in bound
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [
                f"{node.lineno}: class {node.name}({ast.unparse(base)}) in {function.name}"
                for node in ast.walk(function)
                if isinstance(node, ast.ClassDef)
                for base in node.bases
                if _root_name(base) in bound
            ]
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_localcloud_calls_no_private_function_of_infra() -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{use}"
        for path in sorted(LOCALCLOUD.rglob("*.py"))
        for use in private_uses(path.read_text())
    ]
    assert problems == []


def test_the_check_sees_a_private_use() -> None:
    """The reader itself, on made-up sources: the deploy the rehearsal once called, a private
    import, and what is fine (a public call, a private name of the local cloud's own)."""
    source = (
        "from infra.resources import ssh_deployment\n"
        "from infra.config.stack_config import _child\n"
        "import infra.tpu.api as tpu\n"
        "from localcloud import machine\n"
        "ssh_deployment.SshDeploymentProvider()._deploy(inputs)\n"
        "tpu._client().x\n"
        "ssh_deployment.SshDeploymentProvider().deploy(inputs)\n"
        "machine._console_tail()\n"
        "self._undo.close()\n"
        "def deploy():\n"
        "    class Inputs(ssh_deployment.DeploymentInputs):\n"
        "        pass\n"
    )
    assert private_uses(source) == [
        "2: from infra.config.stack_config import _child",
        "5: ssh_deployment.SshDeploymentProvider()._deploy",
        "6: tpu._client",
        "11: class Inputs(ssh_deployment.DeploymentInputs) in deploy",
    ]
