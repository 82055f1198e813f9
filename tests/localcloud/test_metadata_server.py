"""The local cloud's metadata server answers as GCE's does: the header, the paths the scripts
and JAX read, the program's declared metadata, and the faults the boot-path cases need."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from localcloud import metadata_server

ADDRESS = "127.0.1.250"
_port = 0  # the running server's: it binds a free one (two runs of this file at once share none)


@pytest.fixture
def server():
    instance = metadata_server.Instance(
        name="node-a",
        id="42",
        zone="us-east5-a",
        project="proj",
        attributes=metadata_server.worker_attributes(
            {"startup-script": "#!/bin/bash\necho hi\n"}, 1, ["10.0.0.2", "10.0.0.3"]
        ),
    )
    global _port
    srv = metadata_server.MetadataServer(instance, ADDRESS, port=0)
    _port = srv.port
    yield srv
    srv.stop()


def get(path: str, header: bool = True) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{ADDRESS}:{_port}/computeMetadata/v1/{path}")
    if header:
        req.add_header("Metadata-Flavor", "Google")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_it_answers_what_the_boot_path_reads(server):
    assert get("instance/attributes/startup-script") == (200, "#!/bin/bash\necho hi\n")
    assert get("instance/attributes/agent-worker-number") == (200, "1")
    assert get("instance/attributes/worker-network-endpoints") == (200, "10.0.0.2,10.0.0.3")
    assert get("instance/zone")[1].endswith("/zones/us-east5-a")
    assert get("project/project-id") == (200, "proj")
    assert get("instance/attributes/nothing-here")[0] == 404


def test_without_the_header_it_refuses(server):
    assert get("instance/zone", header=False)[0] == 403


def test_503s_for_a_while_then_answers(server):
    server.fail_for(0.5)
    assert get("instance/zone")[0] == 503
    time.sleep(0.6)
    assert get("instance/zone")[0] == 200
