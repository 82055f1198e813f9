"""One client for a Pulumi stack from outside the program: its outputs, its state, a replacement.

The operator commands (infra.ops, infra.ops.recover) and preflight read the stack through this one
class, on Pulumi's Automation API (`pulumi.automation`): the workspace runs the `pulumi` CLI of
the user's machine against the project in this checkout, non-interactively, and answers with
typed values (OutputValue, Deployment, StackSummary) instead of JSON we parse ourselves.

Two things it does not do on purpose:
- It never selects a stack (`pulumi stack select` would change the user's current stack as a side
  effect of a status command): every command names its stack explicitly.
- It never decrypts a secret: outputs and the state are read as `pulumi stack output --json` and
  `pulumi stack export` print them (secrets masked or encrypted; no passphrase needed), through
  the workspace's command runner rather than the workspace methods that add --show-secrets.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
from collections.abc import Callable
from typing import Any

from pulumi import automation as auto

from infra.config.stack_config import ROOT
from infra.errors import InfraError


class StackClientError(InfraError):
    """The pulumi CLI is missing or a command failed; the message is one line."""


class StackClient:
    """The project's stack `stack` (None: the stack currently selected in this checkout).

    `needed_for` says in the missing-CLI error what the caller needs the CLI for.

    Raises (from every method): StackClientError.
    """

    def __init__(
        self,
        stack: str | None = None,
        *,
        work_dir: pathlib.Path = ROOT,
        needed_for: str | None = None,
    ):
        if shutil.which("pulumi") is None:
            why = f": {needed_for}" if needed_for else ""
            raise StackClientError(
                f"the pulumi CLI is not on PATH{why} "
                "(install it: https://www.pulumi.com/docs/install/)"
            )
        try:
            self._workspace = auto.LocalWorkspace(work_dir=str(work_dir))
        except Exception as exc:  # the CLI's version check runs here
            raise StackClientError(f"cannot use the pulumi CLI: {_first_line(exc)}") from None
        self._stack = stack

    @property
    def name(self) -> str:
        """The stack's name: the one given, else the checkout's current stack."""
        if self._stack:
            return self._stack
        current = self._run(self._workspace.stack, "stack ls --json")
        if current is None:
            raise StackClientError(
                "no stack is selected in this checkout: pass --stack or `pulumi stack select`"
            )
        self._stack = current.name
        return self._stack

    def outputs(self) -> dict[str, Any]:
        """The stack's outputs (`pulumi stack output --json`: secret outputs stay masked)."""
        return self._json(["stack", "output", "--json", "--stack", self.name], "outputs")

    def export(self) -> dict[str, Any]:
        """The stack's state (`pulumi stack export`: secrets stay encrypted), {"deployment"...}."""
        state = self._json(["stack", "export", "--stack", self.name], "state")
        if not isinstance(state.get("deployment"), dict):
            raise StackClientError(f"`pulumi stack export --stack {self.name}` has no deployment")
        return state

    def _json(self, args: list[str], what: str) -> dict[str, Any]:
        """One read-only command through the workspace's command runner, its JSON object."""
        result = self._run(
            lambda: self._workspace.pulumi_command.run(list(args), self._workspace.work_dir, {}),
            shlex.join(args),
        )
        try:
            data = json.loads(result.stdout or "{}")
        except json.JSONDecodeError as exc:
            raise StackClientError(f"`pulumi {shlex.join(args)}` printed no JSON: {exc}") from None
        if not isinstance(data, dict):
            raise StackClientError(f"`pulumi {shlex.join(args)}`: the {what} are not a JSON object")
        return data

    def replace_argv(self, urn: str, stack: str | None = None) -> list[str]:
        """The `pulumi up` arguments that delete and recreate one resource of the stack."""
        return ["up", "--yes", "--skip-preview", "--replace", urn, "--stack", stack or self.name]

    def replace(self, urn: str, on_output: Callable[[str], None], stack: str | None = None) -> None:
        """Runs `pulumi up --replace <urn>`, passing Pulumi's progress lines to `on_output`.

        Raises:
            StackClientError: pulumi exited non-zero (the message gives its exit code).
        """
        args = self.replace_argv(urn, stack)
        try:
            self._workspace.pulumi_command.run(
                list(args), self._workspace.work_dir, {}, on_output, on_output
            )
        except auto.CommandError as exc:
            raise StackClientError(
                f"`pulumi {shlex.join(args)}` failed with exit code {_exit_code(exc)} "
                "(its output is above)"
            ) from None

    @staticmethod
    def _run(call: Callable[[], Any], what: str) -> Any:
        try:
            return call()
        except auto.CommandError as exc:
            raise StackClientError(f"`pulumi {what}` failed: {_last_line(exc)}") from None


def current_stack_name(work_dir: pathlib.Path = ROOT) -> str | None:
    """The stack selected in this checkout, or None (no pulumi CLI, no stack, any failure)."""
    try:
        return StackClient(work_dir=work_dir).name
    except StackClientError:
        return None


def _exit_code(exc: auto.CommandError) -> int | None:
    # A CommandError carries its result only as text: "\n code: N\n stdout: ...\n stderr: ...".
    match = re.search(r"^ code: (-?\d+)$", str(exc), re.M)
    return int(match.group(1)) if match else None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _last_line(exc: auto.CommandError) -> str:
    """The last line the CLI wrote to stderr (its error), else to stdout."""
    text = str(exc)
    stderr = text.split("\n stderr: ", 1)[1] if "\n stderr: " in text else text
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
