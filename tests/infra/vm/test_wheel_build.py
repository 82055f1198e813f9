"""The project's wheel is built without pip or setuptools, the same bytes from the same source.

Compared with setuptools' own build of this checkout: the same members and the same
requirements, so pip installs exactly what it would have installed from a `pip wheel` build.
"""

from __future__ import annotations

import email.parser
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement

from infra.vm import source_archive, wheel_build, workloads_wheel

REPO = pathlib.Path(__file__).resolve().parents[3]


def _copy_sources(dest: pathlib.Path) -> pathlib.Path:
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    for package in ("workloads", "infra"):
        shutil.copytree(
            REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    return dest


def _metadata(wheel: pathlib.Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_same_source_gives_the_same_bytes(tmp_path: pathlib.Path) -> None:
    a = wheel_build.build(REPO, tmp_path / "a")
    copy = _copy_sources(tmp_path / "copy")
    # a later mtime
    os.utime(copy / "workloads" / "cli" / "__init__.py", (1_900_000_000, 1_900_000_000))
    b = wheel_build.build(copy, tmp_path / "b")
    assert a.name == b.name == "gemma4_tpu-0.1.0-py3-none-any.whl"
    assert a.read_bytes() == b.read_bytes()
    with zipfile.ZipFile(a) as archive:
        names = archive.namelist()
        assert names[-1].endswith(".dist-info/RECORD")
        assert {i.date_time for i in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert archive.testzip() is None


def test_a_changed_file_changes_the_wheel(tmp_path: pathlib.Path) -> None:
    copy = _copy_sources(tmp_path / "copy")
    before = workloads_wheel.wheel_hash(wheel_build.build(copy, tmp_path / "a"))
    (copy / "workloads" / "common" / "errors.py").write_text(
        (copy / "workloads" / "common" / "errors.py").read_text() + "\n# edited\n"
    )
    assert workloads_wheel.wheel_hash(wheel_build.build(copy, tmp_path / "b")) != before


def test_members_and_requirements_match_a_setuptools_build(tmp_path: pathlib.Path) -> None:
    ours = wheel_build.build(REPO, tmp_path / "ours")
    copy = _copy_sources(tmp_path / "copy")  # setuptools writes build/ and *.egg-info into it
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"),
            *("--disable-pip-version-check", "-w", str(tmp_path / "theirs"), str(copy)),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = next((tmp_path / "theirs").glob("*.whl"))
    assert ours.name == theirs.name
    with zipfile.ZipFile(ours) as a, zipfile.ZipFile(theirs) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
        for name in a.namelist():
            if ".dist-info/" not in name:
                assert a.read(name) == b.read(name), name
    mine, setuptools_ = _metadata(ours), _metadata(theirs)
    for field in (
        "Metadata-Version",
        "Name",
        "Version",
        "Summary",
        "Requires-Python",
        "License",
        "License-Expression",
    ):
        assert mine[field] == setuptools_[field], field
    assert mine.get_all("License-File") == setuptools_.get_all("License-File") == ["LICENSE"]
    assert mine["License-Expression"] == "Apache-2.0"
    assert sorted(mine.get_all("Provides-Extra")) == sorted(setuptools_.get_all("Provides-Extra"))
    assert {str(Requirement(r)) for r in mine.get_all("Requires-Dist")} == {
        str(Requirement(r)) for r in setuptools_.get_all("Requires-Dist")
    }
    assert mine.get_payload().strip() == setuptools_.get_payload().strip()  # the README


def test_only_the_named_top_level_packages(tmp_path: pathlib.Path) -> None:
    full = wheel_build.members(REPO)
    vm = wheel_build.members(REPO, top_level=("workloads",))
    assert any(name.startswith("infra/") for name, _, _ in full)
    assert not any(name.startswith("infra/") for name, _, _ in vm)
    assert {n for n, _, _ in full if n.startswith("workloads/")} == {
        n for n, _, _ in vm if n.startswith("workloads/")
    }
    with pytest.raises(wheel_build.WheelBuildError, match=r"^.*: tests: not a package"):
        wheel_build.members(REPO, top_level=("workloads", "tests"))


def test_pip_installs_it_with_its_entry_point(tmp_path: pathlib.Path) -> None:
    wheel = wheel_build.build(REPO, tmp_path / "w")
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q"),
            *("--disable-pip-version-check", "--target", str(target), str(wheel)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "workloads" / "contract" / "runconfig.py").is_file()
    assert (target / "bin" / "gemma4-workloads").is_file()
    assert os.access(target / "bin" / "gemma4-workloads", os.X_OK)


def test_a_pyproject_key_it_does_not_implement_is_refused(tmp_path: pathlib.Path) -> None:
    copy = _copy_sources(tmp_path / "copy")
    text = (copy / "pyproject.toml").read_text()
    (copy / "pyproject.toml").write_text(
        text.replace('readme = "README.md"', 'readme = "README.md"\ndynamic = ["classifiers"]')
    )
    with pytest.raises(workloads_wheel.WheelBuildError) as err:
        workloads_wheel.build_wheel(copy, tmp_path / "cache")
    message = str(err.value)
    assert "dynamic" in message and "\n" not in message


def test_a_missing_readme_is_named(tmp_path: pathlib.Path) -> None:
    copy = _copy_sources(tmp_path / "copy")
    (copy / "README.md").unlink()
    with pytest.raises(workloads_wheel.WheelBuildError, match=r"README\.md"):
        workloads_wheel.build_wheel(copy, tmp_path / "cache")


def test_clone_and_recovery_archive_give_the_same_fingerprint(tmp_path: pathlib.Path) -> None:
    """The controller builds from the source archive; the laptop from its clone (with files the
    archive leaves out: tests, docs, .git). Both wheels hash the same."""
    clone = workloads_wheel.build_wheel(REPO, tmp_path / "clone-cache")
    unpacked = tmp_path / "archive"
    with tarfile.open(fileobj=io.BytesIO(source_archive.archive_bytes("dev")), mode="r") as tar:
        tar.extractall(unpacked, filter="data")
    assert not (unpacked / "tests").exists()
    from_archive = workloads_wheel.build_wheel(unpacked, tmp_path / "archive-cache")
    assert from_archive.sha256 == clone.sha256
    assert pathlib.Path(from_archive.path).read_bytes() == pathlib.Path(clone.path).read_bytes()
