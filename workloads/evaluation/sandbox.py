"""An operating-system sandbox for Icarus Verilog runs of untrusted code (bubblewrap).

Generated Verilog can ask the simulator to open, read and write files (`$fopen`, `$readmemh`,
`include, ...), and the preprocessor can assemble any of these from harmless-looking pieces
(`` `define CAT(a,b) a``b `` then `` `CAT($fo,pen) ``). No reading of the source can rule that
out, so every iverilog and vvp run goes through `bwrap` (Debian/Ubuntu package `bubblewrap`)
and sees only this:

- a root directory that is an empty, read-only tmpfs holding, read-only and at their host
  paths, only the iverilog and vvp programs, Icarus's own library directory (its preprocessor,
  compiler, code generators and VPI modules), /bin/sh (iverilog's driver starts the preprocessor
  and compiler through it) and the shared libraries these programs load (found with ldd);
  /dev/null; and the sample's own directory at /sample, the only writable place. No /etc, /home,
  /root, /tmp, /dev/shm, /proc, no project file, no model, no credential;
- no network (its own network namespace holds only a loopback that is down), and its own PID,
  IPC and UTS namespaces; it dies with the judge (--die-with-parent);
- an unprivileged identity: uid and gid 65534 with no capabilities, no supplementary groups and
  no_new_privs. When the judge runs as root, bwrap builds the namespaces as root and `setpriv`
  (util-linux) drops to 65534 before the tool starts, so the tool is a real unprivileged uid on
  the host too; otherwise bwrap uses a user namespace in which the calling, already unprivileged
  user shows as 65534;
- an environment of PATH, LC_ALL=C, HOME and TMPDIR (both /sample) only.

CPU time, file size, address space and core dumps are limited by the caller with rlimits, which
bwrap and the tool inherit. When bwrap is missing or cannot create namespaces, `require()` says so
in one line: generated code never runs outside the sandbox.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

from workloads.common import errors

SANDBOX_DIR = "/sample"
SANDBOX_UID = 65534  # "nobody" on Debian and Ubuntu
_INSTALL_HINT = "apt-get install bubblewrap"
_ELF_MAGIC = b"\x7fELF"


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """How to run an Icarus tool on one sample directory.

    Attributes:
        bwrap: path of the bwrap program.
        read_only: host paths made visible read-only at the same path (files or directories),
            as (host source, path in the sandbox).
        drop_privileges: setpriv's command that switches to SANDBOX_UID (when the judge is
            root), or () when bwrap's user namespace does it.
    """

    bwrap: str
    read_only: tuple[tuple[str, str], ...]
    drop_privileges: tuple[str, ...]

    def command(self, argv: Sequence[str], sample_dir: str) -> list[str]:
        """The command line that runs argv (a tool on PATH) inside the sandbox, in sample_dir."""
        # No --new-session: every process of the sandbox stays in the process group the caller
        # gives bwrap, so that one killpg ends them all (the tool gets no terminal: stdin is
        # /dev/null and /dev holds nothing else).
        cmd = [self.bwrap, "--die-with-parent", "--clearenv"]
        if self.drop_privileges:  # root: namespaces without a user namespace, then setpriv
            cmd += [
                "--unshare-net",
                "--unshare-pid",
                "--unshare-ipc",
                "--unshare-uts",
                "--unshare-cgroup-try",
            ]
        else:
            cmd += ["--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        # bwrap creates missing parents of a mount point with mode 0700, which the unprivileged
        # tool could not traverse: make every parent first, world-searchable.
        for parent in _parents([dest for _, dest in self.read_only] + [SANDBOX_DIR, "/dev/null"]):
            cmd += ["--perms", "0755", "--dir", parent]
        for source, dest in self.read_only:
            cmd += ["--ro-bind", source, dest]
        cmd += ["--dev-bind", "/dev/null", "/dev/null"]
        cmd += ["--bind", sample_dir, SANDBOX_DIR, "--chdir", SANDBOX_DIR]
        cmd += ["--remount-ro", "/"]
        for name, value in (
            ("PATH", "/usr/local/bin:/usr/bin:/bin"),
            ("LC_ALL", "C"),
            ("HOME", SANDBOX_DIR),
            ("TMPDIR", SANDBOX_DIR),  # iverilog's driver writes its temporary files there
        ):
            cmd += ["--setenv", name, value]
        cmd += ["--", *self.drop_privileges, *argv]
        return cmd

    def prepare(self, sample_dir: str) -> None:
        """Makes sample_dir writable for the sandbox's uid (when root drops to it); the files
        already there stay the judge's, readable but not writable by the tool."""
        if self.drop_privileges:
            os.chown(sample_dir, SANDBOX_UID, SANDBOX_UID)
            os.chmod(sample_dir, 0o700)


def _parents(paths: Sequence[str]) -> list[str]:
    found: set[str] = set()
    for path in paths:
        parent = os.path.dirname(path)
        while parent not in ("/", ""):
            found.add(parent)
            parent = os.path.dirname(parent)
    return sorted(found, key=lambda p: (p.count("/"), p))


def _shared_libraries(binaries: Sequence[str]) -> set[str]:
    """Every shared library the binaries load, as the paths the dynamic loader opens them by
    (ldd; run once on the installed tools, never on generated code)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise errors.UserError("ldd not found on PATH; install libc-bin")
    libraries: set[str] = set()
    # One ldd for all: it heads each binary's list with "path:" when given several.
    listed = subprocess.run(
        [ldd, *binaries], capture_output=True, text=True, check=False, timeout=120
    )
    for line in listed.stdout.splitlines():
        if not line.startswith(("\t", " ")):
            continue  # a binary's own "path:" line
        # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux... (0x...)"
        words = line.split()
        candidates = words[2:3] if "=>" in words else words[:1]
        libraries.update(w for w in candidates if w.startswith("/"))
    return libraries


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == _ELF_MAGIC
    except OSError:
        return False


def _icarus_library_dir(iverilog: str) -> str:
    """Icarus's own directory (ivlpp, ivl, *.tgt, *.vpi), found from where iverilog lives."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(iverilog)))
    for candidate in (
        *sorted(glob.glob(os.path.join(prefix, "lib", "*", "ivl"))),
        os.path.join(prefix, "lib", "ivl"),
        os.path.join(prefix, "lib64", "ivl"),
    ):
        if os.path.isfile(os.path.join(candidate, "ivlpp")):
            return candidate
    raise errors.UserError(
        f"Icarus Verilog's library directory (with ivlpp) not found under {prefix}/lib; "
        "reinstall Icarus Verilog (apt-get install iverilog)"
    )


def _which(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise errors.UserError(
            f"{tool} not found on PATH; generated code runs only inside the sandbox: "
            f"apt-get install {package}"
        )
    return path


@functools.cache
def current() -> Sandbox:
    """The sandbox for this machine, built once (raises errors.UserError when impossible)."""
    bwrap = _which("bwrap", "bubblewrap")
    iverilog = _which("iverilog", "iverilog")
    vvp = _which("vvp", "iverilog")
    library_dir = _icarus_library_dir(iverilog)
    shell = os.path.realpath("/bin/sh")
    drop: tuple[str, ...] = ()
    programs = [iverilog, vvp, shell]
    if os.geteuid() == 0:
        setpriv = _which("setpriv", "util-linux")
        programs.append(setpriv)
        drop = (
            setpriv,
            f"--reuid={SANDBOX_UID}",
            f"--regid={SANDBOX_UID}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        )
    elf_files = [
        os.path.join(library_dir, name)
        for name in sorted(os.listdir(library_dir))
        if _is_elf(os.path.join(library_dir, name))
    ]
    read_only = [(os.path.realpath(p), p) for p in programs if p != shell]
    read_only.append((shell, "/bin/sh"))
    read_only.append((os.path.realpath(library_dir), library_dir))
    for library in sorted(_shared_libraries([*programs, *elf_files])):
        read_only.append((os.path.realpath(library), library))
    return Sandbox(bwrap, tuple(dict.fromkeys(read_only)), drop)


@functools.cache
def require() -> None:
    """Raises errors.UserError, in one line naming what to install or allow, unless a tool
    really runs in the sandbox on this machine (checked once per process)."""
    box = current()
    probe_dir = tempfile.mkdtemp(prefix="sandbox-probe-")
    try:
        box.prepare(probe_dir)
        ran = subprocess.run(
            box.command(["vvp", "-V"], probe_dir),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
            timeout=60,
        )
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    if ran.returncode != 0 or "Icarus Verilog" not in ran.stdout + ran.stderr:
        detail = (ran.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise errors.UserError(
            f"the Verilog sandbox does not work here (bwrap: {detail}); generated code runs "
            "only inside it: install bubblewrap and allow namespaces (user namespaces when not "
            "root; kernel.unprivileged_userns_clone=1)"
        )
