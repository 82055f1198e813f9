"""The deploy steps on one worker: stage the files, then activate them, or undeploy.

Every step is a plain function that takes a fabric Connection, so the Pulumi provider, the
operator commands and the tests all call the same code. The deployed state file is written last,
so a deploy that stops half-way is redone completely next time (each step is idempotent).
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fabric
import paramiko

from infra.remote.bundle import Bundle, sha256_text
from infra.remote.errors import RemoteError
from infra.remote.layout import RemoteLayout
from infra.remote.transport import CONNECTION_ERRORS, chain, drop, host_name, run

LOG = logging.getLogger("infra.remote")

# Called as on_step(host, step) before each remote step; the Pulumi provider logs with it and
# the tests use it to inject faults at a known point.
StepHook = Callable[[str, str], None]


def read_state(conn: fabric.Connection, layout: RemoteLayout) -> dict[str, Any]:
    """The worker's deployed state ({} when nothing was deployed): the one 'check' command."""
    script = 'cat "$0" 2>/dev/null || true'
    result = run(conn, "check", ["sh", "-c", script, layout.state_file])
    try:
        state = json.loads(result.stdout) if result.stdout.strip() else {}
    except json.JSONDecodeError:
        return {}  # a damaged state file only means: deploy everything again
    return state if isinstance(state, dict) else {}


def _replace(src: str, dest: str, mode: str) -> list[list[str]]:
    """Copies src over dest atomically (write next to it, then rename) with the given mode."""
    return [["install", "-m", mode, src, dest + ".part"], ["mv", "-f", dest + ".part", dest]]


def prepare(
    conn: fabric.Connection, bundle: Bundle, layout: RemoteLayout, *, sudo: bool, hook: StepHook
) -> str:
    """Creates the directories and uploads the wheel, config and units to a private staging dir.

    Nothing that runs is touched. Returns the staging directory.
    """
    host = host_name(conn)
    stage = posixpath.join(layout.incoming_dir, bundle.fingerprint[:16])
    hook(host, "directories")
    run(
        conn,
        "directories",
        chain(
            [
                "install",
                "-d",
                "-m",
                "0755",
                layout.state_dir,
                layout.log_dir,
                layout.wheels_dir,
                layout.unit_dir,
            ],
            # 0755: login shells read the startup script's env file there; run.yaml is 0600.
            ["install", "-d", "-m", "0755", layout.config_dir],
            # Owned by the login user, so SFTP can write there without root.
            ["install", "-d", "-m", "0700", "-o", str(conn.user), layout.incoming_dir, stage],
        ),
        sudo=sudo,
    )

    hook(host, "upload")
    try:
        sftp = conn.client.open_sftp()
    except CONNECTION_ERRORS as exc:
        drop(conn)
        raise RemoteError(host, "upload", None, None, f"{type(exc).__name__}: {exc}") from exc
    try:
        _put_file(sftp, bundle.wheel_path, posixpath.join(stage, bundle.wheel_name), 0o644)
        _put_bytes(sftp, bundle.run_config_yaml.encode(), posixpath.join(stage, "run.yaml"), 0o600)
        for name, text in sorted(bundle.units.items()):
            _put_bytes(sftp, text.encode(), posixpath.join(stage, name), 0o644)
    except (*CONNECTION_ERRORS, OSError) as exc:
        drop(conn)
        raise RemoteError(host, "upload", None, None, f"{type(exc).__name__}: {exc}") from exc
    finally:
        try:
            sftp.close()
        except Exception:
            LOG.debug("closing sftp on %s failed", host, exc_info=True)

    hook(host, "verify-upload")
    with open(bundle.wheel_path, "rb") as handle:  # streamed: a wheel is not read into memory
        local = hashlib.file_digest(handle, "sha256").hexdigest()
    result = run(conn, "verify-upload", ["sha256sum", posixpath.join(stage, bundle.wheel_name)])
    remote = result.stdout.split()[0] if result.stdout.split() else ""
    if remote != local:
        raise RemoteError(
            host,
            "verify-upload",
            None,
            None,
            f"uploaded wheel sha256 {remote!r} != local {local!r}",
        )
    return stage


def _put_bytes(sftp: paramiko.SFTPClient, data: bytes, path: str, mode: int) -> None:
    # The mode is set on the empty file before any content is written, then renamed into place.
    tmp = path + ".part"
    with sftp.open(tmp, "wb") as handle:
        handle.chmod(mode)
        handle.write(data)
    sftp.posix_rename(tmp, path)


def _put_file(sftp: paramiko.SFTPClient, local: str, path: str, mode: int) -> None:
    tmp = path + ".part"
    sftp.put(local, tmp, confirm=True)
    sftp.chmod(tmp, mode)
    sftp.posix_rename(tmp, path)


def activate(
    conn: fabric.Connection,
    bundle: Bundle,
    layout: RemoteLayout,
    stage: str,
    previous: Mapping[str, Any],
    *,
    sudo: bool,
    hook: StepHook,
) -> None:
    """Stops the old job, installs the staged wheel, config and units, and starts the new job.

    The state file is written last: a failure anywhere before leaves the old fingerprint (or
    none), and the next deploy repeats every step (each is idempotent).
    """
    host = host_name(conn)
    log = layout.deploy_log
    old_units = [u for u in previous.get("units", []) if isinstance(u, str)]

    if old_units:
        # The old job must not run on a half-replaced package; the new one starts at the end.
        hook(host, "stop")
        run(conn, "stop", ["systemctl", "stop", *old_units], sudo=sudo, log_path=log)

    hook(host, "install")
    staged_wheel = posixpath.join(stage, bundle.wheel_name)
    pip = [layout.python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    commands = [[*pip, staged_wheel]] if bundle.install_deps else []
    # Same version number, new content: force our package (only ours) to be replaced.
    commands.append([*pip, "--no-deps", "--force-reinstall", staged_wheel])
    # Keep exactly the installed wheel next to the venv (a record of what runs there).
    commands += _replace(staged_wheel, posixpath.join(layout.wheels_dir, bundle.wheel_name), "0644")
    commands.append(
        [
            "find",
            layout.wheels_dir,
            "-maxdepth",
            "1",
            "-name",
            "*.whl",
            "!",
            "-name",
            bundle.wheel_name,
            "-delete",
        ]
    )
    run(conn, "install", chain(*commands), sudo=sudo, log_path=log)

    hook(host, "config")
    run(
        conn,
        "config",
        chain(*_replace(posixpath.join(stage, "run.yaml"), layout.config_path, "0600")),
        sudo=sudo,
        log_path=log,
    )

    hook(host, "units")
    commands = []
    removed = [u for u in old_units if u not in bundle.units]
    if removed:
        commands.append(["systemctl", "disable", *removed])
        commands.append(["rm", "-f", *(posixpath.join(layout.unit_dir, u) for u in removed)])
    for name in sorted(bundle.units):
        commands += _replace(
            posixpath.join(stage, name), posixpath.join(layout.unit_dir, name), "0644"
        )
    run(conn, "units", chain(*commands), sudo=sudo, log_path=log)

    hook(host, "daemon-reload")
    run(conn, "daemon-reload", ["systemctl", "daemon-reload"], sudo=sudo, log_path=log)
    disable = [
        u
        for u in previous.get("enable", [])
        if isinstance(u, str) and u in bundle.units and u not in bundle.enable
    ]
    if disable or bundle.enable:
        hook(host, "enable")
        commands = [["systemctl", "disable", *disable]] if disable else []
        if bundle.enable:
            commands.append(["systemctl", "enable", *bundle.enable])
        run(conn, "enable", chain(*commands), sudo=sudo, log_path=log)
    if bundle.start:
        hook(host, "start")
        # --no-block: a oneshot unit (eval, bench) must not hold the deployment for hours.
        run(
            conn,
            "start",
            ["systemctl", "start", "--no-block", *bundle.start],
            sudo=sudo,
            log_path=log,
        )

    hook(host, "record")
    state = {
        "fingerprint": bundle.fingerprint,
        "wheel": bundle.wheel_name,
        "wheel_sha256": bundle.wheel_sha256,
        "run_config_sha256": sha256_text(bundle.run_config_yaml),
        "units": sorted(bundle.units),
        "enable": list(bundle.enable),
        "start": list(bundle.start),
        "deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    part = layout.state_file + ".part"
    run(
        conn,
        "record",
        chain(
            ["sh", "-c", 'printf "%s\\n" "$1" > "$0"', part, json.dumps(state, sort_keys=True)],
            ["mv", "-f", part, layout.state_file],
            # Staged files of this and of any earlier, failed deploy go: one version stays.
            [
                "find",
                layout.incoming_dir,
                "-mindepth",
                "1",
                "-maxdepth",
                "1",
                "-exec",
                "rm",
                "-rf",
                "{}",
                "+",
            ],
        ),
        sudo=sudo,
        log_path=log,
    )


def undeploy(
    conn: fabric.Connection,
    layout: RemoteLayout,
    units: Sequence[str],
    *,
    sudo: bool,
    hook: StepHook | None = None,
) -> None:
    """Stops and disables the job's units, removes them and the deployed state.

    The venv, the wheel and the run config stay (the VM is usually deleted right after).
    """
    hook = hook or log_step
    host = host_name(conn)
    log = layout.deploy_log
    hook(host, "check")
    state = read_state(conn, layout)
    candidates = sorted({*units, *(u for u in state.get("units", []) if isinstance(u, str))})
    # Only units whose files exist: systemctl refuses to disable a unit it does not know.
    script = 'for f in "$@"; do if [ -e "$f" ]; then basename "$f"; fi; done'
    found = run(
        conn,
        "check",
        ["sh", "-c", script, "sh", *(posixpath.join(layout.unit_dir, u) for u in candidates)],
    )
    names = found.stdout.split()
    if names:
        hook(host, "stop")
        run(conn, "stop", ["systemctl", "disable", "--now", *names], sudo=sudo, log_path=log)
        hook(host, "units")
        run(
            conn,
            "units",
            chain(
                ["rm", "-f", *(posixpath.join(layout.unit_dir, u) for u in names)],
                ["systemctl", "daemon-reload"],
            ),
            sudo=sudo,
            log_path=log,
        )
    hook(host, "record")
    run(conn, "record", ["rm", "-f", layout.state_file], sudo=sudo, log_path=log)


def log_step(host: str, step: str) -> None:
    LOG.info("%s: %s", host, step)
