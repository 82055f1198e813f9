"""Remote work on the TPU workers over SSH, in layers:

- `layout`: where things live on a worker (shared with the startup scripts);
- `bundle`: what one deploy installs and its fingerprint;
- `errors`: what a failed step, worker or wait raises;
- `transport`: one checked command on a worker, waiting for a worker to be ready;
- `steps`: stage, activate and undeploy on one worker;
- `fleet`: the same across every worker of a VM, stage-all-then-activate-all.

The names below are the package's public surface; callers use `remote.deploy_all` and friends.
"""

from __future__ import annotations

from infra.remote.bundle import Bundle, fingerprint, sha256_text
from infra.remote.errors import DeployError, ReadyTimeout, RemoteError
from infra.remote.fleet import HostResult, deploy_all, undeploy_all
from infra.remote.layout import WORKER, RemoteLayout
from infra.remote.steps import StepHook, activate, prepare, read_state, undeploy
from infra.remote.transport import chain, reachable, run, wait_ready

__all__ = [
    "WORKER",
    "Bundle",
    "DeployError",
    "HostResult",
    "ReadyTimeout",
    "RemoteError",
    "RemoteLayout",
    "StepHook",
    "activate",
    "chain",
    "deploy_all",
    "fingerprint",
    "prepare",
    "reachable",
    "read_state",
    "run",
    "sha256_text",
    "undeploy",
    "undeploy_all",
    "wait_ready",
]
