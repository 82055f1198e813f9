"""The recovery controller's source archive: a gzip that no machine's zlib shapes."""

from __future__ import annotations

import gzip
import pathlib
import subprocess
import zlib

import pytest

from infra.vm import source_archive


@pytest.mark.parametrize("size", [0, 1, 0xFFFF, 0xFFFF + 1, 3 * 0xFFFF + 17])
def test_stored_gzip_is_read_back_by_gzip(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert gzip.decompress(source_archive.stored_gzip(data)) == data


def test_the_archive_does_not_depend_on_the_zlib_at_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """What zlib compresses differs between machines (zlib-ng, the OS byte): the archive uses
    none of it, so a zlib that compresses nothing the same way gives the same bytes."""
    before = source_archive.archive_bytes("dev")

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the archive must not depend on zlib's compressor")

    monkeypatch.setattr(zlib, "compress", refuse)
    monkeypatch.setattr(zlib, "compressobj", refuse)
    monkeypatch.setattr(gzip, "compress", refuse)
    assert source_archive.archive_bytes("dev") == before
    assert before[9] == 255  # the header's OS byte: "unknown", from every machine


def test_the_controllers_tar_unpacks_it(tmp_path: pathlib.Path) -> None:
    """recover.sh unpacks `source.tar.gz` with `tar -xzf` (the script of running controllers
    too, which only reboots refresh)."""
    archive = source_archive.write_archive("dev", tmp_path)
    assert archive.name.endswith(".tar.gz")
    (tmp_path / "src").mkdir()
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(tmp_path / "src")], check=True)
    assert (tmp_path / "src" / "Pulumi.dev.yaml").is_file()
    assert (tmp_path / "src" / "infra" / "program.py").is_file()
