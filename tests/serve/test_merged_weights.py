"""Staging the merged model: completion marker, parallel copy, skip-if-complete, checksums."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest

from tests.serve.conftest import checksum, write_merged_model
from workloads.common import digest, storage
from workloads.serve import compile_cache, merged_weights

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def downloads(monkeypatch):
    """Records every download (relative name) and lets a test corrupt chosen ones."""
    seen: list[str] = []
    corrupt: dict[str, int] = {}  # name -> how many more downloads arrive corrupted
    real = storage.download_file

    def download(remote: str, local: str) -> None:
        name = remote.rsplit("/", 1)[-1]
        seen.append(name)
        real(remote, local)
        if corrupt.get(name, 0) > 0:
            corrupt[name] -= 1
            data = pathlib.Path(local).read_bytes()
            pathlib.Path(local).write_bytes(b"X" + data[1:])

    monkeypatch.setattr(storage, "download_file", download)
    return seen, corrupt


def test_stage_copies_verifies_and_fetches_the_markers_last(memory_url, tmp_path, downloads):
    seen, _ = downloads
    files = write_merged_model(f"{memory_url}/merged")
    report = merged_weights.stage_model(f"{memory_url}/merged", str(tmp_path / "staged"), workers=4)
    for name, data in files.items():
        assert (tmp_path / "staged" / name).read_bytes() == data
    assert seen[-2:] == ["model.safetensors.index.json", "merge_metadata.json"]
    assert sorted(report.downloaded) == sorted(set(files) - set(merged_weights.MARKERS))
    assert report.bytes_downloaded == sum(len(files[n]) for n in report.downloaded)
    stamp = json.loads((tmp_path / "staged" / merged_weights.STAMP).read_text())
    assert stamp[SHARD1]["crc32c"] == checksum(files[SHARD1])


def test_a_second_staging_skips_complete_files_and_refetches_a_damaged_one(
    memory_url, tmp_path, downloads
):
    seen, _ = downloads
    files = write_merged_model(f"{memory_url}/merged")
    dest = tmp_path / "staged"
    merged_weights.stage_model(f"{memory_url}/merged", str(dest))
    seen.clear()
    again = merged_weights.stage_model(f"{memory_url}/merged", str(dest))
    assert again.downloaded == () and seen == list(merged_weights.MARKERS)
    # Same size, different bytes (and a new mtime): the checksum catches it.
    (dest / SHARD2).write_bytes(b"\0" * len(files[SHARD2]))
    (dest / "config.json").unlink()
    seen.clear()
    third = merged_weights.stage_model(f"{memory_url}/merged", str(dest))
    assert sorted(third.downloaded) == ["config.json", SHARD2]
    assert (dest / SHARD2).read_bytes() == files[SHARD2]


def test_a_corrupt_download_is_fetched_once_more(memory_url, tmp_path, downloads):
    seen, corrupt = downloads
    files = write_merged_model(f"{memory_url}/merged")
    corrupt[SHARD1] = 1
    merged_weights.stage_model(f"{memory_url}/merged", str(tmp_path / "staged"))
    assert seen.count(SHARD1) == 2
    assert (tmp_path / "staged" / SHARD1).read_bytes() == files[SHARD1]


def test_a_shard_that_stays_corrupt_is_a_clear_error(memory_url, tmp_path, downloads):
    seen, _ = downloads
    write_merged_model(f"{memory_url}/merged", corrupt=SHARD2)
    with pytest.raises(merged_weights.StagingError) as info:
        merged_weights.stage_model(f"{memory_url}/merged", str(tmp_path / "staged"))
    message = str(info.value)
    assert f"{memory_url}/merged/{SHARD2}: crc32c " in message
    assert "does not match merge_metadata.json" in message and "downloaded twice" in message
    assert seen.count(SHARD2) == 2
    assert not (tmp_path / "staged" / SHARD2).exists()
    assert not (tmp_path / "staged" / "model.safetensors.index.json").exists()


def test_a_local_directory_can_be_the_source(tmp_path):
    files = write_merged_model(str(tmp_path / "src"))
    merged_weights.stage_model(str(tmp_path / "src"), str(tmp_path / "dest"))
    assert {p.name for p in (tmp_path / "dest").iterdir()} == set(files) | {merged_weights.STAMP}


def test_a_shard_missing_from_the_source_is_named(memory_url, tmp_path):
    write_merged_model(f"{memory_url}/merged")
    fs, root = storage.filesystem(f"{memory_url}/merged/{SHARD1}")
    fs.rm_file(root)
    with pytest.raises(
        merged_weights.StagingError, match=f"{SHARD1}: listed in merge_metadata.json"
    ):
        merged_weights.stage_model(f"{memory_url}/merged", str(tmp_path / "staged"))


def test_verify_local_checks_sizes_and_checksums(tmp_path):
    files = write_merged_model(str(tmp_path / "m"))
    merged_weights.verify_local(str(tmp_path / "m"))
    (tmp_path / "m" / SHARD1).write_bytes(b"\1" * len(files[SHARD1]))
    with pytest.raises(merged_weights.StagingError, match=f"{SHARD1}: crc32c .* does not match"):
        merged_weights.verify_local(str(tmp_path / "m"))
    (tmp_path / "m" / SHARD1).write_bytes(b"short")
    with pytest.raises(
        merged_weights.StagingError, match=r"5 bytes, merge_metadata\.json says 4096"
    ):
        merged_weights.verify_local(str(tmp_path / "m"))


def test_a_model_merged_with_sha256_by_an_earlier_version_stages_and_is_checked(
    memory_url, tmp_path
):
    files = write_merged_model(f"{memory_url}/merged", algorithm=digest.SHA256)
    merged_weights.stage_model(f"{memory_url}/merged", str(tmp_path / "staged"))
    stamp = json.loads((tmp_path / "staged" / merged_weights.STAMP).read_text())
    assert stamp[SHARD1]["sha256"] == checksum(files[SHARD1], digest.SHA256)
    (tmp_path / "staged" / SHARD1).write_bytes(b"\1" * len(files[SHARD1]))
    with pytest.raises(merged_weights.StagingError, match=f"{SHARD1}: sha256 .* does not match"):
        merged_weights.verify_local(str(tmp_path / "staged"))


def test_a_metadata_entry_without_a_known_checksum_is_one_clear_error(memory_url, tmp_path):
    write_merged_model(f"{memory_url}/merged")
    path = f"{memory_url}/merged/merge_metadata.json"
    meta = json.loads(storage.read_text(path))
    meta["files"][SHARD1] = {"md5": "0" * 32, "bytes": 4096}
    storage.write_text_atomic(path, json.dumps(meta))
    with pytest.raises(merged_weights.StagingError) as info:
        merged_weights.stage_model(f"{memory_url}/merged", str(tmp_path / "staged"))
    assert str(info.value) == (
        f'{path}: files.{SHARD1} needs a checksum ("crc32c" or "sha256", a str) and "bytes" (int)'
    )


def test_waiting_for_the_marker(memory_url):
    url = f"{memory_url}/merged"
    with pytest.raises(merged_weights.StagingError, match=r"not complete after 0.2 s"):
        merged_weights.wait_for_marker(url, timeout_s=0.2, poll_s=0.05)
    assert (
        merged_weights.wait_for_marker(url, timeout_s=10, poll_s=0.05, cancelled=lambda: True)
        is False
    )
    writer = threading.Timer(0.3, write_merged_model, args=(url,))
    writer.start()
    start = time.monotonic()
    assert merged_weights.wait_for_marker(url, timeout_s=10, poll_s=0.05)
    assert time.monotonic() - start >= 0.25
    writer.join()


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_model_path_that_is_a_file_is_one_line_at_once(where, memory_url, tmp_path):
    """serve.model naming a file (a shard, the index) instead of the merged directory: waiting
    up to model_wait_timeout_s for markers that can never appear there helps nobody."""
    if where == "local":
        url = str(tmp_path / "model.safetensors")
        pathlib.Path(url).write_bytes(b"weights")
    else:
        url = f"{memory_url}/model.safetensors"
        storage.write_bytes_atomic(url, b"weights")
    start = time.monotonic()
    with pytest.raises(merged_weights.StagingError) as info:
        merged_weights.wait_for_marker(url, timeout_s=30, poll_s=0.05)
    assert time.monotonic() - start < 5
    assert str(info.value) == (
        f"{url}: is a file; serve.model_dir must name the merged model's directory "
        f"(the one holding {merged_weights.INDEX} and {merged_weights.METADATA})"
    )


def test_compile_cache_round_trip(memory_url, tmp_path):
    remote = f"{memory_url}/xla-cache"
    assert compile_cache.restore(remote, str(tmp_path / "empty")) == 0
    cache = tmp_path / "cache"
    (cache / "sub").mkdir(parents=True)
    (cache / "jit_a").write_bytes(b"a" * 100)
    (cache / "sub" / "jit_b").write_bytes(b"b" * 50)
    (cache / ".jit_c.partial").write_bytes(b"c")
    assert compile_cache.push(str(cache), remote) == 2
    assert compile_cache.push(str(cache), remote) == 0
    (cache / "jit_new").write_bytes(b"n")
    assert compile_cache.push(str(cache), remote, min_age_s=60) == 0  # still being written
    assert compile_cache.push(str(cache), remote) == 1
    fresh = tmp_path / "fresh"
    assert compile_cache.restore(remote, str(fresh)) == 3
    assert (fresh / "sub" / "jit_b").read_bytes() == b"b" * 50
    assert compile_cache.restore(remote, str(fresh)) == 0
