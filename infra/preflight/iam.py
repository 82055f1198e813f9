"""Preflight's IAM check: can the user's project hold every permission of the stack's custom
roles? Asked of IAM itself, before `pulumi up` creates anything.

IAM refuses a custom role naming a permission it does not know (`Error 400: Permission ... is
not valid`) or one that custom roles cannot hold, and it does so in the middle of `pulumi up`,
after the buckets and the service account exist. The catalogue (infra/config/iam_catalogue.py)
is Google's published list; this asks the project: IAM's `permissions:queryTestablePermissions`
(POST https://iam.googleapis.com/v1/permissions:queryTestablePermissions, read-only) lists what
a project-level role can hold there, with each permission's custom-role support.

The request goes through google-auth's AuthorizedSession with Application Default Credentials,
to the endpoint gcloud's own setting names (CLOUDSDK_API_ENDPOINT_OVERRIDES_IAM), else Google's:
one path, whether the answer comes from Google or from a local server in a test. Not reaching
IAM (no credentials, no network, a refusal) is a warning line, never a failed check or a
traceback: preflight's other checks still stand.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Protocol

from infra.config import model as config_mod
from infra.vm import roles

ENDPOINT_ENV = "CLOUDSDK_API_ENDPOINT_OVERRIDES_IAM"
DEFAULT_ENDPOINT = "https://iam.googleapis.com/"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
PAGE_SIZE = 1000  # the method's maximum
# A project lists a few thousand testable permissions: far fewer pages than this. A server that
# never stops paging is not IAM.
MAX_PAGES = 100
TIMEOUT_S = 30.0


class Session(Protocol):
    """What is used of requests.Session (google.auth.transport.requests.AuthorizedSession)."""

    def post(self, url: str, *, json: Any, timeout: float) -> Any: ...


@dataclasses.dataclass(frozen=True)
class StackRole:
    """A custom role the stack would create: its id without the creation suffix
    (infra/resources/role_id.py), what it is for, and its permissions."""

    base_id: str
    purpose: str
    permissions: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"custom role {self.base_id}_* ({self.purpose})"


@dataclasses.dataclass(frozen=True)
class RoleReport:
    """The IAM check's outcome: (ok, line) checks for the verdict, and warning lines."""

    checks: list[tuple[bool, str]]
    warnings: list[str]


class Unreachable(Exception):
    """IAM did not answer with the permissions (one line saying why)."""


def stack_roles(cfg: config_mod.StackConfig) -> list[StackRole]:
    """The custom roles `pulumi up` would create for this config (as if no run had released its
    node yet): the VMs' self-service role and the recovery controller's role."""
    # Lazy: the components import pulumi_gcp, which only this line needs here.
    from infra.components import recovery

    found = []
    permissions = sorted(
        {p for row in roles.ROLES if row.declared(cfg, False) for p in row.self_service(cfg)}
    )
    prefix = cfg.name_prefix.replace("-", "_")
    if permissions:
        found.append(
            StackRole(
                f"gemma4SelfService_{prefix}",
                "training.releaseWhenDone / serving.stopAfterHours",
                tuple(permissions),
            )
        )
    if cfg.recovery.enabled:
        found.append(
            StackRole(f"gemma4Recover_{prefix}", "recovery.enabled", recovery.RECOVER_PERMISSIONS)
        )
    return found


def endpoint() -> str:
    """The IAM API's root URL, ending in '/'."""
    return (os.environ.get(ENDPOINT_ENV, "").strip() or DEFAULT_ENDPOINT).rstrip("/") + "/"


def testable_permissions(session: Session, project: str) -> dict[str, dict[str, Any]]:
    """Every permission a project-level role can hold in `project`, by name (IAM's Permission
    objects: customRolesSupportLevel, apiDisabled, ...), all pages.

    Raises:
        Unreachable: any failure to get the whole list.
    """
    url = endpoint() + "v1/permissions:queryTestablePermissions"
    body: dict[str, Any] = {
        "fullResourceName": f"//cloudresourcemanager.googleapis.com/projects/{project}",
        "pageSize": PAGE_SIZE,
    }
    found: dict[str, dict[str, Any]] = {}
    for _ in range(MAX_PAGES):
        try:
            response = session.post(url, json=body, timeout=TIMEOUT_S)
        except Exception as exc:  # requests' and google-auth's errors alike: one line
            raise Unreachable(f"{type(exc).__name__}: {_first_line(exc)}") from exc
        if response.status_code != 200:
            raise Unreachable(f"HTTP {response.status_code}: {_error_message(response)}")
        try:
            page = response.json()
        except ValueError as exc:
            raise Unreachable(f"the answer is not JSON: {_first_line(exc)}") from exc
        for permission in page.get("permissions") or []:
            found[str(permission.get("name"))] = permission
        token = page.get("nextPageToken")
        if not token:
            return found
        body["pageToken"] = token
    raise Unreachable(f"still paging after {MAX_PAGES} pages")


def check_roles(cfg: config_mod.StackConfig, session_factory: Callable[[], Session]) -> RoleReport:
    """Each custom role's permissions against what `cfg.project` can hold: one failed check per
    permission it cannot (naming the role and the permission), one passed check per role that
    is fine; a warning when IAM cannot be asked. No role, no request."""
    stack = stack_roles(cfg)
    if not stack:
        return RoleReport([], [])
    try:
        testable = testable_permissions(session_factory(), cfg.project)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, Unreachable) else f"{type(exc).__name__}: {exc}"
        return RoleReport(
            [],
            [
                f"IAM: cannot check the custom roles' permissions in project {cfg.project} "
                f"({_first_line(reason)}); `pulumi up` may stop at IAM's \"Permission ... is "
                'not valid"'
            ],
        )
    checks: list[tuple[bool, str]] = []
    for role in stack:
        bad = []
        for name in role.permissions:
            entry = testable.get(name)
            if entry is None:
                bad.append(
                    f"{role.label}: permission {name} cannot be held in project {cfg.project} "
                    "(IAM does not list it there: misspelt, or not Google's)"
                )
            elif entry.get("customRolesSupportLevel") == "NOT_SUPPORTED":
                bad.append(
                    f"{role.label}: permission {name} cannot be held by a custom role "
                    "(IAM: customRolesSupportLevel NOT_SUPPORTED)"
                )
        checks += [(False, line) for line in bad]
        if not bad:
            checks.append(
                (
                    True,
                    f"{role.label}: its {len(role.permissions)} permissions can be held in "
                    f"project {cfg.project}",
                )
            )
    return RoleReport(checks, [])


def google_session() -> Session:
    """An AuthorizedSession with Application Default Credentials.

    Raises:
        Exception: no credentials (google.auth's DefaultCredentialsError), missing library.
    """
    import google.auth
    from google.auth.transport.requests import AuthorizedSession

    credentials, _project = google.auth.default(scopes=[SCOPE])
    session: Session = AuthorizedSession(credentials)
    return session


def _error_message(response: Any) -> str:
    try:
        message = response.json()["error"]["message"]
    except Exception:
        message = getattr(response, "text", "") or getattr(response, "reason", "")
    return _first_line(str(message)) or "no message"


def _first_line(value: object) -> str:
    text = str(value).strip()
    return text.splitlines()[0][:300] if text else ""
