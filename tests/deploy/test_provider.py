"""The dynamic provider's check/diff/create/update/delete, called directly (mocks never do)."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import dill
import pulumi.dynamic.dynamic as pulumi_dynamic
import pytest

from infra import remote, ssh_access, ssh_deployment, workloads_wheel
from tests.deploy.conftest import make_bundle, make_run_config, provider_props
from tests.fixtures.sshd import Worker

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


@pytest.mark.sshd
def test_delete_of_a_vanished_worker_succeeds(worker: Worker, wheel: workloads_wheel.Wheel) -> None:
    props = provider_props(
        str(worker.root),
        wheel,
        dataclasses.replace(worker.access, connect_timeout_s=2),
        [worker.host],
    )
    worker.stop()
    ssh_deployment.SshDeploymentProvider().delete("gemma4-train-workloads", props)


@pytest.mark.sshd
def test_create_failure_names_the_worker_and_step(
    worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    (worker.root / "var/lib/gemma4/ready").unlink()
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
