"""`python -m workloads serve --config RUN.yaml [--dry-run]`: the merged model behind vLLM.

Steps (each one restartable; systemd's gemma4-serve.service runs this in the foreground):
1. wait (bounded) for the merge's completion marker in serve.model_dir;
2. stage a gs:// model to serve.local_dir (parallel, already-complete files skipped, checksums
   verified against merge_metadata.json); a local model is verified in place; a hub id is
   neither (vLLM downloads it with the HF token); with serve.weights_from bucket a gs:// model
   is neither staged nor verified on the host: vLLM streams it (--load-format runai_streamer);
3. restore the XLA compile cache from serve.compile_cache_gcs;
4. start vLLM with serve.launcher (argv: workloads/serve/argv.py, the same vLLM flags either
   way): `docker run` the pinned vLLM TPU image on the serving VM, or (`process`, the local
   rehearsal) the CPU build of the same release from the serving venv; its log streamed to our
   stdout and the last lines kept for error messages;
5. wait for /health and the served name in /v1/models;
6. serve until SIGTERM/SIGINT (forwarded as `docker stop`) or the container exits, uploading the
   compile cache every serve.compile_cache_sync_s seconds and once more at exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from workloads.common import cli_options, errors, logs
from workloads.contract import runconfig, settings
from workloads.serve import argv as argv_lib
from workloads.serve import compile_cache, merged_weights, readiness

LOG = logs.get("serve")

LOG_TAIL_LINES = 60
_TICK_S = 0.5


class ServeError(errors.UserError):
    """The server stopped by itself or could not be started (a run-time failure: exit 1)."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cli_options.add_config(parser, required=True)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be staged and the docker command, then exit",
    )


def load_serve(config: str) -> runconfig.ServingRunSection:
    """The serve section of a run config.

    Raises:
        errors.UserError: the config has no serve section.
    """
    cfg = runconfig.load(config)
    if cfg.serve is None:
        raise errors.UserError(f"{config}: serve: the run config has no serve section")
    return cfg.serve


class Container:
    """The `docker run` child process: its output echoed and the last lines kept.

    The docker client runs in its own session so that a Ctrl-C in a terminal reaches the
    container once, through stop(), and not also through docker's own signal proxy.
    """

    def __init__(
        self,
        serve: runconfig.ServingRunSection,
        run_argv: list[str],
        *,
        docker: str = "docker",
        echo: TextIO | None = None,
        tail_lines: int = LOG_TAIL_LINES,
    ) -> None:
        self._serve = serve
        self._argv = run_argv
        self._docker = docker
        self._echo = echo if echo is not None else sys.stdout
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._proc: subprocess.Popen[str] | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        try:
            subprocess.run(
                argv_lib.remove_argv(self._serve, docker=self._docker),
                capture_output=True,
                check=False,
            )
            self._spawn(env=None)
        except FileNotFoundError:
            raise ServeError(
                f"{self._docker}: not found on PATH; the serving VM's startup "
                "script installs Docker"
            ) from None
        self._pump = threading.Thread(target=self._read, name="vllm-log", daemon=True)
        self._pump.start()

    def _spawn(self, env: dict[str, str] | None) -> None:
        """Starts the child in its own session, its output a line-buffered text pipe (env None:
        this process's environment)."""
        self._proc = subprocess.Popen(
            self._argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
            start_new_session=True,
            env=env,
        )

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._tail.append(line)
            self._echo.write(line)
            self._echo.flush()

    def tail(self) -> str:
        if self._pump is not None and self._proc is not None and self._proc.poll() is not None:
            self._pump.join(timeout=2)  # the last lines before an exit are the useful ones
        return "".join(self._tail)

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> int | None:
        """Forwards the stop: `docker stop` (SIGTERM, SIGKILL after stop_timeout_s); waits."""
        if self._proc is None:
            return None
        grace = self._serve.stop_timeout_s + 30
        if self._proc.poll() is None:
            LOG.info(f"stopping container {self._serve.container_name}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    argv_lib.stop_argv(self._serve, docker=self._docker),
                    capture_output=True,
                    check=False,
                    timeout=grace,
                )
        try:
            return self._proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


class LocalProcess(Container):
    """The process launcher's server: the serving venv's vLLM as a child process in its own
    process group (the API server and its engine core), its output echoed and the last lines kept.
    Stopped as `docker stop` stops the container: SIGTERM to the group, SIGKILL after
    serve.stop_timeout_s."""

    def __init__(
        self,
        serve: runconfig.ServingRunSection,
        run_argv: list[str],
        env: dict[str, str],
        *,
        echo: TextIO | None = None,
        tail_lines: int = LOG_TAIL_LINES,
    ) -> None:
        super().__init__(serve, run_argv, echo=echo, tail_lines=tail_lines)
        self._env = env

    def start(self) -> None:
        try:
            self._spawn(env={**os.environ, **self._env})
        except (FileNotFoundError, PermissionError):
            raise ServeError(
                f"{self._argv[0]}: no serving engine there; `bash .ci/setup` installs vLLM's CPU "
                "build into .venv-serve (or set serve.engine_python)"
            ) from None
        self._pump = threading.Thread(target=self._read, name="vllm-log", daemon=True)
        self._pump.start()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def stop(self) -> int | None:
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            LOG.info(f"stopping vLLM (pid {self._proc.pid})")
        self._signal_group(signal.SIGTERM)
        try:
            code = self._proc.wait(timeout=self._serve.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            code = self._proc.wait()
        # The engine core is a child in the same group: make sure none outlives the server.
        self._signal_group(signal.SIGKILL)
        return code


def launch_argv(
    serve: runconfig.ServingRunSection, source: argv_lib.ModelSource, *, docker: str = "docker"
) -> list[str]:
    """The server's command line for serve.launcher (the same vLLM flags either way)."""
    if serve.launcher == "process":
        return argv_lib.process_serve_argv(serve, source)
    return argv_lib.serve_argv(serve, source, docker=docker)


def make_server(
    serve: runconfig.ServingRunSection,
    source: argv_lib.ModelSource,
    *,
    docker: str = "docker",
    echo: TextIO | None = None,
) -> Container:
    """The launcher serve.launcher names, not yet started."""
    run_argv = launch_argv(serve, source, docker=docker)
    if serve.launcher == "process":
        return LocalProcess(serve, run_argv, argv_lib.process_env(serve, source), echo=echo)
    return Container(serve, run_argv, docker=docker, echo=echo)


class StopFlag:
    """A stop request a signal handler can set: the threading.Event interface (set, is_set,
    wait) without its lock. A handler runs on the main thread between bytecodes; if that thread
    was inside Event.wait() holding the event's (non-reentrant) lock, Event.set() in the handler
    waits for that lock forever: the serve command then ignored SIGTERM. set() here only stores
    a flag, and wait() naps in short steps that a signal cuts short."""

    _STEP_S = 0.05

    def __init__(self) -> None:
        self._requested = False

    def set(self) -> None:
        self._requested = True

    def is_set(self) -> bool:
        return self._requested

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._requested:
            left = self._STEP_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, self._STEP_S))
        return True


@contextlib.contextmanager
def stop_signals() -> Iterator[StopFlag]:
    """A flag set by SIGTERM or SIGINT while inside the block (main thread only)."""
    flag = StopFlag()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def prepare_model(
    serve: runconfig.ServingRunSection,
    source: argv_lib.ModelSource,
    stop: StopFlag | threading.Event,
) -> bool:
    """Waits for, stages and verifies the weights (a model streamed from its bucket: waits
    only). False when stopped while waiting."""
    if source.from_hub:
        if argv_lib.HF_TOKEN_ENV not in os.environ:
            LOG.warning(f"{argv_lib.HF_TOKEN_ENV} is not set; a gated hub model will not download")
        return True
    location = source.location
    if source.kind == "local":
        location = location.removeprefix("file://")
    if serve.model_wait_timeout_s > 0 and not merged_weights.wait_for_marker(
        location,
        timeout_s=serve.model_wait_timeout_s,
        poll_s=serve.model_wait_poll_s,
        cancelled=stop.is_set,
        sleep=stop.wait,
    ):
        return False
    if source.kind == "bucket":
        LOG.info(_streamed_note(location))
        return True
    start = time.monotonic()
    if source.kind == "remote":
        report = merged_weights.stage_model(
            location, source.serve_path, workers=serve.stage_workers
        )
        LOG.info(
            f"staged {location} -> {source.serve_path}: {len(report.downloaded)} downloaded "
            f"({report.bytes_downloaded / 1e9:.2f} GB), {len(report.skipped)} already complete, "
            f"{time.monotonic() - start:.0f} s"
        )
    else:
        merged_weights.verify_local(location, workers=serve.stage_workers)
        LOG.info(
            f"verified {location} against {merged_weights.METADATA} "
            f"({time.monotonic() - start:.0f} s)"
        )
    return True


def _streamed_note(location: str) -> str:
    return (
        f"weights stream from the bucket: vLLM reads {location} with --load-format "
        f"{settings.RUNAI_STREAMER} (serve.weights_from bucket); nothing is staged and the "
        f"checksums are not verified on this host (the merge verified them when it wrote "
        f"{merged_weights.METADATA})"
    )


def _restore_cache(serve: runconfig.ServingRunSection) -> None:
    if not serve.compile_cache_gcs:
        return
    try:
        count = compile_cache.restore(serve.compile_cache_gcs, serve.compile_cache_dir)
    except Exception as exc:  # the cache only saves time: serve without it rather than not at all
        LOG.warning(
            f"compile cache restore from {serve.compile_cache_gcs} failed ({exc}); "
            "vLLM will compile from scratch"
        )
        return
    LOG.info(f"restored {count} compile cache file(s) from {serve.compile_cache_gcs}")


def _sync_cache(serve: runconfig.ServingRunSection, *, min_age_s: float) -> None:
    if not serve.compile_cache_gcs:
        return
    try:
        count = compile_cache.push(
            serve.compile_cache_dir,
            serve.compile_cache_gcs,
            min_age_s=min_age_s,
        )
    except Exception as exc:  # a failed upload must not take the server down; retried later
        LOG.warning(f"compile cache upload to {serve.compile_cache_gcs} failed: {exc}")
        return
    if count:
        LOG.info(f"uploaded {count} compile cache file(s) to {serve.compile_cache_gcs}")


def run(serve: runconfig.ServingRunSection, *, docker: str = "docker") -> int:
    """Runs the whole serve flow in the foreground (see the module docstring).

    Returns:
        0 after a requested stop (SIGTERM/SIGINT).

    Raises:
        ServeError: the server exited by itself; readiness.NotReadyError: it never got ready;
        staging.StagingError: the weights are missing or corrupt.
    """
    source = argv_lib.model_source(serve)
    with stop_signals() as stop:
        if not prepare_model(serve, source, stop):
            LOG.info("stopped while waiting for the merged model")
            return 0
        os.makedirs(serve.compile_cache_dir, exist_ok=True)
        _restore_cache(serve)
        server = make_server(serve, source, docker=docker)
        LOG.info("starting: " + shlex.join(launch_argv(serve, source, docker=docker)))
        server.start()
        try:
            return _serve_until_stopped(serve, server, stop)
        finally:
            server.stop()
            _sync_cache(serve, min_age_s=0)


@contextlib.contextmanager
def serving(
    serve: runconfig.ServingRunSection, *, echo: TextIO | None = None
) -> Iterator[Container]:
    """The model served for the length of the block (the demo's serve step): the weights checked,
    the server started by serve.launcher and ready, stopped at the end whatever happens.

    Raises:
        ServeError, readiness.NotReadyError, staging.StagingError: as run().
    """
    source = argv_lib.model_source(serve)
    prepare_model(serve, source, StopFlag())
    server = make_server(serve, source, echo=echo)
    server.start()
    try:
        readiness.wait_ready(
            argv_lib.local_url(serve),
            serve.served_model_name,
            timeout_s=serve.ready_timeout_s,
            poll_s=serve.ready_poll_s,
            log_excerpt=server.tail,
            alive=server.alive,
        )
        yield server
    finally:
        server.stop()


def _serve_until_stopped(
    serve: runconfig.ServingRunSection, container: Container, stop: StopFlag | threading.Event
) -> int:
    url = argv_lib.local_url(serve)
    start = time.monotonic()
    if not readiness.wait_ready(
        url,
        serve.served_model_name,
        timeout_s=serve.ready_timeout_s,
        poll_s=serve.ready_poll_s,
        log_excerpt=container.tail,
        alive=container.alive,
        cancelled=stop.is_set,
        sleep=stop.wait,
    ):
        LOG.info("stopped before the server was ready")
        return 0
    LOG.info(
        f"ready: {url}/v1 serves {serve.served_model_name!r} "
        f"({time.monotonic() - start:.0f} s after launch)"
    )
    _sync_cache(serve, min_age_s=10)
    next_sync = time.monotonic() + serve.compile_cache_sync_s
    while not stop.wait(_TICK_S):
        code = container.poll()
        if code is not None:
            raise ServeError(
                f"the vLLM container exited with status {code} while serving\n"
                "--- last lines of the container log ---\n" + container.tail().rstrip()
            )
        if time.monotonic() >= next_sync:
            _sync_cache(serve, min_age_s=10)
            next_sync = time.monotonic() + serve.compile_cache_sync_s
    LOG.info("stop requested")
    return 0


def describe(serve: runconfig.ServingRunSection, *, docker: str = "docker") -> str:
    """The plan --dry-run prints: where the weights come from and the exact docker command."""
    source = argv_lib.model_source(serve)
    lines = [f"model: {source.location} ({source.kind})"]
    if source.kind == "remote":
        lines.append(
            f"stage: {source.location} -> {source.serve_path} "
            f"(wait up to {serve.model_wait_timeout_s} s for "
            f"{' + '.join(merged_weights.MARKERS)}, "
            f"verify checksums from {merged_weights.METADATA})"
        )
    elif source.kind == "bucket":
        lines.append(
            f"stream: wait up to {serve.model_wait_timeout_s} s for "
            f"{' + '.join(merged_weights.MARKERS)}, then {_streamed_note(source.location)}"
        )
    elif source.kind == "local":
        lines.append(f"verify: {source.serve_path} against {merged_weights.METADATA}")
    if serve.compile_cache_gcs:
        lines.append(
            f"compile cache: {serve.compile_cache_gcs} <-> {serve.compile_cache_dir} "
            f"(every {serve.compile_cache_sync_s} s and at exit)"
        )
    else:
        lines.append(
            f"compile cache: {serve.compile_cache_dir} (not synced: compile_cache_gcs unset)"
        )
    lines.append("run: " + shlex.join(launch_argv(serve, source, docker=docker)))
    lines.append(
        f"ready when: {argv_lib.local_url(serve)}/health is 200 and /v1/models lists "
        f"{serve.served_model_name!r} (timeout {serve.ready_timeout_s} s)"
    )
    if serve.launcher == "process":
        lines.append(
            f"stop: SIGTERM to the server's process group, SIGKILL after {serve.stop_timeout_s} s"
        )
    else:
        lines.append("stop: " + shlex.join(argv_lib.stop_argv(serve, docker=docker)))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a requested stop; 1 when the server failed at run time (systemd
    restarts it); 2 for a problem restarting cannot fix (config, missing or corrupt weights)."""
    serve = load_serve(args.config)
    if args.dry_run:
        print(describe(serve))
        return 0
    try:
        return run(serve)
    except (ServeError, readiness.NotReadyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
