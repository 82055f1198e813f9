"""Joining the hosts of a multi-host slice (v5p-16 and up: one trainer process per worker).

Every worker derives the same three values from what it already knows, the slice's worker list
and its own worker number: the coordinator (worker 0's address and a fixed port), the process
count (the number of workers) and the process id (the worker number). On a TPU VM the startup
script copies them from the GCE metadata (`instance/attributes/worker-network-endpoints` and
`agent-worker-number`) into the units' environment file; a rehearsal on one machine sets the same
variables itself (127.0.0.1 for every worker and a free port). One code path either way: JAX's
own detection is not used, because it only runs where it finds TPU hardware.

A lost worker must not wedge the others in a collective: the coordination service's heartbeat
timeout makes JAX end every other process (they exit non-zero, their units restart them, and all
resume from the newest checkpoint), and the initialisation timeout bounds how long a restarted
worker waits for the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
from collections.abc import Mapping

from workloads.common import errors

ENDPOINTS_ENV = "GEMMA4_WORKER_ENDPOINTS"
WORKER_ENV = "GEMMA4_WORKER"
PORT_ENV = "GEMMA4_COORDINATOR_PORT"
HEARTBEAT_ENV = "GEMMA4_HEARTBEAT_TIMEOUT_S"
INIT_ENV = "GEMMA4_INIT_TIMEOUT_S"
SHUTDOWN_ENV = "GEMMA4_SHUTDOWN_TIMEOUT_S"

# JAX's own choice for Cloud TPU slices (jax._src.clusters.cloud_tpu_cluster).
DEFAULT_PORT = 8482
# A worker silent this long is taken as dead and the others are ended. JAX's default is 100 s;
# 60 s still rides out a long garbage-collection pause or a busy host, and gives a slice whose
# worker died back to systemd sooner.
DEFAULT_HEARTBEAT_S = 60
# How long a starting worker waits for the others. The workers of a new slice get ready minutes
# apart (worker 0 downloads the weights the others wait for, then each loads them), so this is
# generous; past it the process exits non-zero and systemd starts it again.
DEFAULT_INIT_S = 1800
# How long a finished process waits for the others at the shutdown barrier.
DEFAULT_SHUTDOWN_S = 300


@dataclasses.dataclass(frozen=True)
class Hosts:
    """This process's place in a multi-host run."""

    coordinator: str  # host:port of process 0's coordination service
    count: int
    index: int
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S
    init_timeout_s: int = DEFAULT_INIT_S
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_S


def parse_endpoints(text: str) -> list[str]:
    """The workers' addresses from `worker-network-endpoints`: comma-separated, each a host name
    or address, or the older `name:id:address` triple (the two forms the metadata server uses).

    Raises:
        errors.UserError: an empty entry or another form.
    """
    addresses = []
    for entry in text.split(","):
        parts = entry.strip().split(":")
        if len(parts) == 1 and parts[0]:
            addresses.append(parts[0])
        elif len(parts) == 3 and parts[2]:
            addresses.append(parts[2])
        else:
            raise errors.UserError(
                f"{ENDPOINTS_ENV}={text!r}: entry {entry!r} is neither an address nor "
                "name:id:address; allowed: comma-separated addresses"
            )
    return addresses


def _int_env(env: Mapping[str, str], name: str, default: int | None, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw and default is not None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise errors.UserError(f"{name}={raw!r}: must be an integer from {low} to {high}")
    return int(raw)


def from_env(env: Mapping[str, str] | None = None) -> Hosts | None:
    """This process's place from the environment; None for a one-host run (no worker list, or
    a list of one).

    Raises:
        errors.UserError: a malformed worker list, a worker number outside it, a bad port or
            timeout (one line naming the variable, its value and what is allowed).
    """
    env = os.environ if env is None else env
    text = env.get(ENDPOINTS_ENV, "").strip()
    if not text:
        return None
    workers = parse_endpoints(text)
    if len(workers) == 1:
        return None
    index = _int_env(env, WORKER_ENV, None, 0, len(workers) - 1)
    port = _int_env(env, PORT_ENV, DEFAULT_PORT, 1, 65535)
    return Hosts(
        coordinator=f"{workers[0]}:{port}",
        count=len(workers),
        index=index,
        heartbeat_timeout_s=_int_env(env, HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S, 1, 86400),
        init_timeout_s=_int_env(env, INIT_ENV, DEFAULT_INIT_S, 1, 86400),
        shutdown_timeout_s=_int_env(env, SHUTDOWN_ENV, DEFAULT_SHUTDOWN_S, 1, 86400),
    )


def join(hosts: Hosts | None) -> None:
    """Connects this process to the others (jax.distributed.initialize); nothing for one host.
    Must run before anything touches a JAX device."""
    if hosts is None:
        return
    import jax

    # CPU devices (a rehearsal) need a cross-process collectives backend; TPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=hosts.coordinator,
        num_processes=hosts.count,
        process_id=hosts.index,
        initialization_timeout=hosts.init_timeout_s,
        heartbeat_timeout_seconds=hosts.heartbeat_timeout_s,
        shutdown_timeout_seconds=hosts.shutdown_timeout_s,
    )
    if jax.default_backend() == "cpu":
        share_cpu_cache_entries()
        share_cpu_executables()


def share_cpu_cache_entries() -> None:
    """Lets CPU processes standing in for a slice's hosts (the demo's `--hosts`, the tests'
    slices) find each other's persistent compilation cache entries, as a TPU slice's hosts do.

    JAX hashes the accelerator topology into every entry's key, and its CPU client's topology
    fingerprint differs per process, where a TPU slice's is the slice's on every host. Only
    process 0 writes entries, so host 1 never found one and compiled the step again on every
    resume while host 0, served from the cache, waited for it at the first barrier. Hashing the
    devices' kinds instead is JAX's own fallback for a backend without a topology; the key still
    holds the program and the compile options, which name every device of the assignment.
    Nothing happens if a JAX release no longer has the function (the hosts then compile)."""
    from jax._src import cache_key

    hash_devices = getattr(cache_key, "_hash_devices", None)
    if hash_devices is None or not hasattr(cache_key, "_hash_accelerator_config"):
        return
    cache_key._hash_accelerator_config = hash_devices


# How long a CPU host waits for host 0 to compile a program and hand it over
# (share_cpu_executables): far more than any program of the tiny models the CPU slices train
# takes to compile on a busy machine (under a minute), far less than JAX's default of 20 minutes
# of a hang.
SHARED_COMPILE_TIMEOUT_S = 600


def share_cpu_executables() -> None:
    """Lets host 0 of a CPU stand-in slice compile each program once for all hosts: the others
    wait for its executable through the coordination service (JAX's
    `jax_share_binary_between_hosts`), instead of every process compiling the same program on the
    same two cores at once (the 4-host test compiled each program four times).

    Only for CPU hosts, which always share one compilation cache directory (one machine) and find
    each other's entries (share_cpu_cache_entries): a host that missed the cache where host 0 hit
    it would wait for an executable host 0 never sends. TPU hosts compile for themselves, as
    before (their caches may differ: a replaced VM with a local cache directory)."""
    import jax

    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", SHARED_COMPILE_TIMEOUT_S * 1000)


# How long a host waits at a barrier for the slowest one (a host that died ends the wait sooner:
# the heartbeat timeout).
BARRIER_TIMEOUT_S = 1800


def barrier(name: str) -> None:
    """Waits until every host of the run reaches the barrier `name` (nothing for one host).

    Through the coordination service, not a device collective: on CPU devices the first gloo
    collective of a set of devices waits only 30 s for the other hosts (a fixed limit of XLA's),
    and hosts that compiled the step at different speeds arrive minutes apart. TPU collectives
    have no such limit; the barrier costs them one round trip.
    """
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client jax.distributed.initialize created

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"gemma4-{name}", BARRIER_TIMEOUT_S * 1000)


# How long a host that does not see host 0's token file looks again before it concludes the
# directory is not shared: a shared filesystem (NFS) may cache a missing name for a few seconds.
SHARED_LOOK_S = 5.0
SHARED_CHECK_PREFIX = ".hosts-shared-check-"


def check_shared_directory(directory: str, what: str = "train.output_dir") -> None:
    """Stops every host of a multi-host run when `directory` (a local path) is not one directory
    all of them see: host 0 writes a token file there, all wait at a barrier, each other host
    looks for the token, and all learn every host's answer. Without this a slice whose workers
    each have their own local run directory trains on, each host saving its own part of every
    checkpoint where no other host sees it; it only shows when the run resumes.

    Nothing for one host or a gs:// URL (a bucket is shared by definition).

    Args:
        directory: the run directory (created by host 0 when missing).
        what: the setting it comes from, for the message.

    Raises:
        errors.UserError: on every host, when some host does not see host 0's token (one line
            naming the directory, the hosts and what is allowed).
    """
    import jax

    if jax.process_count() == 1 or "://" in directory:
        return
    import secrets

    import numpy as np
    from jax.experimental import multihost_utils

    primary = jax.process_index() == 0
    barrier("shared-directory")
    # int32: JAX without x64 keeps 32 bits of what it broadcasts.
    token = int(
        multihost_utils.broadcast_one_to_all(np.int32(secrets.randbelow(2**31) if primary else 0))
    )
    path = os.path.join(directory, f"{SHARED_CHECK_PREFIX}{token:08x}")
    if primary:
        _write_token(path, token)
    barrier("shared-directory-written")
    seen = primary or _sees_token(path, token)
    answers = multihost_utils.process_allgather(np.int32(seen))
    barrier("shared-directory-read")
    if primary:
        with contextlib.suppress(OSError):
            os.remove(path)
    blind = [i for i, ok in enumerate(np.asarray(answers).reshape(-1)) if not ok]
    if blind:
        raise errors.UserError(
            f"{what}={directory}: host(s) {', '.join(map(str, blind))} of {jax.process_count()} "
            "do not see the files host 0 writes there; a multi-host run needs a directory every "
            "host shares (a gs:// bucket or a shared filesystem)"
        )


def _write_token(path: str, token: int) -> None:
    """The token file, written whole before it appears (rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as out:
        out.write(str(token))
    os.replace(partial, path)


def _sees_token(path: str, token: int) -> bool:
    """Whether this host reads `token` from `path`, looking again for up to SHARED_LOOK_S."""
    deadline = time.monotonic() + SHARED_LOOK_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            os.listdir(os.path.dirname(path))  # revalidates a network filesystem's name cache
            with open(path) as got:
                if int(got.read()) == token:
                    return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def rehearsal_env(count: int, index: int, port: int, heartbeat_s: int = 10) -> dict[str, str]:
    """The variables that make one process of `count` on this machine a worker of a slice (the
    demo's --hosts and the multi-host tests): every worker at 127.0.0.1."""
    return {
        ENDPOINTS_ENV: ",".join(["127.0.0.1"] * count),
        WORKER_ENV: str(index),
        PORT_ENV: str(port),
        HEARTBEAT_ENV: str(heartbeat_s),
        INIT_ENV: "120",
        SHUTDOWN_ENV: "30",
    }


def free_port() -> int:
    """A TCP port free on this machine now (for a rehearsal's coordinator)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_local(
    count: int,
    argv: list[str],
    *,
    port: int,
    devices_per_host: int,
    log_dir: str,
    index: int | None = None,
    heartbeat_s: int = 10,
    extra_env: Mapping[str, str] | None = None,
) -> dict[int, subprocess.Popen[bytes]]:
    """Starts the workers of a slice rehearsed on this machine: `argv` once per worker (or only
    worker `index`), each with `devices_per_host` CPU devices and the variables `from_env`
    reads; stdout and stderr go to `<log_dir>/host<i>.log` (appended: a restart adds to it).

    Returns:
        worker number -> its subprocess.Popen.
    """
    os.makedirs(log_dir, exist_ok=True)
    started: dict[int, subprocess.Popen[bytes]] = {}
    for i in range(count) if index is None else [index]:
        env = {
            **os.environ,
            **(extra_env or {}),
            **rehearsal_env(count, i, port, heartbeat_s),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_host}",
        }
        with open(os.path.join(log_dir, f"host{i}.log"), "ab") as log:
            started[i] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    return started
