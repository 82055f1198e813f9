"""storage.py's gs:// calls under faults injected between gcsfs and a GCS protocol server
(tests/fixtures/gcs_faults.py): transient failures are retried until they pass, a stalled
connection is abandoned after the socket timeout, a permanent failure is one line naming the
object; a TensorStore write (Orbax's checkpoint path) through a stall is abandoned and
retried within its bound."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import aiohttp
import fsspec.config
import pytest

from workloads.common import errors, storage


def short_timeout(monkeypatch, seconds: float) -> None:
    """The socket timeouts of gcsfs instances made from now on (gcsfs reads both protocols')."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(fsspec.config.conf[protocol], "requests_timeout", timeout)


def test_every_gcsfs_instance_gets_a_bounded_socket_timeout():
    timeout = fsspec.config.conf["gs"]["requests_timeout"]
    assert isinstance(timeout, aiohttp.ClientTimeout)
    assert timeout.sock_read == storage.GCS_READ_TIMEOUT_S == 20
    assert timeout.sock_connect == storage.GCS_CONNECT_TIMEOUT_S
    assert timeout.total is None  # a long healthy download is not cut short


def test_three_503s_on_a_write_and_a_read_are_retried_to_success(gcs_faults):
    url = f"{gcs_faults.bucket}/run/metrics.json"
    gcs_faults.add("503", times=3, method="POST")
    storage.write_bytes_atomic(url, b"payload")
    gcs_faults.add("503", times=3, method="GET")
    assert storage.read_bytes(url) == b"payload"
    assert gcs_faults.proxy.count("503") == 6


def test_a_connection_reset_mid_response_is_retried(gcs_faults):
    url = f"{gcs_faults.bucket}/a.txt"
    gcs_faults.add("reset", method="POST")
    storage.write_text_atomic(url, "x")
    gcs_faults.add("reset", method="GET")
    assert storage.read_text(url) == "x"
    assert gcs_faults.proxy.count("reset") == 2


def test_a_stall_longer_than_the_socket_timeout_is_retried(gcs_faults, monkeypatch):
    # The production bound is 20 s of silence; 1 s here keeps the test short (same mechanism).
    short_timeout(monkeypatch, 1)
    url = f"{gcs_faults.bucket}/a.txt"
    storage.write_text_atomic(url, "x")
    gcs_faults.add("stall", method="GET", seconds=30)
    started = time.monotonic()
    assert storage.read_text(url) == "x"
    took = time.monotonic() - started
    assert gcs_faults.proxy.count("stall") == 1
    assert took < 5, took  # 1 s timeout + about 1-2 s of backoff, not the 30 s stall


@pytest.mark.slow
def test_a_server_that_keeps_stalling_gives_one_line_within_the_bound(gcs_faults, monkeypatch):
    short_timeout(monkeypatch, 0.5)
    url = f"{gcs_faults.bucket}/a.txt"
    gcs_faults.add("stall", times=100, method="GET", seconds=60)
    started = time.monotonic()
    with pytest.raises(errors.UserError) as caught:
        storage.read_bytes(url)
    took = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{url}: could not read it"), message
    # 6 tries x 0.5 s + backoff sleeps 1+2+4+8+16 s (+ < 1 s jitter each)
    assert took < 6 * 0.5 + 36 + 5, took
    assert gcs_faults.proxy.count("stall") == 6


# A TensorStore write (what Orbax's checkpoint save does for every array) through a stall, in a
# fresh process (libcurl reads the variables once per process), with our defaults only.
_TS_WRITE = """
import os, sys, time
from workloads.common import storage  # noqa: F401  (sets TensorStore's stall bound)
import tensorstore as ts
kv = ts.KvStore.open({"driver": "gcs", "bucket": sys.argv[1]}).result()
started = time.time()
kv.write("checkpoints/1/d/chunk", b"y" * 1000).result()
print("written after", round(time.time() - started, 1), flush=True)
"""


@pytest.mark.slow  # a 60 s stall, waited out (the machine meanwhile mostly idle)
def test_a_checkpoint_write_that_stalls_is_abandoned_and_retried_within_the_bound(gcs_faults):
    """A connection that goes silent and stays so (here 300 s) must not hold a save for as long
    as it lasts: abandoned after storage.TENSORSTORE_STALL_S and retried. Without the bound the
    write waited the whole stall (measured: 40.0 s of a 40 s stall)."""
    gcs_faults.add("stall", seconds=300, method="POST")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSTORE_CURL")}
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", _TS_WRITE, gcs_faults.bucket.removeprefix("gs://")],
        env=env,
        capture_output=True,
        text=True,
        timeout=250,
    )
    took = time.time() - started
    assert done.returncode == 0, done.stderr[-2000:]
    assert "written after" in done.stdout
    assert gcs_faults.proxy.count("stall") == 1 and gcs_faults.proxy.count("pass") >= 1
    assert storage.TENSORSTORE_STALL_S <= took < storage.TENSORSTORE_STALL_S + 30, took


def test_a_403_is_one_line_naming_the_object(gcs_faults):
    url = f"{gcs_faults.bucket}/run/metrics.json"
    gcs_faults.add("403", times=10)
    started = time.monotonic()
    with pytest.raises(errors.UserError) as caught:
        storage.write_bytes_atomic(url, b"x")
    assert time.monotonic() - started < 2  # not retried
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{url}: access denied (HTTP 403) trying to write it")
    with pytest.raises(errors.UserError, match=r"access denied \(HTTP 403\) trying to read"):
        storage.read_bytes(url)


def test_a_missing_bucket_is_one_line_naming_it(gcs_faults):
    url = "gs://no-such-bucket-here/run/metrics.json"
    with pytest.raises(errors.UserError) as caught:
        storage.write_bytes_atomic(url, b"x")
    assert str(caught.value) == f"{url}: bucket no-such-bucket-here not found"
    with pytest.raises(errors.UserError) as caught:
        storage.read_bytes(url)
    assert str(caught.value) == f"{url}: file not found"
