"""User-facing errors: one clear line, no traceback unless asked for (WORKLOADS_TRACEBACK=1)."""

from __future__ import annotations

import errno
import os


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


# What each errno means for a path the user chose, and what would be allowed instead. These are
# the errors a wrong location gives (a typo, a file where a directory belongs, a directory the
# process may not write); a full disk (ENOSPC) or an I/O error is not the user's typing.
_PATH_PROBLEMS = {
    errno.ENOENT: "not found",
    errno.ENOTDIR: "a part of this path is a file, not a directory",  # named below
    errno.EISDIR: "is a directory, expected a file",
    errno.EEXIST: "already exists",
    errno.EACCES: "permission denied; choose a location this user can read and write",
    errno.EPERM: "operation not permitted; choose a location this user can write",
    errno.EROFS: "read-only file system; choose a writable location",
    errno.ENAMETOOLONG: "file name too long",
}


def path_error_line(exc: OSError) -> str | None:
    """One line for an OSError about a path the user gave, or None for any other OSError (a full
    disk, a network error, no path named), which stays an unexpected error."""
    problem = _PATH_PROBLEMS.get(exc.errno) if exc.errno is not None else None
    if problem is None or exc.filename is None:
        return None
    path = os.fsdecode(exc.filename)
    if exc.errno == errno.EEXIST and os.path.isfile(path):
        problem = "is a file, expected a directory"
    elif exc.errno == errno.ENOTDIR:
        problem = f"{existing_ancestor(path)} is a file, not a directory"
    return f"{path}: {problem}"


def existing_ancestor(path: str) -> str:
    """The nearest ancestor of a local path that exists: for a path "under a file", that file."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent
