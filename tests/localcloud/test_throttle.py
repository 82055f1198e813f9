"""The slow link the rehearsal puts between its VMs and the GCS protocol server: only the base
model's weights are slowed, everything else passes at full speed, and the bytes are intact."""

from __future__ import annotations

import re
import time
import urllib.parse
import urllib.request

from localcloud import throttle


def _put(server_url: str, uri: str, data: bytes) -> None:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    req = urllib.request.Request(
        f"{server_url}/upload/storage/v1/b/{bucket}/o?{query}", data=data, method="POST"
    )
    urllib.request.urlopen(req, timeout=30).close()


def _get(base: str, uri: str) -> tuple[bytes, float]:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    url = f"{base}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=60) as resp:
        data = resp.read()
    return data, time.monotonic() - started


def test_only_the_models_weights_are_slowed_and_arrive_whole(gcs_server, gcs_bucket):
    weights = f"{gcs_bucket}/models/tiny/model-00001.safetensors"
    config = f"{gcs_bucket}/models/tiny/config.json"
    payload = bytes(range(256)) * 400  # 100 KiB
    _put(gcs_server.url, weights, payload)
    _put(gcs_server.url, config, b"{}")
    slow = throttle.SlowReads(
        gcs_server.url,
        re.compile(re.escape(f"{gcs_bucket}/models/tiny") + r"/[^/]+\.safetensors$"),
        bytes_per_s=200 * 1024,
    )
    try:
        data, seconds = _get(slow.url, weights)
        assert data == payload and 0.4 <= seconds < 5
        small, quick = _get(slow.url, config)
        assert small == b"{}" and quick < 0.4
        # Listing and metadata go through untouched.
        bucket = gcs_bucket.removeprefix("gs://")
        with urllib.request.urlopen(f"{slow.url}/storage/v1/b/{bucket}/o", timeout=30) as resp:
            assert b"model-00001.safetensors" in resp.read()
        assert slow.slowed == [weights]
    finally:
        slow.stop()


def test_gcsfs_and_tensorstore_clients_work_through_it(gcs_server, gcs_bucket):
    """What a VM's trainer does through the link (listings, writes, reads, a tree removal) keeps
    its framing on kept-alive connections: an upstream answer without a length (chunked) is
    passed on with one."""
    from workloads.common import gcs_server as gcs
    from workloads.common import storage

    slow = throttle.SlowReads(gcs_server.url, re.compile(r"\.safetensors$"), 1e6)
    try:
        gcs.point_clients_at(slow.url)
        run = f"{gcs_bucket}/run"
        for i in range(3):
            storage.write_text_atomic(f"{run}/checkpoints/{i}/meta.json", "{}" * 100)
        assert storage.exists(f"{run}/checkpoints/2/meta.json")
        assert storage.read_text(f"{run}/checkpoints/1/meta.json") == "{}" * 100
        storage.remove_tree(f"{run}/checkpoints/0")
        assert not storage.exists(f"{run}/checkpoints/0/meta.json")
    finally:
        gcs.point_clients_at(gcs_server.url)
        slow.stop()
