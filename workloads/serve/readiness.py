"""Waiting for a vLLM OpenAI server: GET /health answers 200 and GET /v1/models lists the name.

vLLM answers /health as soon as the HTTP server is up, but the model only serves after the
weights are loaded and the token buckets are compiled; /v1/models naming the served model is the
check that requests will work (the paper's readiness check).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from workloads.common import errors


class NotReadyError(errors.UserError):
    """The server did not become ready: timeout, or the container exited first."""


def probe(base_url: str, model_name: str, *, timeout_s: float = 5.0) -> tuple[bool, str]:
    """One readiness check.

    Returns:
        (ready, what was seen): e.g. (False, "GET /health -> 503").
    """
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"readiness URL {base_url!r} must be http:// or https://")
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout_s) as response:  # noqa: S310
            if response.status != 200:
                return False, f"GET /health -> {response.status}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout_s) as response:  # noqa: S310
            body = response.read()
    except urllib.error.HTTPError as exc:
        return False, f"GET {exc.url.removeprefix(base) if exc.url else ''} -> {exc.code}"
    except urllib.error.URLError as exc:
        return False, f"no answer from {base} ({exc.reason})"
    except (TimeoutError, OSError) as exc:
        return False, f"no answer from {base} ({type(exc).__name__}: {exc or 'timed out'})"
    try:
        names = [entry["id"] for entry in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return False, f"GET /v1/models -> not an OpenAI model list: {body[:200]!r}"
    if model_name not in names:
        return False, f"GET /v1/models lists {names}, not {model_name!r}"
    return True, "ready"


def _failure(message: str, log_excerpt: Callable[[], str]) -> NotReadyError:
    excerpt = log_excerpt().rstrip()
    if excerpt:
        message += "\n--- last lines of the container log ---\n" + excerpt
    return NotReadyError(message)


def wait_ready(
    base_url: str,
    model_name: str,
    *,
    timeout_s: float,
    poll_s: float = 5.0,
    request_timeout_s: float = 5.0,
    log_excerpt: Callable[[], str] = lambda: "",
    alive: Callable[[], bool] = lambda: True,
    cancelled: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> bool:
    """Polls until the server is ready.

    Args:
        base_url: e.g. http://127.0.0.1:8000.
        model_name: the served model name that /v1/models must list.
        timeout_s: give up after this many seconds.
        poll_s: pause between checks.
        request_timeout_s: limit of one HTTP request.
        log_excerpt: returns the last lines of the server's log, for the error message.
        alive: returns False once the server process has exited (fail at once, not at timeout).
        cancelled: returns True when the caller is shutting down.

    Returns:
        True when ready; False when `cancelled()` became true first.

    Raises:
        NotReadyError: timeout, or the process exited; the message has the last observation
            and the log excerpt.
    """
    start = clock()
    seen = "no check yet"
    while True:
        if cancelled():
            return False
        if not alive():
            raise _failure(
                f"the vLLM container exited before {base_url} was ready (last check: {seen})",
                log_excerpt,
            )
        ready, seen = probe(base_url, model_name, timeout_s=request_timeout_s)
        if ready:
            return True
        if clock() - start >= timeout_s:
            raise _failure(
                f"{base_url} not ready after {timeout_s:g} s (last check: {seen}); "
                "raise serve.ready_timeout_s if the compile is just slow",
                log_excerpt,
            )
        sleep(poll_s)
