"""Running one checked command on a worker over SSH (fabric), and waiting for a worker.

Command lines are built from argv lists with shlex; results are checked with `warn=True` and a
failure raises RemoteError naming the host, the step, the exit code and the remote log that holds
the output. A broken connection is dropped so the next call opens a fresh one.
"""

from __future__ import annotations

import shlex
import socket
import time
from collections.abc import Sequence

import fabric
import invoke
import paramiko

import infra.remote.ssh as ssh
from infra.remote.errors import BootFailed, ReadyTimeout, RemoteError
from infra.vm.layout import RemoteLayout
from workloads.common import logs

LOG = logs.get("deploy")

CONNECTION_ERRORS = (
    paramiko.SSHException,
    socket.error,  # OSError: refused, reset, unreachable, timed out
    EOFError,
    invoke.exceptions.Failure,
    invoke.exceptions.ThreadException,
)


def host_name(conn: fabric.Connection) -> str:
    return f"{conn.host}:{conn.port}" if conn.port != 22 else str(conn.host)


def as_root(argv: Sequence[str], sudo: bool) -> list[str]:
    return ["sudo", "-n", *argv] if sudo else list(argv)


def run(
    conn: fabric.Connection,
    step: str,
    argv: Sequence[str],
    *,
    sudo: bool = False,
    log_path: str | None = None,
) -> invoke.Result:
    """Runs one command (an argv list, quoted here) and checks it.

    With `log_path`, the command's output is appended to that remote file (and named in the
    error); without, it is captured and its stderr tail goes into the error.

    Raises:
        RemoteError: non-zero exit status, or the connection broke.
    """
    if log_path is not None:
        # "$0" is the log path, passed as a separate argument: nothing is pasted into the script.
        script = (
            'mkdir -p "$(dirname "$0")" && '
            f'printf "== %s %s\\n" "$(date -Is)" {shlex.quote(step)} >>"$0" && '
            f'{{ {shlex.join(argv)}; }} >>"$0" 2>&1'
        )
        full = as_root(["sh", "-c", script, log_path], sudo)
    else:
        full = as_root(argv, sudo)
    command = shlex.join(full)
    try:
        result = conn.run(command, warn=True, hide=True, in_stream=False)
    except paramiko.BadHostKeyException as exc:
        raise ssh.SshError(ssh.describe(exc, str(conn.host), settings_of(conn))) from exc
    except CONNECTION_ERRORS as exc:
        drop(conn)
        raise RemoteError(
            host_name(conn), step, None, log_path, f"{type(exc).__name__}: {exc}"
        ) from exc
    if result.failed and (result.exited == -1 or not connected(conn)):
        # The channel closed without an exit status: the server or the network went away.
        drop(conn)
        raise RemoteError(
            host_name(conn), step, None, log_path, "the SSH connection was lost during the command"
        )
    if result.failed:
        detail = tail(conn, log_path, sudo) if log_path else result.stderr.strip()[-2000:]
        raise RemoteError(host_name(conn), step, result.exited, log_path, detail or "(no output)")
    return result


def connected(conn: fabric.Connection) -> bool:
    transport = conn.client.get_transport()
    return bool(transport is not None and transport.is_active())


def drop(conn: fabric.Connection) -> None:
    """Forgets a broken connection so the next call opens a fresh one."""
    try:
        conn.close()
    except Exception:
        LOG.debug("closing %s failed", host_name(conn), exc_info=True)


def tail(conn: fabric.Connection, path: str, sudo: bool, lines: int = 20) -> str:
    """The last lines of a remote file, or a note why they could not be read (never raises)."""
    try:
        result = conn.run(
            shlex.join(as_root(["tail", "-n", str(lines), path], sudo)),
            warn=True,
            hide=True,
            in_stream=False,
        )
    except CONNECTION_ERRORS as exc:
        return f"(could not read it: {type(exc).__name__})"
    if result.failed:
        if "No such file" in result.stderr:
            return "(no such file yet)"
        return f"(could not read it: {result.stderr.strip() or 'exit ' + str(result.exited)})"
    text = result.stdout.rstrip()
    return (
        "last lines:\n" + "\n".join("    " + line for line in text.splitlines())
        if text
        else "(log empty)"
    )


def wait_ready(
    conn: fabric.Connection,
    layout: RemoteLayout,
    *,
    timeout_s: float = 3600.0,
    initial_delay_s: float = 2.0,
    max_delay_s: float = 30.0,
    sudo: bool = False,
    settings: ssh.SshSettings | None = None,
    rerun_failed: bool = True,
) -> None:
    """Waits until the worker answers SSH and its startup script wrote the ready marker.

    Retries with exponential backoff up to `timeout_s`. A changed host key is never retried. A
    boot-failed marker ends the wait at once (BootFailed); one already there at the first answer
    (an earlier boot's) makes the startup script run again first when `rerun_failed`.

    Raises:
        BootFailed: the startup script stopped before ready (its stage and log).
        ReadyTimeout: naming the host and what the startup log shows (or the last SSH error).
        SshError: the host key changed (see infra.remote.ssh.describe).
    """
    deadline = time.monotonic() + timeout_s
    delay = initial_delay_s
    last_problem = "never tried"
    probe = shlex.join(as_root(["sh", "-c", READY_PROBE, "probe", *_probe_paths(layout)], sudo))
    first_answer = True
    while True:
        try:
            result = conn.run(probe, warn=True, hide=True, in_stream=False)
            answer = result.stdout.strip()
            if result.ok and answer == "ready":
                return
            if result.ok and answer.startswith("failed"):
                marker = answer.removeprefix("failed").strip() or "(empty marker)"
                if not (first_answer and rerun_failed):
                    raise BootFailed(host_name(conn), layout.startup_log, marker)
                # Left by an earlier boot: this `up` runs the script again instead of waiting
                # out the timeout on a boot that will never be ready.
                rerun_startup(conn, layout, sudo)
                last_problem = f"the startup script runs again after: {marker}"
            else:
                last_problem = f"ready marker {layout.ready_marker} is not there yet"
            first_answer = False
            connected = True
        except paramiko.BadHostKeyException as exc:
            raise ssh.SshError(
                ssh.describe(exc, str(conn.host), settings or settings_of(conn))
            ) from exc
        except CONNECTION_ERRORS as exc:
            drop(conn)
            why = ssh.describe(exc, str(conn.host), settings or settings_of(conn))
            last_problem = f"SSH not reachable: {why}"
            connected = False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            detail = f"not ready after {timeout_s:g} s: {last_problem}"
            if connected:
                detail += "; startup log: " + tail(conn, layout.startup_log, sudo)
            raise ReadyTimeout(host_name(conn), layout.startup_log if connected else None, detail)
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_delay_s)


# One round trip per poll: "ready", "failed <the boot-failed marker's line>", or nothing yet.
# $2 is the marker on the boot disk, $3 its copy in RAM (the only one when the disk is full).
READY_PROBE = (
    'if [ -e "$1" ]; then echo ready; '
    'elif [ -e "$2" ]; then printf "failed "; head -n 1 "$2"; '
    'elif [ -e "$3" ]; then printf "failed "; head -n 1 "$3"; fi'
)

# Runs the kept copy of the startup script detached from the SSH session (it outlives it, as
# the guest agent's run does); its begin() removes the boot-failed marker and takes the lock.
RERUN = (
    '[ -f "$1" ] || { echo "$1 is missing (the boot stopped before keeping it)" >&2; exit 1; }; '
    'rm -f "$2" "$3" && setsid -f /bin/bash "$1" </dev/null >/dev/null 2>&1'
)


def _probe_paths(layout: RemoteLayout) -> list[str]:
    return [layout.ready_marker, layout.boot_failed_marker, layout.boot_failed_note]


def rerun_startup(conn: fabric.Connection, layout: RemoteLayout, sudo: bool) -> None:
    """Starts the worker's startup script again (the copy its last boot kept).

    Raises:
        BootFailed: there is no copy to run (the boot stopped before keeping one).
    """
    argv = [
        "sh",
        "-c",
        RERUN,
        "rerun",
        layout.startup_script_copy,
        layout.boot_failed_marker,
        layout.boot_failed_note,
    ]
    result = conn.run(shlex.join(as_root(argv, sudo)), warn=True, hide=True, in_stream=False)
    if not result.ok:
        raise BootFailed(
            host_name(conn),
            layout.startup_log,
            f"could not run {layout.startup_script_copy} again: {result.stderr.strip()[-200:]}",
        )


def reachable(conn: fabric.Connection, *, settings: ssh.SshSettings | None = None) -> bool:
    """One connection attempt: False when nothing answers on the SSH port (the VM is gone).

    Raises:
        SshError: the host answers but its key changed, or it refuses our identity.
    """
    try:
        conn.open()
    except (paramiko.BadHostKeyException, paramiko.AuthenticationException) as exc:
        raise ssh.SshError(
            ssh.describe(exc, str(conn.host), settings or settings_of(conn))
        ) from exc
    except (OSError, EOFError, paramiko.SSHException):
        drop(conn)
        return False
    return True


def settings_of(conn: fabric.Connection) -> ssh.SshSettings:
    return ssh.SshSettings(user=str(conn.user), port=int(conn.port))


def chain(*argvs: Sequence[str]) -> list[str]:
    """One `sh -c` argv that runs several argv lists in order and stops at the first failure."""
    return ["sh", "-c", " && ".join(shlex.join(a) for a in argvs)]
