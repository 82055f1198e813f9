"""Remote work on the TPU workers over SSH, in layers:

- `layout`: where things live on a worker (shared with the startup scripts);
- `bundle`: what one deploy installs and its fingerprint;
- `errors`: what a failed step, worker or wait raises;
- `transport`: one checked command on a worker, waiting for a worker to be ready;
- `release`: the remote commands that build, verify, switch to and prune a release;
- `space`: free disk space, checked before writing and named when a write failed;
- `steps`: prepare, activate and undeploy on one worker;
- `fleet`: the same across every worker of a VM, prepare-all-then-activate-all.

The names below are the package's public surface; callers use `remote.deploy_all` and friends.
The modules inside import each other by full path (`import infra.remote.ssh as ssh`), never from
this init, which imports them (tests/test_import_cycles.py).
"""

from __future__ import annotations

from infra.remote.bundle import Bundle, fingerprint, sha256_text
from infra.remote.errors import DeployError, DiskFull, ReadyTimeout, RemoteError
from infra.remote.fleet import HostResult, deploy_all, undeploy_all
from infra.remote.steps import (
    StepHook,
    WorkerState,
    activate,
    prepare,
    read_state,
    read_worker,
    undeploy,
)
from infra.remote.transport import chain, reachable, run, wait_ready
from infra.vm.layout import WORKER, RemoteLayout

__all__ = [
    "WORKER",
    "Bundle",
    "DeployError",
    "DiskFull",
    "HostResult",
    "ReadyTimeout",
    "RemoteError",
    "RemoteLayout",
    "StepHook",
    "WorkerState",
    "activate",
    "chain",
    "deploy_all",
    "fingerprint",
    "prepare",
    "reachable",
    "read_state",
    "read_worker",
    "run",
    "sha256_text",
    "undeploy",
    "undeploy_all",
    "wait_ready",
]
