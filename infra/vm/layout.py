"""Where things live on a TPU worker: the one place that names the remote paths.

The startup scripts (infra/vm/startup.py renders them) and the deploy steps both read these paths
from a RemoteLayout, so a path is written once. `root` prefixes every path: the tests run
several "workers" under temporary directories on one machine.

A deployed version lives in its own directory, `/opt/gemma4/releases/<release>/` (the first 16
hex digits of the bundle's fingerprint): `venv/` (the workloads package, layered on the base venv
the startup script installs), `run.yaml`, `units/` and the installed wheel, and a `COMPLETE`
marker written last, once the package imports and reads its run config. `/opt/gemma4/current`
is a relative symlink to the active release, replaced with one rename(2); the systemd units
name only paths under `current`, so whatever they start is a complete version.
"""

from __future__ import annotations

import dataclasses
import posixpath


@dataclasses.dataclass(frozen=True)
class RemoteLayout:
    """Where things live on a worker. `root` prefixes every path (tests use a temp dir)."""

    root: str = "/"

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    @property
    def app_dir(self) -> str:
        return self.path("opt/gemma4")

    @property
    def venv(self) -> str:
        """The base venv with the pinned stack (the startup script's); releases layer on it."""
        return posixpath.join(self.app_dir, "venv")

    @property
    def python(self) -> str:
        """The base venv's interpreter: it creates each release's venv."""
        return posixpath.join(self.venv, "bin/python")

    @property
    def legacy_wheels_dir(self) -> str:
        """Where deploys before per-version releases kept the installed wheel (pruned)."""
        return posixpath.join(self.app_dir, "wheels")

    @property
    def releases_dir(self) -> str:
        return posixpath.join(self.app_dir, "releases")

    def release_dir(self, release: str) -> str:
        return posixpath.join(self.releases_dir, release)

    @property
    def current(self) -> str:
        """Symlink to the active release (target `releases/<release>`, relative)."""
        return posixpath.join(self.app_dir, "current")

    @property
    def active_python(self) -> str:
        """The interpreter the units run: the active release's venv."""
        return posixpath.join(self.current, "venv/bin/python")

    @property
    def active_config(self) -> str:
        """The run config the units read: the active release's."""
        return posixpath.join(self.current, "run.yaml")

    @property
    def config_dir(self) -> str:
        return self.path("etc/gemma4")

    @property
    def config_path(self) -> str:
        """Stable name of the active run config for people and $GEMMA4_RUN_CONFIG: a symlink
        to `active_config`."""
        return posixpath.join(self.config_dir, "run.yaml")

    @property
    def env_file(self) -> str:
        """Environment for the units, written by the startup script."""
        return posixpath.join(self.config_dir, "env")

    @property
    def unit_dir(self) -> str:
        return self.path("etc/systemd/system")

    @property
    def state_dir(self) -> str:
        return self.path("var/lib/gemma4")

    @property
    def ready_marker(self) -> str:
        """Written by the startup script once the host can run the job. In RAM (/run, a tmpfs)
        so that it is never left over from an earlier boot: the trainer's unit waits for it
        alone, not for the startup script's unit, which lasts until the weights are staged."""
        return self.path("run/gemma4/ready")

    @property
    def boot_failed_marker(self) -> str:
        """Written by the startup script when a boot stops before ready: the stage and the log
        (one line). The deploy's readiness wait reads it instead of waiting out its timeout."""
        return posixpath.join(self.state_dir, "boot-failed")

    @property
    def boot_failed_note(self) -> str:
        """The same line in RAM (/run, a tmpfs): written first, so a boot disk full to the
        last byte, where the marker above cannot be written, still ends the wait in seconds.
        Gone at the next boot, as the failure it describes."""
        return self.path("run/gemma4/boot-failed")

    @property
    def stages_file(self) -> str:
        """Stage records of every boot (workloads/common/stage_records.py): the startup script's,
        the uploads' after ready and the trainer's, one JSON line each."""
        return posixpath.join(self.state_dir, "stages.jsonl")

    @property
    def startup_script_copy(self) -> str:
        """The startup script as the last boot ran it: the background uploads run it again."""
        return posixpath.join(self.state_dir, "startup.sh")

    @property
    def state_file(self) -> str:
        return posixpath.join(self.state_dir, "deployed.json")

    @property
    def incoming_dir(self) -> str:
        return posixpath.join(self.state_dir, "incoming")

    @property
    def log_dir(self) -> str:
        return self.path("var/log")

    @property
    def startup_log(self) -> str:
        return posixpath.join(self.log_dir, "gemma4-startup.log")

    @property
    def deploy_log(self) -> str:
        return posixpath.join(self.log_dir, "gemma4-deploy.log")


#: The layout of a real worker (paths from /).
WORKER = RemoteLayout()
