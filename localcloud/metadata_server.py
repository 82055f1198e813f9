"""The GCE metadata server as one VM sees it, on a loopback address of that VM's own.

A VM's scripts and JAX read `http://metadata.google.internal/computeMetadata/v1/...` with the
header `Metadata-Flavor: Google`; each machine's /etc/hosts names this server's address. It
answers from what the Pulumi program declared for the node (its `metadata`: startup-script,
ssh-keys, ...) plus what the TPU service adds to every worker (agent-worker-number,
worker-network-endpoints) and the instance's own facts (zone, name, id, project). A request
without the header gets 403, as the real server's does.

Faults for the boot-path cases: `fail_for(seconds)` answers 503 until then, `delay_s` holds every
answer that long first.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
from collections.abc import Mapping

PREFIX = "/computeMetadata/v1/"
PROJECT_NUMBER = "123456789012"
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


@dataclasses.dataclass
class Instance:
    """What one worker's metadata server answers.

    Attributes:
        name: the node's name; id: its numeric id (new per VM: a new VM is a new instance).
        zone: the zone it runs in; project: the project id.
        attributes: instance/attributes/* (the program's metadata and the TPU service's).
    """

    name: str
    id: str
    zone: str
    project: str
    attributes: dict[str, str]
    service_account: str = ""
    """The email of the account the node runs as (default: a stand-in `vm@` account)."""
    token: str = "localcloud"  # noqa: S105 - a stand-in, not a credential
    """The access token handed out for that account; the local Cloud TPU API knows whose it is
    (localcloud/iam.py), so a VM's TPU calls are checked against its account's grants."""

    def answer(self, path: str) -> str | None:
        """The value at `path` (below computeMetadata/v1/), or None (404)."""
        email = self.service_account or f"vm@{self.project}.iam.gserviceaccount.com"
        account = {
            # google-auth reads the account's facts (recursive=true), then its token by email.
            "": json.dumps(
                {"aliases": ["default"], "email": email, "scopes": [CLOUD_PLATFORM_SCOPE]}
            ),
            # gcloud and google-auth ask for a token: the local TPU API maps it to the account;
            # the storage stand-in accepts any (fake-gcs-server has no IAM).
            "token": json.dumps(
                {"access_token": self.token, "expires_in": 3599, "token_type": "Bearer"}
            ),
            "email": email,
            "scopes": CLOUD_PLATFORM_SCOPE,
        }
        for alias in ("default", email):
            prefix = f"instance/service-accounts/{alias}/"
            if path.startswith(prefix) and path.removeprefix(prefix) in account:
                return account[path.removeprefix(prefix)]
        fixed = {
            "instance/name": self.name,
            "instance/hostname": f"{self.name}.c.{self.project}.internal",
            "instance/id": self.id,
            "instance/zone": f"projects/{PROJECT_NUMBER}/zones/{self.zone}",
            "project/project-id": self.project,
            "project/numeric-project-id": PROJECT_NUMBER,
        }
        if path in fixed:
            return fixed[path]
        if path in ("instance/attributes/", "instance/attributes"):
            return "".join(f"{key}\n" for key in sorted(self.attributes))
        if path.startswith("instance/attributes/"):
            return self.attributes.get(path.removeprefix("instance/attributes/"))
        return None


class MetadataServer:
    """One instance's metadata server on (address, port), in a thread of this process."""

    def __init__(self, instance: Instance, address: str, port: int = 80) -> None:
        self.instance = instance
        self.address = address
        self.delay_s = 0.0
        self.failing_until = 0.0
        self.requests: list[str] = []
        self.refused = 0  # requests answered 503 by fail_for
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                if server.delay_s:
                    time.sleep(server.delay_s)
                if time.monotonic() < server.failing_until:
                    server.refused += 1
                    self._send(503, "Service Unavailable")
                    return
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._send(403, "Missing Metadata-Flavor:Google header.")
                    return
                path = self.path.split("?", 1)[0]
                if path == "/":  # google-auth's "is this GCE?" ping
                    self._send(200, "computeMetadata/\n")
                    return
                if not path.startswith(PREFIX):
                    self._send(404, "Not Found")
                    return
                value = server.instance.answer(path.removeprefix(PREFIX))
                if value is None:
                    self._send(404, "Not Found")
                else:
                    self._send(200, value)

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Metadata-Flavor", "Google")
                # google-auth parses a JSON answer (a token, an account) by its content type.
                kind = "application/json" if body.startswith("{") else "application/text"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                return  # the requests list is the log

        self._httpd = http.server.ThreadingHTTPServer((address, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def fail_for(self, seconds: float) -> None:
        """Answers 503 to everything for the next `seconds`."""
        self.failing_until = time.monotonic() + seconds

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def worker_attributes(
    declared: Mapping[str, str], worker: int, endpoints: list[str]
) -> dict[str, str]:
    """The attributes of worker `worker`: the node's declared metadata and the TPU service's own
    (its worker number and every worker's address, the internal network's)."""
    return {
        **declared,
        "agent-worker-number": str(worker),
        "worker-network-endpoints": ",".join(endpoints),
        "accelerator-type": declared.get("accelerator-type", ""),
    }
