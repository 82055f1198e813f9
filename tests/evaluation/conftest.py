"""Fixtures for the evaluation tests: the test problems and a fake OpenAI-compatible server."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fixtures.tokenizer import tiny_tokenizer, tiny_tokenizer_dir
from workloads.evaluation import problems

__all__ = ["tiny_tokenizer", "tiny_tokenizer_dir"]


@pytest.fixture
def problems_dir() -> str:
    return str(problems.SAMPLE_DIR)


class FakeOpenAI:
    """A chat-completions server on 127.0.0.1 in a thread.

    `answer(body) -> str | tuple[int, Any]` decides each POST: a string is the assistant's
    content; a (status, payload) tuple is sent as an error. Every request body is recorded.
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.answer: Callable[[dict[str, Any]], Any] = lambda body: "no code"
        self.models = ["test-model"]
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": m} for m in fake.models]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                    return
                result = fake.answer(body)
                if isinstance(result, tuple):
                    self._send(*result)
                    return
                self._send(
                    200,
                    {
                        "id": "cmpl-1",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": result},
                            }
                        ],
                        "usage": {
                            "prompt_tokens": 100,
                            "completion_tokens": 42,
                            "total_tokens": 142,
                        },
                    },
                )

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def posts_for(self, needle: str) -> int:
        """How many requests carried `needle` in their last message."""
        return sum(needle in r["messages"][-1]["content"] for r in self.requests)


@pytest.fixture
def openai_server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()
