"""IAM of the local cloud: who a caller is, and whether the grants the program declared let it.

Google has no IAM emulator, so the local cloud checks calls itself, with Google's permission
names: a grant is (member, permissions, resource), where the permissions come from a custom role
the program declared or from a predefined role as Google's reference defines it
(infra/config/iam_catalogue.py), and the resource is the project ("") or one service account (a
grant on that account, such as roles/iam.serviceAccountUser for act-as). Built from the resources
the Pulumi program declared (`from_resources`), so a permission the program forgot is a 403 here
as it is on GCP.

Who calls: a bearer token the local cloud issued (a VM's metadata server hands its service
account's; the token endpoint issues one for a signed assertion), or a JWT signed with a key the
local cloud made (a service-account key file, as Application Default Credentials read it).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import secrets
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from infra.config import iam_catalogue

# A member holding every permission: the person running `pulumi up` (the project's owner).
ALL = "*"
CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"
PROJECT_MEMBER = "gcp:projects/iAMMember:IAMMember"
ACCOUNT_MEMBER = "gcp:serviceaccount/iAMMember:IAMMember"


@dataclasses.dataclass(frozen=True)
class Grant:
    """`member` holds `permissions` on `resource` ("" = the whole project)."""

    member: str
    permissions: frozenset[str]
    resource: str = ""


def account_resource(account: str) -> str:
    """projects/P/serviceAccounts/EMAIL or EMAIL -> EMAIL (how grants on an account are keyed)."""
    return account.rsplit("/", 1)[-1]


class Iam:
    """The grants in force and the identities the local cloud knows (thread-safe)."""

    def __init__(self, grants: Iterable[Grant] = ()) -> None:
        self.grants: list[Grant] = list(grants)
        self._tokens: dict[str, str] = {}
        self._keys: dict[str, tuple[str, str]] = {}  # key id -> (member, public key PEM)
        self._lock = threading.Lock()

    # -- grants ------------------------------------------------------------------------------

    def grant(self, member: str, permissions: Iterable[str], resource: str = "") -> None:
        with self._lock:
            self.grants.append(Grant(member, frozenset(permissions), resource))

    def owner(self, member: str) -> None:
        """`member` may do everything (the operator: roles/owner)."""
        self.grant(member, [ALL])

    def revoke(self, member: str, permission: str) -> None:
        """Takes `permission` away from every grant of `member` (a fault: a role that lacks it)."""
        with self._lock:
            self.grants = [
                dataclasses.replace(g, permissions=g.permissions - {permission})
                if g.member == member
                else g
                for g in self.grants
            ]

    def allows(self, member: str, permission: str, resource: str = "") -> bool:
        with self._lock:
            grants = list(self.grants)
        return any(
            g.member == member
            and (g.resource in ("", resource))
            and (ALL in g.permissions or permission in g.permissions)
            for g in grants
        )

    # -- identities --------------------------------------------------------------------------

    def issue_token(self, member: str) -> str:
        """A new access token that names `member` (what a metadata server or /token hands out)."""
        token = f"lc.{secrets.token_urlsafe(24)}"
        with self._lock:
            self._tokens[token] = member
        return token

    def new_key_file(self, email: str, project: str, token_uri: str) -> dict[str, Any]:
        """A service-account key (the JSON `gcloud iam service-accounts keys create` writes) for
        `email`, whose signatures this IAM accepts; `token_uri` is the local token endpoint."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        public = (
            key.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )
        key_id = secrets.token_hex(20)
        with self._lock:
            self._keys[key_id] = (f"serviceAccount:{email}", public)
        return {
            "type": "service_account",
            "project_id": project,
            "private_key_id": key_id,
            "private_key": private,
            "client_email": email,
            "client_id": str(int(key_id[:12], 16)),
            "token_uri": token_uri,
        }

    def member_of(self, bearer: str) -> str | None:
        """The member a bearer token or signed JWT names, or None (unknown, forged, expired)."""
        with self._lock:
            known = self._tokens.get(bearer)
            keys = dict(self._keys)
        if known is not None:
            return known
        key_id = _jwt_header(bearer).get("kid")
        if key_id not in keys:
            return None
        member, public = keys[key_id]
        from google.auth import jwt

        try:
            claims = jwt.decode(bearer, certs={key_id: public}, verify=True, audience=None)
        except (ValueError, jwt.exceptions.GoogleAuthError):
            return None
        email = claims.get("sub") or claims.get("iss")
        return member if member == f"serviceAccount:{email}" else None


def _jwt_header(token: str) -> dict[str, Any]:
    head = token.split(".", 1)[0]
    try:
        value = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def from_resources(resources: Iterable[tuple[str, Mapping[str, Any]]]) -> list[Grant]:
    """The grants a program declared: (type token, inputs) of its IAM resources, custom roles
    resolved to their permissions and predefined roles to Google's.

    Raises:
        KeyError: a predefined role the catalogue does not define (add it there).
    """
    resources = list(resources)
    custom = {
        f"projects/{inputs['project']}/roles/{inputs['roleId']}": frozenset(inputs["permissions"])
        for typ, inputs in resources
        if typ == CUSTOM_ROLE
    }

    def permissions(role: str) -> frozenset[str]:
        if role in custom:
            return custom[role]
        return iam_catalogue.role_permissions(role)

    grants = []
    for typ, inputs in resources:
        if typ == PROJECT_MEMBER:
            grants.append(Grant(inputs["member"], permissions(inputs["role"])))
        elif typ == ACCOUNT_MEMBER:
            grants.append(
                Grant(
                    inputs["member"],
                    permissions(inputs["role"]),
                    account_resource(inputs["serviceAccountId"]),
                )
            )
    return grants
