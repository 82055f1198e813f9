"""The release in the bucket: what a new VM installs at boot, so a recreated node trains without
anyone deploying to it.

`pulumi up` packs what the deployment installs on every worker (the workloads wheel, the run
config, the systemd units, which units to enable and start, and the bundle's fingerprint) into
one archive in the training bucket, `recovery/<node>-release.tar.gz`, next to the node's
recorded create request. The training VM's startup script (templates/startup/_release.sh.j2)
downloads it at boot and, when the worker does not already run that fingerprint, builds,
verifies and switches to it with the deploy's own scripts (infra/remote/release.py, taken here
from the argv lists that module builds, so the two never differ), installs and enables the units,
records `deployed.json` as a deploy would, and starts the job after ready. The next `pulumi up`
then finds the worker up to date (same fingerprint) and deploys nothing.

The archive holds nothing secret: the run config is names and paths (the Hugging Face token
stays in Secret Manager), as the metadata's startup script is.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pathlib
import tarfile
from typing import Any

from infra.config import model as config_mod
from infra.config import runconfig_render
from infra.remote import release as release_mod
from infra.remote.bundle import Bundle, sha256_text
from infra.vm.layout import WORKER, RemoteLayout

MANIFEST = "release.json"


def object_name(node: str) -> str:
    """The training bucket's object holding the node's release (runconfig_render's URI)."""
    return f"recovery/{node}-release.tar.gz"


def manifest(bundle: Bundle) -> dict[str, Any]:
    """What the startup script needs besides the files: the deploy's record of this bundle."""
    return {
        "fingerprint": bundle.fingerprint,
        "release": bundle.release,
        "wheel": bundle.wheel_name,
        "wheel_sha256": bundle.wheel_sha256,
        "run_config_sha256": sha256_text(bundle.run_config_yaml),
        "install_deps": bool(bundle.install_deps),
        "units": sorted(bundle.units),
        "enable": list(bundle.enable),
        "start": list(bundle.start),
    }


def archive_bytes(bundle: Bundle, wheel: pathlib.Path) -> bytes:
    """The release as a gzipped tar whose bytes depend on the bundle alone (sorted members,
    zeroed times and owners, gzip without a time): an unchanged bundle is no upload."""
    members: list[tuple[str, bytes, int]] = [
        (MANIFEST, (json.dumps(manifest(bundle), sort_keys=True) + "\n").encode(), 0o644),
        (bundle.wheel_name, wheel.read_bytes(), 0o644),
        ("run.yaml", bundle.run_config_yaml.encode(), 0o600),
        *((f"units/{name}", text.encode(), 0o644) for name, text in sorted(bundle.units.items())),
    ]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


# Archives of one node kept in the local directory: the one this run uploads and a few before it
# (a run under way elsewhere may still name one); older ones only fill the disk.
KEEP_ARCHIVES = 4


def write_archive(
    bundle: Bundle, wheel: pathlib.Path, out_dir: pathlib.Path, node: str
) -> pathlib.Path:
    """The archive as a file named by its content (what the BucketObject's FileAsset reads)."""
    data = archive_bytes(bundle, wheel)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"release-{node}-{hashlib.sha256(data).hexdigest()[:16]}.tar.gz"
    if not path.exists():
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(path)
    path.touch()
    older = sorted(
        (p for p in out_dir.glob(f"release-{node}-*.tar.gz") if p != path),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for stale in older[KEEP_ARCHIVES - 1 :]:
        stale.unlink(missing_ok=True)
    return path


def startup_context(
    cfg: config_mod.StackConfig, node: str, layout: RemoteLayout = WORKER
) -> dict[str, Any]:
    """The variables of templates/startup/_release.sh.j2: where the release is, the deploy's
    build, verify and switch scripts, and the worker paths they act on (`layout`: a worker's;
    tests use a temporary root)."""
    name = "0" * release_mod.NAME_LENGTH
    build = release_mod.build(layout, name, "wheel", install_deps=True)
    verify = release_mod.verify(layout, name, "fingerprint", [])
    switch = release_mod.switch(layout, name)
    return {
        "release_uri": runconfig_render.release_archive_uri(cfg, node),
        "release_build": build[2],
        "release_verify": verify[2],
        "release_import_check": verify[6],
        "release_switch": switch[2],
        "base_python": layout.python,
        "releases_dir": layout.releases_dir,
        "release_current": layout.current,
        "config_link": layout.config_path,
        "active_config": layout.active_config,
        "unit_dir": layout.unit_dir,
        "deployed_file": layout.state_file,
    }
