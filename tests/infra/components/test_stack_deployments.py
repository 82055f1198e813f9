"""The whole Pulumi program under mocks, with the deployments declared for its VMs."""

from __future__ import annotations

import collections
import json
import pathlib
from typing import Any

import pytest
import yaml

from infra.components import stack_deployments
from infra.config import runconfig_render, stack_config
from infra.ops import cli as ops
from tests.fixtures import pulumi_mocks
from workloads.contract import runconfig

DYNAMIC = "pulumi-python:dynamic/gemma4:SshDeployment"
COMPONENT = "gemma4-tpu:infra:WorkloadsDeployment"
CHECKED: collections.Counter[str] = collections.Counter()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_program_declares_one_deployment_per_vm(stack: str) -> None:
    mapping = pulumi_mocks.stack_file_config(stack)
    cfg = stack_config.parse_stack_config(mapping)
    rec = pulumi_mocks.run_program(stack, mapping, hf_token="hf_TEST_ONLY_0123456789")

    roles = ["train", "serve"] if cfg.serving.enabled else ["train"]
    deployments = rec.of_type(DYNAMIC)
    assert sorted(d.name for d in deployments) == sorted(f"{r}-deploy-workloads" for r in roles)
    assert len(rec.of_type(COMPONENT)) == len(roles)
    run_config = runconfig_render.render_run_config(cfg)
    for role in roles:
        dep = rec.one(DYNAMIC, f"{role}-deploy-workloads")
        ips = rec.outputs[f"{role}WorkerIps"]
        assert ips and dep.inputs["hosts"] == ips  # the VM's addresses, resolved
        node = cfg.training_node_name if role == "train" else cfg.serving_node_name
        assert dep.inputs["vm"] == node
        # The deploy reads that node through the Cloud TPU API before it waits on its workers.
        where = dep.inputs["node"].split("/")
        assert (where[0], where[1], where[2], where[4:]) == (
            "projects",
            cfg.project,
            "locations",
            ["nodes", node],
        )
        expected = stack_deployments.run_config_for(role, run_config)
        assert dep.inputs["run_config_yaml"] == expected.to_yaml()
        if role == "serve":
            assert expected == run_config  # the serving VM reads every section
        assert dep.inputs["ssh_user"] == cfg.ssh.user
        assert dep.inputs["use_sudo"] is True
        assert len(dep.inputs["wheel_sha256"]) == 64
        first = "gemma4-train.service" if role == "train" else "gemma4-serve.service"
        assert dep.inputs["start"][0] == first
        assert dep.parent.endswith(f"{COMPONENT}::{role}-deploy")

        # `python -m infra.ops` finds the VM in the stack outputs the program exports.
        info = ops.vm_info(rec.outputs, role)
        assert info.hosts == ips
        assert info.access.user == cfg.ssh.user
        # Nothing of this machine in the state: no key path, no home, no checkout path.
        assert "ssh_key_path" not in dep.inputs
        assert dep.inputs["stack"] == stack and dep.inputs["known_hosts"] == ".known_hosts"
        local = (str(pathlib.Path.home()), str(pathlib.Path(__file__).resolve().parents[3]))
        for text in (json.dumps(dep.inputs, default=str), json.dumps(rec.outputs["deployments"])):
            assert not any(path in text for path in local), text[:300]
        CHECKED[stack] += 1
    if cfg.serving.enabled:
        serve = rec.one(DYNAMIC, "serve-deploy-workloads").inputs
        assert serve["start"] == [f"gemma4-{u}.service" for u in ("serve", "eval", "bench")]
        assert ops.vm_info(rec.outputs, "serve").serve_port == cfg.serving.port
    else:
        with pytest.raises(ops.OpsError, match="no serve VM"):
            ops.vm_info(rec.outputs, "serve")
    assert CHECKED[stack] == len(roles)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_program_opens_no_ssh_connection(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # SSH belongs to the deployment provider's create/update (run by the engine, shown in the
    # preview), never to the program or its Output.apply callbacks: any attempt here fails.
    import fabric
    import paramiko

    from infra import remote
    from infra.remote import ssh

    attempts: list[str] = []

    def refuse(name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            attempts.append(name)
            raise AssertionError(f"{name} called while the program ran")

        return fail

    monkeypatch.setattr(ssh, "connect", refuse("infra.remote.ssh.connect"))
    monkeypatch.setattr(remote, "deploy_all", refuse("infra.remote.deploy_all"))
    monkeypatch.setattr(fabric.Connection, "open", refuse("fabric.Connection.open"))
    monkeypatch.setattr(paramiko.SSHClient, "connect", refuse("paramiko.SSHClient.connect"))
    mapping = pulumi_mocks.stack_file_config(stack)
    rec = pulumi_mocks.run_program(stack, mapping, hf_token="hf_TEST_ONLY_0123456789")
    assert rec.of_type(DYNAMIC)  # the deployments were declared (and their outputs resolved)
    assert rec.outputs["deployments"]["train"]["hosts"] == rec.outputs["trainWorkerIps"]
    assert attempts == []


def test_a_serving_change_does_not_redeploy_the_training_vm() -> None:
    # The training VM's run config has no serve/eval/bench sections: changing one of them must
    # leave its deployment's inputs (and so the provider's diff) unchanged, and not restart
    # a training run that may be hours in; the serving VM gets the change.
    from infra.resources import ssh_deployment

    def deployment_inputs(mapping: dict[str, Any]) -> dict[str, dict[str, Any]]:
        rec = pulumi_mocks.run_program("prod", mapping, hf_token="hf_TEST_ONLY_0123456789")
        # The mocks hand out addresses in registration order: pin them (same VMs each run).
        found = {r.name.split("-")[0]: r.inputs for r in rec.of_type(DYNAMIC)}
        return {role: {**inputs, "hosts": [f"host-of-{role}"]} for role, inputs in found.items()}

    mapping = pulumi_mocks.stack_file_config("prod")
    before = deployment_inputs(mapping)
    mapping["serving"] = {**mapping["serving"], "maxModelLen": 16000, "port": 8080}
    after = deployment_inputs(mapping)

    provider = ssh_deployment.SshDeploymentProvider()
    train = provider.diff("id", before["train"], after["train"])
    assert not train.changes and not train.replaces
    train_config = runconfig.parse(yaml.safe_load(after["train"]["run_config_yaml"]))
    assert (train_config.serve, train_config.eval, train_config.bench) == (None, None, None)
    assert train_config.merge is not None  # the training VM runs the merge
    serve = provider.diff("id", before["serve"], after["serve"])
    assert serve.changes and not serve.replaces
    assert before["serve"]["run_config_sha256"] != after["serve"]["run_config_sha256"]
    # A training change reaches the training VM.
    mapping["training"] = {**mapping["training"], "maxSteps": 1000}
    changed = deployment_inputs(mapping)
    assert provider.diff("id", after["train"], changed["train"]).changes
