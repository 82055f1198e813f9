"""localcloud/ is tests-only tooling: nothing the VMs or the program run imports it."""

from __future__ import annotations

import pathlib

from infra.vm import source_archive

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_program_templates_and_workloads_never_name_localcloud() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for top in ("infra", "workloads", "templates")
        for path in (REPO / top).rglob("*")
        if path.is_file()
        and path.suffix in (".py", ".j2", ".sh")
        and "localcloud" in path.read_text(errors="replace")
    ]
    assert offenders == []


def test_localcloud_is_not_in_the_controllers_source_archive() -> None:
    files = source_archive.source_files("dev")
    assert not [f for f in files if f.parts[0] == "localcloud"]
