"""The permission catalogue's own data (infra/config/iam_catalogue.py): consistent with itself
and with what Google's IAM reference says about Cloud TPU."""

from __future__ import annotations

import pytest

from infra.config import iam_catalogue as cat


def test_cloud_tpu_has_no_queued_resource_permissions() -> None:
    assert not [p for p in cat.PERMISSIONS if p.startswith("tpu.queuedResources.")]
    assert cat.unknown(["tpu.queuedResources.create", "tpu.nodes.create"]) == [
        "tpu.queuedResources.create"
    ]
    # The queued-resource methods are authorized by the node permissions.
    for verb, needs in (
        ("create", "create"),
        ("get", "get"),
        ("list", "list"),
        ("delete", "delete"),
        ("reset", "reset"),
    ):
        assert cat.TPU_METHOD_PERMISSIONS[f"projects.locations.queuedResources.{verb}"] == (
            f"tpu.nodes.{needs}",
        )


def test_every_name_it_uses_is_in_its_own_list() -> None:
    for role, permissions in cat.PREDEFINED_ROLES.items():
        assert role.startswith("roles/")
        assert cat.unknown(permissions) == [], role
    for table in (cat.TPU_METHOD_PERMISSIONS, cat.TPU_METHOD_SERVICE_ACCOUNT_PERMISSIONS):
        for method, permissions in table.items():
            assert cat.unknown(permissions) == [], method
    assert set(cat.TPU_CLIENT_METHODS.values()) == set(cat.TPU_METHOD_PERMISSIONS)
    assert cat.TPU_PERMISSIONS <= cat.PERMISSIONS
    # Permission names are service.resource.verb, nothing else.
    assert all(len(p.split(".")) == 3 and " " not in p for p in cat.PERMISSIONS)


def test_creating_a_node_with_a_service_account_needs_act_as() -> None:
    create = "projects.locations.nodes.create"
    assert cat.tpu_method_permissions(create) == ("tpu.nodes.create",)
    assert cat.tpu_method_permissions(create, with_service_account=True) == (
        "tpu.nodes.create",
        "iam.serviceAccounts.actAs",
    )
    assert cat.tpu_method_permissions(
        "projects.locations.nodes.delete", with_service_account=True
    ) == ("tpu.nodes.delete",)


def test_unknown_names_are_one_line_errors() -> None:
    with pytest.raises(KeyError, match=r"'projects.locations.nodes.explode': not in the catalogue"):
        cat.tpu_method_permissions("projects.locations.nodes.explode")
    with pytest.raises(KeyError, match=r"'roles/tpu.admin': not in the catalogue"):
        cat.role_permissions("roles/tpu.admin")
    assert "iam.serviceAccounts.actAs" in cat.role_permissions("roles/iam.serviceAccountUser")
