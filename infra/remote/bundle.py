"""What one deploy puts on a worker, and the fingerprint that says whether it is there already.

The deployed state of a worker is a small JSON file (`/var/lib/gemma4/deployed.json`) with the
fingerprint of what was deployed: equal fingerprints mean nothing to do, so re-deploying the same
thing costs one `cat`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Bundle:
    """What one deploy puts on every worker of a VM.

    Attributes:
        wheel_path: local path of the workloads wheel built from this checkout.
        wheel_sha256: content hash of the wheel (see infra.components.workloads.wheel_hash).
        run_config_yaml: the run config, installed as /etc/gemma4/run.yaml (mode 0600).
        units: systemd unit file name -> rendered text.
        enable: units to enable (start at boot).
        start: units to (re)start after the install, in this order.
        install_deps: let pip install the wheel's missing dependencies (the startup script
            installs the pinned stack; this only fills in what it did not).
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
