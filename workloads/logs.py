"""Logging of the `python -m workloads` commands: set up once, in the CLI, with a level.

Diagnostics go to stderr as `name: message` (`serve: staged 4 file(s)`), where `name` is the
logger under `workloads` (`workloads.serve` -> `serve`); a warning or an error says so
(`serve: warning: ...`). What a command produces (the training progress lines, tables, JSON)
stays on stdout and is not logging.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
ROOT = "workloads"


def get(name: str) -> logging.Logger:
    """The logger that prints as `name: ...` (e.g. get("serve"))."""
    return logging.getLogger(f"{ROOT}.{name}")


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
