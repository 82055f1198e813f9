"""One Debian 12 machine: a systemd-nspawn container booted from a cached root file system.

Each machine boots a copy-on-write overlay of the cached tree (its own upper directory: its
"boot disk"), so machines never see each other's writes and the cache stays clean. Commands run
inside with nsenter into the container's namespaces (PID 1's root, mounts, PIDs, cgroup); that
needs no registration with systemd-machined, which nspawn cannot reach from here ("Failed to open
system bus"), hence --register=no --keep-unit. The container shares the host's network: a
service it must reach (the metadata server) listens on a loopback address of its own.

`preempt()` kills PID 1 with SIGKILL, as a spot VM's preemption does: no unit stops, nothing is
flushed. `boot()` again starts the same disk, as a restarted VM.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence

from localcloud import rootfs
from localcloud.errors import CannotBoot, MachineError

HOST_CA = pathlib.Path("/etc/ssl/certs/ca-certificates.crt")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Machine:
    """A container machine on `tree` with its disk under `workdir`.

    Attributes:
        name: the machine's hostname.
        disk: the overlay's upper directory (what this machine wrote).
        root: the merged tree the container runs on (valid while mounted).
        console: the container's console output (systemd's boot messages), next to workdir.
    """

    def __init__(self, tree: pathlib.Path, workdir: pathlib.Path, name: str = "localcloud") -> None:
        self.tree = tree
        self.name = name
        self.workdir = workdir
        self.disk = workdir / "disk"
        self.root = workdir / "root"
        # Beside the disk, not on it: a full disk must not also stop nspawn's console output.
        self.console = workdir.parent / f"{workdir.name}.console.log"
        self.binds: list[str] = []
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self._mounted = False
        self._copied = False

    # -- the disk ----------------------------------------------------------------------------

    def mount(self) -> None:
        """Mounts the overlay (once; a copy of the tree where overlayfs is not available)."""
        if self._mounted or self._copied:
            return
        for sub in (self.disk, self.workdir / "ovl-work", self.root):
            sub.mkdir(parents=True, exist_ok=True)
        options = f"lowerdir={self.tree},upperdir={self.disk},workdir={self.workdir / 'ovl-work'}"
        proc = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(self.root)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:
            self._mounted = True
            return
        # No overlayfs here (a nested container): a full copy, reflinked where the file
        # system can.
        shutil.rmtree(self.root)
        subprocess.run(
            ["cp", "-a", "--reflink=auto", str(self.tree), str(self.root)],
            check=True,
            capture_output=True,
        )
        self._copied = True

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Writes a file on the machine's disk (before or while it runs)."""
        self.mount()
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".localcloud-tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        tmp.rename(target)

    def bind(self, host: pathlib.Path, guest: str, read_only: bool = True) -> None:
        """Binds a host path into the machine at its next boot."""
        self.binds.append(f"--bind{'-ro' if read_only else ''}={host}:{guest}")

    # -- the machine -------------------------------------------------------------------------

    def boot(self, timeout_s: float = 120.0, *, wait: bool = True) -> float:
        """Boots the machine and waits until systemd says it is up (running or degraded).

        With wait=False it returns once PID 1 runs, as a cloud VM's create does: a VM's
        startup-script unit holds systemd's "starting" until the script ends, and what waits
        for the VM (the deploy) watches for the script's ready marker itself.

        Returns:
            Seconds from nspawn's start to systemd's answer.

        Raises:
            CannotBoot: nspawn is missing or not root.
            MachineError: the container did not come up within timeout_s (the console's tail).
        """
        rootfs.check_tools()
        self.mount()
        self._host_files()
        self.write("/etc/hostname", self.name + "\n")
        if not (self.root / "etc/machine-id").read_text().strip():
            # Each machine its own ID, made once per disk, as a VM's first boot does.
            self.write("/etc/machine-id", uuid.uuid4().hex + "\n", mode=0o444)
        start = time.monotonic()
        argv = [
            "systemd-nspawn",
            "--register=no",
            "--keep-unit",
            "--quiet",
            "--console=read-only",
            f"--machine={self.name}",
            f"--directory={self.root}",
            *self.binds,
            "--boot",
        ]
        with self.console.open("ab") as console:
            self.nspawn = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT
            )
        self.leader = self._find_leader(start + timeout_s)
        if not wait:
            return time.monotonic() - start
        state = self._wait_systemd(start + timeout_s)
        if state not in ("running", "degraded"):
            raise MachineError(
                f"{self.name}: systemd says {state!r} after boot; console {self.console}: "
                + self._console_tail()
            )
        return time.monotonic() - start

    def _wait_systemd(self, deadline: float) -> str:
        """systemd's state once it has booted: `offline` (its socket is not there yet) and
        `starting` are waited out; `is-system-running --wait` itself waits for the boot jobs."""
        state = "offline"
        while time.monotonic() < deadline and self.running():
            remaining = max(1.0, deadline - time.monotonic())
            with contextlib.suppress(MachineError):
                state = self.run(
                    ["systemctl", "is-system-running", "--wait"], timeout_s=remaining, check=False
                ).stdout.strip()
            if state not in ("offline", "initializing", "starting", ""):
                return state
            time.sleep(0.2)
        return state

    def _host_files(self) -> None:
        """The host's CA list (this network's TLS is re-signed by a proxy the host trusts) for
        curl, apt and pip (Debian's pip in a venv reads /etc/pip.conf)."""
        if HOST_CA.exists() and not any(HOST_CA.as_posix() in b for b in self.binds):
            self.bind(HOST_CA, HOST_CA.as_posix())
            self.write("/etc/pip.conf", f"[global]\ncert = {HOST_CA}\n")

    def _find_leader(self, deadline: float) -> int:
        """The container's PID 1 as the host sees it: nspawn's child whose innermost PID is 1."""
        assert self.nspawn is not None
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise MachineError(
                    f"{self.name}: systemd-nspawn exited with {self.nspawn.returncode}: "
                    + self._console_tail()
                )
            for pid in _descendants(self.nspawn.pid):
                with contextlib.suppress(OSError):
                    status = pathlib.Path(f"/proc/{pid}/status").read_text()
                    ns_pids = next(
                        line.split()[1:]
                        for line in status.splitlines()
                        if line.startswith("NSpid:")
                    )
                    if len(ns_pids) > 1 and ns_pids[-1] == "1":
                        return pid
            time.sleep(0.1)
        raise MachineError(f"{self.name}: no container PID 1 after boot: " + self._console_tail())

    def _console_tail(self) -> str:
        try:
            lines = self.console.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no console output)"
        return " / ".join(lines[-3:]) or "(no console output)"

    def running(self) -> bool:
        """Whether the container's PID 1 is alive."""
        return self.nspawn is not None and self.nspawn.poll() is None

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float = 120.0,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs argv as root inside the machine (its root, namespaces and a clean environment).

        Raises:
            MachineError: the machine is not running, or check and the command failed.
        """
        if not self.leader or not self.running():
            raise MachineError(f"{self.name}: not running")
        variables = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
        cmd = [
            "nsenter",
            f"--target={self.leader}",
            "--all",
            "--root",
            "--wd",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in variables.items()),
            *argv,
        ]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise MachineError(
                f"{self.name}: {' '.join(argv)[:200]} ran over {timeout_s:g} s"
            ) from exc
        if check and proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise MachineError(
                f"{self.name}: {' '.join(argv)[:200]} exited {proc.returncode}: {' / '.join(tail)}"
            )
        return proc

    def sh(self, script: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Runs a bash script inside the machine (see run)."""
        return self.run(["bash", "-c", script], **kwargs)  # type: ignore[arg-type]

    def preempt(self) -> None:
        """Kills the machine without warning (SIGKILL to PID 1: every process goes at once)."""
        if self.running() and self.leader:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.leader, signal.SIGKILL)
        if self.nspawn is not None:
            try:
                self.nspawn.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait(timeout=30)
        self.leader = 0

    def destroy(self) -> None:
        """Preempts the machine and removes its disk."""
        self.preempt()
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.root)], check=False, capture_output=True)
            self._mounted = False
        shutil.rmtree(self.workdir, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    queue = [pid]
    while queue:
        current = queue.pop()
        try:
            children = pathlib.Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            found.append(int(child))
            queue.append(int(child))
    return found


@contextlib.contextmanager
def booted(
    packages: Sequence[str], workdir: pathlib.Path, name: str = "localcloud"
) -> Iterator[Machine]:
    """A machine booted from the cached tree with `packages`, destroyed afterwards.

    Raises:
        CannotBoot: this machine cannot build or boot containers (one line).
    """
    machine = Machine(rootfs.ensure(packages), workdir, name)
    try:
        machine.boot()
        yield machine
    finally:
        machine.destroy()


__all__ = ["CannotBoot", "Machine", "MachineError", "booted"]
