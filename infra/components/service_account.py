"""The dedicated service account of the TPU VMs.

It gets no project-wide role except writing logs and metrics; data access is granted on each
bucket and on the secret by those components.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import pulumi
import pulumi_gcp as gcp

from infra.resources import role_id as role_id_mod

PROJECT_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter")
# The OAuth scope every VM of the stack gets with its service account: IAM alone decides.
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
# Never granted project-wide: the basic roles and any administrator role (storage.admin would
# open every bucket of the project; data access is granted per bucket instead).
FORBIDDEN_PROJECT_ROLES = ("roles/editor", "roles/owner", "roles/storage.admin")


def forbidden_project_roles(roles: tuple[str, ...]) -> list[str]:
    """The roles of `roles` that must never be granted project-wide (see FORBIDDEN_PROJECT_ROLES;
    also any `*.admin` / `*Admin` role)."""
    return sorted(
        r for r in set(roles) if r in FORBIDDEN_PROJECT_ROLES or r.lower().endswith("admin")
    )


@dataclasses.dataclass(frozen=True)
class ServiceAccountArgs:
    """Arguments of VmServiceAccount."""

    project: str
    """Project id of the account."""
    account_id: str
    """Account id (6-30 characters), the part before @ of the e-mail."""
    display_name: str
    """Human-readable name shown in the console."""
    project_roles: tuple[str, ...] = PROJECT_ROLES
    """Project-level roles (observability only; never editor, owner or an admin role)."""


class VmServiceAccount(pulumi.ComponentResource):
    """A service account for the TPU VMs with logging/monitoring writer roles only."""

    account: gcp.serviceaccount.Account
    email: pulumi.Output[str]
    member: pulumi.Output[str]

    def __init__(
        self, name: str, args: ServiceAccountArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("gemma4-tpu:infra:VmServiceAccount", name, None, opts)
        forbidden = forbidden_project_roles(args.project_roles)
        if forbidden:
            raise ValueError(
                f"project_roles: {forbidden}: never granted project-wide to the VMs; allowed: "
                "non-admin roles such as " + ", ".join(PROJECT_ROLES)
            )
        self.account = gcp.serviceaccount.Account(
            f"{name}-account",
            project=args.project,
            account_id=args.account_id,
            display_name=args.display_name,
            description="Runs the gemma4-tpu TPU VMs; access granted per bucket and secret.",
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.email = self.account.email
        self.member = self.account.member
        self.project_grants = [
            gcp.projects.IAMMember(
                f"{name}-{role.split('/')[-1].lower()}",
                project=args.project,
                role=role,
                member=self.member,
                opts=pulumi.ResourceOptions(parent=self),
            )
            for role in args.project_roles
        ]
        self.register_outputs({"email": self.email, "member": self.member})


def custom_role_grant(
    name: str,
    project: str,
    member: pulumi.Input[str],
    *,
    role_id: str,
    title: str,
    description: str,
    permissions: Sequence[str],
    opts: pulumi.ResourceOptions,
) -> pulumi.Resource:
    """A project custom role with exactly `permissions` (`<name>-role`), granted to `member`
    (`<name>-member`). Characters a role id cannot hold become '_'.

    The role's id is `<role_id>_<suffix>` (`<name>-role-id`, infra/resources/role_id.py): GCP
    refuses a deleted role's id for 37 days, so a role created again after a destroy or a
    toggle gets a new suffix; while it lives, it keeps its own.

    Returns:
        The grant (what a resource that needs the permissions depends on).
    """
    rid = role_id_mod.CustomRoleId(
        f"{name}-role-id", project, re.sub(r"[^A-Za-z0-9_]", "_", role_id), opts=opts
    )
    role = gcp.projects.IAMCustomRole(
        f"{name}-role",
        project=project,
        role_id=rid.role_id,
        title=title,
        description=description,
        permissions=sorted(set(permissions)),
        opts=opts,
    )
    return gcp.projects.IAMMember(
        f"{name}-member", project=project, role=role.name, member=member, opts=opts
    )


def self_service_grant(
    name: str, project: str, account: VmServiceAccount, *, prefix: str, permissions: Sequence[str]
) -> pulumi.Resource:
    """A custom role with exactly `permissions`, granted to the VMs' account (one role per stack
    prefix): what the VMs need to give their own nodes back (each role's `self_service`,
    infra/vm/roles.py). Granted on the project: Cloud TPU has no per-node IAM.

    Returns:
        The grant (the VMs depend on it: a run may finish before anyone looks).
    """
    return custom_role_grant(
        name,
        project,
        account.member,
        role_id=f"gemma4SelfService_{prefix}",
        title=f"gemma4-tpu self-service ({prefix})",
        description="Lets the TPU VMs delete or stop their own node (releaseWhenDone, "
        "stopAfterHours).",
        permissions=permissions,
        opts=pulumi.ResourceOptions(parent=account),
    )
