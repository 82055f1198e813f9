"""A deploy across every worker of a VM: prepare all, then activate all, failures collected."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import fabric

import infra.remote.ssh as ssh
from infra.remote.bundle import Bundle
from infra.remote.errors import DeployError, RemoteError
from infra.remote.steps import (
    StepHook,
    WorkerState,
    activate,
    log_step,
    prepare,
    prune,
    read_worker,
    undeploy,
)
from infra.remote.transport import host_name, wait_ready
from infra.vm.layout import RemoteLayout


@dataclasses.dataclass
class HostResult:
    host: str
    changed: bool


def _layouts(
    conns: Sequence[fabric.Connection], layout: RemoteLayout | Sequence[RemoteLayout]
) -> dict[int, RemoteLayout]:
    layouts = [layout] * len(conns) if isinstance(layout, RemoteLayout) else list(layout)
    if len(layouts) != len(conns):
        raise ValueError(f"{len(layouts)} layouts for {len(conns)} workers")
    return {id(c): lay for c, lay in zip(conns, layouts, strict=True)}


def deploy_all(
    vm: str,
    conns: Sequence[fabric.Connection],
    bundle: Bundle,
    layout: RemoteLayout | Sequence[RemoteLayout],
    *,
    sudo: bool,
    ready_timeout_s: float = 3600.0,
    ready_initial_delay_s: float = 2.0,
    settings: ssh.SshSettings | None = None,
    hook: StepHook | None = None,
) -> list[HostResult]:
    """Deploys `bundle` to every worker of a VM in parallel.

    Phase 1 on every worker: wait for SSH and the ready marker, read the deployed state, and on
    workers that differ build and verify the new release next to the running one (upload, venv,
    wheel, config, units). Only when every worker has its release complete does phase 2
    activate them (stop, switch `current`, units, start, record, prune), so a worker that cannot
    be reached or cannot install leaves the running job of every worker untouched. A worker
    that fails in phase 2 is named with its step; the others finish. A deploy interrupted
    anywhere (a kill, a lost connection, a full disk) converges on the next one.

    Args:
        layout: where things live: one layout for every worker (a real slice), or one per
            worker (tests run several "workers" on one machine).

    Raises:
        DeployError: one line per failed worker.
    """
    hook = hook or log_step
    layouts = _layouts(conns, layout)

    def stage(conn: fabric.Connection) -> tuple[WorkerState, str | None]:
        lay = layouts[id(conn)]
        wait_ready(
            conn,
            lay,
            timeout_s=ready_timeout_s,
            initial_delay_s=ready_initial_delay_s,
            sudo=sudo,
            settings=settings,
        )
        hook(host_name(conn), "check")
        worker = read_worker(conn, lay, bundle)
        if worker.up_to_date(bundle):
            if worker.leftovers(bundle):  # a deploy was stopped while it pruned
                keep = [bundle.release, worker.state.get("previous") or bundle.release]
                prune(conn, lay, keep, sudo=sudo, hook=hook)
            return worker, None
        return worker, prepare(conn, bundle, lay, worker, sudo=sudo, hook=hook)

    staged = _parallel(vm, conns, stage)
    results = [
        HostResult(host_name(c), stage_dir is not None)
        for c, (_, stage_dir) in zip(conns, staged, strict=True)
    ]
    todo = {id(c): (c, s, d) for c, (s, d) in zip(conns, staged, strict=True) if d is not None}

    def go(conn: fabric.Connection) -> None:
        _, worker, _ = todo[id(conn)]
        activate(conn, bundle, layouts[id(conn)], worker, sudo=sudo, hook=hook)

    _parallel(vm, [c for c, _, _ in todo.values()], go)
    return results


def undeploy_all(
    vm: str,
    conns: Sequence[fabric.Connection],
    layout: RemoteLayout | Sequence[RemoteLayout],
    units: Sequence[str],
    *,
    sudo: bool,
    hook: StepHook | None = None,
) -> None:
    """Stops and removes the job on every worker in parallel.

    Raises:
        DeployError: one line per failed worker.
    """
    layouts = _layouts(conns, layout)
    _parallel(vm, conns, lambda c: undeploy(c, layouts[id(c)], units, sudo=sudo, hook=hook))


def _parallel(
    vm: str, conns: Sequence[fabric.Connection], fn: Callable[[fabric.Connection], Any]
) -> list[Any]:
    """Runs fn on every connection in its own thread; collects every failure before raising."""
    if not conns:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(conns)) as pool:
        futures = [pool.submit(fn, c) for c in conns]
        concurrent.futures.wait(futures)
    errors = []
    for conn, fut in zip(conns, futures, strict=True):
        exc = fut.exception()
        if exc is None:
            continue
        if isinstance(exc, RemoteError | ssh.SshError):
            errors.append(exc)
        else:
            errors.append(
                RemoteError(host_name(conn), "deploy", None, None, f"{type(exc).__name__}: {exc}")
            )
    if errors:
        raise DeployError(vm, errors)
    return [f.result() for f in futures]
