"""The errors of remote work: one worker's failed step, a VM's failed workers, a timeout."""

from __future__ import annotations

from collections.abc import Sequence

from infra.errors import InfraError


class RemoteError(InfraError):
    """A remote step failed on one worker.

    Attributes:
        host: the worker's address.
        step: the step's name (upload, install, units, ...).
        exit_code: the remote command's exit status; None when the connection failed.
        log_path: the remote file that holds the step's output.
        detail: what went wrong, with the last lines of the remote log when they could be read.
    """

    def __init__(
        self,
        host: str,
        step: str,
        exit_code: int | None,
        log_path: str | None,
        detail: str,
        *,
        outcome: str | None = None,
    ):
        self.host, self.step, self.exit_code = host, step, exit_code
        self.log_path, self.detail = log_path, detail
        if outcome is None:
            why = "connection failed" if exit_code is None else f"exit code {exit_code}"
            outcome = f"failed ({why})"
        where = f"; remote log: {log_path}" if log_path else ""
        super().__init__(f"{host}: step '{step}' {outcome}{where}: {detail}".rstrip(": "))


class DeployError(InfraError):
    """One or more workers of a VM failed; the message has one line per failed worker."""

    def __init__(self, vm: str, errors: Sequence[BaseException]):
        self.errors = list(errors)
        lines = [f"deployment to {vm} failed on {len(self.errors)} worker(s):"]
        lines += [f"  - {err}" for err in self.errors]
        super().__init__("\n".join(lines))


class ReadyTimeout(RemoteError):
    """A worker did not become reachable or ready in time."""

    def __init__(self, host: str, log_path: str | None, detail: str):
        super().__init__(host, "wait-ready", None, log_path, detail, outcome="timed out")


class BootFailed(RemoteError):
    """A worker's startup script stopped before ready: its boot-failed marker's line (the stage,
    the exit status and the log)."""

    def __init__(self, host: str, log_path: str, detail: str):
        super().__init__(host, "wait-ready", None, log_path, detail, outcome="failed at boot")


def mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


class DiskFull(RemoteError):
    """A step could not write because a worker's disk is full: one line with the host, the
    path, its free space and what the deploy needs there."""

    def __init__(self, host: str, step: str, path: str, free: int, needed: int):
        self.path, self.free, self.needed = path, free, needed
        super().__init__(
            host,
            step,
            None,
            None,
            f"{path} has {mib(free)} free"
            + (f", this deploy needs about {mib(needed)} there" if needed else "")
            + "; free space on that disk and deploy again",
            outcome="failed (disk full)",
        )
