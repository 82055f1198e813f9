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


def test_wheel_hash_ignores_timestamps_infra_and_record(tmp_path: pathlib.Path) -> None:
    base = {
        "workloads/__init__.py": b"x = 1\n",
        "infra/__init__.py": b"",
        "p-0.1.dist-info/RECORD": b"a",
    }
    _zip(tmp_path / "a.whl", base, (2020, 1, 1, 0, 0, 0))
    _zip(
        tmp_path / "b.whl",
        {**base, "infra/__init__.py": b"changed", "p-0.1.dist-info/RECORD": b"b"},
        (2024, 5, 5, 5, 5, 4),
    )
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

    # An edit anywhere in the packaged sources is a new cache key (a new build next time).
    before = workloads_wheel.source_hash(src)
    (src / "infra" / "__init__.py").write_text('"""Changed docstring."""\n')
    assert workloads_wheel.source_hash(src) != before
