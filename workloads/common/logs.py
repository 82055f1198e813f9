"""The one voice of the project: how every process tells a person what it does and what went wrong.

Everything that reports progress or a problem to a person goes through here: the `python -m
workloads` commands, the operator CLI (`python -m infra.ops`), the Pulumi program and its
dynamic providers. A line is `name: message` on stderr (`serve: staged 4 file(s)`), where `name`
is the logger under `workloads` (`workloads.serve` -> `serve`); a warning or an error says so
(`deploy: warning: ...`). What a command produces (the training metrics lines, tables, JSON)
stays on stdout and is not reported here.

The handler is installed when this module is imported, at level info, so a process that nobody
configures still speaks: above all a Pulumi dynamic provider, which runs in a process of its own
that Pulumi starts (`python -u -m pulumi.dynamic`) and that never reaches this project's CLI.
Pulumi does not connect that process to its engine (`pulumi.log` there finds no engine and
prints to stderr itself); it reads the process's stderr line by line and shows every non-empty
line as a diagnostic of the update, which `pulumi up` prints. An unconfigured `logging` logger
drops everything below warning, so a provider's progress logged that way never arrived. The CLIs
call `configure` to pick the level.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
ROOT = "workloads"

Say = Callable[[str], None]
"""A progress callable (`say("placed in us-east5-a")`) for code that takes one as a parameter, so
that a test can collect the lines instead."""


def get(name: str) -> logging.Logger:
    """The logger that prints as `name: ...` (e.g. get("serve"))."""
    return logging.getLogger(f"{ROOT}.{name}")


def say(name: str) -> Say:
    """Progress lines as `name: message` at level info (a message is printed as it is, `%` and
    all)."""
    logger = get(name)

    def _say(message: str) -> None:
        logger.info("%s", message)

    return _say


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest and callers may replace it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        name = record.name.removeprefix(ROOT + ".")
        level = "" if record.levelno < logging.WARNING else record.levelname.lower() + ": "
        text = f"{name}: {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure(level: str = "info") -> None:
    """Sends the `workloads` loggers to stderr at `level` (one of LEVELS); safe to call again."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r}: one of {', '.join(LEVELS)}")
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, _CurrentStderr)]:
        logger.removeHandler(handler)
    handler = _CurrentStderr()
    handler.setFormatter(_Formatter())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


configure("info")  # every process speaks from its first import on (see the module docstring)
