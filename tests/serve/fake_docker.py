"""A stand-in for the `docker` CLI at the process boundary, playing the vLLM TPU container.

Every call appends its argv as one JSON line to $FAKE_DOCKER_LOG. Supported:
- `run ... --entrypoint vllm IMAGE serve PATH --served-model-name N ... --port P`: checks what
  vLLM would (a local model with offline mode needs PATH/config.json; a gs:// PATH is streamed,
  so it needs --load-format runai_streamer instead; the compile cache variable must point at a
  mounted dir), prints vLLM-like log lines, serves GET /health and /v1/models on
  127.0.0.1:P, writes two compile-cache entries into the mounted cache dir unless it already has
  some ("cache hit"), and exits 0 on SIGTERM. $FAKE_VLLM_MODE: ok | crash (exits 3 before
  listening) | never (listens, never ready) | die (ready, then exits 1 after 1 s);
  $FAKE_VLLM_DELAY: seconds before /health turns 200.
- `stop -t N NAME`, `rm -f NAME`: SIGTERM (stop, waits) or SIGKILL (rm) to the fake container.
- `exec NAME vllm bench serve ...`: writes a --save-result file (tests/bench/vllm_results.py)
  into --result-dir/--result-filename; exits 1 when the file name is in $FAKE_BENCH_FAIL.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import pathlib
import signal
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE_IN_CONTAINER = "/root/.cache/vllm/xla_cache"


def _state(name: str) -> pathlib.Path:
    root = pathlib.Path(os.environ.get("FAKE_DOCKER_STATE", "/tmp/fake-docker"))
    root.mkdir(parents=True, exist_ok=True)
    return root / f"{name}.pid"


def _running_pid(name: str) -> int | None:
    path = _state(name)
    if not path.exists():
        return None
    pid = int(path.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def _say(line: str) -> None:
    print(line, flush=True)


def _parse_run(args: list[str]) -> tuple[dict, str, list[str]]:
    opts: dict = {"-v": [], "-e": []}
    with_value = {"--name", "--network", "--shm-size", "-v", "-e", "--entrypoint"}
    i = 0
    while args[i].startswith("-"):
        flag = args[i]
        if flag in with_value:
            if flag in ("-v", "-e"):
                opts[flag].append(args[i + 1])
            else:
                opts[flag] = args[i + 1]
            i += 2
        else:
            opts[flag] = True
            i += 1
    return opts, args[i], args[i + 1 :]


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def run(args: list[str]) -> int:
    opts, _image, command = _parse_run(args)
    name = opts["--name"]
    env = dict(e.split("=", 1) if "=" in e else (e, os.environ.get(e, "")) for e in opts["-e"])
    mounts = dict(v.split(":")[1::-1] for v in opts["-v"])  # container path -> host path
    if opts.get("--entrypoint") != "vllm" or command[0] != "serve":
        _say(f"fake docker: expected --entrypoint vllm ... serve, got {command[:1]}")
        return 125
    model, served = command[1], _flag(command, "--served-model-name")
    port = int(_flag(command, "--port"))
    _say(f"INFO vllm serve {model} (served as {served}) on port {port}")
    if model.startswith("gs://"):
        if _flag(command, "--load-format") != "runai_streamer":
            _say(
                f"fake docker: {model} is object storage: only --load-format "
                "runai_streamer reads it"
            )
            return 1
        _say(f"INFO streaming {model} with the Run:ai Model Streamer")
    elif env.get("HF_HUB_OFFLINE") == "1" and not pathlib.Path(model, "config.json").is_file():
        _say(f"OSError: {model} is not a local folder with a config.json and offline mode is on")
        return 1
    cache_host = mounts.get(env.get("VLLM_XLA_CACHE_PATH", ""))
    if cache_host is None:
        _say("ERROR VLLM_XLA_CACHE_PATH does not point at a mounted directory")
        return 1
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    if mode == "crash":
        _say("ERROR RuntimeError: TPU initialization failed: Failed to get global TPU topology")
        return 3
    _state(name).write_text(str(os.getpid()))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ready_at = time.monotonic() + float(os.environ.get("FAKE_VLLM_DELAY", "0"))

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            ready = mode != "never" and time.monotonic() >= ready_at
            if self.path == "/health":
                self.send_response(200 if ready else 503)
                self.end_headers()
            elif self.path == "/v1/models":
                data = [{"id": served, "object": "model", "root": model}] if ready else []
                body = json.dumps({"object": "list", "data": data}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(404)
                self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    cache = pathlib.Path(cache_host)
    entries = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
    if entries:
        _say(f"INFO XLA cache hit: {len(entries)} entries")
    else:
        _say("INFO compiling token buckets 16..2048")
        cache.mkdir(parents=True, exist_ok=True)
        for bucket in ("prefill_16", "decode_16"):
            (cache / f"jit_{bucket}").write_bytes(os.urandom(2048))
    _say("INFO Application startup complete.")
    died_at = ready_at + 1.0 if mode == "die" else math.inf
    while not stop.wait(0.05):
        if time.monotonic() >= died_at:
            _say("ERROR EngineCore died unexpectedly")
            _state(name).unlink(missing_ok=True)
            return 1
    _say("INFO Shutting down")
    server.shutdown()
    _state(name).unlink(missing_ok=True)
    return 0


def stop(args: list[str]) -> int:
    """SIGTERM, then wait for the fake container to remove its pid file (it does at exit)."""
    name = args[-1]
    pid = _running_pid(name)
    if pid is None:
        print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _state(name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    print(name)
    return 0


def remove(args: list[str]) -> int:
    name = args[-1]
    pid = _running_pid(name)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    _state(name).unlink(missing_ok=True)
    return 0


def bench(args: list[str]) -> int:
    name, command = args[0], args[1:]
    if _running_pid(name) is None:
        print(f"Error response from daemon: container {name} is not running", file=sys.stderr)
        return 1
    if command[:3] != ["vllm", "bench", "serve"] or "--save-result" not in command:
        print(f"fake docker: unexpected exec {command}", file=sys.stderr)
        return 2
    filename = _flag(command, "--result-filename")
    if filename in os.environ.get("FAKE_BENCH_FAIL", "").split(","):
        print("ERROR: benchmark failed: Server disconnected", file=sys.stderr)
        return 1
    sys.path.insert(0, str(REPO))
    from tests.bench import vllm_results

    input_len = int(_flag(command, "--random-input-len"))
    rate = float(_flag(command, "--request-rate"))
    percentiles = tuple(_flag(command, "--metric-percentiles", "99").split(","))
    result = vllm_results.vllm_result(
        input_len=input_len,
        output_len=int(_flag(command, "--random-output-len")),
        request_rate=rate,
        num_prompts=int(_flag(command, "--num-prompts")),
        ttft_ms=20 + input_len / 100 * (1 + math.log2(min(rate, 128))),
        percentiles=percentiles,
    )
    metadata = command[command.index("--metadata") + 1 :] if "--metadata" in command else []
    for item in metadata:
        if item.startswith("--"):
            break
        key, value = item.split("=", 1)
        result[key] = value
    out = pathlib.Path(_flag(command, "--result-dir"), filename)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(vllm_results.dumps(result))
    out.with_name(out.stem + ".pytorch.json").write_text("[]")
    print(f"============ Serving Benchmark Result ============ ({filename})")
    return 0


def main(argv: list[str]) -> int:
    log = os.environ.get("FAKE_DOCKER_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(json.dumps(argv) + "\n")
    if argv[:1] == ["run"]:
        return run(argv[1:])
    if argv[:1] == ["stop"]:
        return stop(argv[1:])
    if argv[:1] == ["rm"]:
        return remove(argv[1:])
    if argv[:1] == ["exec"]:
        return bench(argv[1:])
    print(f"fake docker: unsupported command {argv[:1]}", file=sys.stderr)
    return 125


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
