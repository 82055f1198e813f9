"""The local cloud's errors."""

from __future__ import annotations


class CannotBoot(RuntimeError):
    """This machine cannot build or boot containers (one line says why)."""


class MachineError(RuntimeError):
    """A container did not come up, or a command in it failed (one line says which)."""
