"""What the state says about reaching the workers, and how each machine turns it into a key file.

A stack's state travels: the laptop runs `pulumi up`, the recovery controller runs the next one
(`--replace` after a preemption), another laptop runs `pulumi destroy`. A key path stored in the
state names a file on the machine that ran the last `up`, and a delete from any other machine
failed "key file does not exist". So the state (the deployment resource's inputs and outputs)
and the `deployments` stack output hold only portable values (SshAccess): the stack's name, the
login user, the key's public fingerprint, the known_hosts file's name inside the project, the
port. Every operation resolves them where it runs (`settings_here`): the key file and user from
that machine's Pulumi.<stack>.yaml (`~` expanded with that machine's home), known_hosts inside
that machine's project directory.

Old states carried `ssh_key_path` and an absolute known_hosts path; both are ignored and
resolved here like any other (the next `up` rewrites the state without them).
"""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib

import paramiko
import pydantic

from infra.config import stack_config, validation
from infra.config.model import ConfigError, SshStackSection
from infra.errors import InfraError
from infra.remote import ssh
from infra.resources import dynamic_values
from workloads.common import logs

LOG = logs.get("ssh")

# The project directory (holding Pulumi.yaml and the stack files) of this machine's checkout:
# where the program, its dynamic providers and `python -m infra.ops` find the stack file.
PROJECT_DIR = stack_config.ROOT


class SshAccessError(InfraError):
    """The stack file on this machine cannot say how to reach the workers (one line)."""


def public_key_fingerprint(line: str) -> str:
    """`ssh-ed25519 AAAA... comment` -> `SHA256:...` (what `ssh-keygen -l` prints).

    Raises:
        ValueError: not an OpenSSH public key line.
    """
    parts = line.split()
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except (IndexError, ValueError):
        raise ValueError(f"{line[:40]!r}...: not an OpenSSH public key line") from None
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def configured_fingerprint(public_key: str | None, private_key_file: str | None) -> str | None:
    """The fingerprint of the key the stack config names (ssh.publicKey, else the `.pub` next to
    ssh.privateKeyFile on this machine); None when neither can be read (the fingerprint only
    tells the state that the key changed; the ssh-keys metadata checks the key itself)."""
    try:
        if public_key:
            return public_key_fingerprint(public_key)
        if private_key_file:
            pub = pathlib.Path(os.path.expanduser(private_key_file) + ".pub")
            return public_key_fingerprint(pub.read_text())
    except (OSError, ValueError):
        return None
    return None


def _key_file_fingerprint(path: str) -> str | None:
    try:
        return str(paramiko.PKey.from_path(path).fingerprint)
    except (OSError, paramiko.SSHException, ValueError):
        return None  # unreadable, or protected by a passphrase: nothing to compare


class SshAccess(dynamic_values.ProviderState):
    """How to reach the workers, in values that mean the same on every machine; in the state
    under the keys `stack`, `ssh_user`, `ssh_key_fingerprint`, `known_hosts`, `port`,
    `connect_timeout_s`. Old states' machine paths (ssh_key_path, an absolute known_hosts) are
    ignored.

    Attributes:
        stack: the Pulumi stack whose stack file names the key (ssh.privateKeyFile).
        user: the login user (the one whose key is in the VMs' ssh-keys metadata).
        key_fingerprint: `SHA256:...` of the key the last `up` deployed with; None = unknown or
            ssh-agent. A different key changes it (an update, so the state follows).
        known_hosts: the project-local known_hosts file, relative to the project directory.
        port: SSH port of every worker.
        connect_timeout_s: TCP connect and SSH banner timeout of one attempt.
    """

    stack: str | None = None
    user: str = pydantic.Field(alias="ssh_user")
    key_fingerprint: str | None = pydantic.Field(None, alias="ssh_key_fingerprint")
    known_hosts: str = ssh.DEFAULT_KNOWN_HOSTS
    port: int = 22
    connect_timeout_s: float = 15.0

    @pydantic.field_validator("known_hosts")
    @classmethod
    def _inside_the_project(cls, known: str) -> str:
        if not known or pathlib.PurePath(known).is_absolute() or known.startswith("~"):
            return ssh.DEFAULT_KNOWN_HOSTS  # an old state's path on another machine
        return known


def portable_path(path: str) -> str:
    """A file inside this project as a path relative to the project directory (the wheel in
    .whl/: the state must not name this machine's checkout); any other path unchanged."""
    resolved = pathlib.Path(path).resolve()
    if resolved.is_relative_to(PROJECT_DIR):
        return resolved.relative_to(PROJECT_DIR).as_posix()
    return path


def local_path(path: str) -> str:
    """portable_path read back on the machine running the operation."""
    return str(PROJECT_DIR / path)


def _stack_name(access: SshAccess, project_dir: pathlib.Path) -> str | None:
    """The stack whose file to read. Old states did not record it: PULUMI_STACK when set, else
    the project's only stack file."""
    if access.stack:
        return access.stack
    if os.environ.get("PULUMI_STACK"):
        return os.environ["PULUMI_STACK"].rsplit("/", 1)[-1]
    stacks = sorted(project_dir.glob("Pulumi.*.yaml"))
    if len(stacks) == 1:
        return stacks[0].name.removeprefix("Pulumi.").removesuffix(".yaml")
    return None


def _ssh_section(project_dir: pathlib.Path, stack: str, user: str) -> SshStackSection:
    """ssh.* of this machine's Pulumi.<stack>.yaml; the defaults when the file sets none (the
    program would use them too), with the state's user when there is no stack file here."""
    path = project_dir / stack_config.stack_file(stack)
    if not path.is_file():
        return SshStackSection(user=user)
    try:
        raw = stack_config.read_stack_file(path).get("ssh") or {}
        if not isinstance(raw, dict):
            raise SshAccessError(f"{path}: ssh: {raw!r}: a mapping of ssh.* keys")
        section = SshStackSection.model_validate(raw)
    except ConfigError as exc:
        raise SshAccessError("; ".join(exc.problems)) from None
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SshAccessError(f"{path}: ssh.{where}: {first['msg']}") from None
    # The key path is opened here, not only by the program's rules: `~nobody/key` would be a
    # RuntimeError from pathlib, a NUL a ValueError from exec.
    problems = validation.key_file_problems(section.private_key_file)
    if problems:
        raise SshAccessError(f"{path}: {problems[0]}")
    return section


def settings_here(access: SshAccess, project_dir: pathlib.Path | None = None) -> ssh.SshSettings:
    """The SshSettings of this machine: key file and user from its stack file, known_hosts in its
    project directory.

    Raises:
        SshAccessError: the stack file cannot be read or its ssh section is invalid.
    """
    project_dir = project_dir or PROJECT_DIR
    known = str(project_dir / access.known_hosts)
    stack = _stack_name(access, project_dir)
    if stack is None:
        LOG.warning(
            "this deployment's state predates the stack name and %s has several stack files: "
            "using the default ssh settings (run `pulumi up` once to record the stack)",
            project_dir,
        )
        section = SshStackSection(user=access.user)
    else:
        section = _ssh_section(project_dir, stack, access.user)
    key_path = None
    if section.private_key_file is not None:
        key = pathlib.Path(section.private_key_file).expanduser()
        key_path = str(key if key.is_absolute() else project_dir / key)
    if access.key_fingerprint and key_path and pathlib.Path(key_path).is_file():
        here = _key_file_fingerprint(key_path)
        if here is not None and here != access.key_fingerprint:
            LOG.warning(
                "%s (ssh.privateKeyFile of stack %s here) is key %s, the deployment was made "
                "with key %s: the workers may refuse it",
                key_path,
                stack,
                here,
                access.key_fingerprint,
            )
    return ssh.SshSettings(
        user=section.user,
        key_path=key_path,
        known_hosts=known,
        port=access.port,
        connect_timeout_s=access.connect_timeout_s,
    )
