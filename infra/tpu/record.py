"""The recorded create request of a TPU node: what recovery recreates the node from.

`pulumi up` writes one JSON object per VM into the training bucket (`recovery/<node name>.json`,
infra/config/runconfig_render.recovery_record_uri): the placement Request the TpuNode resource
creates its node with (project, node id, zones in order, the queue, the node's spec as
the Cloud TPU API names its fields: accelerator, runtime, scheduling, service account, network,
tags, labels, metadata with the startup script and ssh-keys, which hold no secret), plus where
the run writes and where the VM reports a failed boot. Recovery (infra/ops/recover.py) reads it
and places a new node with infra/tpu/placement.py, so the controller needs no Pulumi state, CLI
or passphrase to recreate exactly the node `pulumi up` would.

A record written by a later checkout with fields this one does not know is refused in one line
rather than half-read: a node created from half a spec is worse than none.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from infra.errors import OpsError
from infra.tpu import placement

VERSION = 1
# The keys of a record, and of its request; anything else is refused.
RECORD_KEYS = ("version", "role", "request", "run_dir", "boot_reports")
REQUEST_KEYS = ("project", "node_id", "zones", "queue", "node")


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One VM's recorded request and what its recovery reads besides the TPU API.

    Attributes:
        role: train or serve.
        request: what placement creates the node from.
        run_dir: the training run's directory (train_summary.json, metrics.jsonl), or None.
        boot_reports: the folder where a worker whose boot failed writes `<host>.failed` (the
            startup script's boot-failed line), or None.
    """

    role: str
    request: placement.Request
    run_dir: str | None = None
    boot_reports: str | None = None


def to_record(
    props: Mapping[str, Any],
    *,
    role: str,
    run_dir: str | None,
    boot_reports: str | None,
    node_keys: tuple[str, ...],
) -> dict[str, Any]:
    """The record of a TpuNode's inputs (`props`: project, node_id, zones, queue and the node
    spec's keys `node_keys`), unset spec fields left out as the provider leaves them out."""
    queue = props.get("queue")
    return {
        "version": VERSION,
        "role": role,
        "request": {
            "project": props["project"],
            "node_id": props["node_id"],
            "zones": list(props["zones"]),
            "queue": dict(queue) if queue else None,
            "node": {k: props[k] for k in node_keys if props.get(k) is not None},
        },
        "run_dir": run_dir,
        "boot_reports": boot_reports,
    }


def dumps(record: Mapping[str, Any]) -> str:
    """The record as the bucket holds it: sorted keys, so an unchanged request is unchanged
    bytes and `pulumi up` plans no upload."""
    return json.dumps(record, sort_keys=True, indent=1) + "\n"


def _bad(source: str, key: str, value: Any, allowed: str) -> OpsError:
    return OpsError(f"{source}: {key} {value!r}: {allowed}")


def _text(source: str, data: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(source, key, value, "a non-empty string" + (" or null" if optional else ""))
    return value


def from_record(data: Any, source: str) -> Recorded:
    """A Recorded from the JSON object a record holds.

    Raises:
        OpsError: one line naming the key, its value and what is allowed.
    """
    if not isinstance(data, dict):
        raise _bad(source, "record", type(data).__name__, "a JSON object")
    if data.get("version") != VERSION:
        raise _bad(
            source,
            "version",
            data.get("version"),
            f"{VERSION} (written by another checkout: run `pulumi up` with this one)",
        )
    for key in data:
        if key not in RECORD_KEYS:
            raise _bad(source, "key", key, f"one of {', '.join(RECORD_KEYS)}")
    req = data.get("request")
    if not isinstance(req, dict):
        raise _bad(source, "request", req, "a JSON object")
    for key in req:
        if key not in REQUEST_KEYS:
            raise _bad(source, "request key", key, f"one of {', '.join(REQUEST_KEYS)}")
    zones = req.get("zones")
    if not isinstance(zones, list) or not zones or not all(isinstance(z, str) and z for z in zones):
        raise _bad(source, "request.zones", zones, "a non-empty list of zone names")
    node = req.get("node")
    if not isinstance(node, dict) or not node.get("accelerator_type"):
        raise _bad(source, "request.node", node, "the node's spec, with its accelerator_type")
    queue = req.get("queue")
    parsed_queue = None
    if queue is not None:
        spot, valid = (queue or {}).get("spot"), (queue or {}).get("valid_for_s")
        if not isinstance(queue, dict) or not isinstance(spot, bool) or not isinstance(valid, int):
            raise _bad(source, "request.queue", queue, "null or {spot: bool, valid_for_s: int}")
        parsed_queue = placement.Queue(spot=spot, valid_for_s=valid)
    request = placement.Request(
        project=_text(source, req, "project"),
        node_id=_text(source, req, "node_id"),
        zones=tuple(zones),
        node=node,
        queue=parsed_queue,
    )
    role = _text(source, data, "role")
    return Recorded(
        role=role,
        request=request,
        run_dir=_text(source, data, "run_dir", optional=True),
        boot_reports=_text(source, data, "boot_reports", optional=True),
    )


def load(uri: str) -> Recorded:
    """The record at `uri` (gs:// or a local path).

    Raises:
        OpsError: it cannot be read, or it is not a record (one line).
    """
    from workloads.common import errors, storage  # lazy: gcsfs only when it is read

    try:
        text = storage.read_text(uri)
    except errors.UserError as exc:
        raise OpsError(
            f"cannot read the recorded request {uri}: {exc} (`pulumi up` writes it)"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OpsError(f"{uri}: not JSON ({exc})") from None
    return from_record(data, uri)
