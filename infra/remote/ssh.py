"""SSH connections to the TPU workers: identity from the stack config, host keys pinned.

Host keys are checked against a project-local known_hosts file (OpenSSH format, so the `ssh`
command line reads the same file). A host seen for the first time is trusted and written into
that file (trust on first use); a host whose key changed is refused with a message that says how
to forget the old key. There is no "accept anything" mode.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pathlib
import threading

import fabric
import paramiko

from infra.errors import InfraError

DEFAULT_KNOWN_HOSTS = ".known_hosts"

_KNOWN_HOSTS_LOCK = threading.Lock()


class SshError(InfraError):
    """A connection problem the user can act on (missing key, changed host key)."""


@dataclasses.dataclass(frozen=True)
class SshSettings:
    """How to reach the workers.

    Attributes:
        user: login user on the VMs (the one whose public key is in the VM metadata).
        key_path: private key file; None uses the keys of a running ssh-agent.
        known_hosts: project-local known_hosts file; created on first use.
        port: SSH port of every worker.
        connect_timeout_s: TCP connect and SSH banner timeout of one attempt.
    """

    user: str
    key_path: str | None = None
    known_hosts: str = DEFAULT_KNOWN_HOSTS
    port: int = 22
    connect_timeout_s: float = 15.0

    def resolved(self) -> SshSettings:
        """The same settings with absolute, user-expanded paths (safe to store in state)."""
        key = str(pathlib.Path(self.key_path).expanduser().resolve()) if self.key_path else None
        known = str(pathlib.Path(self.known_hosts).expanduser().resolve())
        return dataclasses.replace(self, key_path=key, known_hosts=known)


def known_hosts_name(host: str, port: int) -> str:
    """The name OpenSSH and paramiko use for a host in known_hosts (`[h]:p` off port 22)."""
    return host if port == 22 else f"[{host}]:{port}"


class TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Accepts an unknown host once and records its key in the project's known_hosts.

    paramiko only consults this policy when the host has no key of the offered type in the
    client's host keys; a known host with a different key raises BadHostKeyException before.
    The file is appended under a lock, so parallel connections to several workers do not lose
    each other's entries.
    """

    def __init__(self, path: str) -> None:
        self.path = pathlib.Path(path)

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        with _KNOWN_HOSTS_LOCK:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "r+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                # Another process may have recorded this host meanwhile: trust only what it wrote.
                current = paramiko.HostKeys()
                handle.seek(0)
                for line in handle:
                    if line.lstrip().startswith("#"):
                        continue  # a comment (OpenSSH allows them; from_line would choke)
                    try:
                        entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
                    except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey):
                        continue  # a line paramiko cannot parse (e.g. a marker) never matches
                    if entry is not None:
                        for name in entry.hostnames:
                            current.add(name, entry.key.get_name(), entry.key)
                recorded = current.lookup(hostname)
                if recorded:
                    # Known host (perhaps under another key type): the same key or nothing.
                    same = recorded.get(key.get_name())
                    if same is None or same != key:
                        raise paramiko.BadHostKeyException(
                            hostname, key, next(iter(recorded.values()))
                        )
                else:
                    entry = paramiko.hostkeys.HostKeyEntry([hostname], key)
                    handle.write(entry.to_line())
        client.get_host_keys().add(hostname, key.get_name(), key)


def _names_host(name: str, hosts: set[str], ports: tuple[int, ...]) -> bool:
    """Whether a known_hosts name is one of `hosts`: a plain or `[h]:p` name on any port, a
    hashed one (`|1|salt|hash`, what OpenSSH writes with HashKnownHosts) on one of `ports`."""
    if name.startswith("|1|"):
        salt = name.split("|")[2]
        return any(
            paramiko.HostKeys.hash_host(known_hosts_name(host, port), salt) == name
            for host in hosts
            for port in ports
        )
    plain = name[1:].split("]:", 1)[0] if name.startswith("[") else name
    return plain in hosts


def forget_hosts(
    known_hosts: str | pathlib.Path, hosts: list[str], ports: tuple[int, ...] = (22,)
) -> list[str]:
    """Removes every key recorded for `hosts` (addresses; hashed names are matched on `ports`,
    plain ones on any port) from a known_hosts file:
    the machines behind those addresses are gone (a deleted or replaced TPU node), and an
    ephemeral address comes back on another VM with another key, which trust on first use must
    then take as the new host it is. Other lines, comments and markers stay as they were. The
    file is rewritten whole (a temporary file renamed over it), under the same locks as
    TrustOnFirstUse.

    Returns:
        The names whose lines were removed (empty when the file does not exist).
    """
    path = pathlib.Path(known_hosts)
    wanted = {parse_address(h, 22)[0] for h in hosts if h}
    if not wanted or not path.is_file():
        return []
    removed: list[str] = []
    with _KNOWN_HOSTS_LOCK, open(path, "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        kept = []
        for line in handle:
            # Comments and marker lines (@cert-authority, @revoked) are never a host's key.
            entry = not line.lstrip().startswith(("#", "@")) and bool(line.strip())
            names = line.split(None, 1)[0].split(",") if entry else []
            if any(_names_host(name, wanted, ports) for name in names):
                removed += names
                continue
            kept.append(line)
        if removed:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.writelines(kept)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
    return removed


def parse_address(address: str, default_port: int) -> tuple[str, int]:
    """`10.0.0.1` -> (10.0.0.1, default_port); `10.0.0.1:2222` -> (10.0.0.1, 2222)."""
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and ":" not in host:
        return host, int(port)
    return address, default_port


def connect(address: str, settings: SshSettings) -> fabric.Connection:
    """A fabric Connection to one worker (opened lazily) with the project's host key policy.

    Args:
        address: the worker's address, optionally `address:port` (else settings.port).
        settings: user, identity, known_hosts.

    Raises:
        SshError: the configured private key file does not exist.
    """
    host, port = parse_address(address, settings.port)
    settings = dataclasses.replace(settings.resolved(), port=port)
    connect_kwargs: dict[str, object] = {
        "allow_agent": settings.key_path is None,
        "look_for_keys": False,  # only the configured identity, never whatever is in ~/.ssh
        "banner_timeout": settings.connect_timeout_s,
        "auth_timeout": settings.connect_timeout_s,
    }
    if settings.key_path is not None:
        if not pathlib.Path(settings.key_path).is_file():
            raise SshError(
                f"SSH private key {settings.key_path} does not exist "
                "(ssh.privateKeyFile in the stack config)"
            )
        connect_kwargs["key_filename"] = settings.key_path
    config = fabric.Config(overrides={"load_ssh_configs": False})
    conn = fabric.Connection(
        host,
        user=settings.user,
        port=settings.port,
        config=config,
        connect_timeout=int(max(1, settings.connect_timeout_s)),
        connect_kwargs=connect_kwargs,
    )
    # fabric installs AutoAddPolicy on its client; replace the client with a pinned one.
    client = paramiko.SSHClient()
    known = pathlib.Path(settings.known_hosts)
    if known.exists():
        client.load_host_keys(str(known))
    client.set_missing_host_key_policy(TrustOnFirstUse(str(known)))
    conn.client = client
    return conn


def describe(exc: BaseException, host: str, settings: SshSettings) -> str:
    """One line that says what went wrong connecting to `host` and what to do about it."""
    settings = settings.resolved()
    name = known_hosts_name(host, settings.port)
    if isinstance(exc, paramiko.BadHostKeyException):
        return (
            f"host key of {name} changed since it was recorded in {settings.known_hosts} "
            f"(a recreated VM, or someone in between). If the VM was recreated, forget the old "
            f"key: "
            f"ssh-keygen -R '{name}' -f {settings.known_hosts}"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        how = f"key {settings.key_path}" if settings.key_path else "the keys of ssh-agent"
        return f"{settings.user}@{name} refused {how} ({exc})"
    if isinstance(exc, paramiko.SSHException) and "No authentication methods" in str(exc):
        return "no SSH identity: set the ssh key path in the stack config or start ssh-agent"
    return f"{settings.user}@{name}: {type(exc).__name__}: {exc}".rstrip(": ")


def ssh_command(address: str, settings: SshSettings, *extra: str) -> list[str]:
    """The OpenSSH command line that reaches `address` with the same identity and host keys."""
    host, port = parse_address(address, settings.port)
    settings = settings.resolved()
    argv = ["ssh", "-p", str(port)]
    if settings.key_path:
        argv += ["-i", settings.key_path, "-o", "IdentitiesOnly=yes"]
    argv += [
        "-o",
        f"UserKnownHostsFile={settings.known_hosts}",
        # accept-new is trust on first use: new hosts are recorded, changed keys are refused.
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        f"ConnectTimeout={int(max(1, settings.connect_timeout_s))}",
        *extra,
        f"{settings.user}@{host}",
    ]
    return argv
