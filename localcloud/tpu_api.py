"""The Cloud TPU API (v2) of the local cloud: its REST protocol on a loopback port.

Google publishes no emulator of Cloud TPU; this server speaks the part of its REST surface the
project calls (nodes create/get/list/delete/stop/start/patch, queuedResources
create/get/list/delete, operations get, acceleratorTypes and runtimeVersions list, a location),
with the API's JSON shapes, long-running operations and error bodies, so that the real
`google.cloud.tpu_v2.TpuClient` (and the VMs' gcloud stand-in) reach it by an endpoint setting
alone (`CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU`, infra/tpu/api.py).

What it models, as GCP does it:
- a node moves CREATING -> READY (its `Hooks.boot` makes the workers: a container VM in the
  rehearsal), READY -> PREEMPTED (`preempt`, the workers killed), STOPPING -> STOPPED ->
  STARTING -> READY, DELETING (`delete_s`, its name still taken) -> gone; a node deleted while
  CREATING ends its create's operation in an error (ABORTED, modelled: the reference does not
  say which) and its workers are stopped;
- a queued resource moves ACCEPTED -> WAITING_FOR_RESOURCES -> PROVISIONING -> ACTIVE on the
  schedule `queue_s` sets, and waits while its zone has no capacity;
- errors: 404 NOT_FOUND, 409 ALREADY_EXISTS, 403 PERMISSION_DENIED (every call is checked against
  the permissions the caller holds, localcloud/iam.py, named as Google's IAM reference names them),
  401 UNAUTHENTICATED, a zone that refuses reads (403 "Location ... is not found or access is
  unauthorized.") and a zone without capacity (the create operation fails with code 8,
  RESOURCE_EXHAUSTED, as a stockout does).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import http.server
import itertools
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

from infra.config import iam_catalogue
from localcloud import iam as iam_mod

V2 = "/v2/"
TYPE_PREFIX = "type.googleapis.com/"
NODE_TYPE = TYPE_PREFIX + "google.cloud.tpu.v2.Node"
QUEUED_TYPE = TYPE_PREFIX + "google.cloud.tpu.v2.QueuedResource"
EMPTY_TYPE = TYPE_PREFIX + "google.protobuf.Empty"
METADATA_TYPE = TYPE_PREFIX + "google.cloud.tpu.v2.OperationMetadata"
# What every zone offers here (preflight's reads).
ACCELERATOR_TYPES = ("v5p-8", "v5p-16", "v5p-32", "v6e-8", "v6e-16")
RUNTIME_VERSIONS = ("v2-alpha-tpuv5", "v2-alpha-tpuv6e", "tpu-ubuntu2204-base")
# gRPC codes of the errors an operation can end with (google.rpc.Code).
RESOURCE_EXHAUSTED = 8
ABORTED = 10


class ApiError(Exception):
    """An error answer: HTTP status, google.rpc status name and message."""

    def __init__(self, http: int, status: str, message: str) -> None:
        super().__init__(message)
        self.http, self.status, self.message = http, status, message


def not_found(what: str) -> ApiError:
    return ApiError(404, "NOT_FOUND", f"Resource '{what}' was not found")


class Hooks(Protocol):
    """What becomes of a node's workers: the rehearsal boots and kills container VMs."""

    def boot(self, node: dict[str, Any]) -> list[str]:
        """Starts the node's workers (from its metadata and service account); returns their
        internal addresses, one per worker."""
        ...

    def halt(self, node: dict[str, Any], why: str) -> None:
        """Stops the node's workers at once (why: preempted, stopped, deleted)."""
        ...


class NoWorkers:
    """Hooks with no machines behind them: a worker is an address (the protocol tests)."""

    def __init__(self) -> None:
        self._n = itertools.count(2)
        self.halted: list[tuple[str, str]] = []

    def boot(self, node: dict[str, Any]) -> list[str]:
        workers = _workers(str(node.get("acceleratorType", "v5p-8")))
        return [f"10.130.0.{next(self._n)}" for _ in range(workers)]

    def halt(self, node: dict[str, Any], why: str) -> None:
        self.halted.append((node["name"], why))


def _workers(accelerator: str) -> int:
    """Workers (hosts) of an accelerator type: 4 chips per host; v5p counts TensorCores."""
    family, _, size = accelerator.partition("-")
    chips = int(size) // (2 if family == "v5p" else 1) if size.isdigit() else 4
    return max(1, chips // (4 if family == "v5p" else 8))


@dataclasses.dataclass
class Zone:
    """How one zone answers: `capacity` False makes a create fail (stockout) and a queue wait;
    `readable` False refuses every call there (the location is not found or not allowed)."""

    capacity: bool = True
    readable: bool = True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TpuApiServer:
    """The API, in threads of this process, on 127.0.0.1:`port` (0: any free port).

    Attributes:
        url: http://127.0.0.1:PORT, what CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU is set to.
        iam: who holds what (localcloud/iam.py).
        zones: per zone, how it answers (a zone not listed answers normally).
        calls: (member, method, resource name, HTTP status) of every call, in order.
        create_s: how long a node stays CREATING before its workers boot.
        delete_s: how long a deleted node stays DELETING, its name taken, before it is gone
            (minutes on GCP; 0 here unless a test sets it).
        queue_s: (state, seconds) a queued resource spends in each waiting state.
    """

    def __init__(
        self,
        project: str,
        hooks: Hooks | None = None,
        port: int = 0,
        iam: iam_mod.Iam | None = None,
    ) -> None:
        self.project = project
        self.hooks: Hooks = hooks or NoWorkers()
        # Given when the hooks need it too (the rehearsal's VMs get their tokens from it).
        self.iam = iam if iam is not None else iam_mod.Iam()
        self.zones: dict[str, Zone] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.queued: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str, int]] = []
        self.create_s = 0.2
        self.delete_s = 0.0
        self.queue_s: list[tuple[str, float]] = [
            ("WAITING_FOR_RESOURCES", 1.0),
            ("PROVISIONING", 0.5),
        ]
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- what a rehearsal or test does to the cloud ------------------------------------------

    def zone(self, name: str) -> Zone:
        return self.zones.setdefault(name, Zone())

    def preempt(self, name: str) -> None:
        """Takes a spot/preemptible node back without warning: PREEMPTED, workers killed."""
        with self._lock:
            node = self._node(name)
            node["state"] = "PREEMPTED"
            queued = node.get("queuedResource")
            if queued in self.queued:
                self.queued[queued]["state"] = {"state": "SUSPENDED"}
        self.hooks.halt(node, "preempted")

    def state(self, name: str) -> str | None:
        with self._lock:
            node = self.nodes.get(name)
            return None if node is None else str(node["state"])

    def wait_state(self, name: str, states: tuple[str | None, ...], timeout_s: float) -> str | None:
        """Waits until node `name` is in one of `states` (None: gone); returns the state.

        Raises:
            TimeoutError: not within timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state(name)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name}: {state}, not {states} within {timeout_s:.0f} s")
            time.sleep(0.1)

    # -- the protocol ------------------------------------------------------------------------

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def do_DELETE(self) -> None:
                self._answer("DELETE")

            def do_PATCH(self) -> None:
                self._answer("PATCH")

            def _answer(self, verb: str) -> None:
                parsed = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(parsed.query))
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if parsed.path == "/token":
                    code, body = server._token(raw)
                    self._send(code, body)
                    return
                auth = self.headers.get("Authorization", "")
                member = (
                    server.iam.member_of(auth.removeprefix("Bearer ").strip()) if auth else None
                )
                try:
                    if member is None:
                        raise ApiError(
                            401,
                            "UNAUTHENTICATED",
                            "Request had invalid authentication credentials. Expected OAuth 2 "
                            "access token, login cookie or other valid authentication credential.",
                        )
                    body = json.loads(raw) if raw.strip() else {}
                    answer = server._route(member, verb, parsed.path, query, body)
                except ApiError as exc:
                    server._log(member or "-", verb, parsed.path, exc.http)
                    self._send(
                        exc.http,
                        {"error": {"code": exc.http, "message": exc.message, "status": exc.status}},
                    )
                    return
                except (ValueError, KeyError) as exc:
                    server._log(member or "-", verb, parsed.path, 400)
                    self._send(
                        400,
                        {"error": {"code": 400, "message": str(exc), "status": "INVALID_ARGUMENT"}},
                    )
                    return
                server._log(member, verb, parsed.path, 200)
                self._send(200, answer)

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                return  # `calls` is the log

        return Handler

    def _log(self, member: str, verb: str, path: str, code: int) -> None:
        with self._lock:
            self.calls.append((member, verb, path.removeprefix(V2), code))

    def _token(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        """OAuth 2.0's token endpoint for a signed JWT assertion (a key file's token_uri)."""
        form = dict(urllib.parse.parse_qsl(raw.decode()))
        member = self.iam.member_of(form.get("assertion", ""))
        if member is None:
            return 400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
        return 200, {
            "access_token": self.iam.issue_token(member),
            "expires_in": 3599,
            "token_type": "Bearer",
        }

    def _route(
        self, member: str, verb: str, path: str, query: dict[str, str], body: dict[str, Any]
    ) -> dict[str, Any]:
        if not path.startswith(V2):
            raise ApiError(404, "NOT_FOUND", f"no such method: {verb} {path}")
        name = path.removeprefix(V2)
        name, _, action = name.partition(":")
        match = re.fullmatch(
            r"projects/([^/]+)/locations/([^/]+)(?:/([A-Za-z]+)(?:/([^/]+))?)?", name
        )
        if not match:
            raise ApiError(404, "NOT_FOUND", f"no such method: {verb} {path}")
        project, zone, collection, item = match.groups()
        parent = f"projects/{project}/locations/{zone}"
        method = _method(verb, collection, item, action)
        if method is None:
            raise ApiError(404, "NOT_FOUND", f"no such method: {verb} {path}")
        if project != self.project:
            raise ApiError(
                403, "PERMISSION_DENIED", f"Project '{project}' not found or permission denied."
            )
        self._authorize(member, method, name)
        if not self.zone(zone).readable:
            raise ApiError(
                403,
                "PERMISSION_DENIED",
                f"Location {zone} is not found or access is unauthorized.",
            )
        short = (
            method.removeprefix("projects.locations.") if method.count(".") > 2 else "locations.get"
        )
        handler: Callable[..., dict[str, Any]] = getattr(self, "_" + short.replace(".", "_"))
        return handler(member=member, parent=parent, name=name, query=query, body=body, zone=zone)

    def _authorize(self, member: str, method: str, resource: str) -> None:
        for permission in iam_catalogue.tpu_method_permissions(method):
            if not self.iam.allows(member, permission):
                raise ApiError(
                    403,
                    "PERMISSION_DENIED",
                    f"Permission '{permission}' denied on resource "
                    f"'//tpu.googleapis.com/{resource}' (or it may not exist).",
                )

    def _act_as(self, member: str, method: str, node: dict[str, Any]) -> None:
        """Creating a node that runs as a service account needs act-as on that account."""
        email = (node.get("serviceAccount") or {}).get("email")
        if not email:
            return
        for permission in iam_catalogue.TPU_METHOD_SERVICE_ACCOUNT_PERMISSIONS[method]:
            if not self.iam.allows(member, permission, email):
                raise ApiError(
                    403,
                    "PERMISSION_DENIED",
                    f"Permission '{permission}' denied on service account {email} "
                    "(or it may not exist).",
                )

    # -- operations --------------------------------------------------------------------------

    def _operation(self, parent: str, target: str, verb: str) -> dict[str, Any]:
        name = f"{parent}/operations/operation-{int(time.time() * 1000)}-{next(self._ids)}"
        op: dict[str, Any] = {
            "name": name,
            "metadata": {
                "@type": METADATA_TYPE,
                "createTime": _now(),
                "target": target,
                "verb": verb,
                "apiVersion": "v2",
            },
            "done": False,
        }
        with self._lock:
            self.operations[name] = op
        return copy.deepcopy(op)

    def _finish(
        self,
        op: dict[str, Any],
        response: dict[str, Any] | None = None,
        error: tuple[int, str] | None = None,
    ) -> None:
        with self._lock:
            stored = self.operations[op["name"]]
            stored["done"] = True
            stored["metadata"]["endTime"] = _now()
            if error is not None:
                stored["error"] = {"code": error[0], "message": error[1]}
            else:
                stored["response"] = response or {"@type": EMPTY_TYPE}

    def _later(self, work: Callable[[], None]) -> None:
        threading.Thread(target=work, daemon=True).start()

    def _operations_get(self, *, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            if name not in self.operations:
                raise not_found(name)
            return copy.deepcopy(self.operations[name])

    # -- nodes -------------------------------------------------------------------------------

    def _node(self, name: str) -> dict[str, Any]:
        return _found(self.nodes, name)

    def _copy(self, table: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(_found(table, name))

    def _listing(self, table: dict[str, dict[str, Any]], parent: str, key: str) -> dict[str, Any]:
        with self._lock:
            found = [copy.deepcopy(v) for k, v in table.items() if k.startswith(parent + "/")]
        return {key: found}

    def _nodes_get(self, *, name: str, **_: Any) -> dict[str, Any]:
        return self._copy(self.nodes, name)

    def _nodes_list(self, *, parent: str, **_: Any) -> dict[str, Any]:
        return self._listing(self.nodes, parent, "nodes")

    def _nodes_create(
        self,
        *,
        member: str,
        parent: str,
        query: dict[str, str],
        body: dict[str, Any],
        zone: str,
        **_: Any,
    ) -> dict[str, Any]:
        node_id = query.get("nodeId") or body.get("name", "").rsplit("/", 1)[-1]
        if not node_id:
            raise ApiError(400, "INVALID_ARGUMENT", "nodeId is required")
        self._act_as(member, "projects.locations.nodes.create", body)
        name = f"{parent}/nodes/{node_id}"
        with self._lock:
            if name in self.nodes:
                raise ApiError(409, "ALREADY_EXISTS", f"Resource '{name}' already exists")
            op = self._operation(parent, name, "create")
            if not self.zone(zone).capacity:
                self._finish(
                    op,
                    error=(
                        RESOURCE_EXHAUSTED,
                        f'There is no more capacity in the zone "{zone}"; you can try in another '
                        "zone where Cloud TPU Nodes are offered (see "
                        "https://cloud.google.com/tpu/docs/regions) [EID: 0x1]",
                    ),
                )
                return op
            node = self._new_node(name, body)
        self._later(lambda: self._bring_up(node, op))
        return op

    def _new_node(
        self, name: str, body: dict[str, Any], queued: str | None = None
    ) -> dict[str, Any]:
        node = {
            **copy.deepcopy(body),
            "name": name,
            "state": "CREATING",
            "createTime": _now(),
            "id": str(next(self._ids) * 7919 + 10**15),
            "apiVersion": "V2",
            "health": "HEALTHY",
            "networkEndpoints": [],
        }
        if queued:
            node["queuedResource"] = queued
        self.nodes[name] = node
        return node

    def _bring_up(self, node: dict[str, Any], op: dict[str, Any] | None) -> None:
        time.sleep(self.create_s)
        try:
            addresses = self.hooks.boot(copy.deepcopy(node))
        except Exception as exc:  # a worker that cannot start: the create fails, as on GCP
            with self._lock:
                self._forget(self.nodes, node)
            if op is not None:
                self._finish(
                    op, error=(13, f"Internal error: the node's workers did not start: {exc}")
                )
            return
        with self._lock:
            deleted = self.nodes.get(node["name"]) is not node
            if not deleted:
                node["networkEndpoints"] = [
                    {"ipAddress": a, "port": 8470, "accessConfig": {"externalIp": a}}
                    for a in addresses
                ]
                node["state"] = "READY"
                if op is not None:
                    self._finish(op, {"@type": NODE_TYPE, **copy.deepcopy(node)})
        if deleted:
            # Deleted while it was being created: the workers it just got go too, and its
            # create ends in an error instead of never (the caller waiting on it is told).
            self.hooks.halt(copy.deepcopy(node), "deleted")
            if op is not None:
                self._finish(
                    op, error=(ABORTED, f"The node {node['name']} was deleted while being created")
                )

    @staticmethod
    def _forget(table: dict[str, dict[str, Any]], item: dict[str, Any]) -> None:
        """Drops `item` from `table` if it is still there: not a newer one under its name."""
        if table.get(item["name"]) is item:
            del table[item["name"]]

    def _nodes_delete(self, *, parent: str, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            node = self._node(name)
            node["state"] = "DELETING"
            op = self._operation(parent, name, "delete")

        def work() -> None:
            self.hooks.halt(copy.deepcopy(node), "deleted")
            time.sleep(self.delete_s)
            with self._lock:
                self._forget(self.nodes, node)  # a second delete of it must not take a new one
            self._finish(op)

        self._later(work)
        return op

    def _nodes_stop(self, *, parent: str, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            node = self._node(name)
            if node["state"] != "READY":
                raise ApiError(
                    400,
                    "FAILED_PRECONDITION",
                    f"stop is not supported while in state {node['state']}",
                )
            node["state"] = "STOPPING"
            op = self._operation(parent, name, "stop")

        def work() -> None:
            self.hooks.halt(copy.deepcopy(node), "stopped")
            with self._lock:
                node["state"] = "STOPPED"
            self._finish(op, {"@type": NODE_TYPE, **copy.deepcopy(node)})

        self._later(work)
        return op

    def _nodes_start(self, *, parent: str, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            node = self._node(name)
            if node["state"] != "STOPPED":
                raise ApiError(
                    400,
                    "FAILED_PRECONDITION",
                    f"start is not supported while in state {node['state']}",
                )
            node["state"] = "STARTING"
            op = self._operation(parent, name, "start")
        self._later(lambda: self._bring_up(node, op))
        return op

    def _nodes_patch(
        self, *, parent: str, name: str, query: dict[str, str], body: dict[str, Any], **_: Any
    ) -> dict[str, Any]:
        fields = [f for f in query.get("updateMask", "").split(",") if f]
        with self._lock:
            node = self._node(name)
            for field in fields:
                key = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), field)
                if key in body:
                    node[key] = copy.deepcopy(body[key])
                else:
                    node.pop(key, None)
            op = self._operation(parent, name, "update")
            self._finish(op, {"@type": NODE_TYPE, **copy.deepcopy(node)})
        return op

    # -- queued resources --------------------------------------------------------------------

    def _queuedResources_get(self, *, name: str, **_: Any) -> dict[str, Any]:
        return self._copy(self.queued, name)

    def _queuedResources_list(self, *, parent: str, **_: Any) -> dict[str, Any]:
        return self._listing(self.queued, parent, "queuedResources")

    def _queuedResources_create(
        self,
        *,
        member: str,
        parent: str,
        query: dict[str, str],
        body: dict[str, Any],
        zone: str,
        **_: Any,
    ) -> dict[str, Any]:
        queued_id = query.get("queuedResourceId")
        if not queued_id:
            raise ApiError(400, "INVALID_ARGUMENT", "queuedResourceId is required")
        specs = (body.get("tpu") or {}).get("nodeSpec") or []
        if len(specs) != 1:
            raise ApiError(400, "INVALID_ARGUMENT", "tpu.nodeSpec: exactly one node spec here")
        self._act_as(
            member, "projects.locations.queuedResources.create", specs[0].get("node") or {}
        )
        name = f"{parent}/queuedResources/{queued_id}"
        with self._lock:
            if name in self.queued:
                raise ApiError(409, "ALREADY_EXISTS", f"Resource '{name}' already exists")
            node_name = f"{specs[0].get('parent', parent)}/nodes/{specs[0]['nodeId']}"
            if node_name in self.nodes:
                raise ApiError(409, "ALREADY_EXISTS", f"Resource '{node_name}' already exists")
            self.queued[name] = {
                **copy.deepcopy(body),
                "name": name,
                "createTime": _now(),
                "state": {"state": "ACCEPTED"},
            }
            op = self._operation(parent, name, "create")
            self._finish(op, {"@type": QUEUED_TYPE, **copy.deepcopy(self.queued[name])})
        self._later(lambda: self._provision(name, node_name, specs[0].get("node") or {}, zone))
        return op

    def _provision(self, name: str, node_name: str, spec: dict[str, Any], zone: str) -> None:
        """Moves a queued resource through its states; makes its node once capacity is there."""
        for state, seconds in self.queue_s:
            with self._lock:
                if name not in self.queued or self.queued[name]["state"]["state"] == "DELETING":
                    return
                self.queued[name]["state"] = {"state": state}
            time.sleep(seconds)
            while state == "WAITING_FOR_RESOURCES" and not self.zone(zone).capacity:
                time.sleep(0.2)
                with self._lock:
                    if name not in self.queued:
                        return
        with self._lock:
            if name not in self.queued or self.queued[name]["state"]["state"] == "DELETING":
                return
            node = self._new_node(node_name, spec, queued=name)
        self._bring_up(node, None)
        with self._lock:
            if name in self.queued and self.nodes.get(node_name) is node:
                self.queued[name]["state"] = {"state": "ACTIVE"}

    def _queuedResources_delete(
        self, *, parent: str, name: str, query: dict[str, str], **_: Any
    ) -> dict[str, Any]:
        force = query.get("force", "").lower() == "true"
        with self._lock:
            queued = _found(self.queued, name)
            nodes = [n for n in self.nodes.values() if n.get("queuedResource") == name]
            if nodes and not force:
                raise ApiError(
                    400,
                    "FAILED_PRECONDITION",
                    f"Queued resource {name} still has node(s); delete them first or use force",
                )
            queued["state"] = {"state": "DELETING"}
            op = self._operation(parent, name, "delete")

        def work() -> None:
            for node in nodes:
                self.hooks.halt(copy.deepcopy(node), "deleted")
            with self._lock:
                for node in nodes:
                    self.nodes.pop(node["name"], None)
                self.queued.pop(name, None)
            self._finish(op)

        self._later(work)
        return op

    # -- catalogue reads (preflight) -----------------------------------------------------------

    def _acceleratorTypes_list(self, *, parent: str, **_: Any) -> dict[str, Any]:
        return {
            "acceleratorTypes": [
                {"name": f"{parent}/acceleratorTypes/{t}", "type": t} for t in ACCELERATOR_TYPES
            ]
        }

    def _runtimeVersions_list(self, *, parent: str, **_: Any) -> dict[str, Any]:
        return {
            "runtimeVersions": [
                {"name": f"{parent}/runtimeVersions/{v}", "version": v} for v in RUNTIME_VERSIONS
            ]
        }

    def _locations_get(self, *, name: str, zone: str, **_: Any) -> dict[str, Any]:
        return {"name": name, "locationId": zone}


def _found(table: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """table[name], or the API's 404 for it."""
    item = table.get(name)
    if item is None:
        raise not_found(name)
    return item


def _method(verb: str, collection: str | None, item: str | None, action: str) -> str | None:
    """The REST method a request names (`nodes.create`, ...), as the IAM table keys it."""
    if collection is None:
        return "projects.locations.get" if verb == "GET" and not action else None
    table = {
        ("GET", False, ""): "list",
        ("POST", False, ""): "create",
        ("GET", True, ""): "get",
        ("DELETE", True, ""): "delete",
        ("PATCH", True, ""): "patch",
        ("POST", True, "stop"): "stop",
        ("POST", True, "start"): "start",
    }
    verb_name = table.get((verb, item is not None, action))
    if verb_name is None:
        return None
    method = f"projects.locations.{collection}.{verb_name}"
    return method if method in iam_catalogue.TPU_METHOD_PERMISSIONS else None
