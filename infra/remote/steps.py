"""The deploy steps on one worker: prepare a release, then activate it, or undeploy.

Every step is a plain function that takes a fabric Connection, so the Pulumi provider, the
operator commands and the tests all call the same code.

`prepare` builds the new version in its own release directory (infra.remote.release) while the
old job keeps running: upload, venv + wheel, config and units, then the import check that marks
it complete. `activate` stops the old job, switches `current` to the new release with one
rename, installs the units (they name only paths under `current`), starts them, records the
state and prunes old releases. The deployed state file is written after the switch and the
start, so a deploy that stops anywhere is redone next time; every step is idempotent, and a
release that was already built completely is reused (a rollback to the previous version
uploads and installs nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import time
from collections.abc import Callable, Sequence
from typing import Any

import fabric
import paramiko

import infra.remote.release as release
import infra.remote.space as space
from infra.remote.bundle import Bundle, sha256_text
from infra.remote.errors import RemoteError
from infra.remote.transport import CONNECTION_ERRORS, chain, drop, host_name, run
from infra.vm.layout import RemoteLayout
from workloads.common import logs

LOG = logs.get("deploy")

# Called as on_step(host, step) before each remote step; the Pulumi provider logs with it and
# the tests use it to inject faults at a known point.
StepHook = Callable[[str, str], None]


def read_state(conn: fabric.Connection, layout: RemoteLayout) -> dict[str, Any]:
    """The worker's deployed state ({} when nothing was deployed)."""
    script = 'cat "$0" 2>/dev/null || true'
    result = run(conn, "check", ["sh", "-c", script, layout.state_file])
    return _parse_state(result.stdout)


def _parse_state(text: str) -> dict[str, Any]:
    try:
        state = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}  # a damaged state file only means: deploy everything again
    return state if isinstance(state, dict) else {}


@dataclasses.dataclass(frozen=True)
class WorkerState:
    """What one 'check' command finds on a worker.

    Attributes:
        state: the deployed state file ({} when none or damaged).
        active: the release `current` points at (None when there is none).
        release_complete: the bundle's release directory holds a complete build (its marker).
        release_sound: complete, and its package imports from its venv, every file of it as
            pip installed it (a venv or a module deleted after the marker was written is not
            sound).
        release_configured: the release's run config and units are there as the bundle has
            them (a file deleted by hand is copied again).
        units_installed: the bundle's units are in the unit directory as the bundle has them.
        unsound: why the release is not sound (the check's last line), for the log.
        current_kind: what `current` is: "link", "none", or "other" (a directory or file put
            there by hand, which switch cannot replace).
        unit_files: the bundle's units that have a file in the unit directory.
        entries: what the releases and staging directories hold (`releases/<name>`,
            `incoming/<name>`).
    """

    state: dict[str, Any]
    active: str | None
    release_complete: bool
    unit_files: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    release_sound: bool = False
    current_kind: str = "link"
    release_configured: bool = False
    units_installed: bool = False
    unsound: str = ""

    def leftovers(self, bundle: Bundle) -> bool:
        """Whether an interrupted prune left something behind besides the active release and
        the one kept for a rollback."""
        keep = {f"releases/{name}" for name in (bundle.release, self.state.get("previous"))}
        return any(
            entry not in keep
            and (entry.startswith("incoming/") or release.is_release_name(entry.split("/")[-1]))
            for entry in self.entries
        )

    def up_to_date(self, bundle: Bundle) -> bool:
        """Whether the worker runs `bundle` already: recorded, active, its release complete
        with a package that imports and is whole, its run config and units there, and the units
        installed (not merely recorded: what a hand deleted is put back)."""
        return (
            self.state.get("fingerprint") == bundle.fingerprint
            and self.active == bundle.release
            and self.release_sound
            and self.release_configured
            and self.units_installed
            and self.current_kind == "link"
        )

    def rollback_candidates(self, bundle: Bundle) -> list[str]:
        """The releases a deploy of `bundle` may keep for a rollback, best first: the active
        one, the recorded one (a deploy that stopped after its switch made the new one active),
        the recorded previous one."""
        names = [self.active, self.state.get("release"), self.state.get("previous")]
        found: list[str] = []
        for name in names:
            if isinstance(name, str) and name and name != bundle.release and name not in found:
                found.append(name)
        return found

    @property
    def units(self) -> list[str]:
        """The units of the recorded deployment."""
        return [u for u in self.state.get("units", []) if isinstance(u, str)]


# The run config is root's and 0600 on the VMs while this runs as the login user: its size (a
# stat, no read) stands for it; a change made through a deploy changes the fingerprint anyway.
_CHECK = r"""state=$1 current=$2 marker=$3 unit_dir=$4 releases=$5 incoming=$6 check=$7
shift 7
target=$(readlink "$current" 2>/dev/null || true)
printf 'active=%s\n' "${target##*/}"
if [ -L "$current" ]; then echo current=link
elif [ -e "$current" ]; then echo current=other
else echo current=none; fi
if [ -e "$marker" ]; then
    echo complete=1
    release=${marker%/*}
    if why=$("$release/venv/bin/python" -c "$check" 2>&1); then
        echo sound=1
    else
        printf 'unsound=%s\n' "$(printf '%s\n' "$why" | tail -n 1)"
    fi
    printf 'config_size=%s\n' "$(stat -c %s "$release/run.yaml" 2>/dev/null)"
    for unit in "$@"; do
        sum=$(sha256sum "$release/units/$unit" 2>/dev/null) || sum=
        printf 'release_unit=%s=%s\n' "$unit" "${sum%% *}"
    done
else
    echo complete=0
fi
for entry in "$releases"/* "$releases"/.[!.]* "$incoming"/* "$incoming"/.[!.]*; do
    if [ -e "$entry" ]; then printf 'entry=%s\n' "${entry#"${entry%/*/*}/"}"; fi
done
for unit in "$@"; do
    if [ -e "$unit_dir/$unit" ]; then
        printf 'unit=%s\n' "$unit"
        sum=$(sha256sum "$unit_dir/$unit" 2>/dev/null) || sum=
        printf 'installed_unit=%s=%s\n' "$unit" "${sum%% *}"
    fi
done
printf 'state='
cat "$state" 2>/dev/null | tr -d '\n' || true
echo
"""


# A unit the recorded state names may have lost its file to a deploy killed in its units step:
# systemd no longer knows it after a reload, and `systemctl stop` or `disable` would fail on it
# at every later deploy. Such a unit is left out (stop: unless systemd still runs it).
_STOP = r"""unit_dir=$1
shift
for unit in "$@"; do
    shift
    if [ -e "$unit_dir/$unit" ] || systemctl is-active --quiet "$unit"; then set -- "$@" "$unit"; fi
done
if [ "$#" -gt 0 ]; then systemctl stop "$@"; fi
"""

_REMOVE_UNITS = r"""set -e
unit_dir=$1
shift
for unit in "$@"; do
    if [ -e "$unit_dir/$unit" ]; then systemctl disable "$unit"; rm -f -- "$unit_dir/$unit"; fi
done
"""


def read_worker(conn: fabric.Connection, layout: RemoteLayout, bundle: Bundle) -> WorkerState:
    """The worker's state for deploying `bundle`: the one 'check' command of a deploy."""
    state_text = ""
    result = run(
        conn,
        "check",
        [
            "sh",
            "-c",
            _CHECK,
            "sh",
            layout.state_file,
            layout.current,
            posixpath.join(layout.release_dir(bundle.release), release.MARKER),
            layout.unit_dir,
            layout.releases_dir,
            layout.incoming_dir,
            release.import_check(),
            *sorted(bundle.units),
        ],
    )
    active, complete, units, entries = None, False, [], []
    sound, current_kind, unsound, config_size = False, "link", "", ""
    sums: dict[str, dict[str, str]] = {"release_unit": {}, "installed_unit": {}}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key == "active":
            active = value or None
        elif key == "complete":
            complete = value == "1"
        elif key == "sound":
            sound = value == "1"
        elif key == "unsound":
            unsound = value
        elif key == "config_size":
            config_size = value
        elif key in sums:
            name, _, digest = value.partition("=")
            sums[key][name] = digest
        elif key == "current":
            current_kind = value
        elif key == "unit":
            units.append(value)
        elif key == "entry":
            entries.append(value)
        elif key == "state":
            state_text = value
    wanted = {name: sha256_text(text) for name, text in bundle.units.items()}
    return WorkerState(
        _parse_state(state_text),
        active,
        complete,
        tuple(units),
        tuple(entries),
        release_sound=sound,
        current_kind=current_kind,
        release_configured=(
            config_size == str(len(bundle.run_config_yaml.encode()))
            and sums["release_unit"] == wanted
        ),
        units_installed=sums["installed_unit"] == wanted,
        unsound=unsound,
    )


def _replace(src: str, dest: str, mode: str) -> list[list[str]]:
    """Copies src over dest atomically (write next to it, then rename) with the given mode."""
    return [["install", "-m", mode, src, dest + ".part"], ["mv", "-f", dest + ".part", dest]]


def _remove_entries(directory: str, *keep: str) -> list[str]:
    """Removes what is in `directory` but the entries named `keep`."""
    spare = [arg for name in keep for arg in ("!", "-name", name)]
    return [
        *("find", directory, "-mindepth", "1", "-maxdepth", "1"),
        *spare,
        *("-exec", "rm", "-rf", "{}", "+"),
    ]


def _step(
    conn: fabric.Connection,
    step: str,
    argv: list[str],
    *,
    sudo: bool,
    log: str,
    path: str,
    needed: int = 0,
) -> None:
    """Runs one logged step; a failure for want of space on `path` becomes one DiskFull line."""
    try:
        run(conn, step, argv, sudo=sudo, log_path=log)
    except RemoteError as err:
        explained = space.explain(conn, err, path, needed, sudo=sudo)
        if explained is err:
            raise
        raise explained from err


def prepare(
    conn: fabric.Connection,
    bundle: Bundle,
    layout: RemoteLayout,
    worker: WorkerState,
    *,
    sudo: bool,
    hook: StepHook,
) -> str:
    """Builds the bundle's release on one worker and verifies it; nothing that runs is touched.

    Returns the release directory.

    Raises:
        RemoteError: a step failed (DiskFull when for want of space).
    """
    host = host_name(conn)
    log = layout.deploy_log
    stage = posixpath.join(layout.incoming_dir, bundle.release)
    target = layout.release_dir(bundle.release)
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
                layout.app_dir,
                layout.releases_dir,
                layout.unit_dir,
            ],
            # 0755: login shells read the startup script's env file there; run.yaml is 0600.
            ["install", "-d", "-m", "0755", layout.config_dir],
            # Owned by the login user, so SFTP can write there without root.
            ["install", "-d", "-m", "0700", "-o", str(conn.user), layout.incoming_dir, stage],
        ),
        sudo=sudo,
    )

    if worker.current_kind == "other":
        _move_current_aside(conn, layout, sudo=sudo, hook=hook)

    # What interrupted deploys left (half-built releases, other staging directories) goes
    # before the space is measured; the active release, the recorded previous one and a
    # complete build of this bundle stay.
    hook(host, "clean")
    keep = [bundle.release, *worker.rollback_candidates(bundle)]
    run(
        conn,
        "clean",
        chain(release.prune(layout, keep), _remove_entries(layout.incoming_dir, bundle.release)),
        sudo=sudo,
        log_path=log,
    )

    if worker.release_complete and not worker.release_sound:
        # Marked complete, but its package no longer imports or lost a file (its venv or a
        # module was deleted): built again, even while active (release.build rebuilds an
        # unmarked active release).
        LOG.warning(
            f"{host}: release {bundle.release} is marked complete but its package is not whole "
            f"or does not import from its venv ({worker.unsound or 'no reason given'}): "
            "reinstalling it"
        )
        hook(host, "unmark")
        run(conn, "unmark", release.unmark(layout, bundle.release), sudo=sudo, log_path=log)

    if not worker.release_sound:
        hook(host, "space")
        space.check(
            conn,
            {stage: bundle.staged_bytes(), layout.releases_dir: bundle.release_bytes()},
            sudo=sudo,
        )
        _upload(conn, bundle, stage, sudo=sudo, hook=hook)

        hook(host, "install")
        _step(
            conn,
            "install",
            release.build(
                layout,
                bundle.release,
                posixpath.join(stage, bundle.wheel_name),
                install_deps=bundle.install_deps,
            ),
            sudo=sudo,
            log=log,
            path=layout.releases_dir,
            needed=bundle.release_bytes(),
        )
    elif not worker.release_configured:
        # The package is whole but a run config or unit of the release went missing: only they
        # travel again.
        _upload(conn, bundle, stage, sudo=sudo, hook=hook, wheel=False)

    if not worker.release_sound or not worker.release_configured:
        hook(host, "config")
        units_dir = posixpath.join(target, "units")
        commands = [
            ["install", "-m", "0600", posixpath.join(stage, "run.yaml"), target + "/run.yaml"],
            ["install", "-d", "-m", "0755", units_dir],
        ]
        for name in sorted(bundle.units):
            commands.append(
                ["install", "-m", "0644", posixpath.join(stage, name), f"{units_dir}/{name}"]
            )
        _step(
            conn,
            "config",
            chain(*commands),
            sudo=sudo,
            log=log,
            path=layout.releases_dir,
            needed=bundle.staged_bytes(),
        )

    hook(host, "verify")
    _step(
        conn,
        "verify",
        release.verify(layout, bundle.release, bundle.fingerprint, sorted(bundle.units)),
        sudo=sudo,
        log=log,
        path=layout.releases_dir,
        needed=bundle.release_bytes(),
    )
    return target


def _move_current_aside(
    conn: fabric.Connection, layout: RemoteLayout, *, sudo: bool, hook: StepHook
) -> None:
    """`current` is a directory or file, not the release symlink: switch could not replace it
    (after the old job was stopped). Moved aside now, before anything is stopped, and kept."""
    host = host_name(conn)
    suffix = "moved-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    hook(host, "current")
    run(conn, "current", release.move_aside(layout.current, suffix), sudo=sudo)
    LOG.warning(
        f"{host}: {layout.current} was not the release symlink (a directory or file put there): "
        f"moved aside to {layout.current}.{suffix}"
    )


def _upload(
    conn: fabric.Connection,
    bundle: Bundle,
    stage: str,
    *,
    sudo: bool,
    hook: StepHook,
    wheel: bool = True,
) -> None:
    """Uploads the wheel (unless `wheel` is false), config and units to the staging directory
    and checks the wheel."""
    host = host_name(conn)
    hook(host, "upload")
    try:
        sftp = conn.client.open_sftp()
    except CONNECTION_ERRORS as exc:
        drop(conn)
        raise RemoteError(host, "upload", None, None, f"{type(exc).__name__}: {exc}") from exc
    try:
        if wheel:
            _put_file(sftp, bundle.wheel_path, posixpath.join(stage, bundle.wheel_name), 0o644)
        _put_bytes(sftp, bundle.run_config_yaml.encode(), posixpath.join(stage, "run.yaml"), 0o600)
        for name, text in sorted(bundle.units.items()):
            _put_bytes(sftp, text.encode(), posixpath.join(stage, name), 0o644)
    except (*CONNECTION_ERRORS, OSError) as exc:
        drop(conn)
        err = RemoteError(host, "upload", None, None, f"{type(exc).__name__}: {exc}")
        # SFTP reports ENOSPC as a bare "Failure": the staging disk's free space tells.
        why = space.explain(conn, err, stage, bundle.staged_bytes(), sudo=sudo, by_free_space=True)
        raise why from exc
    finally:
        try:
            sftp.close()
        except Exception:
            LOG.debug("closing sftp on %s failed", host, exc_info=True)

    if not wheel:
        return
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
    worker: WorkerState,
    *,
    sudo: bool,
    hook: StepHook,
) -> None:
    """Stops the old job, switches `current` to the prepared release, installs and starts the
    units, records the state and prunes old releases.

    A kill anywhere leaves a worker the next deploy finishes: before the switch the old release
    is active (its units may be stopped; the next deploy starts them as the new ones); after it,
    the units on disk name `current`, which is complete.
    """
    host = host_name(conn)
    log = layout.deploy_log
    target = layout.release_dir(bundle.release)
    old_units = worker.units
    # Every unit of ours that has a file: one started by a deploy that stopped before its record
    # may be running too, and no old process may go on running while `current` changes.
    running = sorted({*old_units, *worker.unit_files})

    if running:
        hook(host, "stop")
        stop = ["sh", "-c", _STOP, "sh", layout.unit_dir, *running]
        run(conn, "stop", stop, sudo=sudo, log_path=log)

    hook(host, "switch")
    switch = release.switch(layout, bundle.release)
    _step(conn, "switch", switch, sudo=sudo, log=log, path=layout.app_dir)

    hook(host, "units")
    commands = []
    removed = [u for u in old_units if u not in bundle.units]
    if removed:
        commands.append(["sh", "-c", _REMOVE_UNITS, "sh", layout.unit_dir, *removed])
    for name in sorted(bundle.units):
        commands += _replace(
            posixpath.join(target, "units", name), posixpath.join(layout.unit_dir, name), "0644"
        )
    _step(conn, "units", chain(*commands), sudo=sudo, log=log, path=layout.unit_dir)

    hook(host, "daemon-reload")
    run(conn, "daemon-reload", ["systemctl", "daemon-reload"], sudo=sudo, log_path=log)
    disable = [
        u
        for u in worker.state.get("enable", [])
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
    previous = next(iter(worker.rollback_candidates(bundle)), None)
    state = {
        "fingerprint": bundle.fingerprint,
        "release": bundle.release,
        "previous": previous,
        "wheel": bundle.wheel_name,
        "wheel_sha256": bundle.wheel_sha256,
        "run_config_sha256": sha256_text(bundle.run_config_yaml),
        "units": sorted(bundle.units),
        "enable": list(bundle.enable),
        "start": list(bundle.start),
        "deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    part = layout.state_file + ".part"
    _step(
        conn,
        "record",
        chain(
            ["sh", "-c", 'printf "%s\\n" "$1" > "$0"', part, json.dumps(state, sort_keys=True)],
            ["mv", "-f", part, layout.state_file],
        ),
        sudo=sudo,
        log=log,
        path=layout.state_dir,
    )

    prune(conn, layout, [bundle.release, *([previous] if previous else [])], sudo=sudo, hook=hook)


def prune(
    conn: fabric.Connection,
    layout: RemoteLayout,
    keep: Sequence[str],
    *,
    sudo: bool,
    hook: StepHook,
) -> None:
    """Removes staged files and every release but the active one and the complete ones named
    in `keep` (one version back stays for a rollback)."""
    hook(host_name(conn), "prune")
    run(
        conn,
        "prune",
        chain(
            release.prune(layout, keep),
            _remove_entries(layout.incoming_dir),
            ["rm", "-rf", layout.legacy_wheels_dir],
        ),
        sudo=sudo,
        log_path=layout.deploy_log,
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

    The releases and `current` stay (the VM is usually deleted right after).
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
