"""Served as trained: the greedy decode of the training code's LoRA model, the server client, and
(slow: it starts real vLLM) the real CPU engine serving the merge of a LoRA run, token for token.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any, ClassVar

import pytest

from tests.merge.conftest import lora_run, merged  # noqa: F401 - the session fixtures
from tests.serve.engine import needs_engine
from workloads.cli import demo_serving
from workloads.contract import runconfig
from workloads.serve import argv, parity
from workloads.serve import command as serve_command


def test_batched_greedy_equals_one_prompt_at_a_time(tiny_model_dir):
    """The padded batch decodes each prompt exactly as decoding it alone does (different prompt
    lengths: the padding must never be read)."""
    from workloads.merge import verify
    from workloads.model import gemma4

    mesh = verify.single_device_mesh()
    model = gemma4.load_model(str(tiny_model_dir), mesh=mesh, dtype="float32")
    prompts = parity.prompt_ids(str(tiny_model_dir))[:3]
    assert len({len(p) for p in prompts}) > 1
    batched = parity.greedy(model, mesh, prompts, 4)
    alone = [parity.greedy(model, mesh, [p], 4)[0] for p in prompts]
    assert batched == alone
    assert all(len(t) == 4 for t in batched)


class _Completions(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[list[Any]] = []
    bodies: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        status, payload = self.answers.pop(0)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def completions_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Completions.answers, _Completions.bodies = [], []
    yield f"http://127.0.0.1:{server.server_address[1]}", _Completions
    server.shutdown()


def test_the_server_is_asked_for_greedy_token_ids(completions_server):
    url, handler = completions_server
    handler.answers = [(200, {"choices": [{"token_ids": [5, 6]}]})]
    assert parity.served_greedy(url, "m", [[2, 9, 9]], 2) == [[5, 6]]
    [body] = handler.bodies
    assert body == {
        "model": "m",
        "prompt": [2, 9, 9],
        "max_tokens": 2,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ((200, {"choices": [{"text": "abc"}]}), "no token ids"),
        ((400, {"error": "bad prompt"}), "-> 400"),
    ],
)
def test_a_server_without_token_ids_is_one_clear_error(completions_server, answer, message):
    url, handler = completions_server
    handler.answers = [answer]
    with pytest.raises(parity.ParityError, match=message):
        parity.served_greedy(url, "m", [[2, 9]], 2)


class _Drip(http.server.BaseHTTPRequestHandler):
    """A 200 with a valid header, then its body one byte every 0.2 s: every read ends well
    within any per-read timeout, the whole answer takes 10 s."""

    stop = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"choices": [{"token_ids": [5] * 10}]}).ljust(50).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for byte in body:
            if self.stop.wait(0.2):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def test_a_dripping_server_hits_the_total_deadline():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        started = time.monotonic()
        with pytest.raises(parity.ParityError) as caught:
            parity.served_greedy(url, "m", [[2, 9]], 10, timeout_s=1.0)
        elapsed = time.monotonic() - started
    finally:
        _Drip.stop.set()
        server.shutdown()
        server.server_close()
    assert elapsed < 1.0 + 1.0, elapsed  # the deadline, not the 10 s of drip
    assert str(caught.value) == (
        f"POST {url}/v1/completions: no complete answer within 1 s (each request's total deadline)"
    )


def test_a_mismatch_names_the_prompt_and_both_continuations():
    result = parity.ParityResult(
        prompts=((2, 7), (2, 8)), trained=((1, 2), (3, 4)), served=((1, 2), (3, 5))
    )
    assert not result.ok
    assert result.summary() == "FAILED: prompt 1 [2, 8]: LoRA model [3, 4], served [3, 5]"


# ---------------------------------------------------------------------------------------------
# The real engine (vLLM's CPU build from .ci/setup's serving venv): one server for the module


@pytest.fixture(scope="module")
def served(merged, tmp_path_factory):  # noqa: F811 - the imported session fixture
    """vLLM serving the merged LoRA run with the demo's settings (process launcher, float32), but
    two replicas behind one API server (--data-parallel-size 2, the throughput profile's
    mechanism at TP 1; the demo serves one, to start sooner)."""
    out, _ = merged
    work = tmp_path_factory.mktemp("served")
    sections = demo_serving.serving_sections(
        work, demo_serving.engine_python(), demo_serving.free_port()
    )
    serve = runconfig.ServingRunSection(
        **{**sections["serve"], "model_dir": str(out), "data_parallel_size": 2}
    )
    with (work / "vllm.log").open("w") as log, serve_command.serving(serve, echo=log):
        yield serve


@pytest.mark.slow
@needs_engine
def test_vllm_serves_what_was_trained(served, lora_run):  # noqa: F811
    url = argv.local_url(served)
    # Two replicas behind one API server (the throughput profile's mechanism, at TP 1).
    assert served.data_parallel_size == 2
    assert demo_serving.server_version(url) == demo_serving.catalog.VLLM_RELEASE
    result = parity.check(
        str(lora_run.base),
        str(lora_run.checkpoints),
        served.model_dir,
        url,
        served.served_model_name,
    )
    assert result.ok, result.summary()
    # Not vacuous: the adapters change the greedy decode, so serving the base model would fail.
    from workloads.merge import verify
    from workloads.model import gemma4

    mesh = verify.single_device_mesh()
    base = gemma4.load_model(str(lora_run.base), mesh=mesh, dtype="float32")
    assert parity.greedy(base, mesh, [list(p) for p in result.prompts]) != list(
        map(list, result.served)
    )
