"""The one small client of the GCS protocol server (workloads.common.gcs_server.Client) and the
one switch of this process's environment to a server and back (`clients_at`,
workloads.common.processes.environment): what the rehearsal and the tests use beside gcsfs."""

from __future__ import annotations

import os
import urllib.error

import pytest

from workloads.common import gcs_server as gcs
from workloads.common import processes


def test_objects_are_written_read_listed_and_deleted(gcs_server, gcs_bucket):
    client = gcs_server.client()
    client.put(f"{gcs_bucket}/run/a b.json", b'{"x": 1}')  # a name that needs quoting
    client.put(f"{gcs_bucket}/run/sub/c", b"c")
    client.put(f"{gcs_bucket}/other", b"o")

    assert client.get(f"{gcs_bucket}/run/a b.json") == b'{"x": 1}'
    assert sorted(client.names(f"{gcs_bucket}/run/")) == ["run/a b.json", "run/sub/c"]
    assert len(client.names(gcs_bucket)) == 3  # the whole bucket

    client.delete(f"{gcs_bucket}/run/sub/c")
    assert client.names(f"{gcs_bucket}/run/sub") == []
    with pytest.raises(urllib.error.HTTPError) as missing:
        client.get(f"{gcs_bucket}/run/sub/c")
    assert missing.value.code == 404


def test_the_environment_is_switched_for_a_block_and_back(monkeypatch):
    monkeypatch.setenv("GEMMA4_TEST_SET", "before")
    monkeypatch.delenv("GEMMA4_TEST_UNSET", raising=False)
    with processes.environment({"GEMMA4_TEST_SET": "in", "GEMMA4_TEST_UNSET": "in"}):
        assert os.environ["GEMMA4_TEST_SET"] == os.environ["GEMMA4_TEST_UNSET"] == "in"
    assert os.environ["GEMMA4_TEST_SET"] == "before"
    assert "GEMMA4_TEST_UNSET" not in os.environ

    with pytest.raises(RuntimeError), processes.environment({"GEMMA4_TEST_SET": "in"}):
        raise RuntimeError  # restored on the way out of a failed block too
    assert os.environ["GEMMA4_TEST_SET"] == "before"


def test_the_clients_are_pointed_at_a_server_and_back(gcs_server):
    names = (*gcs.ENV_VARS, gcs.HNS_ENV)
    before = {name: os.environ.get(name) for name in names}
    with gcs.clients_at("http://127.0.0.1:9"):
        assert {os.environ[name] for name in gcs.ENV_VARS} == {"http://127.0.0.1:9"}
        assert os.environ[gcs.HNS_ENV] == "false"
    assert {name: os.environ.get(name) for name in names} == before


def test_a_server_serving_for_a_block_leaves_the_environment_as_it_was(tmp_path, gcs_server):
    names = (*gcs.ENV_VARS, gcs.HNS_ENV)
    before = {name: os.environ.get(name) for name in names}
    with gcs.serving(tmp_path / "objects", "demo") as server:
        assert os.environ[gcs.ENV_VARS[0]] == server.url
        server.client().put("gs://demo/x", b"x")
        assert server.client().names("gs://demo") == ["x"]
    assert server.process is None  # stopped
    assert {name: os.environ.get(name) for name in names} == before
