"""Renamed Pulumi types carry an alias to their old type, so an existing stack updates in place.

The old URNs below are what stacks created before the renames hold. The program runs under mocks
and each resource's registration is checked: a resource whose URN changed must carry an alias
spec naming its old type (same name, same parent), or be the child of one that does (the engine
gives children their parent's aliases). Without that, `pulumi up` would delete and recreate the
Secret Manager secrets and stop the running job to redeploy it.
"""

from __future__ import annotations

import pytest

from tests.fixtures import pulumi_mocks

RENAMED = {
    "gemma4-tpu:infra:StoredSecret": "gemma4-tpu:infra:HfTokenSecret",
    "pulumi-python:dynamic/gemma4:SshDeployment": "pulumi-python:dynamic/gemma4:WorkloadDeployment",
}


def previous_urn(urn: str) -> str:
    """The URN the same resource had before the renames (types in the parent chain included)."""
    head, name = urn.rsplit("::", 1)
    prefix, chain = head.rsplit("::", 1)
    return f"{prefix}::{'$'.join(RENAMED.get(t, t) for t in chain.split('$'))}::{name}"


def aliased_types(registered: pulumi_mocks.Registered) -> list[str]:
    """The old types this registration aliases, refusing aliases that move or rename it."""
    found = []
    for alias in registered.aliases:
        spec = alias.get("spec", {})
        assert spec.get("name", registered.name) == registered.name, alias
        assert not spec.get("noParent") and not spec.get("parentUrn"), alias
        found.append(spec.get("type"))
    return found


@pytest.mark.parametrize("stack", ["prod"])
def test_every_resource_whose_urn_changed_is_aliased_to_its_old_urn(stack):
    mapping = pulumi_mocks.stack_file_config(stack)
    rec = pulumi_mocks.run_program(stack, mapping, hf_token="hf_x")
    by_urn = {r.urn: r for r in rec.resources}
    seen = {new: 0 for new in RENAMED}
    for r in rec.resources:
        assert r.type not in RENAMED.values(), f"{r.urn} still registers an old type"
        if previous_urn(r.urn) == r.urn:
            continue
        if r.type in RENAMED:
            assert RENAMED[r.type] in aliased_types(r), f"{r.urn}: no alias to {RENAMED[r.type]}"
            seen[r.type] += 1
            continue
        # A child of a renamed resource: its parent chain holds the renamed (aliased) resource.
        parent = by_urn[r.parent]
        while parent.type not in RENAMED:
            parent = by_urn[parent.parent]
        assert RENAMED[parent.type] in aliased_types(parent), r.urn
    assert all(seen.values()), seen


def test_previous_urn_renames_the_parent_chain():
    urn = (
        "urn:pulumi:dev::gemma4-tpu::gemma4-tpu:infra:StoredSecret$"
        "gcp:secretmanager/secret:Secret::hf-token-secret"
    )
    assert previous_urn(urn) == (
        "urn:pulumi:dev::gemma4-tpu::gemma4-tpu:infra:HfTokenSecret$"
        "gcp:secretmanager/secret:Secret::hf-token-secret"
    )
