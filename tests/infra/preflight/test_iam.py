"""Preflight's IAM check (infra/preflight/iam.py) against a local HTTP server that answers
IAM's permissions:queryTestablePermissions as Google's does (JSON pages, error bodies), reached
through the same endpoint setting and a real requests session."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from infra.components import recovery
from infra.config import iam_catalogue, stack_config
from infra.ops import release_record
from infra.preflight import checks as preflight
from infra.preflight import iam as iam_preflight
from tests.fixtures import pulumi_mocks
from tests.infra.preflight.test_checks import _healthy as healthy_tpu

PROJECT = "my-project-1"


class FakeIam(http.server.ThreadingHTTPServer):
    """Answers POST /v1/permissions:queryTestablePermissions with `permissions` in pages of
    `page` (or `status` with an error body), recording each request body."""

    def __init__(self, permissions: list[dict[str, Any]], page: int = 2, status: int = 200):
        super().__init__(("127.0.0.1", 0), Handler)
        self.permissions, self.page, self.status = permissions, page, status
        self.bodies: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"


class Handler(http.server.BaseHTTPRequestHandler):
    server: FakeIam

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if self.path != "/v1/permissions:queryTestablePermissions":
            return self._send(404, {"error": {"code": 404, "message": "not found"}})
        if self.server.status != 200:
            message = "Permission 'iam.permissions.none' denied on resource"
            return self._send(self.server.status, {"error": {"message": message}})
        start = int(body.get("pageToken") or 0)
        end = start + min(self.server.page, body["pageSize"])
        answer: dict[str, Any] = {"permissions": self.server.permissions[start:end]}
        if end < len(self.server.permissions):
            answer["nextPageToken"] = str(end)
        self._send(200, answer)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_args: Any) -> None:
        pass


def serve(server: FakeIam, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIam]:
    monkeypatch.setenv(iam_preflight.ENDPOINT_ENV, server.url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def google_list(*leave_out: str, **support: str) -> list[dict[str, Any]]:
    """Cloud TPU's permissions (and a few others) as IAM lists them, less `leave_out`."""
    names = sorted(iam_catalogue.TPU_PERMISSIONS | {"iam.serviceAccounts.actAs"})
    return [
        {"name": n, "stage": "GA", "customRolesSupportLevel": support.get(n, "SUPPORTED")}
        for n in names
        if n not in leave_out
    ]


def every_role(stack: str = "prod") -> Any:
    mapping = pulumi_mocks.stack_file_config(stack, project=PROJECT)
    mapping["recovery"] = {"enabled": True}
    mapping = pulumi_mocks.with_key(mapping, "training.releaseWhenDone", True)
    return stack_config.parse_stack_config(mapping)


@pytest.fixture
def iam(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIam]:
    yield from serve(FakeIam(google_list()), monkeypatch)


def test_the_stacks_roles_are_what_the_program_declares() -> None:
    roles = iam_preflight.stack_roles(every_role())
    assert [(r.base_id, r.permissions) for r in roles] == [
        (
            "gemma4SelfService_gemma4_prod",
            ("tpu.nodes.delete", "tpu.nodes.get", "tpu.operations.get"),
        ),
        ("gemma4Recover_gemma4_prod", recovery.RECOVER_PERMISSIONS),
    ]
    plain = pulumi_mocks.stack_file_config("dev", project=PROJECT)
    assert iam_preflight.stack_roles(stack_config.parse_stack_config(plain)) == []


def test_preflight_checks_the_roles_the_program_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    """stack_roles reads the config as the program does: the same roles, the same permissions."""
    monkeypatch.setattr(release_record.storage, "exists", lambda _uri: False)
    mapping = pulumi_mocks.stack_file_config("prod", project=PROJECT)
    mapping["recovery"] = {"enabled": True}
    mapping = pulumi_mocks.with_key(mapping, "training.releaseWhenDone", True)
    rec = pulumi_mocks.run_program("prod", mapping, hf_token="hf_x" * 8)
    declared = sorted(
        (r.inputs["roleId"].rsplit("_", 1)[0], tuple(sorted(r.inputs["permissions"])))
        for r in rec.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
    )
    cfg = stack_config.parse_stack_config(mapping)
    assert declared == sorted((r.base_id, r.permissions) for r in iam_preflight.stack_roles(cfg))


def test_roles_the_project_can_hold_pass_reading_every_page(iam: FakeIam) -> None:
    report = iam_preflight.check_roles(every_role(), requests.Session)
    assert report.warnings == []
    assert report.checks == [
        (
            True,
            f"custom role gemma4SelfService_gemma4_prod_* (training.releaseWhenDone / "
            f"serving.stopAfterHours): its 3 permissions can be held in project {PROJECT}",
        ),
        (
            True,
            f"custom role gemma4Recover_gemma4_prod_* (recovery.enabled): its 5 permissions "
            f"can be held in project {PROJECT}",
        ),
    ]
    # Pages of 2: every page was asked for, each for the project, and nothing but reads.
    assert len(iam.bodies) == -(-len(iam.permissions) // 2)
    assert {b["fullResourceName"] for b in iam.bodies} == {
        f"//cloudresourcemanager.googleapis.com/projects/{PROJECT}"
    }
    assert [b.get("pageToken") for b in iam.bodies[:3]] == [None, "2", "4"]


def test_a_permission_the_project_cannot_hold_is_one_line_naming_the_role(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = google_list("tpu.nodes.create", **{"tpu.operations.get": "NOT_SUPPORTED"})
    for _server in serve(FakeIam(listed), monkeypatch):
        report = iam_preflight.check_roles(every_role(), requests.Session)
    assert report.warnings == []
    assert report.checks == [
        (
            False,
            "custom role gemma4SelfService_gemma4_prod_* (training.releaseWhenDone / "
            "serving.stopAfterHours): permission tpu.operations.get cannot be held by a custom "
            "role (IAM: customRolesSupportLevel NOT_SUPPORTED)",
        ),
        (
            False,
            "custom role gemma4Recover_gemma4_prod_* (recovery.enabled): permission "
            f"tpu.nodes.create cannot be held in project {PROJECT} (IAM does not list it there: "
            "misspelt, or not Google's)",
        ),
        (
            False,
            "custom role gemma4Recover_gemma4_prod_* (recovery.enabled): permission "
            "tpu.operations.get cannot be held by a custom role (IAM: customRolesSupportLevel "
            "NOT_SUPPORTED)",
        ),
    ]


def test_the_old_recovery_role_fails_at_preflight(
    iam: FakeIam, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        recovery,
        "RECOVER_PERMISSIONS",
        (*recovery.RECOVER_PERMISSIONS, "tpu.queuedResources.create"),
    )
    report = iam_preflight.check_roles(every_role(), requests.Session)
    assert [line for ok, line in report.checks if not ok] == [
        "custom role gemma4Recover_gemma4_prod_* (recovery.enabled): permission "
        f"tpu.queuedResources.create cannot be held in project {PROJECT} (IAM does not list it "
        "there: misspelt, or not Google's)"
    ]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_not_reaching_iam_is_a_warning_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = every_role()
    monkeypatch.setenv(iam_preflight.ENDPOINT_ENV, f"http://127.0.0.1:{_closed_port()}")
    (closed,) = iam_preflight.check_roles(cfg, requests.Session).warnings
    assert closed.startswith(
        f"IAM: cannot check the custom roles' permissions in project {PROJECT} (ConnectionError: "
    )
    assert "\n" not in closed and closed.endswith(
        'may stop at IAM\'s "Permission ... is not valid"'
    )
    for _server in serve(FakeIam([], status=403), monkeypatch):
        report = iam_preflight.check_roles(cfg, requests.Session)
    assert report.checks == []
    assert report.warnings == [
        f"IAM: cannot check the custom roles' permissions in project {PROJECT} (HTTP 403: "
        "Permission 'iam.permissions.none' denied on resource); `pulumi up` may stop at IAM's "
        '"Permission ... is not valid"'
    ]

    def no_credentials() -> Any:
        raise RuntimeError("Your default credentials were not found.\nTo set up ADC, see ...")

    (line,) = iam_preflight.check_roles(cfg, no_credentials).warnings
    assert "(RuntimeError: Your default credentials were not found.)" in line


def test_preflight_runs_the_iam_check_and_warns_without_failing(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (
        (pulumi_mocks.ROOT / "Pulumi.dev.yaml")
        .read_text()
        .replace("your-gcp-project", PROJECT)
        .replace("203.0.113.0/24", "192.168.10.0/24")
        .replace("  gemma4-tpu:training:\n", "  gemma4-tpu:training:\n    releaseWhenDone: true\n")
    )
    (tmp_path / "Pulumi.mine.yaml").write_text(text + "  gemma4-tpu:hfToken:\n    secure: v1:abc\n")
    argv = ["--stack", "mine", "--root", str(tmp_path)]
    for _server in serve(FakeIam(google_list()), monkeypatch):
        status = preflight.main(
            argv, client_factory=healthy_tpu, iam_session_factory=requests.Session
        )
    out = capsys.readouterr().out
    assert status == 0, out
    assert (
        "ok    custom role gemma4SelfService_gemma4_dev_* (training.releaseWhenDone / "
        f"serving.stopAfterHours): its 3 permissions can be held in project {PROJECT}"
    ) in out.splitlines()
    assert out.splitlines()[-1] == "preflight: OK (4 checks passed): `pulumi up` can go ahead"
    # IAM out of reach: a warning line, and the verdict rests on the other checks.
    monkeypatch.setenv(iam_preflight.ENDPOINT_ENV, f"http://127.0.0.1:{_closed_port()}")
    status = preflight.main(argv, client_factory=healthy_tpu, iam_session_factory=requests.Session)
    out = capsys.readouterr().out
    assert status == 0, out
    warnings = [line for line in out.splitlines() if line.startswith("WARN  IAM:")]
    assert len(warnings) == 1 and "cannot check the custom roles' permissions" in warnings[0]
    assert out.splitlines()[-1] == "preflight: OK (3 checks passed): `pulumi up` can go ahead"
