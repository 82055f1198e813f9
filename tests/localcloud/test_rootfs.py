"""The root file system cache: keyed by its packages, and one line where containers cannot run."""

from __future__ import annotations

import pytest

from localcloud import rootfs
from localcloud.errors import CannotBoot


def test_the_cache_key_is_the_package_set_not_its_order() -> None:
    assert rootfs.key(["python3", "curl"]) == rootfs.key(["curl", "python3", "curl"])
    assert rootfs.key(rootfs.STOCK_GCE) != rootfs.key(rootfs.WITH_VENV)


def test_not_root_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rootfs.os, "geteuid", lambda: 1000)
    with pytest.raises(CannotBoot, match=r"^local cloud: containers need root") as caught:
        rootfs.ensure(rootfs.STOCK_GCE)
    assert "\n" not in str(caught.value)


def test_a_missing_tool_names_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rootfs.os, "geteuid", lambda: 0)
    monkeypatch.setattr(rootfs.shutil, "which", lambda tool: None)
    monkeypatch.setattr(rootfs.pathlib.Path, "exists", lambda self: False)
    with pytest.raises(
        CannotBoot, match=r"debootstrap is missing \(apt-get install -y debootstrap\)"
    ):
        rootfs.check_tools()
