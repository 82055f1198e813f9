"""Samples answers from an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM), resumably.

One request per sample (n=1) so that a failed request costs one sample, with a bounded number
of requests in flight (threads; the standard library's http.client, no client library). Each
request has a total deadline, from connecting to its last byte, and a body size cap. Transient
failures (connection errors, timeouts, 408/409/425/429/5xx) are retried with exponential
backoff and jitter, honouring Retry-After; when a request still fails the run stops, since a
summary over an unreachable endpoint would be a lie. Other 4xx answers (say, a prompt longer
than the context) are permanent: the sample is recorded with its error, counts as a failure,
and is requested again by the next run.

Progress lives in `<results_dir>/samples/<problem>.json`, written atomically (local or gs://)
as soon as a problem has all its samples. A rerun reads these files and only requests what is
missing, so a crash or a preemption loses at most the problems in flight.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import http.client
import json
import math
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from workloads.common import errors, storage
from workloads.contract import runconfig

TRANSIENT_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
RECORD_VERSION = 1
# The most of an answer's body read (a bigger one is a broken server: retried, then an error),
# and of an answer's text stored and judged (1024 tokens are a few KB; a server that ignores
# max_tokens must not fill the results directory or the judge's memory).
MAX_BODY_BYTES = 64 << 20
MAX_STORED_CHARS = 1 << 20


class EndpointError(errors.UserError):
    """The endpoint kept failing (or answered nonsense) after all retries."""


class PermanentRequestError(Exception):
    """A 4xx answer other than the transient ones: retrying the same request cannot help."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What every request asks for; a results directory holds samples of one setting only."""

    model: str
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 1024

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One answer: text, why generation stopped (`length` = cut off) and tokens used."""

    text: str
    finish_reason: str | None
    completion_tokens: int | None
    prompt_tokens: int | None


class ChatClient:
    """A minimal OpenAI chat-completions client with retries.

    Args:
        base_url: the API root, e.g. http://127.0.0.1:8000/v1 (a trailing /v1 is added if
            missing).
        api_key: sent as a Bearer token when given (vLLM needs none unless started with one).
        timeout_s: total deadline of one request, from connecting to the last byte of the
            answer (a 1024-token answer under load takes a while; a server that drips its
            answer cannot stretch it).

    Raises:
        errors.UserError: base_url is not an http(s) URL, or timeout_s is not positive.
        max_attempts: tries per request before giving up on a transient failure.
        backoff_s: first backoff; doubles per attempt, capped at max_backoff_s, with jitter.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_attempts: int = 8,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        base = check_endpoint(base_url).rstrip("/")
        if not 0 < timeout_s < math.inf:
            raise errors.UserError(
                f"request timeout {timeout_s!r}: must be a number of seconds > 0"
            )
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep: Callable[[float], None] = time.sleep

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + path
        last_problem = ""
        for attempt in range(1, self.max_attempts + 1):
            retry_after: float | None = None
            try:
                status, retry_header, payload = http_call(
                    method, url, data, headers, self.timeout_s
                )
                if 200 <= status < 300:
                    try:
                        return json.loads(payload)
                    except ValueError:  # not JSON, or not even text
                        last_problem = (
                            f"HTTP {status} but the answer is not JSON: {payload[:100]!r}"
                        )
                else:
                    detail = payload[:300].decode("utf-8", errors="replace")
                    if status not in TRANSIENT_STATUS:
                        raise PermanentRequestError(f"HTTP {status} from {url}: {detail}")
                    last_problem = f"HTTP {status}: {detail}"
                    retry_after = _retry_after(retry_header)
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, DNS, deadline
                last_problem = f"{type(exc).__name__}: {exc}"
            if attempt < self.max_attempts:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                delay = delay * (0.5 + random.random() / 2)  # noqa: S311 - jitter, not crypto
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.max_backoff_s))
                self._sleep(delay)
        raise EndpointError(
            f"{url}: still failing after {self.max_attempts} attempts "
            f"({' '.join(last_problem.split())[:300]}); is the server up? "
            "(GET /v1/models answers once vLLM is ready)"
        )

    def models(self) -> list[str]:
        """Model ids the server serves (GET /v1/models)."""
        answer = self._request("GET", "/models")
        try:
            return [str(m["id"]) for m in answer["data"]]
        except (KeyError, TypeError):
            raise EndpointError(
                f"{self.base_url}/models: unexpected answer {str(answer)[:200]}"
            ) from None

    def complete(self, messages: list[dict[str, str]], params: SamplingParams) -> Completion:
        """One chat completion.

        Raises:
            EndpointError: transient failures outlasted the retries, or the answer is malformed.
            PermanentRequestError: the server rejected this request (a 4xx other than 408/409/
                425/429).
        """
        answer = self._request(
            "POST",
            "/chat/completions",
            {
                "model": params.model,
                "messages": messages,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "max_tokens": params.max_tokens,
                "n": 1,
                "stream": False,
            },
        )
        try:
            choice = answer["choices"][0]
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EndpointError(
                f"{self.base_url}/chat/completions: unexpected answer {str(answer)[:200]}"
            ) from None
        if not isinstance(text, str):
            raise EndpointError(
                f"{self.base_url}/chat/completions: the answer's content is not text: "
                f"{str(text)[:100]}"
            )
        usage = answer.get("usage") or {}
        if not isinstance(usage, dict):
            usage = {}
        return Completion(
            text=text,
            finish_reason=choice.get("finish_reason"),
            completion_tokens=usage.get("completion_tokens"),
            prompt_tokens=usage.get("prompt_tokens"),
        )


def check_endpoint(url: str) -> str:
    """url when it is an http(s) URL with a host (and a valid port), else errors.UserError."""
    try:
        parts = urllib.parse.urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:
        valid = False
    if not valid:
        raise errors.UserError(
            f"endpoint {url!r}: not an http(s) URL; expected e.g. http://127.0.0.1:8000/v1"
        )
    return url


def http_call(
    method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float
) -> tuple[int, str | None, bytes]:
    """One HTTP exchange that ends within timeout_s, whatever the server does (the one deadline
    mechanism for the project's calls to a served model: eval's requests, serve's parity check).

    A socket timeout only bounds each read: a server that sends a byte a second would hold the
    request forever. A timer shuts the socket down at the deadline, which ends any blocked read.

    Args:
        method, url, body, headers: the request (url http or https).
        timeout_s: the total deadline, from connecting to the answer's last byte.

    Returns:
        (status, Retry-After header, body up to MAX_BODY_BYTES).

    Raises:
        TimeoutError: the deadline passed. OSError, http.client.HTTPException: the exchange
            failed. http.client.HTTPException also for a body over MAX_BODY_BYTES.
    """
    parts = urllib.parse.urlsplit(url)
    connection_type = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_type(parts.hostname or "", parts.port, timeout=timeout_s)
    expired = threading.Event()
    # The connection's socket, held here: when the answer closes the connection (HTTP/1.0, or
    # `Connection: close`), getresponse() hands the socket to the response and sets
    # connection.sock to None, and the timer must still reach it.
    held: list[socket.socket] = []

    def expire() -> None:
        expired.set()
        for sock in (connection.sock, *held):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        connection.connect()
        held.append(connection.sock)
        if expired.is_set():  # connected just as the deadline passed
            raise TimeoutError
        connection.request(method, target or "/", body=body, headers=headers)
        if expired.is_set():
            raise TimeoutError
        response = connection.getresponse()
        payload = bytearray()
        while chunk := response.read(1 << 16):
            payload += chunk
            if len(payload) > MAX_BODY_BYTES:
                raise http.client.HTTPException(f"answer over {MAX_BODY_BYTES} bytes")
        if expired.is_set():  # the shutdown made the answer look complete
            raise TimeoutError
        return response.status, response.getheader("Retry-After"), bytes(payload)
    except (OSError, http.client.HTTPException) as exc:
        # The socket's own timeout equals the deadline, so it can fire a hair before the timer:
        # either way the whole exchange has run out of its time.
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise TimeoutError(f"no complete answer within {timeout_s:g} s") from None
        raise exc
    finally:
        timer.cancel()
        connection.close()


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def messages_digest(messages: list[dict[str, str]]) -> str:
    """A short hash of the prompt, so that a changed prompt format is not mixed with old samples."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode("utf-8")).hexdigest()[:16]


class ProgressStore:
    """Per-problem sample files under `<results_dir>/samples/` (local or gs://)."""

    def __init__(self, results_dir: str) -> None:
        self.results_dir = results_dir

    def path(self, problem: str) -> str:
        return runconfig.join(self.results_dir, "samples", f"{problem}.json")

    def load(self, problem: str) -> dict[str, Any] | None:
        path = self.path(problem)
        if not storage.exists(path):
            return None
        try:
            record = json.loads(storage.read_text(path))
        except json.JSONDecodeError:
            return None  # unreadable: sample the problem again
        return record if isinstance(record, dict) else None

    def save(self, problem: str, record: dict[str, Any]) -> None:
        storage.write_text_atomic(self.path(problem), json.dumps(record, indent=1) + "\n")


def _reusable(
    record: dict[str, Any] | None, problem: str, params: SamplingParams, digest: str
) -> list[dict[str, Any]]:
    """The finished samples of a saved record made with the same settings.

    Raises:
        errors.UserError: the record was made with other settings (mixing would skew pass@k).
    """
    if record is None:
        return []
    made_with = {"params": record.get("params"), "prompt_digest": record.get("prompt_digest")}
    wanted = {"params": params.to_json(), "prompt_digest": digest}
    if made_with != wanted:
        raise errors.UserError(
            f"{problem}: the results directory holds samples made with {made_with}, this run "
            f"asks for {wanted}; use another results directory (nothing is deleted for you)"
        )
    return [s for s in record.get("samples", []) if isinstance(s, dict) and not s.get("error")]


def sample_all(
    items: Sequence[tuple[str, list[dict[str, str]]]],
    client: ChatClient,
    params: SamplingParams,
    store: ProgressStore,
    *,
    n: int,
    concurrency: int = 16,
    on_problem_done: Callable[[str, int, int], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Collects n samples per problem, reusing saved ones.

    Args:
        items: (problem name, chat messages) pairs.
        client: the endpoint.
        params: model and sampling settings.
        store: where progress is saved and resumed from.
        n: samples per problem.
        concurrency: requests in flight.
        on_problem_done: called as (problem, newly requested, total problems done) when a
            problem's record is saved.

    Returns:
        problem -> its n sample records ({"index", "text", "finish_reason",
        "completion_tokens", "prompt_tokens", "seconds"}, or {"index", "error"} for a request
        the server rejected), in index order. A text over MAX_STORED_CHARS is cut there and
        its record gets "text_chars", the length of the whole answer.

    Raises:
        EndpointError: the endpoint stayed unreachable; finished problems are saved.
        errors.UserError: saved samples were made with other settings.
    """
    results: dict[str, list[dict[str, Any]]] = {}
    pending: dict[str, dict[str, Any]] = {}
    for name, messages in items:
        digest = messages_digest(messages)
        kept = _reusable(store.load(name), name, params, digest)[:n]
        if len(kept) == n:
            results[name] = sorted(kept, key=lambda s: s["index"])
            continue
        used = {s["index"] for s in kept}
        missing = [i for i in range(n) if i not in used][: n - len(kept)]
        pending[name] = {
            "messages": messages,
            "digest": digest,
            "samples": list(kept),
            "missing": missing,
            "left": len(missing),
        }

    lock = threading.Lock()
    stop = threading.Event()
    done_count = [len(results)]

    def run_one(name: str, index: int) -> None:
        if stop.is_set():
            return
        state = pending[name]
        started = time.monotonic()
        try:
            completion = client.complete(state["messages"], params)
            sample: dict[str, Any] = {
                "index": index,
                "text": completion.text[:MAX_STORED_CHARS],
                "finish_reason": completion.finish_reason,
                "completion_tokens": completion.completion_tokens,
                "prompt_tokens": completion.prompt_tokens,
                "seconds": round(time.monotonic() - started, 3),
            }
            if len(completion.text) > MAX_STORED_CHARS:  # what was cut, for the record
                sample["text_chars"] = len(completion.text)
        except PermanentRequestError as exc:
            sample = {"index": index, "error": str(exc)}
        except BaseException:
            stop.set()
            raise
        with lock:
            state["samples"].append(sample)
            state["left"] -= 1
            finished = state["left"] == 0
        if finished:
            ordered = sorted(state["samples"], key=lambda s: s["index"])
            store.save(
                name,
                {
                    "version": RECORD_VERSION,
                    "problem": name,
                    "params": params.to_json(),
                    "prompt_digest": state["digest"],
                    "messages": state["messages"],
                    "samples": ordered,
                },
            )
            with lock:
                results[name] = ordered
                done_count[0] += 1
                total_done = done_count[0]
            if on_problem_done is not None:
                on_problem_done(name, len(state["missing"]), total_done)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futures = [
            pool.submit(run_one, name, index)
            for name, state in pending.items()
            for index in state["missing"]
        ]
        first_error: BaseException | None = None
        for future in concurrent.futures.as_completed(futures):
            if future.cancelled():
                continue
            exc = future.exception()
            if exc is not None and first_error is None:
                first_error = exc
                stop.set()
                for other in futures:
                    other.cancel()
    if first_error is not None:
        raise first_error
    return {name: results[name] for name, _ in items}
