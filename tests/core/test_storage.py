"""Local and remote (fsspec memory://, standing in for gs://) paths behave alike."""

import os
import time

import fsspec
import pytest

from workloads.common import errors, storage


def test_atomic_local_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "a" / "b.json"
    storage.write_text_atomic(str(target), "one")
    storage.write_text_atomic(str(target), "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["b.json"]


def test_missing_file_is_a_one_line_user_error(tmp_path):
    with pytest.raises(errors.UserError, match=r"x.jsonl: file not found"):
        list(storage.iter_lines(str(tmp_path / "x.jsonl")))


def test_stage_directory_copies_once_and_skips_complete_files(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/bucket/model/config.json", b"{}")
    fs.pipe_file("/bucket/model/sub/w.safetensors", b"x" * 1000)
    dest = tmp_path / "stage"
    assert storage.stage_directory("memory://bucket/model", str(dest)) == str(dest)
    assert (dest / "sub" / "w.safetensors").read_bytes() == b"x" * 1000
    before = (dest / "sub" / "w.safetensors").stat().st_mtime_ns
    storage.stage_directory("memory://bucket/model", str(dest))
    assert (dest / "sub" / "w.safetensors").stat().st_mtime_ns == before
    assert storage.list_files("memory://bucket/model") == ["config.json", "sub/w.safetensors"]


def test_copy_tree_copies_what_differs_both_ways_and_never_deletes(tmp_path):
    fs = fsspec.filesystem("memory")
    local = tmp_path / "cache"
    (local / "a").mkdir(parents=True)
    (local / "a" / "one.bin").write_bytes(b"1" * 10)
    (local / "two.bin").write_bytes(b"2" * 20)
    (local / ".three.bin.partial").write_bytes(b"x")  # a partial download is never copied
    remote = "memory://copy-tree/cache"
    assert storage.copy_tree(str(local), remote) == ["a/one.bin", "two.bin"]
    assert fs.cat_file("/copy-tree/cache/a/one.bin") == b"1" * 10
    assert storage.copy_tree(str(local), remote) == []  # same sizes: nothing to do
    # A file only on the remote comes down; a changed size goes up again; nothing is deleted.
    fs.pipe_file("/copy-tree/cache/new.bin", b"n" * 5)
    (local / "two.bin").write_bytes(b"2" * 21)
    assert storage.copy_tree(str(local), remote) == ["two.bin"]
    back = tmp_path / "back"
    assert storage.copy_tree(remote, str(back)) == ["a/one.bin", "new.bin", "two.bin"]
    assert (back / "two.bin").read_bytes() == b"2" * 21
    assert not [p for p in back.rglob(".*")]  # partial names renamed away
    assert storage.copy_tree(remote, str(back), files=["new.bin", "missing.bin"]) == []
    assert fs.exists("/copy-tree/cache/new.bin") and (local / "a" / "one.bin").exists()
    fs.rm("/copy-tree", recursive=True)


def test_copy_tree_leaves_out_files_still_being_written(tmp_path):
    local = tmp_path / "cache"
    local.mkdir()
    (local / "old.bin").write_bytes(b"o")
    os.utime(local / "old.bin", (time.time() - 600, time.time() - 600))
    (local / "fresh.bin").write_bytes(b"f")
    assert storage.copy_tree(str(local), "memory://copy-age/c", min_age_s=60) == ["old.bin"]
    fsspec.filesystem("memory").rm("/copy-age", recursive=True)
