"""The release a recreated node installs at boot (infra/components/boot_release.py and
templates/startup/_release.sh.j2): the archive `pulumi up` pushes, restored by the startup
script's own functions with the deploy's scripts, into a worker root under a temporary
directory, with a fake gcloud and systemctl."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import sysconfig

from infra import remote
from infra.components import boot_release
from infra.config import stack_config
from infra.vm import templating
from infra.vm.workloads_wheel import Wheel
from tests.fixtures import pulumi_mocks
from tests.infra.conftest import make_bundle

FAKES = {
    "gcloud": """#!/bin/sh
# gcloud storage cp --quiet gs://BUCKET/PATH DEST: copies $GCS/BUCKET/PATH.
echo "gcloud $*" >>"$CALLS"
[ "$1 $2" = "storage cp" ] || exit 1
src=$4
cp "$GCS/${src#gs://}" "$5"
""",
    "systemctl": """#!/bin/sh
echo "systemctl $*" >>"$CALLS"
""",
}
HARNESS = """set -euo pipefail
log() { printf '%s\\n' "$*"; }
retry() { shift; "$@"; }
gcs_exists() { [ -e "$GCS/${1#gs://}" ]; }
TMPDIR=$WORK
STAGE_NOTE=""
"""


def _base_venv(root: pathlib.Path) -> pathlib.Path:
    """The worker's base venv (the startup script's), borrowing this test venv's packages."""
    venv = root / "opt/gemma4/venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = next(venv.glob("lib/python3*/site-packages"))
    (purelib / "_test_parent_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_a_new_worker_installs_the_pushed_release_at_boot_as_a_deploy_would(
    tmp_path: pathlib.Path, wheel: Wheel
) -> None:
    root, gcs, bin_dir, work = (tmp_path / d for d in ("root", "gcs", "bin", "work"))
    for d in (root, gcs, bin_dir, work):
        d.mkdir()
    layout = remote.RemoteLayout(str(root))
    bundle = make_bundle(root, wheel)
    _base_venv(root)
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    node = cfg.training_node_name
    context = boot_release.startup_context(cfg, node, layout)
    # What `pulumi up` uploads, where the startup script looks for it.
    archive = boot_release.write_archive(bundle, pathlib.Path(wheel.path), tmp_path / "out", node)
    uri = context["release_uri"]
    assert uri == f"gs://{cfg.training_bucket_name}/{boot_release.object_name(node)}"
    (gcs / uri.removeprefix("gs://")).parent.mkdir(parents=True)
    (gcs / uri.removeprefix("gs://")).write_bytes(archive.read_bytes())
    # The same bundle packs to the same bytes: an unchanged bundle is no upload.
    again = boot_release.write_archive(bundle, pathlib.Path(wheel.path), tmp_path / "b", node)
    assert again.name == archive.name and again.read_bytes() == archive.read_bytes()

    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "boot.sh"
    script.write_text(
        HARNESS
        + templating.render("startup/_release.sh.j2", **context)
        + '\nSTAGE_NOTE=""\nrestore_release\necho "note: $STAGE_NOTE"\nstart_release\n'
    )
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "GCS": str(gcs),
        "CALLS": str(calls),
        "WORK": str(work),
    }
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=work)
    assert run.returncode == 0, run.stdout + run.stderr

    release = pathlib.Path(layout.release_dir(bundle.release))
    assert (release / "COMPLETE").read_text().strip() == bundle.fingerprint
    assert pathlib.Path(layout.current).resolve() == release.resolve()
    assert pathlib.Path(layout.config_path).resolve() == (release / "run.yaml").resolve()
    for unit in bundle.units:
        assert (pathlib.Path(layout.unit_dir) / unit).read_text() == bundle.units[unit]
    deployed = json.loads(pathlib.Path(layout.state_file).read_text())
    assert deployed["fingerprint"] == bundle.fingerprint and deployed["release"] == bundle.release
    assert set(deployed) == {
        "fingerprint", "release", "previous", "wheel", "wheel_sha256", "run_config_sha256",
        "units", "enable", "start", "deployed_at",
    }  # fmt: skip
    systemctl = [line for line in calls.read_text().splitlines() if line.startswith("systemctl")]
    assert systemctl == [
        "systemctl daemon-reload",
        f"systemctl enable {' '.join(bundle.enable)}",
        f"systemctl start --no-block {' '.join(bundle.start)}",
    ]
    assert f"note: release {bundle.release} from {uri}" in run.stdout

    # The next boot (or a deploy's worker) finds it deployed and leaves it to the deploy.
    calls.unlink()
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=work)
    assert run.returncode == 0 and "note: deployed already" in run.stdout
    assert not calls.exists()


def test_without_a_release_in_the_bucket_the_boot_leaves_the_job_to_the_deploy(
    tmp_path: pathlib.Path,
) -> None:
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    layout = remote.RemoteLayout(str(tmp_path / "root"))
    context = boot_release.startup_context(cfg, cfg.training_node_name, layout)
    script = tmp_path / "boot.sh"
    script.write_text(
        HARNESS
        + templating.render("startup/_release.sh.j2", **context)
        + '\nrestore_release\necho "note: $STAGE_NOTE"\nstart_release\n'
    )
    env = {"PATH": "/usr/bin:/bin", "GCS": str(tmp_path), "WORK": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert "note: none in the bucket: the deploy installs the job" in run.stdout
