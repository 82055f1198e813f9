"""The rehearsal's control plane (localcloud/control_plane.py), without VMs: one IAM that the
API checks calls against and the hooks issue the nodes' tokens from, and this process's client
pointed at the API only until it closes."""

from __future__ import annotations

import os

from infra.tpu import api as tpu_api
from localcloud import control_plane, stack_plan


def test_the_api_and_the_hooks_share_one_iam_and_the_environment_comes_back(tmp_path, monkeypatch):
    monkeypatch.delenv(tpu_api.ENDPOINT_ENV, raising=False)
    monkeypatch.setenv(control_plane.CREDENTIALS_ENV, "/elsewhere/key.json")
    plan = stack_plan.StackPlan(stack="dev", config={"project": "acme"}, vms={}, buckets=[])

    def no_vm(*_args):
        raise AssertionError("no node is created here")

    control = control_plane.ControlPlane(plan, tmp_path, no_vm, lambda _vm: None)
    try:
        assert control.hooks.iam is control.api.iam
        member = f"serviceAccount:{control_plane.OPERATOR}@acme.iam.gserviceaccount.com"
        assert control.api.iam.allows(member, "tpu.nodes.create")  # the operator owns it
        token = control.hooks.iam.issue_token("serviceAccount:vm@acme.iam.gserviceaccount.com")
        assert control.api.iam.member_of(token) == "serviceAccount:vm@acme.iam.gserviceaccount.com"
        assert os.environ[tpu_api.ENDPOINT_ENV] == control.api.url
        assert os.environ[control_plane.CREDENTIALS_ENV] == str(tmp_path / "operator-key.json")
    finally:
        control.close()
    assert tpu_api.ENDPOINT_ENV not in os.environ
    assert os.environ[control_plane.CREDENTIALS_ENV] == "/elsewhere/key.json"
