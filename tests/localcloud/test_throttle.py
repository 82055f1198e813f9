"""The slow link the rehearsal puts between its VMs and the GCS protocol server: only the base
model's weights are slowed, everything else passes at full speed, and the bytes are intact."""

from __future__ import annotations

import re
import time

from localcloud import throttle
from workloads.common import gcs_server as gcs


def _timed_get(base: str, uri: str) -> tuple[bytes, float]:
    started = time.monotonic()
    data = gcs.Client(base).get(uri)
    return data, time.monotonic() - started


def test_only_the_models_weights_are_slowed_and_arrive_whole(gcs_server, gcs_bucket):
    weights = f"{gcs_bucket}/models/tiny/model-00001.safetensors"
    config = f"{gcs_bucket}/models/tiny/config.json"
    payload = bytes(range(256)) * 400  # 100 KiB
    gcs_server.client().put(weights, payload)
    gcs_server.client().put(config, b"{}")
    slow = throttle.SlowReads(
        gcs_server.url,
        re.compile(re.escape(f"{gcs_bucket}/models/tiny") + r"/[^/]+\.safetensors$"),
        bytes_per_s=200 * 1024,
    )
    try:
        data, seconds = _timed_get(slow.url, weights)
        assert data == payload and 0.4 <= seconds < 5
        small, quick = _timed_get(slow.url, config)
        assert small == b"{}" and quick < 0.4
        # Listing and metadata go through untouched.
        assert "models/tiny/model-00001.safetensors" in gcs.Client(slow.url).names(gcs_bucket)
        assert slow.slowed == [weights]
    finally:
        slow.stop()


def test_gcsfs_and_tensorstore_clients_work_through_it(gcs_server, gcs_bucket):
    """What a VM's trainer does through the link (listings, writes, reads, a tree removal) keeps
    its framing on kept-alive connections: an upstream answer without a length (chunked) is
    passed on with one."""
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
