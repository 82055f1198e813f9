"""Every permission the program grants is one of Google's: the dev and prod stacks with every
grant turned on (the recovery controller, releaseWhenDone, stopAfterHours) run under Pulumi's
mocks, and each custom role's permissions and each binding's role are looked up in
infra/config/iam_catalogue.py.

Why: IAM refuses a custom role naming a permission it does not know, and the mocks accept any
string. The controller's role once named tpu.queuedResources.*, which Cloud TPU does not have;
test_the_old_recovery_role_fails_here keeps that mistake caught.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra.components import recovery as recovery_mod
from infra.config import iam_catalogue
from infra.ops import release_record
from tests.fixtures import pulumi_mocks

TOKEN = "hf_TEST_SECRET_3f9a1c7e5b2d4068a1b2c3d4e5f60718"
CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"
# Every binding type the program declares today: a new one must be added here to be checked.
BINDINGS = {
    "gcp:projects/iAMMember:IAMMember",
    "gcp:serviceaccount/iAMMember:IAMMember",
    "gcp:storage/bucketIAMMember:BucketIAMMember",
    "gcp:secretmanager/secretIamMember:SecretIamMember",
}
# What the controller's role held before the catalogue: Cloud TPU has no queued-resource
# permissions (the queued-resource methods are authorized by tpu.nodes.*).
OLD_RECOVER_PERMISSIONS = (
    "tpu.nodes.create",
    "tpu.nodes.delete",
    "tpu.nodes.get",
    "tpu.nodes.list",
    "tpu.nodes.update",
    "tpu.operations.get",
    "tpu.queuedResources.create",
    "tpu.queuedResources.delete",
    "tpu.queuedResources.get",
    "tpu.queuedResources.list",
)


def every_grant_on(stack: str) -> dict[str, Any]:
    """The stack file with the recovery controller, releaseWhenDone and (prod) stopAfterHours."""
    mapping = pulumi_mocks.stack_file_config(stack)
    mapping["recovery"] = {"enabled": True}
    mapping = pulumi_mocks.with_key(mapping, "training.releaseWhenDone", True)
    if stack == "prod":
        # Only an on-demand node can be stopped (a spot one is deleted instead).
        mapping = pulumi_mocks.with_key(mapping, "serving.stopAfterHours", 8)
        mapping = pulumi_mocks.with_key(mapping, "serving.provisioning", "on-demand")
    return mapping


def run(stack: str, monkeypatch: pytest.MonkeyPatch) -> pulumi_mocks.Recording:
    # The run has not released its node (the bucket would say so), so the role is declared.
    monkeypatch.setattr(release_record.storage, "exists", lambda _uri: False)
    return pulumi_mocks.run_program(stack, every_grant_on(stack), hf_token=TOKEN)


def outside_the_catalogue(rec: pulumi_mocks.Recording) -> list[str]:
    """One line per permission or role the recorded program grants that Google does not have
    (as far as the catalogue knows), naming the resource."""
    custom = {
        f"projects/{r.inputs['project']}/roles/{r.inputs['roleId']}": r
        for r in rec.of_type(CUSTOM_ROLE)
    }
    lines = [
        f"{r.name}: custom role {r.inputs['roleId']}: permission {p} is not one of Google's "
        "(infra/config/iam_catalogue.py)"
        for r in custom.values()
        for p in iam_catalogue.unknown(r.inputs["permissions"])
    ]
    for r in rec.resources:
        role = r.inputs.get("role") if r.custom else None
        if role is None:
            continue
        if r.type not in BINDINGS:
            lines.append(f"{r.name}: binding type {r.type} is not checked here (BINDINGS)")
        elif role.startswith("roles/"):
            if role not in iam_catalogue.PREDEFINED_ROLES:
                lines.append(f"{r.name}: predefined role {role} is not in the catalogue")
        elif role not in custom:
            lines.append(f"{r.name}: role {role} is neither predefined nor declared by the stack")
    return lines


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_permission_the_program_grants_is_googles(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = run(stack, monkeypatch)
    assert outside_the_catalogue(rec) == []
    # Not vacuous: both custom roles and a binding of each kind were checked.
    role_ids = sorted(r.inputs["roleId"].split("_")[0] for r in rec.of_type(CUSTOM_ROLE))
    assert role_ids == ["gemma4Recover", "gemma4SelfService"]
    kinds = {r.type for r in rec.resources if r.custom and "role" in r.inputs}
    assert kinds == BINDINGS
    if stack == "prod":
        (self_service,) = [
            r for r in rec.of_type(CUSTOM_ROLE) if r.inputs["roleId"].startswith("gemma4Self")
        ]
        assert sorted(self_service.inputs["permissions"]) == [
            "tpu.nodes.delete",
            "tpu.nodes.get",
            "tpu.nodes.stop",
            "tpu.operations.get",
        ]


def test_the_old_recovery_role_fails_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery_mod, "RECOVER_PERMISSIONS", OLD_RECOVER_PERMISSIONS)
    problems = outside_the_catalogue(run("dev", monkeypatch))
    assert [line.split(": permission ")[1].split()[0] for line in problems] == [
        "tpu.queuedResources.create",
        "tpu.queuedResources.delete",
        "tpu.queuedResources.get",
        "tpu.queuedResources.list",
    ]
    assert all(line.startswith("recover-tpu-role: custom role gemma4Recover_") for line in problems)


def test_a_binding_outside_the_catalogue_fails_here(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = run("dev", monkeypatch)
    logs = next(r for r in rec.resources if r.inputs.get("role") == "roles/logging.logWriter")
    logs.inputs["role"] = "roles/tpu.viewer"  # a real role, but not one the catalogue lists
    member = next(r for r in rec.resources if "roles/gemma4SelfService_" in str(r.inputs))
    member.inputs["role"] = "projects/p/roles/gemma4Gone_x"
    assert outside_the_catalogue(rec) == [
        f"{logs.name}: predefined role roles/tpu.viewer is not in the catalogue",
        f"{member.name}: role projects/p/roles/gemma4Gone_x is neither predefined nor declared "
        "by the stack",
    ]
