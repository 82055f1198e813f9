"""Where things live on a TPU worker: the one place that names the remote paths.

The startup scripts (infra/startup.py renders them) and the deploy steps both read these paths
from a RemoteLayout, so a path is written once. `root` prefixes every path: the tests run
several "workers" under temporary directories on one machine.
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
    def venv(self) -> str:
        return self.path("opt/gemma4/venv")

    @property
    def python(self) -> str:
        return posixpath.join(self.venv, "bin/python")

    @property
    def wheels_dir(self) -> str:
        return self.path("opt/gemma4/wheels")

    @property
    def config_dir(self) -> str:
        return self.path("etc/gemma4")

    @property
    def config_path(self) -> str:
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
        return posixpath.join(self.state_dir, "ready")

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
