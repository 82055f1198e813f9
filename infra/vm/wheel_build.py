"""The project's wheel, built from pyproject.toml in plain Python: no pip, no setuptools, offline.

Why not `pip wheel`: the recovery controller's Debian 12 venv has pip 23.0.1 and setuptools
66.1.1 and no `wheel` package, which cannot build this project (pyproject asks for a newer
setuptools, pinned exactly); building with it would need PyPI at deploy time, and two
setuptools releases write different METADATA. The deployment fingerprint hashes the wheel's
contents, so the same source must give the same members wherever it is built (a laptop clone,
or the controller's copy from the source archive), else every controller `up` restarts the
serving units and the user's next `up` restarts them back.

This builder reads the few pyproject keys the project uses and refuses any other (a key it
ignored would silently change what is installed). The members depend on the source files only:
sorted names, one timestamp (SOURCE_DATE_EPOCH, default 1980-01-01), modes from the executable
bit. tests/infra/vm/test_wheel_build.py checks the member list against setuptools' own build.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import os
import pathlib
import re
import time
import tomllib
import zipfile
from collections.abc import Collection, Iterable
from typing import Any

from infra.errors import WheelBuildError

# 1980-01-01, the earliest time a zip member can carry.
DEFAULT_EPOCH = 315532800
GENERATOR = "gemma4-tpu infra/vm/wheel_build.py"
LICENSE_NAMES = ("LICENSE", "LICENSE.txt", "LICENCE", "COPYING", "NOTICE")

# The [project] and [tool.setuptools] keys this builder implements; anything else is refused.
PROJECT_KEYS = frozenset(
    {
        "name",
        "version",
        "description",
        "readme",
        "requires-python",
        "license",
        "license-files",
        "dependencies",
        "optional-dependencies",
        "scripts",
    }
)
SETUPTOOLS_KEYS = frozenset({"packages", "package-data"})


def normalized(name: str) -> str:
    """PEP 503/685 normal form of a distribution or extra name: `Foo_Bar.x` -> `foo-bar-x`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _with_extra(requirement: str, extra: str) -> str:
    """`x>=1; python_version<"3.12"` + extra -> `x>=1; (python_version<"3.12") and extra == ...`."""
    spec, sep, marker = requirement.partition(";")
    condition = f'extra == "{extra}"'
    if sep and marker.strip():
        condition = f"({marker.strip()}) and {condition}"
    return f"{spec.strip()}; {condition}"


def _load(source_dir: pathlib.Path) -> dict[str, Any]:
    path = source_dir / "pyproject.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise WheelBuildError(f"{path}: cannot read: {exc}") from None


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WheelBuildError(f"pyproject.toml: {key}: {value!r}: a list of strings")
    return list(value)


def _find_packages(source_dir: pathlib.Path, include: list[str], exclude: list[str]) -> list[str]:
    """Like setuptools' find_packages: directories with an __init__.py, descending only into
    packages, whose dotted names match an include pattern and no exclude pattern."""
    found: list[str] = []
    pending = [p for p in sorted(source_dir.iterdir()) if p.is_dir()]
    while pending:
        path = pending.pop(0)
        if "." in path.name or not (path / "__init__.py").is_file():
            continue
        name = ".".join(path.relative_to(source_dir).parts)
        if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
            fnmatch.fnmatchcase(name, p) for p in exclude
        ):
            found.append(name)
        pending += [p for p in sorted(path.iterdir()) if p.is_dir()]
    return sorted(found)


def _package_files(
    source_dir: pathlib.Path, packages: list[str], package_data: dict[str, list[str]]
) -> list[pathlib.Path]:
    """The modules of every package (its *.py files) and the data files its patterns name."""
    files: set[pathlib.Path] = set()
    for package in packages:
        pkg_dir = source_dir.joinpath(*package.split("."))
        files.update(p for p in pkg_dir.glob("*.py") if p.is_file())
        for pattern in [*package_data.get(package, []), *package_data.get("*", [])]:
            for match in pkg_dir.glob(pattern):
                if match.is_file() and "__pycache__" not in match.parts and match.suffix != ".pyc":
                    files.add(match)
    return sorted(files, key=lambda p: p.relative_to(source_dir).as_posix())


def _metadata(project: dict[str, Any], source_dir: pathlib.Path) -> str:
    license_ = project.get("license")
    # PEP 639's SPDX string needs metadata 2.4 (what setuptools writes for it); the older table
    # form stays at 2.1.
    lines = [
        f"Metadata-Version: {'2.4' if isinstance(license_, str) else '2.1'}",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if "description" in project:
        lines.append(f"Summary: {project['description']}")
    if isinstance(license_, str):
        lines.append(f"License-Expression: {license_}")
    elif isinstance(license_, dict) and "text" in license_:
        lines.append(f"License: {license_['text']}")
    elif license_ is not None:
        raise WheelBuildError(
            f"pyproject.toml: project.license: {license_!r}: an SPDX string or {{text = ...}}"
        )
    lines += [f"License-File: {name}" for name in license_files(project, source_dir)]
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    readme_text = None
    if "readme" in project:
        readme = project["readme"]
        if not isinstance(readme, str) or not readme.lower().endswith(".md"):
            raise WheelBuildError(f"pyproject.toml: project.readme: {readme!r}: a .md file name")
        try:
            readme_text = (source_dir / readme).read_text()
        except OSError as exc:
            raise WheelBuildError(
                f"project.readme: {source_dir / readme}: cannot read ({exc.strerror})"
            ) from None
        lines.append("Description-Content-Type: text/markdown")
    lines += [
        f"Requires-Dist: {r.strip()}"
        for r in _strings(project.get("dependencies", []), "dependencies")
    ]
    extras = project.get("optional-dependencies", {})
    for extra, requirements in extras.items():
        name = normalized(extra)
        lines.append(f"Provides-Extra: {name}")
        lines += [
            f"Requires-Dist: {_with_extra(r, name)}"
            for r in _strings(requirements, f"optional-dependencies.{extra}")
        ]
    text = "\n".join(lines) + "\n"
    return text + ("\n" + readme_text if readme_text is not None else "")


def license_files(project: dict[str, Any], source_dir: pathlib.Path) -> list[str]:
    """The license files the wheel carries, relative to `source_dir`: project.license-files'
    globs when set (PEP 639), else the conventional names that exist.

    Raises:
        WheelBuildError: license-files is not a list of strings, or a glob matches nothing.
    """
    if "license-files" not in project:
        return [name for name in LICENSE_NAMES if (source_dir / name).is_file()]
    names: list[str] = []
    for pattern in _strings(project["license-files"], "license-files"):
        matches = sorted(
            p.relative_to(source_dir).as_posix() for p in source_dir.glob(pattern) if p.is_file()
        )
        if not matches:
            raise WheelBuildError(
                f"pyproject.toml: project.license-files: {pattern!r}: matches no file in "
                f"{source_dir}"
            )
        names += [m for m in matches if m not in names]
    return names


def wheel_name(source_dir: pathlib.Path) -> str:
    """`gemma4_tpu-0.1.0-py3-none-any.whl` for the project in `source_dir`."""
    project = _load(source_dir).get("project", {})
    return f"{_dist_name(project)}-{project.get('version')}-py3-none-any.whl"


def _dist_name(project: dict[str, Any]) -> str:
    return normalized(str(project.get("name", ""))).replace("-", "_")


def _epoch() -> tuple[int, int, int, int, int, int]:
    raw = os.environ.get("SOURCE_DATE_EPOCH", "")
    seconds = int(raw) if raw.isdigit() else DEFAULT_EPOCH
    return time.gmtime(max(seconds, DEFAULT_EPOCH))[:6]


def members(
    source_dir: pathlib.Path, top_level: Collection[str] | None = None
) -> list[tuple[str, bytes, bool]]:
    """Every member of the wheel but RECORD: (name, bytes, executable), sorted by name.

    Args:
        source_dir: the project (its pyproject.toml and packages).
        top_level: only the packages found under these top-level names (None: every package
            pyproject's packages.find names, as setuptools would build).

    Raises:
        WheelBuildError: pyproject.toml is missing, unreadable, or uses a key this builder does
            not implement; the readme is missing; a `top_level` name is not among the packages.
    """
    document = _load(source_dir)
    project = document.get("project")
    if not isinstance(project, dict) or not project.get("name") or not project.get("version"):
        raise WheelBuildError(f"{source_dir}/pyproject.toml: [project] needs a name and a version")
    unknown = sorted(set(project) - PROJECT_KEYS)
    setuptools_cfg = document.get("tool", {}).get("setuptools", {})
    unknown += [f"tool.setuptools.{k}" for k in sorted(set(setuptools_cfg) - SETUPTOOLS_KEYS)]
    find = setuptools_cfg.get("packages", {})
    if not isinstance(find, dict) or set(find) - {"find"}:
        unknown.append("tool.setuptools.packages (only packages.find)")
    find = find.get("find", {}) if isinstance(find, dict) else {}
    if set(find) - {"include", "exclude"}:
        unknown.append("tool.setuptools.packages.find (only include, exclude)")
    if unknown:
        raise WheelBuildError(
            f"pyproject.toml: {', '.join(unknown)}: not implemented by infra/vm/wheel_build.py "
            f"(it builds from {', '.join(sorted(PROJECT_KEYS))} and packages.find/package-data)"
        )
    packages = _find_packages(
        source_dir,
        _strings(find.get("include", ["*"]), "packages.find.include"),
        _strings(find.get("exclude", []), "packages.find.exclude"),
    )
    if not packages:
        raise WheelBuildError(f"{source_dir}: no package matches tool.setuptools.packages.find")
    if top_level is not None:
        packages = _only(packages, top_level, source_dir)
    data = {
        k: _strings(v, f"package-data.{k}")
        for k, v in setuptools_cfg.get("package-data", {}).items()
    }
    dist_info = f"{_dist_name(project)}-{project['version']}.dist-info"
    out: list[tuple[str, bytes, bool]] = []
    for path in _package_files(source_dir, packages, data):
        rel = path.relative_to(source_dir).as_posix()
        out.append((rel, path.read_bytes(), os.access(path, os.X_OK)))
    for name in license_files(project, source_dir):
        out.append((f"{dist_info}/licenses/{name}", (source_dir / name).read_bytes(), False))
    out.append((f"{dist_info}/METADATA", _metadata(project, source_dir).encode(), False))
    wheel = f"Wheel-Version: 1.0\nGenerator: {GENERATOR}\nRoot-Is-Purelib: true\n"
    out.append((f"{dist_info}/WHEEL", (wheel + "Tag: py3-none-any\n").encode(), False))
    scripts = project.get("scripts") or {}
    if scripts:
        entry = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(scripts.items()))
        out.append((f"{dist_info}/entry_points.txt", entry.encode(), False))
    top = sorted({p.split(".", 1)[0] for p in packages})
    out.append((f"{dist_info}/top_level.txt", "".join(f"{t}\n" for t in top).encode(), False))
    return sorted(out)


def _only(packages: list[str], top_level: Collection[str], source_dir: pathlib.Path) -> list[str]:
    found = sorted({p.split(".", 1)[0] for p in packages})
    missing = sorted(set(top_level) - set(found))
    if missing:
        raise WheelBuildError(
            f"{source_dir}: {', '.join(missing)}: not a package tool.setuptools.packages.find "
            f"names (it finds {', '.join(found)})"
        )
    return [p for p in packages if p.split(".", 1)[0] in top_level]


def _zip_member(archive: zipfile.ZipFile, name: str, data: bytes, executable: bool) -> None:
    info = zipfile.ZipInfo(name, date_time=_epoch())
    info.external_attr = ((0o100755 if executable else 0o100644) & 0xFFFF) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    archive.writestr(info, data, compresslevel=9)


def build(
    source_dir: pathlib.Path, out_dir: pathlib.Path, top_level: Collection[str] | None = None
) -> pathlib.Path:
    """Writes the wheel of the project in `source_dir` into `out_dir` and returns its path.

    Args:
        source_dir: the project.
        out_dir: where the wheel is written (created if missing).
        top_level: only these top-level packages (see `members`); None: all of them.

    Returns:
        The wheel's path.

    Raises:
        WheelBuildError: see `members`.
    """
    content = members(source_dir, top_level)
    dist_info = next(n for n, _, _ in content if n.endswith(".dist-info/METADATA")).split("/")[0]
    record_name = f"{dist_info}/RECORD"
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d, _ in content)
    record += f"{record_name},,\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / wheel_name(source_dir)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data, executable in _ordered(content):
            _zip_member(archive, name, data, executable)
        _zip_member(archive, record_name, record.encode(), False)
    return path


def _ordered(content: Iterable[tuple[str, bytes, bool]]) -> list[tuple[str, bytes, bool]]:
    """Package files first, .dist-info last (the order the wheel spec recommends)."""
    return sorted(content, key=lambda m: (".dist-info/" in m[0], m[0]))
