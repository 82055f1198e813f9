"""The deployment component under Pulumi mocks: the resource preview shows, with its inputs."""

from __future__ import annotations

import pathlib
from typing import Any

import pulumi
import pytest

from infra import remote
from infra.components import workloads as component
from infra.resources import ssh_access, ssh_deployment
from infra.vm import workloads_wheel
from tests.infra.conftest import make_run_config

REPO = pathlib.Path(__file__).resolve().parents[3]
DYNAMIC_TYPE = "pulumi-python:dynamic/gemma4:SshDeployment"


class Recorder(pulumi.runtime.Mocks):
    """Records every resource the program registers; a dynamic resource echoes its inputs."""

    def __init__(self) -> None:
        self.resources: list[pulumi.runtime.MockResourceArgs] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        self.resources.append(args)
        outputs = dict(args.inputs)
        if args.typ == DYNAMIC_TYPE:
            outputs["fingerprint"] = "f" * 64
        return f"{args.name}-id", outputs

    def call(
        self, args: pulumi.runtime.MockCallArgs
    ) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        return {}, None


@pytest.fixture
def mocks() -> Recorder:
    recorder = Recorder()
    pulumi.runtime.set_mocks(recorder, project="gemma4-tpu", stack="dev", preview=False)
    return recorder


def test_declare_registers_the_deployment_resource_with_its_inputs(
    mocks: Recorder, wheel: workloads_wheel.Wheel
) -> None:
    cfg = make_run_config(merge=True)
    access = ssh_access.SshAccess(
        stack="dev", user="gemma4", key_fingerprint="SHA256:abc", known_hosts=".known_hosts"
    )
    hosts = pulumi.Output.from_input(["10.0.0.1", "10.0.0.2"])  # as the TPU VM reports them
    checked: list[str] = []

    @pulumi.runtime.test
    def program() -> pulumi.Output[Any]:
        comp = component.declare(
            "train",
            vm="gemma4-train",
            role="train",
            hosts=hosts,
            run_config=cfg,
            access=access,
            project="my-project",
            zone="us-central1-a",
            wheel=wheel,
        )

        def check(values: list[Any]) -> None:
            fingerprint, info = values
            assert fingerprint == "f" * 64
            assert info["hosts"] == ["10.0.0.1", "10.0.0.2"]
            assert info["units"] == ["gemma4-merge.service", "gemma4-train.service"]
            assert (info["vm"], info["role"], info["zone"], info["run_dir"]) == (
                "gemma4-train",
                "train",
                "us-central1-a",
                cfg.train.output_dir,
            )
            checked.append("outputs")

        return pulumi.Output.all(comp.fingerprint, comp.ops_info).apply(check)

    program()
    assert checked == ["outputs"]  # the assertions inside apply really ran

    by_type = {r.typ: r for r in mocks.resources}
    assert set(by_type) == {"gemma4-tpu:infra:WorkloadsDeployment", DYNAMIC_TYPE}
    resource = by_type[DYNAMIC_TYPE]
    assert resource.name == "train-workloads"
    inputs = resource.inputs
    assert inputs["hosts"] == ["10.0.0.1", "10.0.0.2"]
    assert inputs["vm"] == "gemma4-train"
    assert inputs["wheel_sha256"] == wheel.sha256
    # The wheel in .whl/, relative to the project: the state names no checkout of any machine.
    assert inputs["wheel_path"] == str(pathlib.Path(wheel.path).relative_to(REPO))
    assert ssh_access.local_path(inputs["wheel_path"]) == wheel.path
    assert inputs["run_config_yaml"] == cfg.to_yaml()
    assert inputs["run_config_sha256"] == remote.sha256_text(cfg.to_yaml())
    assert sorted(inputs["units"]) == ["gemma4-merge.service", "gemma4-train.service"]
    assert inputs["units_sha256"] == ssh_deployment.units_sha256(inputs["units"])
    assert inputs["enable"] == inputs["start"] == ["gemma4-train.service"]
    assert inputs["ssh_user"] == "gemma4"
    # Portable values only: each machine finds its own key file (infra.resources.ssh_access).
    assert (inputs["stack"], inputs["ssh_key_fingerprint"]) == ("dev", "SHA256:abc")
    assert "ssh_key_path" not in inputs
    assert inputs["known_hosts"] == ".known_hosts"  # inside the project of whoever runs it
    assert inputs["remote_root"] == "/"
    assert inputs["use_sudo"] is True  # not root on the VM
    assert inputs["__provider"]  # the serialised provider travels in the state


def test_serve_role_deploys_serve_eval_bench(mocks: Recorder, wheel: workloads_wheel.Wheel) -> None:
    cfg = make_run_config(serve=True)

    @pulumi.runtime.test
    def program() -> pulumi.Output[Any]:
        comp = component.declare(
            "serve",
            vm="gemma4-serve",
            role="serve",
            hosts=["10.0.1.1"],
            run_config=cfg,
            access=ssh_access.SshAccess(stack="dev", user="gemma4"),
            wheel=wheel,
        )
        return comp.ops_info

    program()
    inputs = next(r.inputs for r in mocks.resources if r.typ == DYNAMIC_TYPE)
    assert inputs["start"] == [
        "gemma4-serve.service",
        "gemma4-eval.service",
        "gemma4-bench.service",
    ]
    assert inputs.get("ssh_key_fingerprint") is None  # unknown (None inputs are not sent)


def test_the_exported_record_reads_back_as_the_same_record():
    """One dataclass writes the `deployments` output and reads it
    (infra.resources.deployment_record)."""
    from infra.resources.deployment_record import VmInfo

    record = VmInfo(
        role="serve",
        vm="gemma4-serve",
        hosts=["10.0.0.2", "10.0.0.3"],
        access=ssh_access.SshAccess(
            stack="prod", user="gemma4", key_fingerprint="SHA256:k", port=2222
        ),
        use_sudo=True,
        remote_root="/",
        units=["gemma4-serve.service"],
        start=["gemma4-serve.service"],
        project="p",
        zone="asia-northeast1-b",
        run_dir="gs://b/checkpoints/run",
        serve_port=8000,
    )
    assert VmInfo.model_validate(record.props()) == record
    # The addresses and the zone are those the VM got (a fallback zone when the first was full).
    placed = component._ops_info(
        record.model_copy(update={"hosts": [], "zone": None}), ("10.0.0.9",), "us-east5-b"
    )
    assert (placed["hosts"], placed["zone"]) == (["10.0.0.9"], "us-east5-b")


def test_an_older_deployments_output_still_reads():
    """An output exported before `stack`, `use_sudo` and `start` were recorded, with its numbers
    as floats: what it meant is read back (sudo for any user but root, the first unit)."""
    from infra.resources.deployment_record import VmInfo

    old = {
        "role": "train",
        "hosts": ["10.0.0.1"],
        "ssh_user": "root",
        "ssh_key_path": "/home/alice/.ssh/id_ed25519",
        "port": 22.0,
        "units": ["gemma4-train.service", "gemma4-merge.service"],
        "serve_port": None,
    }
    info = VmInfo.model_validate(old)
    assert (info.vm, info.use_sudo, info.start) == ("train", False, ["gemma4-train.service"])
    assert (info.access.stack, info.access.port, info.remote_root) == (None, 22, "/")
    assert type(info.access.port) is int and info.serve_port is None
