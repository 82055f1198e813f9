"""The wheel of this checkout: built once per source state, hashed by content."""

from __future__ import annotations

import pathlib
import shutil
import time
import zipfile

from infra.vm import workloads_wheel

REPO = pathlib.Path(__file__).resolve().parents[3]


def _zip(path: pathlib.Path, members: dict[str, bytes], date: tuple[int, ...]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=date), data)  # type: ignore[arg-type]


def test_wheel_hash_ignores_timestamps_and_record(tmp_path: pathlib.Path) -> None:
    base = {"workloads/__init__.py": b"x = 1\n", "p-0.1.dist-info/RECORD": b"a"}
    _zip(tmp_path / "a.whl", base, (2020, 1, 1, 0, 0, 0))
    _zip(tmp_path / "b.whl", {**base, "p-0.1.dist-info/RECORD": b"b"}, (2024, 5, 5, 5, 5, 4))
    _zip(tmp_path / "c.whl", {**base, "workloads/__init__.py": b"x = 2\n"}, (2020, 1, 1, 0, 0, 0))
    a, b, c = (workloads_wheel.wheel_hash(tmp_path / f"{n}.whl") for n in "abc")
    assert a == b
    assert a != c


def test_build_is_cached_by_source_hash(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src)
    for package in ("workloads", "infra"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"

    first = workloads_wheel.build_wheel(src, cache)
    assert pathlib.Path(first.path).name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(first.path) as archive:
        assert "workloads/contract/runconfig.py" in archive.namelist()
    started = time.monotonic()
    assert workloads_wheel.build_wheel(src, cache) == first  # same sources: the cached wheel
    assert time.monotonic() - started < 1.0

    # An edit anywhere in the packaged sources is a new cache key (a new build next time); an
    # edit of the Pulumi program is not (infra/ is not in the wheel).
    before = workloads_wheel.source_hash(src)
    (src / "infra" / "__init__.py").write_text('"""Changed docstring."""\n')
    assert workloads_wheel.source_hash(src) == before
    (src / "workloads" / "__init__.py").write_text('"""Changed docstring."""\n')
    assert workloads_wheel.source_hash(src) != before


def test_the_vm_wheel_holds_workloads_only(tmp_path: pathlib.Path) -> None:
    """The VMs never import infra/: the wheel pushed to them has no infra file, and says so."""
    wheel = workloads_wheel.build_wheel(REPO, tmp_path / "cache")
    with zipfile.ZipFile(wheel.path) as archive:
        names = archive.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        assert archive.read(top_level).decode().split() == ["workloads"]
        assert "infra/" not in archive.read(record).decode()
    assert [n for n in names if n.startswith("infra/")] == []
    assert "workloads/cli/__init__.py" in names
    packages = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert packages == {"workloads"}
