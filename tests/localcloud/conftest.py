"""The local cloud for the boot-fault tests (test_boot_faults.py, test_boot_interrupted.py):
a rehearsal's storage server and metadata servers, no VM yet; closed after the test."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from localcloud import rehearse
from localcloud.errors import CannotBoot


@pytest.fixture
def cloud(tmp_path: pathlib.Path) -> Iterator[rehearse.Rehearsal]:
    r = rehearse.Rehearsal("dev", tmp_path, print)
    try:
        rehearse.rootfs.check_tools()
    except CannotBoot as exc:
        pytest.fail(str(exc), pytrace=False)
    yield r
    r.close()
