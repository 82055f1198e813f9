"""One trainer per run directory: `<output_dir>/train.lock` names the holder (host, pid, since).

Two trainers on one run directory would interleave metrics.jsonl lines, write the same
checkpoint steps and leave one of them behind, so the second one stops with one line naming the
holder.

- A local run directory is locked with flock(2) on the lock file: the kernel drops the lock when
  its process dies, however it dies (SIGKILL, OOM, a reboot), so a stale lock cannot exist; the
  file's content only names the holder for the message, and the file is removed on release.
- A gs:// run directory has no such lock, so the lock is the object itself: it is created only
  if absent (a GCS generation precondition, `ifGenerationMatch=0`), and deleted at the end. A
  lock left by a process that died is taken over when it was written on this host and that
  process is gone (another boot of the host, or no live process with that pid and start time):
  the case of a preempted VM that boots again. It is deleted only if it is still the generation
  that was judged stale, so two processes taking it over at once cannot both win.
- A lock held from another host is judged by its lease: its holder rewrites `train.lock.alive`
  every LEASE_S / 4 seconds while it runs. One with no sign of life (that object's, else the
  lock's, last write) for LEASE_S is taken over: a preempted VM's trainer, whose replacement is
  a new host (a recreated TPU VM has another host name), stops renewing it. One renewed while
  the newcomer watches (at most LEASE_S) is alive: the newcomer stops with one line naming it.
  Ages are this host's clock against the bucket's write times (NTP-synced on GCE; the lease is
  minutes, skew is milliseconds).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from workloads.common import errors, storage
from workloads.contract import runconfig

LOCK_FILE = "train.lock"
ALIVE_FILE = "train.lock.alive"
# How long a remote lock may go without a sign of life before another host takes it over.
LEASE_S = float(os.environ.get("GEMMA4_LOCK_LEASE_S", "120"))


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' when unknown or gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            # The command name (field 2) may hold spaces; the fields after its ')' are plain.
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_time": _start_time(os.getpid()),
        "boot_id": _boot_id(),
        "since": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        # Makes this acquire's content unique, so a lock whose create answer was lost is
        # recognised as ours by its content alone (see _create_remote).
        "token": uuid.uuid4().hex,
    }


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown holder (unreadable lock)"
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
        f"since {holder.get('since', '?')}"
    )


def is_stale(holder: dict[str, Any] | None) -> bool:
    """Whether a lock written on this host belongs to a process that no longer runs."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    if holder.get("boot_id") and holder.get("boot_id") != _boot_id():
        return True  # written before this host's last boot
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    started = _start_time(pid)
    return not started or started != holder.get("start_time")


class RunLock:
    """The lock of one run directory; `acquire` then `release` (or use it as a context)."""

    def __init__(self, output_dir: str, log: Callable[[str], None]):
        self.output_dir = output_dir
        self.path = runconfig.join(output_dir, LOCK_FILE)
        self.log = log
        self.alive_path = runconfig.join(output_dir, ALIVE_FILE)
        self._fd: int | None = None
        self._mine: bytes | None = None
        self._renewing: threading.Event | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _busy(self, holder: dict[str, Any] | None, hint: str) -> errors.UserError:
        return errors.UserError(
            f"{self.output_dir}: another trainer holds {self.path} ({describe(holder)}); {hint}"
        )

    def acquire(self) -> None:
        """Takes the lock, or raises.

        Raises:
            errors.UserError: another live trainer holds it (one line naming the holder).
        """
        data = json.dumps(_me()).encode()
        if storage.is_remote(self.path):
            self._acquire_remote(data)
        else:
            self._acquire_local(data)

    def _acquire_local(self, data: bytes) -> None:
        import fcntl

        os.makedirs(self.output_dir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(os.pread(fd, 4096, 0))
                os.close(fd)
                raise self._busy(holder, "stop it first, or use another train.output_dir") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # locked a file its holder removed on release: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        self._fd = fd

    def _acquire_remote(self, data: bytes) -> None:
        with storage.gcs_errors(self.path, "take the lock"):
            self._create_remote(data)

    def _create_remote(self, data: bytes) -> None:
        fs, path = storage.filesystem(self.path)
        for _ in range(3):
            try:
                fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                pass
            else:
                self._mine = data
                self._start_renewing(data)
                return
            try:
                info = fs.info(path)
                raw = bytes(fs.cat_file(path))
                holder = _parse(raw)
            except FileNotFoundError:
                continue  # released between the two calls: try again
            if raw == data:
                # Our own create: it went through but its answer was lost (a dropped
                # connection, a 503 from a front end), and gcsfs's retry then met our object.
                self._mine = data
                self._start_renewing(data)
                return
            verdict = "stale" if is_stale(holder) else self._watch_lease(fs, path, info, holder)
            if verdict == "changed":
                continue  # released or taken while we watched: try again
            if verdict == "alive":
                raise self._busy(
                    holder,
                    "stop it first; if that host no longer runs it, delete the lock "
                    f"(gcloud storage rm {self.path}) and start again",
                )
            self.log(f"note: taking over {self.path} from {describe(holder)}, which no longer runs")
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                _delete_if_unchanged(fs, path, info)
        raise self._busy(None, "it changed hands while this trainer tried to take it")

    def _watch_lease(
        self, fs: Any, path: str, info: dict[str, Any], holder: dict[str, Any] | None
    ) -> str:
        """Watches another host's lock for up to LEASE_S: "stale" once it has gone that long
        without a sign of life (take it over), "alive" as soon as it is renewed, "changed"
        when it was released or replaced meanwhile. A lock of this host is "alive" here (its
        holder runs: is_stale judged it)."""
        if holder is not None and holder.get("host") == socket.gethostname():
            return "alive"
        token = (holder or {}).get("token")
        alive_path = storage.filesystem(self.alive_path)[1]

        def last_sign() -> float:
            with contextlib.suppress(FileNotFoundError):
                fs.invalidate_cache(alive_path)
                if token and _parse(bytes(fs.cat_file(alive_path))) == {"token": token}:
                    return _written_at(fs.info(alive_path))
            return _written_at(info)

        seen = last_sign()
        waited = False
        while True:
            age = time.time() - seen
            if age >= LEASE_S:
                return "stale"
            if not waited:
                self.log(
                    f"note: {self.path} is held by {describe(holder)}, last renewed {age:.0f} s "
                    f"ago; watching it for up to {LEASE_S - age:.0f} s more (a trainer that "
                    "no longer runs stops renewing it)"
                )
                waited = True
            time.sleep(min(5.0, max(0.2, LEASE_S / 8), LEASE_S - age))
            try:
                fs.invalidate_cache(path)
                if fs.info(path).get("generation", 0) != info.get("generation", 0):
                    return "changed"
            except FileNotFoundError:
                return "changed"
            newest = last_sign()
            if newest > seen:
                return "alive"  # renewed while we watched
            seen = newest

    def _start_renewing(self, data: bytes) -> None:
        """Rewrites ALIVE_FILE every LEASE_S / 4 while the lock is held (a daemon thread)."""
        token = (_parse(data) or {}).get("token")
        stop = threading.Event()
        self._renewing = stop
        fs, alive_path = storage.filesystem(self.alive_path)
        beat = json.dumps({"token": token}).encode()

        def renew() -> None:
            while not stop.is_set():
                try:
                    fs.pipe_file(alive_path, beat)
                except Exception as exc:
                    self.log(f"note: could not renew {self.path}'s lease: {exc}")
                stop.wait(LEASE_S / 4)

        threading.Thread(target=renew, name="runlock-lease", daemon=True).start()

    def release(self) -> None:
        """Gives the lock back (a remote lock only while it is still this trainer's)."""
        if self._renewing is not None:
            self._renewing.set()
            self._renewing = None
            with contextlib.suppress(Exception):
                storage.filesystem(self.alive_path)[0].rm_file(
                    storage.filesystem(self.alive_path)[1]
                )
        if self._fd is not None:
            # Removed while still locked, then unlocked: a trainer that opened the old file
            # meanwhile sees it is no longer the lock file's (acquire compares inodes).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None
        if self._mine is not None:
            fs, path = storage.filesystem(self.path)
            with (
                storage.gcs_errors(self.path, "release the lock"),
                contextlib.suppress(FileNotFoundError, FileExistsError),
            ):
                if bytes(fs.cat_file(path)) == self._mine:
                    _delete_if_unchanged(fs, path, fs.info(path))
            self._mine = None


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _written_at(info: dict[str, Any]) -> float:
    """An object's last write as epoch seconds: GCS's `updated`, else fsspec's mtime/created."""
    updated = info.get("updated") or info.get("mtime") or info.get("created")
    if isinstance(updated, str):
        return datetime.datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
    if isinstance(updated, datetime.datetime):
        return updated.timestamp()
    return float(updated) if updated is not None else 0.0


def _delete_if_unchanged(fs: Any, path: str, info: dict[str, Any]) -> None:
    """Deletes the object only if it is still the generation `info` describes (GCS); stores
    without generations (other fsspec back ends, in tests) delete it as is."""
    generation = info.get("generation")
    if generation is not None and hasattr(fs, "split_path") and hasattr(fs, "call"):
        bucket, key, _ = fs.split_path(path)
        fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(generation))
        fs.invalidate_cache(path)
        return
    fs.rm_file(path)
