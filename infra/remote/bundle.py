"""What one deploy puts on a worker, and the fingerprint that says whether it is there already.

The deployed state of a worker is a small JSON file (`/var/lib/gemma4/deployed.json`) with the
fingerprint of what was deployed: equal fingerprints (and `current` pointing at that release)
mean nothing to do, so re-deploying the same thing costs one command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import zipfile
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Bundle:
    """What one deploy puts on every worker of a VM.

    Attributes:
        wheel_path: local path of the workloads wheel built from this checkout.
        wheel_sha256: content hash of the wheel (see infra.vm.workloads_wheel.wheel_hash).
        run_config_yaml: the run config, installed as the release's run.yaml (mode 0600).
        units: systemd unit file name -> rendered text.
        enable: units to enable (start at boot).
        start: units to (re)start after the install, in this order.
        install_deps: let pip install the wheel's missing dependencies into the release's
            venv (the startup script installs the pinned stack into the base venv; this only
            fills in what it did not).
    """

    wheel_path: str
    wheel_sha256: str
    run_config_yaml: str
    units: Mapping[str, str]
    enable: Sequence[str]
    start: Sequence[str]
    install_deps: bool = True

    @property
    def fingerprint(self) -> str:
        return fingerprint(
            self.wheel_sha256,
            self.run_config_yaml,
            self.units,
            self.enable,
            self.start,
            self.install_deps,
        )

    @property
    def wheel_name(self) -> str:
        return pathlib.Path(self.wheel_path).name

    @property
    def release(self) -> str:
        """The name of this bundle's release directory on a worker (see RemoteLayout)."""
        return self.fingerprint[:16]  # infra.remote.release.NAME_LENGTH

    def staged_bytes(self) -> int:
        """What the upload writes into the staging directory."""
        texts = [self.run_config_yaml, *self.units.values()]
        return pathlib.Path(self.wheel_path).stat().st_size + sum(len(t.encode()) for t in texts)

    def release_bytes(self) -> int:
        """About what a release of this bundle takes on disk: the unpacked wheel three times
        (sources, bytecode, file-system blocks of ~100 small files), a copy of the wheel, the
        config and units, and 1 MiB for the venv itself: 4.1 MB for today's 0.3 MB wheel (0.9 MB
        unpacked), whose release measures 3.1 MB (`du`, wheel copy and bytecode included).
        Dependencies that pip adds (install_deps) are not counted: the startup script installs
        them into the base venv."""
        with zipfile.ZipFile(self.wheel_path) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
        return 3 * unpacked + self.staged_bytes() + (1 << 20)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(
    wheel_sha256: str,
    run_config_yaml: str,
    units: Mapping[str, str],
    enable: Sequence[str],
    start: Sequence[str],
    install_deps: bool = True,
) -> str:
    """One hash over everything a deploy installs; equal fingerprints mean nothing to do."""
    payload = {
        "wheel": wheel_sha256,
        "run_config": sha256_text(run_config_yaml),
        "units": {name: sha256_text(text) for name, text in sorted(units.items())},
        "enable": list(enable),
        "start": list(start),
        "install_deps": bool(install_deps),
    }
    return sha256_text(json.dumps(payload, sort_keys=True))
