"""The dynamic provider's check/diff/create/update/delete, called directly (mocks never do)."""

from __future__ import annotations

import asyncio
import base64
import os
import pathlib
import subprocess
import sys
import threading
import time
from typing import Any

import dill
import grpc
import pulumi.dynamic.dynamic as pulumi_dynamic
import pytest
from google.cloud import tpu_v2
from pulumi.runtime import proto, rpc

from infra import remote
from infra.errors import InfraError
from infra.resources import ssh_access, ssh_deployment
from infra.tpu import api as tpu_api
from infra.vm import workloads_wheel
from tests.fixtures import tpu_api as tpu_fixture
from tests.fixtures.sshd import Worker
from tests.infra.conftest import host, make_bundle, make_run_config, provider_props

FAKE = ssh_access.SshAccess(stack="dev", user="gemma4", key_fingerprint="SHA256:a")
FAKE_WHEEL = workloads_wheel.Wheel("/w/gemma4_tpu-0.1.0-py3-none-any.whl", "a" * 64)


def test_diff_is_empty_for_the_same_content_even_with_another_wheel_path() -> None:
    olds = provider_props("/", FAKE_WHEEL, FAKE, ["10.0.0.1", "10.0.0.2"])
    news = {**olds, "wheel_path": "/elsewhere/gemma4_tpu-0.1.0-py3-none-any.whl", "port": 22}
    result = ssh_deployment.SshDeploymentProvider().diff("id", olds, news)
    assert result.changes is False
    assert result.replaces == []


@pytest.mark.parametrize(
    ("key", "value", "replaces"),
    [
        ("wheel_sha256", "b" * 64, []),
        ("run_config_sha256", "c" * 64, []),
        ("enable", [], []),
        ("ssh_key_fingerprint", "SHA256:other", []),
        ("hosts", ["10.0.0.9", "10.0.0.2"], ["hosts"]),
        ("remote_root", "/srv", ["remote_root"]),
    ],
)
def test_diff_updates_on_content_and_replaces_on_other_machines(
    key: str, value: Any, replaces: list[str]
) -> None:
    olds = provider_props("/", FAKE_WHEEL, FAKE, ["10.0.0.1", "10.0.0.2"])
    result = ssh_deployment.SshDeploymentProvider().diff("id", olds, {**olds, key: value})
    assert result.changes is True
    assert result.replaces == replaces
    assert result.delete_before_replace is True  # old units stop before the new ones start


def test_diff_of_changed_units_text() -> None:
    olds = provider_props("/", FAKE_WHEEL, FAKE, ["10.0.0.1"])
    units = {
        **olds["units"],
        "gemma4-train.service": olds["units"]["gemma4-train.service"] + "# edited\n",
    }
    news = {k: v for k, v in olds.items() if k != "units_sha256"} | {"units": units}
    assert ssh_deployment.SshDeploymentProvider().diff("id", olds, news).changes is True


def test_unknown_hosts_during_preview_are_an_update_not_a_replace() -> None:
    olds = provider_props("/", FAKE_WHEEL, FAKE, ["10.0.0.1"])
    result = ssh_deployment.SshDeploymentProvider().diff(
        "id", olds, {**olds, "hosts": ssh_deployment.UNKNOWN}
    )
    assert result.changes is True
    assert result.replaces == []


def test_check_rejects_no_hosts_and_unknown_units() -> None:
    news = provider_props("/", FAKE_WHEEL, FAKE, []) | {"start": ["gemma4-nope.service"]}
    failures = ssh_deployment.SshDeploymentProvider().check({}, news).failures
    assert [(f.property, f.reason.split(" ")[0]) for f in failures] == [
        ("hosts", "the"),
        ("start", "['gemma4-nope.service']"),
    ]
    no_ip = provider_props("/", FAKE_WHEEL, FAKE, ["10.0.0.1", ""])
    failures = ssh_deployment.SshDeploymentProvider().check({}, no_ip).failures
    assert [f.property for f in failures] == ["hosts"]
    assert "no address" in failures[0].reason
    preview = provider_props("/", FAKE_WHEEL, FAKE, []) | {"hosts": ssh_deployment.UNKNOWN}
    assert ssh_deployment.SshDeploymentProvider().check({}, preview).failures == []


def test_provider_survives_pulumis_serialisation() -> None:
    provider = ssh_deployment.SshDeploymentProvider()
    restored = dill.loads(base64.b64decode(pulumi_dynamic.serialize_provider(provider)))
    assert isinstance(restored, ssh_deployment.SshDeploymentProvider)
    olds = provider_props("/", FAKE_WHEEL, FAKE, ["10.0.0.1"])
    assert restored.diff("id", olds, olds).changes is False


@pytest.mark.sshd
def test_create_update_delete_against_a_worker(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    root = str(worker.root)
    props = provider_props(root, wheel, worker.access, [worker.host])
    host = f"{worker.host}:{worker.port}"

    created = provider.create(props)
    assert created.id == "gemma4-train-workloads"
    outs = created.outs or {}
    assert outs["changed_hosts"] == [host]
    assert outs["fingerprint"] == make_bundle(root, wheel).fingerprint
    assert (worker.root / "etc/systemd/system/gemma4-train.service").exists()

    assert provider.diff(created.id, outs, props).changes is False
    second = make_run_config(run_name="second")
    news = provider_props(root, wheel, worker.access, [worker.host], cfg=second)
    diff = provider.diff(created.id, outs, news)
    assert (diff.changes, diff.replaces) == (True, [])
    worker.clear_calls()
    updated = provider.update(created.id, outs, news).outs or {}
    assert updated["fingerprint"] != outs["fingerprint"]
    assert ["start", "--no-block", "gemma4-train.service"] in worker.systemctl_calls()
    assert "run_name: second" in (worker.root / "etc/gemma4/run.yaml").read_text()

    worker.clear_calls()
    provider.delete(created.id, updated)
    assert worker.systemctl_calls() == [
        ["disable", "--now", "gemma4-merge.service", "gemma4-train.service"],
        ["daemon-reload"],
    ]
    assert not list((worker.root / "etc/systemd/system").iterdir())
    assert not (worker.root / "var/lib/gemma4/deployed.json").exists()
    # Deleted (destroyed, or replaced for a different host list): its workers' host keys leave
    # known_hosts, since their ephemeral addresses may come back on another VM with another key.
    assert f"[{worker.host}]:{worker.port} " not in worker.known_hosts.read_text()


@pytest.mark.sshd
def test_the_public_deploy_reaches_the_worker_with_the_callers_settings(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    """What the rehearsal calls (localcloud/rehearse.py): the deploy create and update run, with
    its own key and known_hosts in place of what the state's stack resolves to here."""
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    # A stack with no file here: the state alone would find no key on this machine.
    access = worker.access.model_copy(update={"stack": "elsewhere"})
    props = provider_props(str(worker.root), wheel, access, [worker.host])
    inputs = ssh_deployment.DeploymentInputs.model_validate(props)

    outs = provider.deploy(inputs, worker.settings)

    assert outs["changed_hosts"] == [f"{worker.host}:{worker.port}"]
    assert outs["fingerprint"] == make_bundle(str(worker.root), wheel).fingerprint
    assert (worker.root / "etc/systemd/system/gemma4-train.service").exists()


@pytest.mark.sshd
def test_delete_of_a_vanished_worker_succeeds(worker: Worker, wheel: workloads_wheel.Wheel) -> None:
    props = provider_props(
        str(worker.root),
        wheel,
        worker.access.model_copy(update={"connect_timeout_s": 2}),
        [worker.host],
    )
    worker.stop()
    ssh_deployment.SshDeploymentProvider().delete("gemma4-train-workloads", props)


@pytest.mark.sshd
def test_create_failure_names_the_worker_and_step(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    (worker.root / "run/gemma4/ready").unlink()
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    props = provider_props(str(worker.root), wheel, worker.access, [worker.host])
    props["ready_timeout_s"] = 0.5
    with pytest.raises(
        remote.DeployError,
        match=rf"(?s)gemma4-train failed on 1 worker.*{worker.port}: step 'wait-ready' timed out",
    ):
        provider.create(props)


def test_delete_skips_an_address_that_now_answers_with_another_host_key():
    """After a preemption the old address may belong to another machine: never talk to it."""
    import paramiko

    class _Conn:
        host = "203.0.113.9"
        user = "gemma4"
        port = 22

        def open(self):
            key = paramiko.RSAKey.generate(1024)
            raise paramiko.BadHostKeyException(self.host, key, key)

    assert ssh_deployment._still_ours(_Conn(), None) is False


# How Pulumi starts a Python dynamic provider (its pulumi-resource-pulumi-python launcher runs
# `python -u -m pulumi.dynamic`), with the project directory of the test's machine set first.
PROVIDER_SERVER = (
    "import pathlib, runpy, sys\n"
    "from infra.resources import ssh_access\n"
    "ssh_access.PROJECT_DIR = pathlib.Path(sys.argv[1])\n"
    "runpy.run_module('pulumi.dynamic', run_name='__main__')\n"
)


@pytest.mark.sshd
def test_pulumi_up_shows_the_per_worker_deploy_progress(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    """`pulumi up` runs the provider in a process of its own, calls it over gRPC, and shows every
    non-empty line of that process's stderr as a diagnostic of the update: the engine connects
    no logging channel to a dynamic provider. Here the provider's own server takes a Create the
    way the engine sends it, and its stderr is read the way the engine reads it; the progress
    logged with an unconfigured `logging` logger never got there."""
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    props = provider_props(str(worker.root), wheel, worker.access, [worker.host])
    props["__provider"] = pulumi_dynamic.serialize_provider(provider)
    project_dir = pathlib.Path(ssh_access.PROJECT_DIR)  # the sshd fixture's (tmp_path)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[3])}
    server = subprocess.Popen(
        [sys.executable, "-u", "-c", PROVIDER_SERVER, str(project_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    shown: list[str] = []
    assert server.stdout is not None and server.stderr is not None
    reader = threading.Thread(target=lambda: shown.extend(server.stderr or []), daemon=True)
    reader.start()
    try:
        port = int(server.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = proto.ResourceProviderStub(channel)
            properties = asyncio.run(rpc.serialize_properties(props, {}))
            urn = "urn:pulumi:dev::gemma4-tpu::pulumi-python:dynamic/gemma4:WorkloadDeployment::t"
            created = stub.Create(proto.CreateRequest(urn=urn, properties=properties), timeout=120)
        assert created.id == "gemma4-train-workloads"
    finally:
        server.terminate()
        server.wait(timeout=30)
        reader.join(timeout=30)
    lines = [line.rstrip("\n") for line in shown if line.strip()]
    progress = [line for line in lines if line.startswith("deploy: ")]
    where = f"deploy: gemma4-train {host(worker)}: "
    for step in ("check", "upload", "install", "switch", "units", "start", "record"):
        assert f"{where}{step}" in progress, lines


def test_a_state_written_by_an_older_version_still_loads() -> None:
    """Stacks deployed before the state held only portable values: machine paths, no stack or
    key fingerprint, every number a float (as Pulumi stores them). They load; the paths go."""
    units = {"gemma4-train.service": "[Unit]\n"}
    old = {
        "vm": "gemma4-train",
        "hosts": ["10.0.0.1", "10.0.0.2"],
        "port": 2222.0,
        "ssh_user": "gemma4",
        "ssh_key_path": "/home/alice/.ssh/id_ed25519",
        "known_hosts": "/home/alice/gemma4-tpu/.known_hosts",
        "connect_timeout_s": 15.0,
        "use_sudo": True,
        "wheel_path": "/home/alice/gemma4-tpu/.whl/gemma4_tpu-0.1.0-py3-none-any.whl",
        "wheel_sha256": "a" * 64,
        "run_config_yaml": "run_name: demo\n",
        "run_config_sha256": remote.sha256_text("run_name: demo\n"),
        "units": units,
        "units_sha256": ssh_deployment.units_sha256(units),
        "enable": ["gemma4-train.service"],
        "start": ["gemma4-train.service"],
        "remote_root": "/",
        "ready_timeout_s": 3600.0,
        "install_deps": True,
        "fingerprint": "f" * 64,
        "changed_hosts": ["10.0.0.1:2222"],
        "__provider": "serialised provider",
    }
    inputs = ssh_deployment.DeploymentInputs.model_validate(old)
    assert inputs.ssh == ssh_access.SshAccess(stack=None, user="gemma4", port=2222)
    assert type(inputs.ssh.port) is int and inputs.hosts == ["10.0.0.1", "10.0.0.2"]
    assert inputs.local_bundle().wheel_path == old["wheel_path"]  # an absolute path stays
    written = inputs.props()
    assert "ssh_key_path" not in written and "__provider" not in written
    assert written["known_hosts"] == ".known_hosts"
    # The hashes are computed as before: the state reads as unchanged content.
    for key in ("run_config_sha256", "units_sha256", "wheel_sha256", "enable", "start"):
        assert written[key] == old[key]
    # Keys that an old state left unset take the one default: a None is not a value.
    sparse = {k: v for k, v in old.items() if k not in ("connect_timeout_s", "install_deps")}
    sparse |= {"remote_root": None, "ready_timeout_s": None}
    loaded = ssh_deployment.DeploymentInputs.model_validate(sparse)
    assert (loaded.remote_root, loaded.ready_timeout_s) == ("/", 3600.0)
    assert (loaded.ssh.connect_timeout_s, loaded.bundle.install_deps) == (15.0, True)


class _BootsAt:
    """Local Cloud TPU API hooks: each boot of a node gets the next address of `addresses` (a
    stopped node started again may come back at another external address)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    def boot(self, node: dict[str, Any]) -> list[str]:
        return [self.addresses.pop(0)]

    def halt(self, node: dict[str, Any], why: str) -> None:
        pass


@pytest.mark.sshd
def test_a_deploy_to_a_node_started_at_another_address_stops_at_once_saying_refresh(
    worker: Worker, wheel: workloads_wheel.Wheel, tpu_cloud: Any
) -> None:
    """serving.stopAfterHours stops the node; started again, it may have another address, which
    the state learns only at a refresh. The deploy reads the node first, instead of waiting its
    whole ready timeout on the old address."""
    tpu_cloud.hooks = _BootsAt(worker.host, "127.0.0.2")
    parent = f"projects/{tpu_fixture.PROJECT}/locations/us-central1-a"
    client = tpu_api.tpu_client()
    spec = tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version="v2-alpha-tpuv5-lite")
    node = client.create_node(parent=parent, node_id="gemma4-serve", node=spec).result(30)
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    props = provider_props(str(worker.root), wheel, worker.access, [worker.host])
    props |= {"node": node.name, "ready_timeout_s": 20.0}
    # At the address the node has: deployed.
    outs = provider.create(dict(props)).outs or {}
    assert outs["node"] == node.name

    client.stop_node(request={"name": node.name}).result(30)
    client.start_node(request={"name": node.name}).result(30)
    worker.stop()  # nothing answers at the old address any more
    news = dict(props) | {"run_config_yaml": make_run_config(run_name="again").to_yaml()}
    started = time.monotonic()
    with pytest.raises(InfraError) as caught:
        provider.update("gemma4-train-workloads", outs, news)
    assert time.monotonic() - started < 10
    assert str(caught.value) == (
        f"gemma4-train: TPU node gemma4-serve now has its workers at 127.0.0.2, not at "
        f"{worker.host} as the state says (it was stopped and started again?): run "
        "`pulumi up --refresh` (or `pulumi refresh`, then `pulumi up`)"
    )

    client.stop_node(request={"name": node.name}).result(30)
    with pytest.raises(InfraError, match="is STOPPED: start it"):
        provider.update("gemma4-train-workloads", outs, news)
