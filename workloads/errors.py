"""User-facing errors: one clear line, no traceback unless asked for (WORKLOADS_TRACEBACK=1)."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix: bad input, a missing file, a config that does not fit.

    The message is one line naming the field or file, the bad value and what is allowed.
    The CLI prints it as `error: <message>` and exits with `exit_status` (2; a subclass may
    name another status, so that a unit can tell it apart).
    """

    exit_status = 2


def exception_line(exc: BaseException) -> str:
    """An unexpected exception as one line: `Type: first line of its message` (just the type
    when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
