"""A process's own state: whether a process still runs, from its PID (markers name the process
that wrote them), and this process's environment switched for a block (`environment`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def alive(pid: int) -> bool:
    """True while a process with this PID exists (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to another user
        return True
    return True


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` set in os.environ (and so in every child started) for the block; after it, each
    of those variables as it was before: its old value, or unset if it was unset. What changes
    other variables in the block keep."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
