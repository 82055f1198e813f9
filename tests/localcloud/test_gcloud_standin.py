"""The VMs' `gcloud` stand-in against the GCS protocol server: the storage commands the startup
scripts run (cp, ls, rsync with --exclude and --delete-unmatched-destination-objects) and
secrets, with gcloud's exit statuses."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

GCLOUD = pathlib.Path(__file__).resolve().parents[2] / "localcloud" / "guest" / "gcloud"


@pytest.fixture
def gcloud(gcs_bucket, tmp_path):
    def run(*args: str, stdin: bytes = b"", check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, str(GCLOUD), *args],
            input=stdin,
            capture_output=True,
            env={**os.environ, "LOCALCLOUD_GCLOUD_LOG": str(tmp_path / "gcloud.log")},
            check=False,
        )
        if check:
            assert proc.returncode == 0, proc.stderr.decode()
        return proc

    return run


def test_cp_ls_and_rsync_round_trip(gcloud, gcs_bucket, tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "w.safetensors").write_bytes(b"\0" * 1000)
    (src / "sub" / "x.txt").write_text("x")
    gcloud("storage", "rsync", "--recursive", str(src), f"{gcs_bucket}/m")
    listed = gcloud("storage", "ls", f"{gcs_bucket}/m").stdout.decode().split()
    assert sorted(listed) == sorted(
        f"{gcs_bucket}/m/{n}" for n in ("config.json", "w.safetensors", "sub/x.txt")
    )
    small = tmp_path / "small"
    gcloud(
        "storage",
        "rsync",
        "--recursive",
        r"--exclude=.*\.safetensors$",
        f"{gcs_bucket}/m",
        str(small),
    )
    assert sorted(p.name for p in small.rglob("*") if p.is_file()) == ["config.json", "x.txt"]
    gcloud("storage", "cp", "--quiet", "-", f"{gcs_bucket}/marker", stdin=b"done\n")
    out = tmp_path / "marker"
    gcloud("storage", "cp", f"{gcs_bucket}/marker", str(out))
    assert out.read_text() == "done\n"


def test_missing_objects_fail_as_gcloud_does(gcloud, gcs_bucket, tmp_path):
    assert gcloud("storage", "ls", f"{gcs_bucket}/nothing", check=False).returncode == 1
    missing = gcloud("storage", "cp", f"{gcs_bucket}/nothing", str(tmp_path / "x"), check=False)
    assert missing.returncode == 1 and b"matched no objects" in missing.stderr


def test_delete_unmatched_destination_objects(gcloud, gcs_bucket, tmp_path):
    src = tmp_path / "a"
    src.mkdir()
    (src / "keep").write_text("1")
    gcloud("storage", "cp", "-", f"{gcs_bucket}/d/stale", stdin=b"old")
    gcloud(
        "storage",
        "rsync",
        "--recursive",
        "--delete-unmatched-destination-objects",
        str(src),
        f"{gcs_bucket}/d",
    )
    assert gcloud("storage", "ls", f"{gcs_bucket}/d").stdout.decode().split() == [
        f"{gcs_bucket}/d/keep"
    ]


def test_an_unknown_command_is_one_line_and_status_2(gcloud):
    proc = gcloud("compute", "instances", "list", check=False)
    assert proc.returncode == 2
    assert proc.stderr.decode().count("\n") == 1 and "does not implement" in proc.stderr.decode()
