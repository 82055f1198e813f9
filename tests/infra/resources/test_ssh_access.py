"""The state travels between machines: each operation finds the SSH key on its own machine.

A laptop runs `pulumi up`, the recovery controller (another home, its key at another path) runs
the next update, the replace after a preemption and the delete; the state written by one is used
by the other, against real sshd workers.
"""

from __future__ import annotations

import getpass
import json
import pathlib
import shutil
import subprocess
from typing import Any

import pytest

from infra.resources import ssh_access, ssh_deployment
from infra.vm import workloads_wheel
from tests.fixtures.sshd import STACK, Worker, write_stack_file
from tests.infra.conftest import make_run_config, provider_props


def test_fingerprint_is_what_ssh_keygen_prints(tmp_path: pathlib.Path) -> None:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    printed = subprocess.run(
        ["ssh-keygen", "-l", "-f", str(key)], check=True, capture_output=True, text=True
    ).stdout.split()[1]
    assert ssh_access.configured_fingerprint(None, str(key)) == printed
    public = (tmp_path / "id.pub").read_text()
    assert ssh_access.configured_fingerprint(public, "/nowhere") == printed
    assert ssh_access._key_file_fingerprint(str(key)) == printed
    assert ssh_access.configured_fingerprint(None, str(tmp_path / "missing")) is None


def test_settings_come_from_this_machines_stack_file_and_home(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write_stack_file(tmp_path, "dev", user="alice", key_file="~/.ssh/deploy")
    access = ssh_access.SshAccess(stack="dev", user="gemma4", port=2222)
    settings = ssh_access.settings_here(access, tmp_path)
    assert settings.key_path == str(tmp_path / "home/.ssh/deploy")
    assert settings.user == "alice"  # the stack file here is the authority
    assert settings.known_hosts == str(tmp_path / ".known_hosts")
    assert settings.port == 2222
    # No stack file here: the config's defaults, with the user the state recorded.
    other = ssh_access.settings_here(access.model_copy(update={"stack": "prod"}), tmp_path)
    assert other.key_path == str(tmp_path / "home/.ssh/id_ed25519")
    assert other.user == "gemma4"
    # privateKeyFile: null here = ssh-agent on this machine.
    (tmp_path / "Pulumi.agent.yaml").write_text(
        "config:\n  gemma4-tpu:ssh:\n    privateKeyFile: null\n"
    )
    agent = ssh_access.settings_here(access.model_copy(update={"stack": "agent"}), tmp_path)
    assert agent.key_path is None


def test_a_bad_ssh_section_here_is_one_line(tmp_path: pathlib.Path) -> None:
    (tmp_path / "Pulumi.dev.yaml").write_text("config:\n  gemma4-tpu:ssh:\n    user: [1, 2]\n")
    with pytest.raises(ssh_access.SshAccessError) as err:
        ssh_access.settings_here(ssh_access.SshAccess(stack="dev", user="u"), tmp_path)
    assert "ssh.user" in str(err.value) and "\n" not in str(err.value)


def test_old_state_paths_are_ignored(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PULUMI_STACK", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    old = {
        "hosts": ["10.0.0.1"],
        "ssh_user": "gemma4",
        "ssh_key_path": "/home/alice/.ssh/id_ed25519",
        "known_hosts": "/home/alice/gemma4-tpu/.known_hosts",
        "port": 22.0,
    }
    access = ssh_access.SshAccess.model_validate(old)
    assert (access.stack, access.known_hosts) == (None, ".known_hosts")
    write_stack_file(tmp_path, "only", user="gemma4", key_file="~/k")
    settings = ssh_access.settings_here(access, tmp_path)  # the project's only stack file
    assert settings.key_path == str(tmp_path / "home/k")
    assert settings.known_hosts == str(tmp_path / ".known_hosts")
    # The diff sees the old state as different connection values: one update rewrites it.
    news = {**old, **ssh_access.SshAccess(stack="only", user="gemma4").props()}
    news.pop("ssh_key_path")
    diff = ssh_deployment.SshDeploymentProvider().diff("id", old, news)
    assert diff.changes is True and diff.replaces == []


def test_another_key_here_is_warned_about(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    write_stack_file(tmp_path, "dev", user="gemma4", key_file=str(key))
    access = ssh_access.SshAccess(stack="dev", user="gemma4", key_fingerprint="SHA256:other")
    ssh_access.settings_here(access, tmp_path)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ssh: warning: {key} (ssh.privateKeyFile of stack dev here) is key ")
    assert line.endswith("the deployment was made with key SHA256:other: the workers may refuse it")


class Machine:
    """One machine running Pulumi: its own home, project directory and key path."""

    def __init__(self, base: pathlib.Path, key_source: pathlib.Path, key_file: str) -> None:
        self.base = base
        self.home = base / "home"
        self.project = base / "project"
        self.project.mkdir(parents=True)
        key = pathlib.Path(key_file.replace("~", str(self.home), 1))
        key.parent.mkdir(parents=True)
        shutil.copy(key_source, key)
        shutil.copy(f"{key_source}.pub", f"{key}.pub")
        key.chmod(0o600)
        self.key = key
        write_stack_file(self.project, STACK, user=getpass.getuser(), key_file=key_file)

    def use(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setattr(ssh_access, "PROJECT_DIR", self.project)


def _props(worker: Worker, wheel: workloads_wheel.Wheel, run_name: str = "first") -> dict[str, Any]:
    return provider_props(
        str(worker.root),
        wheel,
        ssh_access.SshAccess(
            stack=STACK,
            user=getpass.getuser(),
            key_fingerprint=worker.access.key_fingerprint,
            port=worker.port,
            connect_timeout_s=5.0,
        ),
        [f"{worker.host}:{worker.port}"],
        cfg=make_run_config(run_name=run_name),
    )


@pytest.mark.sshd
def test_a_deployment_made_on_the_laptop_is_deleted_by_the_controller(
    worker: Worker,
    ssh_user_key: pathlib.Path,
    wheel: workloads_wheel.Wheel,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`pulumi destroy` (or the delete half of a replace) on the machine that did not create it."""
    laptop = Machine(tmp_path / "laptop", ssh_user_key, "~/.ssh/gemma4-tpu")
    controller = Machine(tmp_path / "controller", ssh_user_key, "~/.ssh/gemma4-tpu")
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    laptop.use(monkeypatch)
    created = provider.create(_props(worker, wheel))
    shutil.rmtree(laptop.base)
    controller.use(monkeypatch)
    worker.clear_calls()
    provider.delete(created.id, created.outs or {})
    assert not list((worker.root / "etc/systemd/system").iterdir())
    assert ["daemon-reload"] in worker.systemctl_calls()


@pytest.mark.sshd
@pytest.mark.slow  # three deployments and two deletes over SSH: ~20 s on 2 cores
def test_update_replace_and_delete_from_another_machine(
    sshd_factory: Any,
    ssh_user_key: pathlib.Path,
    wheel: workloads_wheel.Wheel,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old_vm, new_vm = sshd_factory("worker-0"), sshd_factory("worker-1")
    for vm in (old_vm, new_vm):
        vm.make_venv()
        vm.mark_ready()
    laptop = Machine(tmp_path / "laptop", ssh_user_key, "~/.ssh/gemma4-tpu")
    controller = Machine(tmp_path / "controller", ssh_user_key, "~/keys/deploy")
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1

    laptop.use(monkeypatch)
    created = provider.create(_props(old_vm, wheel))
    state = created.outs or {}
    assert str(laptop.base) not in json.dumps(state)  # nothing of the laptop in the state
    shutil.rmtree(laptop.base)  # the laptop is closed; the controller takes over

    controller.use(monkeypatch)
    news = _props(old_vm, wheel, run_name="second")
    diff = provider.diff(created.id, state, news)
    assert (diff.changes, diff.replaces) == (True, [])
    state = provider.update(created.id, state, news).outs or {}
    assert "run_name: second" in (old_vm.root / "etc/gemma4/run.yaml").read_text()
    assert (controller.project / ".known_hosts").is_file()  # its own pinned host keys

    # A preemption: the node comes back elsewhere; the controller replaces the deployment.
    news = _props(new_vm, wheel, run_name="second")
    assert provider.diff(created.id, state, news).replaces == ["hosts", "remote_root"]
    old_vm.clear_calls()
    provider.delete(created.id, state)
    assert ["disable", "--now", "gemma4-merge.service", "gemma4-train.service"] in (
        old_vm.systemctl_calls()
    )
    replaced = provider.create(news)
    state = replaced.outs or {}
    assert (new_vm.root / "etc/systemd/system/gemma4-train.service").exists()

    new_vm.clear_calls()
    provider.delete(replaced.id, state)
    assert not list((new_vm.root / "etc/systemd/system").iterdir())
    assert ["daemon-reload"] in new_vm.systemctl_calls()


@pytest.mark.sshd
def test_an_old_state_with_the_other_machines_key_path_is_deleted_here(
    worker: Worker,
    ssh_user_key: pathlib.Path,
    wheel: workloads_wheel.Wheel,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = ssh_deployment.SshDeploymentProvider()
    provider.ready_initial_delay_s = 0.1
    created = provider.create(_props(worker, wheel))
    old = dict(created.outs or {})
    for key in ("stack", "ssh_key_fingerprint"):
        old.pop(key)
    old |= {"ssh_key_path": "/home/alice/.ssh/id_ed25519", "known_hosts": "/home/alice/p/.kh"}
    controller = Machine(tmp_path / "controller", ssh_user_key, "~/.ssh/deploy")
    controller.use(monkeypatch)
    monkeypatch.delenv("PULUMI_STACK", raising=False)
    worker.clear_calls()
    provider.delete(created.id, old)
    assert not list((worker.root / "etc/systemd/system").iterdir())
