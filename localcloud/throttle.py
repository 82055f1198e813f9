"""A slow link to the GCS protocol server for one kind of read: the base model's weights.

A real VM stages ~62 GB of weights for many minutes; the rehearsal's tiny model arrives in a
blink, so the overlap the design relies on (the trainer prepares its data and compiles its step
while the weights still arrive) would never be exercised. This proxy sits between the VMs and
the storage server and hands out the bytes of objects matching `slow` (the model's
`*.safetensors`) at `bytes_per_s`; everything else (the venv archive, checkpoints, the model's
small files) passes at full speed. What the staging reads is what a slow link changes, so the
boot's stage records show the real ordering.
"""

from __future__ import annotations

import http.client
import http.server
import re
import sys
import threading
import time
import urllib.parse

CHUNK = 16 * 1024
# Hop-by-hop headers a proxy must not forward (RFC 9110, section 7.6.1).
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
# An object's media read in the GCS JSON API: /storage/v1/b/B/o/NAME?alt=media, or
# /download/storage/v1/b/B/o/NAME.
MEDIA = re.compile(r"^(?:/download)?/storage/v1/b/([^/]+)/o/([^?]+)$")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A VM killed mid-connection (a preemption) resets it: expected, not worth a traceback.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class SlowReads:
    """The proxy on a free port of 127.0.0.1; `url` is what the VMs are given. Setting
    `bytes_per_s` to 0 lets everything through at full speed from then on."""

    def __init__(self, upstream: str, slow: re.Pattern[str], bytes_per_s: float) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.slow = slow
        self.bytes_per_s = bytes_per_s
        self.slowed: list[str] = []  # gs://bucket/object of every slowed read
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._forward()

            def do_HEAD(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

            def do_PUT(self) -> None:
                self._forward()

            def do_PATCH(self) -> None:
                self._forward()

            def do_DELETE(self) -> None:
                self._forward()

            def _forward(self) -> None:
                try:
                    self._relay()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client went away (a VM killed)

            def _relay(self) -> None:
                body = self._request_body()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=600)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    rate = proxy.rate_for(self.command, self.path)
                    length = resp.getheader("Content-Length")
                    # Keep-alive framing: a body the upstream sent chunked (no length) is read
                    # whole and sent with its length; a slowed read always has one.
                    data = None if (length is not None or self.command == "HEAD") else resp.read()
                    self.send_response(resp.status, resp.reason)
                    for key, value in resp.getheaders():
                        if key.lower() not in HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    if data is not None:
                        self.send_header("Content-Length", str(len(data)))
                    elif length is not None:
                        self.send_header("Content-Length", length)
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    if data is not None:
                        self.wfile.write(data)
                        return
                    started, sent = time.monotonic(), 0
                    while chunk := resp.read(CHUNK):
                        self.wfile.write(chunk)
                        sent += len(chunk)
                        ahead = sent / rate - (time.monotonic() - started) if rate else 0.0
                        if ahead > 0:
                            time.sleep(ahead)
                finally:
                    conn.close()

            def _request_body(self) -> bytes | None:
                """The request's body, a chunked one de-chunked (None: there is none)."""
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            def log_message(self, format: str, *args: object) -> None:
                return

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def rate_for(self, method: str, path: str) -> float:
        """The read rate for a request (0: full speed); records what it slows."""
        route, _, query = path.partition("?")
        match = MEDIA.match(route)
        media = route.startswith("/download/") or "alt=media" in query
        if method != "GET" or not match or not media or not self.bytes_per_s:
            return 0.0
        uri = f"gs://{match.group(1)}/{urllib.parse.unquote(match.group(2))}"
        if not self.slow.search(uri):
            return 0.0
        self.slowed.append(uri)
        return self.bytes_per_s

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
