"""Whether a process still runs, from its PID (markers name the process that wrote them)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while a process with this PID exists (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to another user
        return True
    return True
