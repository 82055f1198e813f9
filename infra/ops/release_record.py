"""Whether this stack's training run gave its TPU back (training.releaseWhenDone).

The training VM's `workloads release` writes `released.json` into the run directory before it
asks Cloud TPU to delete the node. `pulumi up` reads that record: while it exists for the
stack's runName, the program leaves the training node (and its deployment) out, so neither a
plain `pulumi up` nor `pulumi up --refresh` creates it again; a new runName is a new run.
"""

from __future__ import annotations

import json
from typing import Any

from infra.config import model as config_mod
from infra.config import runconfig_render
from workloads.common import storage


def read(cfg: config_mod.StackConfig) -> dict[str, Any] | None:
    """The release record of the stack's run, or None (not released, or not asked to release).

    Raises:
        Exception: the bucket could not be read (credentials, network); the caller decides.
    """
    if not cfg.training.release_when_done:
        return None
    uri = runconfig_render.release_marker_uri(cfg)
    if not storage.exists(uri):
        return None
    try:
        record = json.loads(storage.read_text(uri))
    except json.JSONDecodeError:
        record = {}
    return {**(record if isinstance(record, dict) else {}), "marker": uri}
