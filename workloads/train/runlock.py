"""One trainer per run directory: `<output_dir>/train.lock` names the holder (host, pid, since).

Two trainers on one run directory would interleave metrics.jsonl lines, write the same
checkpoint steps and leave one of them behind, so the second one stops with one line naming the
holder.

- A local run directory is locked with flock(2) on the lock file: the kernel drops the lock when
  its process dies, however it dies (SIGKILL, OOM, a reboot), so a stale lock cannot exist; the
  file's content only names the holder for the message, and the file is removed on release.
- A gs:// run directory has no such lock, so the lock is the object itself, and every write of
  it carries a GCS generation precondition: it is created only if absent
  (`ifGenerationMatch=0`), renewed by rewriting it only if it is still the generation this
  holder last wrote, taken over by rewriting only the generation judged stale, and deleted at
  the end only if it is still ours. So two newcomers cannot both take it, and a holder whose
  lock was taken over cannot renew it: its next renewal fails, and it learns that it lost.
- The holder renews every LEASE_S / 4. A lock of this host is taken over at once when its
  process is gone (another boot of the host, or no live process with that pid and start time):
  a preempted VM that boots again. A lock of another host is watched for LEASE_S by this host's
  monotonic clock: rewritten by its holder meanwhile (a new generation with the holder's token),
  it is alive and the newcomer stops with one line naming it; untouched for the whole lease, it
  is taken over (a preempted VM's trainer, whose replacement is a new host: a recreated TPU VM
  has another host name). No clock is compared with another: a newcomer whose clock is minutes
  off judges the lease exactly as one whose clock is right.
- A lease alone does not fence: a holder frozen (SIGSTOP, a VM paused for live migration) or
  cut off from GCS for longer than the lease comes back believing it holds the lock. So the
  holder proves it still holds the lock, by renewing it, before every checkpoint save and
  before any write once its last renewal is older than LEASE_S * WRITE_WITHIN
  (`RunLock.check`); a renewal that fails its precondition means another trainer took over,
  and the holder stops (`on_lost`, `LockLost`). The generation the holder created or took the
  lock with is its fencing token (`RunLock.fence`): it only grows from one holder to the next
  (GCS generations of one object name increase), each checkpoint step records the token it was
  written under (FENCE_KEY in the step's metadata), and a resume refuses a step written under an
  older token than an earlier step's (workloads.train.resume): the step of a writer that had
  already lost the lock when it saved.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from workloads.common import errors, storage
from workloads.contract import runconfig

LOCK_FILE = "train.lock"
LEASE_ENV = "GEMMA4_LOCK_LEASE_S"


def lease_from_env() -> float:
    """GEMMA4_LOCK_LEASE_S, 120 when unset.

    Raises:
        errors.UserError: not a number of seconds above 0.
    """
    raw = os.environ.get(LEASE_ENV, "120")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise errors.UserError(
            f"{LEASE_ENV}={raw!r}: expected the gs:// run lock's lease in seconds, a number "
            "above 0 (unset: 120)"
        )
    return value


# How long a remote lock may go without a renewal before another host takes it over.
LEASE_S = lease_from_env()
# The holder renews every LEASE_S * RENEW_EVERY; it writes without asking GCS first only while
# its last renewal (timed from when it was sent) is younger than LEASE_S * WRITE_WITHIN, which
# leaves the other half of the lease for the write itself and for two hosts' clock rates.
RENEW_EVERY = 0.25
WRITE_WITHIN = 0.5
# The custom metadata entry of a checkpoint step that holds the lock generation it was saved
# under (workloads.train.step.SaveHook, workloads.train.resume).
FENCE_KEY = "run_lock_generation"


class LockLost(errors.UserError):
    """Another trainer took this trainer's run directory over: it must not write anything more."""


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
        # Makes this acquire's content unique, so a write of ours whose answer was lost is
        # recognised as ours by the content alone, and a renewal by a newcomer watching.
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


class _LockObject:
    """The lock object through GCS's JSON API, on gcsfs's session and credentials: a read gives
    the content with its generation, every write and delete carries a generation precondition
    (a failed one raises FileExistsError, as gcsfs maps HTTP 412).

    `retry=False` makes one attempt: the lease's own loops pace their retries by the lease,
    where gcsfs's backoff (about 30 s over 6 attempts) could outlast a short one."""

    def __init__(self, url: str):
        fs, path = storage.filesystem(url)
        if not hasattr(fs, "split_path") or not hasattr(fs, "_request"):
            raise errors.UserError(
                f"{url}: a remote run directory must be in GCS (gs://), whose generation "
                "preconditions the run lock is built on"
            )
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)

    def _request(self, retry: bool, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        request = type(self.fs)._request
        once = getattr(request, "__wrapped__", None) if not retry else None
        if once is None:  # gcsfs's retrying request (or a gcsfs without the plain one)
            return sync(self.fs.loop, request, self.fs, method, path, *args, **kwargs)
        return sync(self.fs.loop, once, self.fs, method, path, *args, **kwargs)

    def read(self, *, retry: bool = True) -> tuple[bytes, int] | None:
        """(content, generation), or None when there is no lock."""
        try:
            _, headers, _, body = self._request(
                retry, "GET", "b/{}/o/{}", self.bucket, self.key, alt="media"
            )
        except FileNotFoundError:
            return None
        return bytes(body), int(headers["X-Goog-Generation"])

    def write(self, data: bytes, if_generation: int, *, retry: bool = True) -> int:
        """Writes the lock only if its generation is `if_generation` (0: only if absent).
        Returns the new generation."""
        meta = json.dumps({"name": self.key, "contentType": "application/json"})
        body = (
            (
                f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
                "--==0==\nContent-Type: application/json\n\n"
            ).encode()
            + data
            + b"\n--==0==--"
        )
        _, _, _, answer = self._request(
            retry,
            "POST",
            f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
            uploadType="multipart",
            ifGenerationMatch=str(if_generation),
            headers={"Content-Type": 'multipart/related; boundary="==0=="'},
            data=body,
        )
        return int(json.loads(answer)["generation"])

    def delete(self, if_generation: int) -> None:
        self._request(
            True, "DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=str(if_generation)
        )


class RunLock:
    """The lock of one run directory; `acquire` then `release` (or use it as a context).

    Args:
        output_dir: the run directory.
        log: where notes go.
        on_lost: called (from whichever thread finds it out, once) with the LockLost error when
            another trainer took a gs:// lock over; `check` raises it after that either way.
            The trainer's command exits there, so that no thread of it writes anything more.
    """

    def __init__(
        self,
        output_dir: str,
        log: Callable[[str], None],
        *,
        on_lost: Callable[[LockLost], None] | None = None,
    ):
        self.output_dir = output_dir
        self.path = runconfig.join(output_dir, LOCK_FILE)
        self.log = log
        self.on_lost = on_lost
        # The fencing token: the generation of the gs:// lock this holder created or took over
        # (None for a local lock, which the kernel fences: flock cannot outlive its process).
        self.fence: int | None = None
        self._fd: int | None = None
        self._object: _LockObject | None = None
        self._holder: dict[str, Any] = {}
        self._generation = 0  # of the lock's last write by this holder
        self._renewals = 0
        self._renewed_at = 0.0  # time.monotonic() when the last successful renewal was sent
        self._mutex = threading.Lock()  # one renewal at a time: the thread's or a check's
        self._stop: threading.Event | None = None
        self._lost: LockLost | None = None
        self._unreachable = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def lost(self) -> bool:
        """Whether another trainer took this holder's lock over (as far as it has found out)."""
        return self._lost is not None

    def _busy(self, holder: dict[str, Any] | None, hint: str) -> errors.UserError:
        return errors.UserError(
            f"{self.output_dir}: another trainer holds {self.path} ({describe(holder)}); {hint}"
        )

    def acquire(self) -> None:
        """Takes the lock, or raises.

        Raises:
            errors.UserError: another live trainer holds it (one line naming the holder).
        """
        holder = _me()
        data = json.dumps(holder).encode()
        if storage.is_remote(self.path):
            self._acquire_remote(holder, data)
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

    def _acquire_remote(self, holder: dict[str, Any], data: bytes) -> None:
        lock = _LockObject(self.path)
        with storage.gcs_errors(self.path, "take the lock"):
            generation, sent = self._take(lock, data)
        self._object, self._holder, self._generation = lock, holder, generation
        self.fence, self._renewed_at, self._lost = generation, sent, None
        stop = threading.Event()
        self._stop = stop
        threading.Thread(
            target=self._renew_every, args=(stop,), name="runlock-lease", daemon=True
        ).start()

    def _take(self, lock: _LockObject, data: bytes) -> tuple[int, float]:
        """Creates the lock, or takes a stale one over. Returns its generation and when the
        write that made it was sent (time.monotonic(); the lease counts from there)."""
        sends: list[float] = []
        for _ in range(3):
            sends.append(time.monotonic())
            try:
                return lock.write(data, 0), sends[-1]
            except FileExistsError:
                pass
            current = lock.read()
            if current is None:
                continue  # released between the two calls: try again
            raw, generation = current
            if raw == data:
                # Our own write: it went through but its answer was lost (a dropped connection,
                # a 503 from a front end), and gcsfs's retry then met our object. It is the
                # previous write or this one: the lease counts from the earlier.
                return generation, sends[max(0, len(sends) - 2)]
            holder = _parse(raw)
            verdict = "stale" if is_stale(holder) else self._watch_lease(lock, generation, holder)
            if verdict == "changed":
                continue  # released or taken while we watched: try again
            if verdict == "alive":
                raise self._busy(
                    holder,
                    "stop it first; if that host no longer runs it, delete the lock "
                    f"(gcloud storage rm {self.path}) and start again",
                )
            self.log(f"note: taking over {self.path} from {describe(holder)}, which no longer runs")
            sends.append(time.monotonic())
            with contextlib.suppress(FileExistsError):
                # Only the generation judged stale: one renewed or taken by another newcomer
                # at the last moment fails the precondition and is judged again.
                return lock.write(data, generation), sends[-1]
        raise self._busy(None, "it changed hands while this trainer tried to take it")

    def _watch_lease(
        self, lock: _LockObject, generation: int, holder: dict[str, Any] | None
    ) -> str:
        """Watches another host's lock for LEASE_S by this host's monotonic clock: "stale" when
        it was not rewritten all that time (take it over), "alive" as soon as its holder renews
        it, "changed" when it was released or taken by another trainer meanwhile. A lock of this
        host is "alive" here (its holder runs: is_stale judged it)."""
        if holder is not None and holder.get("host") == socket.gethostname():
            return "alive"
        token = (holder or {}).get("token")
        self.log(
            f"note: {self.path} is held by {describe(holder)}; watching it for up to "
            f"{LEASE_S:.0f} s (a trainer that no longer runs stops renewing it)"
        )
        started = time.monotonic()
        while True:
            left = LEASE_S - (time.monotonic() - started)
            if left <= 0:
                return "stale"
            time.sleep(min(5.0, max(0.2, LEASE_S / 8), left))
            current = lock.read()
            if current is None:
                return "changed"
            if current[1] != generation:
                renewed = token and (_parse(current[0]) or {}).get("token") == token
                return "alive" if renewed else "changed"

    def _renew_every(self, stop: threading.Event) -> None:
        # After a freeze (SIGSTOP) the wait returns at once: the first thing the process does
        # then is this renewal, which finds out whether another trainer took over meanwhile.
        while not stop.wait(LEASE_S * RENEW_EVERY):
            self._renew()

    def _renew(self) -> bool:
        """Rewrites the lock if it is still the generation this holder last wrote. Returns
        whether it did; False when GCS could not be reached (try again) or the lock was taken
        over (self._lost is set, on_lost called)."""
        with self._mutex:
            lock = self._object
            if lock is None or self._lost is not None:
                return False
            self._renewals += 1
            content = json.dumps({**self._holder, "renewal": self._renewals}).encode()
            sent = time.monotonic()
            try:
                generation = self._rewrite(lock, content)
            except Exception as exc:  # GCS unreachable or failing: the lease runs on
                if not self._unreachable:
                    self._unreachable = True
                    self.log(
                        f"note: could not renew {self.path}'s lease "
                        f"({errors.exception_line(exc)}); trying again"
                    )
                return False
            if generation is None:
                return False
            if self._unreachable:
                self._unreachable = False
                self.log(f"note: renewed {self.path}'s lease again")
            self._generation, self._renewed_at = generation, sent
            return True

    def _rewrite(self, lock: _LockObject, content: bytes) -> int | None:
        """One renewal: the new generation, or None when another trainer holds the lock now."""
        try:
            return lock.write(content, self._generation, retry=False)
        except (FileExistsError, FileNotFoundError):
            pass
        current = lock.read(retry=False)
        if current is not None and (_parse(current[0]) or {}).get("token") == self._holder["token"]:
            # An earlier renewal of ours went through although its answer never came (a
            # timeout): still ours, at the generation that one wrote.
            return lock.write(content, current[1], retry=False)
        self._lose(_parse(current[0]) if current is not None else None)
        return None

    def _lose(self, taker: dict[str, Any] | None) -> None:
        by = f"taken over by {describe(taker)}" if taker else "released by another trainer"
        self._lost = LockLost(
            f"{self.output_dir}: this trainer no longer holds {self.path} ({by}: its lease ran "
            "out while this trainer was paused or cut off from GCS); stopping without writing "
            "anything more"
        )
        if self.on_lost is not None:
            self.on_lost(self._lost)

    def check(self, *, renew: bool = False) -> None:
        """Returns only while this trainer still holds the lock: at once when its last renewal
        is recent, else (or with `renew`) after renewing it. While GCS cannot be reached it
        waits (a trainer cut off from GCS cannot write either): until a renewal goes through, or
        fails because another trainer took over. A local lock always holds.

        Raises:
            LockLost: another trainer took the lock over.
        """
        if self._object is None:
            return
        if self._lost is not None:
            raise self._lost
        if not renew and time.monotonic() - self._renewed_at < LEASE_S * WRITE_WITHIN:
            return
        waiting = False
        while not self._renew():
            if self._lost is not None:
                raise self._lost
            if self._object is None:
                return  # released meanwhile
            if not waiting:
                waiting = True
                self.log(f"note: waiting to renew {self.path}'s lease before writing more")
            time.sleep(min(5.0, max(0.2, LEASE_S / 8)))

    def release(self) -> None:
        """Gives the lock back (a remote lock only while it is still this trainer's)."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        if self._fd is not None:
            # Removed while still locked, then unlocked: a trainer that opened the old file
            # meanwhile sees it is no longer the lock file's (acquire compares inodes).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None
        with self._mutex:  # a renewal in flight ends first, and none starts after
            lock, self._object = self._object, None
        if lock is None or self._lost is not None:
            return  # not held, or held by another trainer now: theirs to keep
        with (
            storage.gcs_errors(self.path, "release the lock"),
            contextlib.suppress(FileNotFoundError, FileExistsError),
        ):
            current = lock.read()
            if current is not None and (_parse(current[0]) or {}).get("token") == self._holder.get(
                "token"
            ):
                lock.delete(current[1])


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None
