"""Stage records: when each step from VM boot to the first training step started and how long
it took, in one append-only file per host that the startup script and the trainer both write.

The file (`/var/lib/gemma4/stages.jsonl` on a VM; `$GEMMA4_STAGES_FILE` names it) holds one JSON
object a line:

    {"stage": "venv", "event": "start", "at": 1764080000.12, "boot": "<boot id>",
     "source": "startup"}
    {"stage": "venv", "event": "end", "at": 1764080084.30, "seconds": 84.18, "ok": true,
     "boot": "<boot id>", "source": "startup", "note": "restored from gs://.../venv-<digest>"}

- `stage`: boot (kernel boot to the startup script), python, venv, weights, data,
  compile_ahead (the step compiling beside the weights' arrival and loading), load, compile,
  first_step, and the background jobs after ready (weights_upload, venv_upload).
- `event`: `start` or `end`; an `end` carries `seconds` (the stage's duration) and `ok`.
- `at`: Unix time (seconds, UTC) of the event; `boot`: the kernel's boot id, so a reader
  shows the latest boot's stages only (the file survives reboots; a new VM has a new disk).
- `source`: who wrote it (startup, trainer, upload); `note`: optional, one line of context.

Each record is appended with one write(2) on a file opened O_APPEND (a line is far below the
size a local filesystem writes at once), so concurrent writers (the startup script, a background
upload, the trainer) never interleave, and a writer killed mid-way leaves at most a torn last
line, which `read_records` skips. A stage with a start and no end is still running, or was cut
short when a later boot or a later start of the same stage exists.

The startup script writes the same lines from bash (templates/startup/_common.sh.j2,
`stage_start`/`stage_end`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

STAGES_ENV = "GEMMA4_STAGES_FILE"
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
# The order a boot goes through them; unknown names sort after, by start time.
ORDER = (
    "boot",
    "python",
    "venv",
    "weights",
    "data",
    "compile_ahead",
    "weights_wait",
    "load",
    "compile",
    "first_step",
    "weights_upload",
    "venv_upload",
)


def boot_id(path: str = BOOT_ID_FILE) -> str:
    """The kernel's id of this boot ("unknown" where there is none, e.g. not Linux)."""
    try:
        return pathlib.Path(path).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def append(path: str, record: dict[str, Any]) -> None:
    """Appends one record as one line, in one write(2) on an O_APPEND descriptor."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class StageLog:
    """Records stages of one process: in memory always (`records`), and appended to `path`
    when one is given (a VM sets $GEMMA4_STAGES_FILE; a local run has none). A failure to
    write the file never stops the work it measures: the record stays in memory."""

    def __init__(
        self,
        path: str | None,
        source: str,
        *,
        boot: str | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.source = source
        self.boot = boot or boot_id()
        self.log = log
        self.records: list[dict[str, Any]] = []
        self._started: dict[str, float] = {}
        self._open: set[str] = set()

    @classmethod
    def from_env(cls, source: str, log: Callable[[str], None] | None = None) -> StageLog:
        return cls(os.environ.get(STAGES_ENV) or None, source, log=log)

    def _add(self, record: dict[str, Any]) -> None:
        record = {**record, "boot": self.boot, "source": self.source}
        self.records.append(record)
        if self.path:
            with contextlib.suppress(OSError):
                append(self.path, record)

    def start(self, stage: str, at: float | None = None) -> None:
        at = time.time() if at is None else at
        self._started[stage] = at
        self._open.add(stage)
        self._add({"stage": stage, "event": "start", "at": at})
        if self.log is not None:
            self.log(f"stage {stage} started")

    def end(
        self, stage: str, *, ok: bool = True, seconds: float | None = None, note: str = ""
    ) -> None:
        """Ends `stage`; `seconds` overrides the wall time since its start (compile: the time
        JAX spent compiling, not the wall time around it)."""
        now = time.time()
        self._open.discard(stage)
        if seconds is None:
            seconds = now - self._started.get(stage, now)
        record: dict[str, Any] = {
            "stage": stage,
            "event": "end",
            "at": now,
            "seconds": round(seconds, 3),
            "ok": ok,
        }
        if note:
            record["note"] = note
        self._add(record)
        if self.log is not None:
            failed = "" if ok else ", FAILED"
            self.log(f"stage {stage}: {seconds:.1f} s{f' ({note})' if note else ''}{failed}")

    def is_open(self, stage: str) -> bool:
        """Whether `stage` was started and not ended yet."""
        return stage in self._open

    def rows(self) -> list[dict[str, Any]]:
        """This boot's stages (`summarise`): the host's file when there is one (the startup
        script's stages too), else this process's own records."""
        records = read_records(self.path) if self.path else []
        return summarise(records or self.records, boot=self.boot)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Records `name` around the block; an exception ends it with ok=false."""
        self.start(name)
        try:
            yield
        except BaseException:
            self.end(name, ok=False)
            raise
        self.end(name)


def parse(text: str) -> list[dict[str, Any]]:
    """The records of a stages file's text; torn or foreign lines are skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("stage"), str)
            and isinstance(record.get("at"), int | float)
        ):
            records.append(record)
    return records


def read_records(path: str) -> list[dict[str, Any]]:
    try:
        return parse(pathlib.Path(path).read_text())
    except OSError:
        return []


def latest_boot(records: list[dict[str, Any]]) -> str | None:
    """The boot id of the last record appended (None without records)."""
    if not records:
        return None
    return str(records[-1].get("boot"))


def summarise(records: list[dict[str, Any]], boot: str | None = None) -> list[dict[str, Any]]:
    """One row per stage of `boot` (default: the latest boot), in boot order:
    {stage, source, start, seconds, state, note}; state is done, failed, running, or
    interrupted (a start with no end, followed by a later start of the same stage). The last
    attempt of a stage wins: a stage retried within a boot shows its newest run. Records are
    taken in the order they were appended (the file's order is the order of events; clocks
    are not compared)."""
    boot = boot or latest_boot(records)
    rows: dict[str, dict[str, Any]] = {}
    for record in (r for r in records if r.get("boot") == boot):
        name = record["stage"]
        if record.get("event") == "start":
            cut = rows.get(name)
            interrupted = cut is not None and cut["state"] == "running"
            rows[name] = {
                "stage": name,
                "source": record.get("source"),
                "start": record["at"],
                "seconds": None,
                "state": "running",
                "note": "",
            }
            if interrupted:
                rows[name]["note"] = "an earlier attempt was cut short"
        elif record.get("event") == "end":
            row = rows.setdefault(
                name,
                {"stage": name, "source": record.get("source"), "note": ""},
            )
            seconds = record.get("seconds")
            row["seconds"] = float(seconds) if isinstance(seconds, int | float) else None
            row.setdefault("start", record["at"] - (row["seconds"] or 0.0))
            row["state"] = "done" if record.get("ok", True) else "failed"
            if record.get("note"):
                row["note"] = str(record["note"])
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(rows.values(), key=lambda r: (rank.get(r["stage"], len(ORDER)), r["start"]))


def _utc(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at))


def format_rows(rows: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """Human lines, one per stage: `venv  started 14:02:11 UTC  84.2 s  (note)`."""
    now = time.time() if now is None else now
    lines = []
    for row in rows:
        if row["state"] == "running":
            took = f"running for {now - row['start']:.0f} s"
        elif row["seconds"] is None:
            took = row["state"]
        else:
            took = f"{row['seconds']:.1f} s" + ("" if row["state"] == "done" else " FAILED")
        note = f"  ({row['note']})" if row.get("note") else ""
        lines.append(f"{row['stage']:<15} started {_utc(row['start'])} UTC  {took}{note}")
    return lines
