"""Fixtures for serving tests: a fake `docker` on PATH, a free port, a merged model directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import socket
import sys
import uuid

import fsspec
import pytest

from workloads.common import digest

FAKE_DOCKER = pathlib.Path(__file__).with_name("fake_docker.py")


@dataclasses.dataclass
class FakeDocker:
    """The fake docker's recorded calls (argv lists, in order)."""

    log: pathlib.Path
    state: pathlib.Path

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def subcommands(self) -> list[str]:
        return [call[0] for call in self.calls()]


@pytest.fixture
def fake_docker(tmp_path, monkeypatch) -> FakeDocker:
    """`docker` on PATH is tests/serve/fake_docker.py, run by this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "docker"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_DOCKER}" "$@"\n')
    script.chmod(0o755)
    log, state = tmp_path / "docker-calls.jsonl", tmp_path / "docker-state"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state))
    for name in ("FAKE_VLLM_MODE", "FAKE_VLLM_DELAY", "FAKE_BENCH_FAIL"):
        monkeypatch.delenv(name, raising=False)
    fake = FakeDocker(log, state)
    yield fake
    # Leave no fake container behind (a failed test may not have stopped it).
    for pid_file in state.glob("*.pid") if state.exists() else []:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), 9)


@pytest.fixture
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def checksum(data: bytes, algorithm: str = digest.CRC32C) -> str:
    running = digest.new(algorithm)
    running.update(data)
    return running.hexdigest()


def write_merged_model(
    url: str,
    *,
    shards: int = 2,
    shard_bytes: int = 4096,
    corrupt: str | None = None,
    algorithm: str = digest.CRC32C,
) -> dict[str, bytes]:
    """Writes a merged-model directory as the merge leaves it (shards, config, tokenizer, index
    last-but-one, merge_metadata.json with each shard's `algorithm` checksum); `corrupt` names a
    shard whose bytes no longer match its recorded checksum (same size). Returns name ->
    content."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    files: dict[str, bytes] = {}
    meta_files = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        files[name] = os.urandom(shard_bytes)
        meta_files[name] = {
            algorithm: checksum(files[name], algorithm),
            "bytes": len(files[name]),
        }
    files["config.json"] = json.dumps({"model_type": "gemma4"}).encode()
    files["tokenizer.json"] = b'{"version": "1.0"}'
    if corrupt is not None:
        files[corrupt] = bytes(b ^ 0xFF for b in files[corrupt])
    for name, data in files.items():
        fs.pipe_file(f"{root}/{name}", data)
    index = {"metadata": {}, "weight_map": {"w": next(iter(meta_files))}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["merge_metadata.json"] = json.dumps(
        {
            "source_checkpoint": "gs://b/run/checkpoints",
            "step": 10,
            "rank": 4,
            "alpha": 4.0,
            "targets": ["q_einsum"],
            "base": "gs://b/base",
            "files": meta_files,
        }
    ).encode()
    for name in ("model.safetensors.index.json", "merge_metadata.json"):
        fs.pipe_file(f"{root}/{name}", files[name])
    return files


@pytest.fixture(params=["memory", "gs"])
def memory_url(request):
    """A fresh remote directory: memory:// (fsspec's in-memory stand-in), and gs:// on the GCS
    protocol server (tests/fixtures/gcs_server.py), removed afterwards."""
    if request.param == "gs":
        yield f"{request.getfixturevalue('gcs_bucket')}/dir"
        return
    url = f"memory://bucket-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)
