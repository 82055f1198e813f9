"""Host keys are pinned in a project-local known_hosts: trust on first use, refuse a changed key."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess

import paramiko
import pytest

from infra import remote
from infra.remote import ssh
from tests.fixtures.sshd import Worker

pytestmark = pytest.mark.sshd


def test_first_connection_records_the_host_key_and_openssh_accepts_the_file(worker: Worker) -> None:
    settings = worker.settings
    assert not pathlib.Path(settings.known_hosts).exists()
    conn = ssh.connect(worker.host, settings)
    assert conn.run("echo hello", hide=True, in_stream=False).stdout == "hello\n"
    conn.close()
    lines = pathlib.Path(settings.known_hosts).read_text().splitlines()
    host_pub = (worker.base / "ssh_host_ed25519_key.pub").read_text().split()
    assert lines == [f"[127.0.0.1]:{worker.port} {host_pub[0]} {host_pub[1]}"]
    # The OpenSSH client reads the same file with strict checking: the recorded key matches.
    argv = ssh.ssh_command(
        worker.host, settings, "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"
    )
    proc = subprocess.run(
        [*argv, "echo", "via-openssh"], capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "via-openssh\n"


def test_changed_host_key_is_refused_with_the_fix(worker: Worker) -> None:
    settings = worker.settings
    other = paramiko.Ed25519Key.from_private_key_file(str(worker.user_key))  # any other ed25519 key
    name = ssh.known_hosts_name(worker.host, worker.port)
    pathlib.Path(settings.known_hosts).write_text(
        f"{name} {other.get_name()} {other.get_base64()}\n"
    )
    conn = ssh.connect(worker.host, settings)
    with pytest.raises(ssh.SshError) as caught:
        remote.wait_ready(
            conn, remote.RemoteLayout(str(worker.root)), timeout_s=30, settings=settings
        )
    message = str(caught.value)
    assert "changed" in message and f"ssh-keygen -R '{name}' -f {settings.known_hosts}" in message
    # Nothing was added next to the pinned key.
    assert len(pathlib.Path(settings.known_hosts).read_text().splitlines()) == 1


def test_missing_private_key_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    settings = ssh.SshSettings(
        user="me", key_path=str(tmp_path / "nope"), known_hosts=str(tmp_path / "kh")
    )
    with pytest.raises(ssh.SshError, match="does not exist"):
        ssh.connect("127.0.0.1", settings)


def test_wrong_identity_is_reported_with_the_key_used(
    worker: Worker, tmp_path: pathlib.Path
) -> None:
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    settings = dataclasses.replace(worker.settings, key_path=str(stranger))
    conn = ssh.connect(worker.host, settings)
    with pytest.raises(ssh.SshError, match=f"refused key {stranger}"):
        remote.reachable(conn, settings=settings)


def test_forget_hosts_drops_every_key_of_the_addresses_and_nothing_else(tmp_path) -> None:
    """A deleted node's addresses leave known_hosts whatever form OpenSSH or paramiko wrote them
    in (plain, `[h]:port`, hashed); other hosts and comments stay."""
    old, new, other = (paramiko.ECDSAKey.generate() for _ in range(3))
    hashed = paramiko.HostKeys.hash_host("203.0.113.9")
    known = tmp_path / "known_hosts"
    lines = [
        "# pinned by the deployment",
        f"203.0.113.9 {old.get_name()} {old.get_base64()}",
        f"[203.0.113.9]:2222 {old.get_name()} {old.get_base64()}",
        f"{hashed} {old.get_name()} {old.get_base64()}",
        f"203.0.113.10 {other.get_name()} {other.get_base64()}",
    ]
    known.write_text("\n".join(lines) + "\n")
    removed = ssh.forget_hosts(known, ["203.0.113.9"])
    assert removed == ["203.0.113.9", "[203.0.113.9]:2222", hashed]
    assert known.read_text().splitlines() == [lines[0], lines[4]]
    assert oct(known.stat().st_mode & 0o777) == "0o600"

    # The recycled address now answers with a new key: a new host, trusted on first use; the
    # host that kept its address keeps its pin (a new key there is still refused).
    client = paramiko.SSHClient()
    client.load_host_keys(str(known))
    policy = ssh.TrustOnFirstUse(str(known))
    policy.missing_host_key(client, "203.0.113.9", new)
    assert f"203.0.113.9 {new.get_name()} {new.get_base64()}" in known.read_text()
    with pytest.raises(paramiko.BadHostKeyException):
        policy.missing_host_key(client, "203.0.113.10", new)
    assert ssh.forget_hosts(tmp_path / "missing", ["203.0.113.9"]) == []
