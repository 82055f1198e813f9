"""The Cloud TPU API boundary: the operator commands (status, cost, recover) and the node
resource's placement (GoogleTpuApi, for infra/tpu/placement.py).

One place that makes the client, reads a node (None when it does not exist) and names its
state; the commands take the client as a parameter, so the tests hand them fakes here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from infra.errors import CloudRefused, OpsError
from workloads.common.errors import exception_line

T = TypeVar("T")
# gcloud's own setting for another Cloud TPU endpoint (`https://tpu.googleapis.com/` by
# default). The project's client reads the same variable, so one setting points gcloud on a VM
# and the Python client on the operator's machine at another server: the local cloud's Cloud TPU
# API in a rehearsal (docs/rehearsal.md). There is no other switch: the same calls, the same
# transport and Application Default Credentials either way.
ENDPOINT_ENV = "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU"


class TpuApi(Protocol):
    """The one call of `google.cloud.tpu_v2.TpuClient` the commands use."""

    def get_node(self, *, name: str) -> Any: ...


def node_path(project: str, zone: str, node: str) -> str:
    return f"projects/{project}/locations/{zone}/nodes/{node}"


def tpu_client() -> Any:
    """google.cloud.tpu_v2.TpuClient over REST (what gcloud speaks too, and what a local server
    can answer), at the endpoint ENDPOINT_ENV names, else Google's; Application Default
    Credentials.

    Raises:
        Exception: whatever creating it raised (credentials, missing library).
    """
    from google.cloud import tpu_v2  # lazy: a heavy import only the TPU commands need

    endpoint = os.environ.get(ENDPOINT_ENV, "").strip().rstrip("/")
    return tpu_v2.TpuClient(
        transport="rest", client_options={"api_endpoint": endpoint} if endpoint else None
    )


def new_client(factory: Callable[[], TpuApi] | None) -> TpuApi:
    """A TPU API client (`factory`, or tpu_client()).

    Raises:
        Exception: whatever creating it raised (credentials, missing library).
    """
    return (factory or tpu_client)()


def client(factory: Callable[[], TpuApi] | None) -> TpuApi:
    """new_client, for a command that cannot go on without it.

    Raises:
        OpsError: the client cannot be created, with a hint.
    """
    try:
        return new_client(factory)
    except Exception as exc:
        raise OpsError(
            f"cannot create a Cloud TPU API client: {exception_line(exc)} "
            "(`gcloud auth application-default login`?)"
        ) from exc


def is_not_found(exc: BaseException) -> bool:
    """Whether a TPU API call failed because the node does not exist."""
    try:
        from google.api_core import exceptions  # lazy: only the real client raises these
    except ImportError:
        return False
    return isinstance(exc, exceptions.NotFound)


def call_failed(message: str, exc: BaseException) -> OpsError:
    """`message: <the exception as one line>` as the error an operator command raises: a
    CloudRefused when the Cloud TPU API answered with an error, an OpsError otherwise (no
    credentials, a network failure)."""
    line = f"{message}: {exception_line(exc)}"
    try:
        from google.api_core import exceptions  # lazy: only the real client raises these
    except ImportError:
        return OpsError(line)
    return CloudRefused(line) if isinstance(exc, exceptions.GoogleAPICallError) else OpsError(line)


def unless_gone(call: Callable[[], T]) -> T | None:
    """What `call` returns, or None when the API says its object does not exist (a read of a
    deleted node, a delete of what is gone already).

    Raises:
        Exception: whatever else the API raised (credentials, permissions, network).
    """
    try:
        return call()
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise


def get_node(api: TpuApi, name: str) -> Any | None:
    """The node, or None when it does not exist.

    Raises:
        Exception: whatever else the API raised (credentials, permissions, network).
    """
    return unless_gone(lambda: api.get_node(name=name))


def queued_state(api: Any, node: Any) -> str | None:
    """`queued resource <id> <STATE>` for a node that came through a queued resource
    (provisioning: queued), else None; an unreadable queue says why instead of its state."""
    queued = str(getattr(node, "queued_resource", "") or "")
    if not queued:
        return None
    try:
        state = api.get_queued_resource(name=queued).state.state.name
    except Exception as exc:
        state = f"unknown ({exception_line(exc)})"
    return f"queued resource {queued.rsplit('/', 1)[-1]} {state}"


def state_name(node: Any) -> str:
    """READY, PREEMPTED, ... (the enum's name; STATE_UNSPECIFIED when the node says nothing)."""
    state = getattr(node, "state", None)
    return str(getattr(state, "name", None) or state or "STATE_UNSPECIFIED")


class GoogleTpuApi:
    """tpu_placement.PlacementApi on google.cloud.tpu_v2 (Application Default Credentials, as
    pulumi-gcp uses)."""

    def __init__(self, client: Any | None = None, *, timeout_s: float = 3600.0):
        self._client = tpu_client() if client is None else client
        self._timeout_s = timeout_s

    @staticmethod
    def _types() -> Any:
        from google.cloud import tpu_v2

        return tpu_v2

    def get_node(self, name: str) -> dict[str, Any] | None:
        node = get_node(self._client, name)
        return None if node is None else type(node).to_dict(node, use_integers_for_enums=False)

    def create_node(self, parent: str, node_id: str, node: Mapping[str, Any]) -> None:
        tpu = self._types()
        op = self._client.create_node(parent=parent, node_id=node_id, node=tpu.Node(node))
        op.result(timeout=self._timeout_s)

    def delete_node(self, name: str) -> None:
        unless_gone(lambda: self._client.delete_node(name=name).result(timeout=self._timeout_s))

    def update_node(self, name: str, node: Mapping[str, Any], fields: Sequence[str]) -> None:
        tpu = self._types()
        body = tpu.Node({**{k: node[k] for k in fields if k in node}, "name": name})
        request = tpu.UpdateNodeRequest(node=body, update_mask={"paths": list(fields)})
        self._client.update_node(request=request).result(timeout=self._timeout_s)

    def create_queued_resource(self, parent: str, queued_id: str, body: Mapping[str, Any]) -> None:
        tpu = self._types()
        op = self._client.create_queued_resource(
            parent=parent, queued_resource_id=queued_id, queued_resource=tpu.QueuedResource(body)
        )
        op.result(timeout=self._timeout_s)

    def queued_state(self, name: str) -> str | None:
        queued = unless_gone(lambda: self._client.get_queued_resource(name=name))
        return None if queued is None else queued.state.state.name

    def get_queued(self, name: str) -> dict[str, Any] | None:
        queued = unless_gone(lambda: self._client.get_queued_resource(name=name))
        if queued is None:
            return None
        return type(queued).to_dict(queued, use_integers_for_enums=False)

    def list_queued(self, parent: str) -> list[dict[str, Any]]:
        """Every queued resource in the location `parent` (all pages), as dicts."""
        return [
            type(queued).to_dict(queued, use_integers_for_enums=False)
            for queued in self._client.list_queued_resources(parent=parent)
        ]

    def delete_queued_resource(self, name: str) -> None:
        tpu = self._types()
        request = tpu.DeleteQueuedResourceRequest(name=name, force=True)
        unless_gone(
            lambda: self._client.delete_queued_resource(request=request).result(
                timeout=self._timeout_s
            )
        )
