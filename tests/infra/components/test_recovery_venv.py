"""A venv like the recovery controller's runs the program from the source archive, and its wheel
matches the laptop's.

The controller (templates/startup/recover.sh.j2) unpacks the source archive and makes a venv
with Debian 12's `python3 -m venv`: an old pip and setuptools (23.0.1, 66.1.1) and no `wheel`,
which cannot build this project with setuptools (pyproject pins a newer setuptools exactly). It
now runs only `infra.ops recover` there (the `recover` extra), no longer the program; this test
still shows that such a venv (this Python's ensurepip: pip 23.2.1, setuptools 65.5.0, no wheel;
the installed third-party packages reached through a .pth file placed after the venv's own
site-packages, so the old setuptools is the one that imports) runs the program under mocks from
the unpacked archive and declares the clone's wheel: the archive is a whole, buildable copy of
the program.
"""

from __future__ import annotations

import io
import json
import pathlib
import site
import subprocess
import sys
import tarfile

import pytest

from infra.vm import source_archive, workloads_wheel

REPO = pathlib.Path(__file__).resolve().parents[3]
STACK = "prod"

SCRIPT = """
import importlib.util, json, pathlib, sys
import setuptools
import infra
from tests.fixtures import pulumi_mocks

mapping = pulumi_mocks.stack_file_config(sys.argv[1])
rec = pulumi_mocks.run_program(sys.argv[1], mapping, hf_token="hf_TEST_ONLY_0123456789")
deployments = rec.of_type("pulumi-python:dynamic/gemma4:SshDeployment")
print(json.dumps({
    "infra": infra.__file__,
    "setuptools": setuptools.__version__,
    "has_wheel": importlib.util.find_spec("wheel") is not None,
    "wheels": {d.name: d.inputs["wheel_sha256"] for d in deployments},
}))
"""


def _controller_venv(path: pathlib.Path) -> pathlib.Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
    python = path / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The main venv's packages (pulumi, fabric, ...) after the venv's own old pip/setuptools.
    (pathlib.Path(own) / "zz-main-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


@pytest.mark.slow
def test_the_controllers_venv_runs_the_program_and_builds_the_laptops_wheel(
    tmp_path: pathlib.Path,
) -> None:
    python = _controller_venv(tmp_path / "venv")
    src = tmp_path / "src"
    with tarfile.open(fileobj=io.BytesIO(source_archive.archive_bytes(STACK)), mode="r") as tar:
        tar.extractall(src, filter="data")
    proc = subprocess.run(
        [str(python), "-c", SCRIPT, STACK],
        cwd=src,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": f"{src}:{REPO}"},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["infra"].startswith(str(src))  # the archive's program, not this checkout's
    major, minor = (int(x) for x in result["setuptools"].split(".")[:2])
    assert (major, minor) < (69, 0) and not result["has_wheel"]  # what broke `pip wheel` there
    laptop = workloads_wheel.build_wheel(REPO, tmp_path / "laptop-cache")
    assert set(result["wheels"]) == {"train-deploy-workloads", "serve-deploy-workloads"}
    assert set(result["wheels"].values()) == {laptop.sha256}
