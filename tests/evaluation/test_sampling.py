"""Sampling against a local HTTP server speaking the OpenAI chat-completions format."""

import json
import threading
import time

import pytest

from workloads.common import errors
from workloads.evaluation import sampling

PARAMS = sampling.SamplingParams(model="test-model", temperature=0.8, top_p=0.95, max_tokens=64)


def _items(names):
    return [(name, [{"role": "user", "content": f"spec of {name}"}]) for name in names]


def _client(server, **kwargs):
    client = sampling.ChatClient(
        server.url, backoff_s=0.001, max_backoff_s=0.01, timeout_s=5, **kwargs
    )
    return client


def test_samples_each_problem_n_times_with_the_requested_settings(openai_server, tmp_path):
    openai_server.answer = lambda body: "answer to " + body["messages"][-1]["content"]
    store = sampling.ProgressStore(str(tmp_path))
    got = sampling.sample_all(
        _items(["A", "B"]), _client(openai_server), PARAMS, store, n=3, concurrency=4
    )
    assert [s["index"] for s in got["A"]] == [0, 1, 2]
    assert {s["text"] for s in got["B"]} == {"answer to spec of B"}
    assert got["A"][0]["completion_tokens"] == 42 and got["A"][0]["finish_reason"] == "stop"
    assert len(openai_server.requests) == 6
    body = openai_server.requests[0]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"], body["n"]) == (
        "test-model",
        0.8,
        0.95,
        64,
        1,
    )
    record = json.loads((tmp_path / "samples" / "A.json").read_text())
    assert record["params"] == PARAMS.to_json() and len(record["samples"]) == 3


def test_transient_errors_are_retried(openai_server, tmp_path):
    failures = {"left": 3}
    lock = threading.Lock()

    def answer(body):
        with lock:
            if failures["left"] > 0:
                failures["left"] -= 1
                return (503 if failures["left"] != 1 else 429), {"error": "busy"}
        return "ok"

    openai_server.answer = answer
    got = sampling.sample_all(
        _items(["A"]),
        _client(openai_server),
        PARAMS,
        sampling.ProgressStore(str(tmp_path)),
        n=2,
        concurrency=1,
    )
    assert [s["text"] for s in got["A"]] == ["ok", "ok"]
    assert len(openai_server.requests) == 5  # 3 failures + 2 successes


def test_rerun_skips_finished_problems_and_tops_up_partial_ones(openai_server, tmp_path):
    openai_server.answer = lambda body: "ok"
    store = sampling.ProgressStore(str(tmp_path))
    client = _client(openai_server)
    sampling.sample_all(_items(["A", "B"]), client, PARAMS, store, n=2)
    assert len(openai_server.requests) == 4

    openai_server.requests.clear()
    again = sampling.sample_all(_items(["A", "B"]), client, PARAMS, store, n=2)
    assert openai_server.requests == []
    assert [len(v) for v in again.values()] == [2, 2]

    # A problem saved with fewer samples (an earlier run with a smaller n) is topped up.
    sampling.sample_all(_items(["A", "B", "C"]), client, PARAMS, store, n=3)
    assert openai_server.posts_for("spec of A") == 1
    assert openai_server.posts_for("spec of B") == 1
    assert openai_server.posts_for("spec of C") == 3


def test_rejected_requests_are_recorded_and_requested_again(openai_server, tmp_path):
    openai_server.answer = lambda body: (400, {"error": "prompt too long"})
    store = sampling.ProgressStore(str(tmp_path))
    got = sampling.sample_all(_items(["A"]), _client(openai_server), PARAMS, store, n=2)
    assert all("HTTP 400" in s["error"] for s in got["A"])
    assert len(openai_server.requests) == 2  # permanent: not retried

    openai_server.answer = lambda body: "ok"
    got = sampling.sample_all(_items(["A"]), _client(openai_server), PARAMS, store, n=2)
    assert [s.get("text") for s in got["A"]] == ["ok", "ok"]


def test_unreachable_endpoint_stops_the_run_and_keeps_finished_work(openai_server, tmp_path):
    def answer(body):
        if "spec of B" in body["messages"][-1]["content"]:
            return 503, {"error": "down"}
        return "ok"

    openai_server.answer = answer
    store = sampling.ProgressStore(str(tmp_path))
    client = _client(openai_server, max_attempts=3)
    with pytest.raises(sampling.EndpointError, match=r"still failing after 3 attempts .*HTTP 503"):
        sampling.sample_all(_items(["A", "B"]), client, PARAMS, store, n=2, concurrency=1)
    assert (tmp_path / "samples" / "A.json").exists()
    assert not (tmp_path / "samples" / "B.json").exists()


def test_connection_refused_is_an_endpoint_error(tmp_path):
    client = sampling.ChatClient("http://127.0.0.1:9", max_attempts=2, backoff_s=0.001)
    with pytest.raises(sampling.EndpointError, match="still failing after 2 attempts"):
        client.complete([{"role": "user", "content": "x"}], PARAMS)


def test_samples_made_with_other_settings_are_not_mixed(openai_server, tmp_path):
    openai_server.answer = lambda body: "ok"
    store = sampling.ProgressStore(str(tmp_path))
    sampling.sample_all(_items(["A"]), _client(openai_server), PARAMS, store, n=1)
    hotter = sampling.SamplingParams(model="test-model", temperature=1.0, top_p=0.95, max_tokens=64)
    with pytest.raises(errors.UserError, match="another results directory"):
        sampling.sample_all(_items(["A"]), _client(openai_server), hotter, store, n=1)


def test_models_and_base_url(openai_server):
    assert sampling.ChatClient(openai_server.url.removesuffix("/v1")).models() == ["test-model"]


def test_requests_in_flight_are_bounded_by_the_concurrency(openai_server, tmp_path):
    state = {"now": 0, "peak": 0}
    lock = threading.Lock()

    def answer(body):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return "ok"

    openai_server.answer = answer
    store = sampling.ProgressStore(str(tmp_path))
    got = sampling.sample_all(
        _items(["A", "B", "C"]), _client(openai_server), PARAMS, store, n=4, concurrency=3
    )
    assert sum(len(v) for v in got.values()) == 12
    assert state["peak"] == 3  # parallel, never more than asked


class _RawServer:
    """A TCP server on 127.0.0.1 that answers every connection with `respond(conn)`."""

    def __init__(self, respond):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.respond = respond
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with conn:
            try:
                conn.recv(65536)  # the request (small enough for one read here)
                self.respond(conn, self.stop)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def raw_server():
    servers = []

    def make(respond):
        servers.append(_RawServer(respond))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def _drip(conn, stop, status_line=b"HTTP/1.1 200 OK", closing=b""):
    """A 200 with a valid header, then the body one byte every 0.1 s: every single read
    finishes well within any socket timeout, the whole answer never does."""
    body = json.dumps({"choices": [{"message": {"content": "x" * 1000}}]}).encode()
    conn.sendall(
        status_line
        + b"\r\nContent-Type: application/json\r\n"
        + closing
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    for byte in body:
        if stop.wait(0.1):
            return
        conn.sendall(bytes([byte]))


# An answer that closes the connection makes http.client hand the socket over to the response
# (connection.sock becomes None): the deadline must reach it there too.
DRIPS = {
    "keep-alive": _drip,
    "HTTP/1.0": lambda conn, stop: _drip(conn, stop, b"HTTP/1.0 200 OK"),
    "Connection: close": lambda conn, stop: _drip(conn, stop, closing=b"Connection: close\r\n"),
}


@pytest.mark.parametrize("drip", sorted(DRIPS))
def test_a_dripping_endpoint_hits_the_total_deadline(raw_server, drip):
    server = raw_server(DRIPS[drip])
    client = sampling.ChatClient(server.url, timeout_s=1.0, max_attempts=2, backoff_s=0.001)
    started = time.monotonic()
    with pytest.raises(sampling.EndpointError) as caught:
        client.complete([{"role": "user", "content": "x"}], PARAMS)
    elapsed = time.monotonic() - started
    assert elapsed < 2 * 1.0 + 1.5, elapsed  # two attempts of 1 s each, not 100 s of drip
    message = str(caught.value)
    assert "still failing after 2 attempts (TimeoutError: no complete answer within 1 s)" in message
    assert "\n" not in message


def test_a_silent_endpoint_hits_the_total_deadline(raw_server):
    server = raw_server(lambda conn, stop: stop.wait(30))
    client = sampling.ChatClient(server.url, timeout_s=0.5, max_attempts=1)
    started = time.monotonic()
    with pytest.raises(sampling.EndpointError, match=r"within 0\.5 s"):
        client.models()
    assert time.monotonic() - started < 2


def test_a_socket_timeout_before_the_deadline_timer_is_the_deadline(raw_server, monkeypatch):
    # The socket's timeout and the deadline timer are equal; when the socket's fires first (CI
    # saw it), the answer is still the deadline's, not a bare "timed out".
    class NeverFires:
        def __init__(self, interval, function):
            self.daemon = True

        def start(self):
            pass

        def cancel(self):
            pass

    monkeypatch.setattr(sampling.threading, "Timer", NeverFires)
    server = raw_server(lambda conn, stop: stop.wait(30))
    client = sampling.ChatClient(server.url, timeout_s=0.3, max_attempts=1)
    with pytest.raises(sampling.EndpointError, match=r"no complete answer within 0\.3 s"):
        client.models()


@pytest.mark.parametrize(
    "body",
    [bytes(range(256)) * 4, b"\xff\xfe\x00garbage", b"<html>not json</html>", b""],
    ids=["binary", "bad-utf8", "html", "empty"],
)
def test_a_200_that_is_not_json_ends_in_one_line(raw_server, body):
    def respond(conn, stop):
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    server = raw_server(respond)
    client = sampling.ChatClient(server.url, timeout_s=5, max_attempts=2, backoff_s=0.001)
    with pytest.raises(sampling.EndpointError) as caught:
        client.complete([{"role": "user", "content": "x"}], PARAMS)
    message = str(caught.value)
    assert "HTTP 200 but the answer is not JSON" in message
    assert "\n" not in message and len(message) < 600


def test_an_answer_over_the_body_cap_is_refused(raw_server, monkeypatch):
    monkeypatch.setattr(sampling, "MAX_BODY_BYTES", 1000)

    def respond(conn, stop):
        body = b"[" + b"1," * 5000 + b"1]"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    server = raw_server(respond)
    client = sampling.ChatClient(server.url, timeout_s=5, max_attempts=1)
    with pytest.raises(sampling.EndpointError, match="answer over 1000 bytes"):
        client.models()


def test_huge_answers_are_stored_capped(openai_server, tmp_path, monkeypatch):
    monkeypatch.setattr(sampling, "MAX_STORED_CHARS", 1000)
    openai_server.answer = lambda body: (
        "y" * 5000 if "spec of A" in body["messages"][-1]["content"] else "short"
    )
    store = sampling.ProgressStore(str(tmp_path))
    got = sampling.sample_all(_items(["A", "B"]), _client(openai_server), PARAMS, store, n=1)
    assert (len(got["A"][0]["text"]), got["A"][0]["text_chars"]) == (1000, 5000)
    assert got["B"][0]["text"] == "short" and "text_chars" not in got["B"][0]
    saved = json.loads((tmp_path / "samples" / "A.json").read_text())
    assert saved["samples"][0]["text"] == "y" * 1000
    assert (tmp_path / "samples" / "A.json").stat().st_size < 5000


@pytest.mark.parametrize(
    "url", ["not a url", "ftp://host/v1", "http://", "http://host:notaport/v1", "127.0.0.1:8000"]
)
def test_an_endpoint_that_is_not_an_http_url_is_a_user_error(url):
    with pytest.raises(errors.UserError) as caught:
        sampling.ChatClient(url)
    assert str(caught.value) == (
        f"endpoint {url!r}: not an http(s) URL; expected e.g. http://127.0.0.1:8000/v1"
    )


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_request_timeout_that_is_not_positive_is_a_user_error(timeout):
    with pytest.raises(errors.UserError, match="must be a number of seconds > 0"):
        sampling.ChatClient("http://127.0.0.1:8000/v1", timeout_s=timeout)
