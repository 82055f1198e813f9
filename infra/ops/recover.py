"""Recovering a preempted or failed TPU VM through the Cloud TPU API: `python -m infra.ops recover`.

A preempted spot/preemptible TPU node stays PREEMPTED: it cannot be restarted, only deleted and
created again. Recovery does that from the create request `pulumi up` recorded in the training
bucket (infra/tpu/record.py): it deletes the PREEMPTED/TERMINATED node and its queued resource
and places a new one with infra/tpu/placement.py (zone failover, queued resources, adoption of
what exists). The new VM's startup script restores the last release `pulumi up` pushed to the
bucket and starts the job at boot, so nobody deploys to it; the trainer resumes from the
newest checkpoint. Pulumi's state catches up at the next `pulumi up` or `refresh` (the TpuNode
provider reads the new node under the same name and keeps it).

No Pulumi here: a laptop's `ops recover` and the recovery controller's `recover --watch` run
this same code with nothing but Cloud TPU API access and reads of the bucket. One pass
(`recover_pass`) reads the state first and acts on what it finds, so a pass that stops anywhere
(a controller restarted mid-recovery, two callers at once) converges on the next one:

- no live node (PREEMPTED, TERMINATED, gone): recreate it (placement adopts a node or a queued
  resource another caller is creating; a create refused with ALREADY_EXISTS is adopted too);
- a READY node whose boot failed (a worker wrote its boot-failed line to the bucket) or that
  shows no training progress (metrics.jsonl) by `boot_deadline_s` after its creation: deleted
  and created again, at most `max_attempts` new nodes in a row, then deleted and reported in one
  line: nothing is left billing with no job;
- anything else (READY and training, CREATING, a queue waiting): left alone, one line.

Only nodes recovery made are judged by their boot: each carries the labels RECOVERED_BY and
ATTEMPT_LABEL (which new node in a row it is), so every caller, the controller after a restart
or a laptop at the same time, reads the same count from the node itself. A node `pulumi up`
made is left to its deploy, which waits for its boot and reports a failure to the person
running it (and its first boot may download the model from the hub for hours). `journal` keeps
what the cloud cannot hold once the node is deleted (the recoveries made, a give-up), across
restarts of the caller (the controller's is a file on its disk); it is keyed by the request, so
a `pulumi up` that records another request starts afresh.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from infra.errors import OpsError
from infra.tpu import api as tpu_api
from infra.tpu import placement
from infra.tpu import record as record_mod
from infra.vm import roles
from workloads.common import errors

HELP = "recreate a preempted or failed TPU VM through the Cloud TPU API; the job resumes"
# Node states after which nothing brings the node back: it has to be deleted and created again.
NEEDS_RECOVERY = frozenset({*placement.NODE_GONE, "NOT_FOUND"})
DEFAULT_INTERVAL_S = 120.0
DEFAULT_MAX_RECOVERIES = 10
# New nodes in a row whose boot fails (or that never train) before recovery gives up: a cause
# that survives three fresh VMs (a broken release, a PyPI outage longer than the boot's retries)
# is for a person, and each try bills an idle TPU until its deadline.
DEFAULT_MAX_ATTEMPTS = 3
# From a node's creation to its first training step after a recovery: the boot restores the venv
# and the release from the bucket (minutes), stages ~62 GB of weights from the bucket and
# compiles the step (the compile cache is in the bucket): well under an hour when healthy.
DEFAULT_BOOT_DEADLINE_S = 5400.0
# The labels of a node recovery made: which caller's code made it, and which new node in a row
# it is (1 after a preemption, +1 per node replaced because it did not train).
RECOVERED_BY = {"recovered-by": "gemma4-recover"}
ATTEMPT_LABEL = "recovery-attempt"
# A watch survives this many consecutive failed checks (API or GCS hiccups) before giving up.
MAX_FAILED_CHECKS = 5
# What a pass ends with (`Pass.outcome`).
FINISHED, HEALTHY, WAITING, RECREATED, GAVE_UP = (
    "finished",
    "healthy",
    "waiting",
    "recreated",
    "gave-up",
)


class LimitReached(OpsError):
    """More recoveries than allowed, or a recovery nobody confirmed: waiting will not help."""


@dataclasses.dataclass(frozen=True)
class RecoveryLimits:
    """How far recovery goes: preemptions recovered, new nodes per failed boot, and the
    deadline from a node's creation to its first training progress."""

    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    boot_deadline_s: float = DEFAULT_BOOT_DEADLINE_S


class Journal:
    """What recovery remembers between passes: a JSON file (local or gs://), or memory only
    (`path` None). Keyed by the request's digest: a different request starts afresh."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._memory: dict[str, Any] = {}

    def load(self, digest: str) -> dict[str, Any]:
        data: Any = self._memory
        if self.path is not None:
            from workloads.common import storage

            try:
                data = json.loads(storage.read_text(self.path)) if _exists(self.path) else {}
            except (errors.UserError, json.JSONDecodeError):
                data = {}  # a damaged journal only forgets counts: the cloud is the truth
        if not isinstance(data, dict) or data.get("request") != digest:
            data = {"request": digest}
        return {
            "request": digest,
            "recoveries": int(data.get("recoveries") or 0),
            "gave_up": data.get("gave_up"),
        }

    def save(self, state: Mapping[str, Any]) -> None:
        self._memory = dict(state)
        if self.path is not None:
            from workloads.common import storage

            if not storage.is_remote(self.path):
                pathlib.Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            storage.write_text_atomic(self.path, json.dumps(state, sort_keys=True) + "\n")


def _exists(path: str) -> bool:
    from workloads.common import storage

    return storage.exists(path)


def request_digest(request: placement.Request) -> str:
    body = dataclasses.asdict(request)
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# what the bucket says: the run finished, a boot failed, training progressed


def modified(path: str) -> float | None:
    """When the file at `path` (local or gs://) was last written (Unix time), None if absent."""
    from workloads.common import storage

    if not storage.is_remote(path):
        try:
            return os.stat(path).st_mtime
        except FileNotFoundError:
            return None
    fs, p = storage.filesystem(path)
    try:
        with storage.gcs_errors(path, "look up"):
            fs.invalidate_cache(p)
            return fs.modified(p).timestamp()
    except FileNotFoundError:
        return None


def run_finished(run_dir: str | None) -> str | None:
    """The train_summary.json path when the training run has finished, else None."""
    if not run_dir:
        return None
    from workloads.common import storage

    path = f"{run_dir.rstrip('/')}/train_summary.json"
    return path if storage.exists(path) else None


def progressed(run_dir: str | None, since: float) -> bool:
    """Whether the trainer wrote a step (metrics.jsonl) after `since` (Unix time). Without a
    run directory (the serving VM) a booted node counts as progressing."""
    if not run_dir:
        return True
    written = modified(f"{run_dir.rstrip('/')}/metrics.jsonl")
    return written is not None and written >= since


def boot_failure(reports: str | None, since: float) -> str | None:
    """The boot-failed line a worker of the node wrote to `reports` after `since`, else None.
    The startup script writes it there (templates/startup/_common.sh.j2, boot_ended) as well as
    on the worker's disk, so the caller needs no SSH to tell a failed boot from a slow one."""
    if not reports:
        return None
    from workloads.common import storage

    for name in sorted(storage.file_sizes(reports)):
        path = f"{reports.rstrip('/')}/{name}"
        written = modified(path)
        if name.endswith(".failed") and written is not None and written >= since:
            try:
                return storage.read_text(path).strip() or f"{path} (empty)"
            except errors.UserError:
                return f"a worker reported a failed boot ({path})"
    return None


@dataclasses.dataclass(frozen=True)
class Probes:
    """What recovery reads besides the TPU API (the tests' are fakes)."""

    finished: Callable[[str | None], str | None] = run_finished
    progressed: Callable[[str | None, float], bool] = progressed
    boot_failure: Callable[[str | None, float], str | None] = boot_failure


# ---------------------------------------------------------------------------------------------
# one pass


@dataclasses.dataclass(frozen=True)
class Pass:
    """What one pass found and did."""

    outcome: str
    line: str
    zone: str | None = None


Confirm = Callable[[str], bool]


def confirmer(yes: bool, stdin: TextIO, out: TextIO) -> Confirm:
    """A yes/no question: always yes with --yes, asked on a terminal, refused without one."""

    def ask(question: str) -> bool:
        if yes:
            return True
        if not stdin.isatty():
            raise OpsError(
                f"refusing to {question} without confirmation (stdin is not a terminal): pass --yes"
            )
        out.write(f"{question[0].upper()}{question[1:]}? [y/N] ")
        out.flush()
        return stdin.readline().strip().lower() in ("y", "yes")

    return ask


def _created(node: Mapping[str, Any], fallback: float) -> float:
    text = str(node.get("create_time") or node.get("createTime") or "")
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return fallback


def _label(target: record_mod.Recorded) -> str:
    return f"{target.role} VM {target.request.node_id}"


def _find_live(
    api: placement.PlacementApi, request: placement.Request, say: Callable[[str], None]
) -> tuple[str, dict[str, Any]] | None:
    """The first node of the request's name in its zones that may still run (zone, node)."""
    reads = placement.ZoneReads(say)
    for zone in request.zones:
        node = reads.read(zone, functools.partial(api.get_node, request.node_name(zone)))
        if node is not None and str(node.get("state") or "") not in placement.NODE_GONE:
            return zone, node
    return None


def recover_pass(
    api: placement.PlacementApi,
    target: record_mod.Recorded,
    out: TextIO,
    *,
    journal: Journal | None = None,
    limits: RecoveryLimits = RecoveryLimits(),
    confirm: Confirm = lambda _q: True,
    probes: Probes = Probes(),
    clock: Callable[[], float] = time.time,
    poll_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Pass:
    """One look at the node and what it needs (module docstring); one line per step on `out`.

    Args:
        api: the Cloud TPU API (infra.tpu.api.GoogleTpuApi, or any PlacementApi).
        target: the recorded request (infra.tpu.record.load).
        journal: counts kept between passes (None: this pass only).
        clock: wall-clock time, compared with the API's and the bucket's times.
        poll_s, sleep: how placement waits on a queued resource.

    Raises:
        OpsError: more recoveries than `limits.max_recoveries`, or a refusal that waiting will
            not fix (a foreign node under the name, a bad spec, a permission).
    """
    journal = journal or Journal()
    request = target.request
    label = _label(target)
    state = journal.load(request_digest(request))

    def say(line: str) -> None:
        print(f"{_stamp()} recover: {line}", file=out, flush=True)

    done = probes.finished(target.run_dir)
    if done:
        say(f"training finished ({done}); nothing to recover")
        return Pass(FINISHED, f"training finished ({done})")
    live = _find_live(api, request, say)
    if live is not None:
        zone, node = live
        node_state = str(node.get("state") or "STATE_UNSPECIFIED")
        created = _created(node, clock())
        age = clock() - created
        where = f"{label} in {zone}"
        failed = None
        attempt = _attempt(node)
        if attempt is None:  # made by `pulumi up`: its deploy watches its boot
            line = f"{where}: {node_state}"
            say(line)
            return Pass(HEALTHY if node_state == "READY" else WAITING, line, zone)
        if node_state == "READY":
            failed = probes.boot_failure(target.boot_reports, created)
            if failed is None and probes.progressed(target.run_dir, created):
                line = (
                    f"{where}: READY and training (recovered {age:.0f} s ago)"
                    if target.run_dir
                    else f"{where}: READY (recovered {age:.0f} s ago; no training run to watch)"
                )
                if state["gave_up"]:  # someone fixed it and brought it back
                    state["gave_up"] = None
                    journal.save(state)
                say(line)
                return Pass(HEALTHY, line, zone)
            if failed is None and age <= limits.boot_deadline_s:
                line = (
                    f"{where}: READY, no training step yet ({age:.0f} s of "
                    f"{limits.boot_deadline_s:.0f} s)"
                )
                say(line)
                return Pass(WAITING, line, zone)
            if failed is None:
                failed = f"no training step within {limits.boot_deadline_s:.0f} s of its creation"
        elif age > limits.boot_deadline_s and node_state in ("CREATING", "STARTING"):
            failed = f"still {node_state} {age:.0f} s after its creation"
        else:
            line = f"{where}: {node_state}; left alone"
            say(line)
            return Pass(WAITING, line, zone)
        return _replace_failed(
            api, target, (zone, node, attempt), failed, state, journal, limits, say,
            (clock, poll_s, sleep),
        )  # fmt: skip

    if state["gave_up"]:
        line = f"{label}: gave up earlier ({state['gave_up']}); nothing to do until it is fixed"
        say(line)
        return Pass(GAVE_UP, line)
    if state["recoveries"] >= limits.max_recoveries:
        raise LimitReached(
            f"{label} is lost again after {state['recoveries']} recoveries "
            f"(--max-recoveries {limits.max_recoveries}): run `python -m infra.ops recover` or "
            "raise the limit"
        )
    if not confirm(f"recreate the lost {label} through the Cloud TPU API"):
        raise LimitReached(f"not confirmed: the {label} stays lost")
    say(
        f"{label}: PREEMPTED, TERMINATED or gone; recreating it "
        f"(recovery {state['recoveries'] + 1}/{limits.max_recoveries})"
    )
    # Counted before the create: a caller killed while it is in flight (the controller
    # restarted) has made this recovery, and the restarted one adopts the node uncounted.
    state["recoveries"] += 1
    journal.save(state)
    try:
        result = _recreate(api, target, 1, say, (clock, poll_s, sleep))
    except Exception:  # the API refused or failed: the next pass tries again, counted once
        _uncount(state, journal)
        raise
    if result.outcome != RECREATED:  # a zone-less pass (no capacity anywhere) is not counted
        _uncount(state, journal)
    return result


def _uncount(state: dict[str, Any], journal: Journal) -> None:
    state["recoveries"] -= 1
    journal.save(state)


def _attempt(node: Mapping[str, Any]) -> int | None:
    """Which new node in a row recovery made this one (its label), None if recovery did not."""
    labels = node.get("labels") or {}
    if any(labels.get(k) != v for k, v in RECOVERED_BY.items()):
        return None
    try:
        return max(1, int(labels.get(ATTEMPT_LABEL) or 1))
    except ValueError:
        return 1


def _replace_failed(
    api: placement.PlacementApi,
    target: record_mod.Recorded,
    found: tuple[str, Mapping[str, Any], int],
    why: str,
    state: dict[str, Any],
    journal: Journal,
    limits: RecoveryLimits,
    say: Callable[[str], None],
    waits: tuple[Callable[[], float], float, Callable[[float], None]],
) -> Pass:
    """Deletes a node that booted but does not train; creates the next one, or gives up."""
    request = target.request
    label = _label(target)
    zone, node, attempt = found
    say(f"{label} in {zone} failed: {why}; deleting it (new node {attempt} in a row)")
    placement.remove(api, request.node_name(zone), node.get("queued_resource") or None)
    if attempt >= limits.max_attempts:
        line = (
            f"{label}: gave up after {attempt} new node(s) that did not train (last: "
            f"{why}); deleted, nothing of it bills. Fix the cause, then run `python -m infra.ops "
            "recover` or `pulumi up`"
        )
        state["gave_up"] = why
        journal.save(state)
        say(line)
        return Pass(GAVE_UP, line, zone)
    return _recreate(api, target, attempt + 1, say, waits)


def _recreate(
    api: placement.PlacementApi,
    target: record_mod.Recorded,
    attempt: int,
    say: Callable[[str], None],
    waits: tuple[Callable[[], float], float, Callable[[float], None]],
) -> Pass:
    """Places the node from its recorded request (deleting what is lost on the way), labelled
    as recovery's `attempt`-th new node in a row."""
    labels = {**(target.request.node.get("labels") or {}), **RECOVERED_BY}
    labels[ATTEMPT_LABEL] = str(attempt)
    request = dataclasses.replace(target.request, node={**target.request.node, "labels": labels})
    _clock, poll_s, sleep = waits
    started = time.monotonic()
    try:
        placed = placement.place(
            api, request, say=lambda line: say(f"tpu: {line}"), poll_s=poll_s, sleep=sleep
        )
    except placement.NoCapacity as exc:
        line = f"{_label(target)}: {exc}"
        say(line)
        return Pass(WAITING, line)
    verb = "adopted" if placed.adopted else "created"
    role = roles.find(target.role)
    then = (
        "its startup script restores the release and the job resumes from the newest checkpoint"
        if role is None or role.recovered_by_controller
        # Its startup script restores no release (templates/startup/_release.sh.j2 is the
        # recovered roles'): the deploy of the next `up` brings its job.
        else "it installs no release at boot: `pulumi up --refresh` deploys to it"
    )
    line = (
        f"{_label(target)} {verb} in {placed.zone} "
        f"({placed.node.get('state') or '?'}, {time.monotonic() - started:.1f} s); {then}"
    )
    say(line)
    return Pass(RECREATED, line, placed.zone)


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------------------------------------
# the watch


def source_changed(uri: str, local: str) -> Callable[[], str | None]:
    """A check that names the change once the archive at `uri` is no longer the `local` copy
    (the recovery controller's code: its service then starts again on the new one)."""
    from workloads.common import storage  # lazy: gcsfs only on the controller

    try:
        installed = pathlib.Path(local).read_bytes()
    except FileNotFoundError:
        installed = b""

    def check() -> str | None:
        if storage.read_bytes(uri) == installed:
            return None
        return f"a new source was uploaded to {uri}"

    return check


def watch(
    api: placement.PlacementApi,
    load: Callable[[], record_mod.Recorded],
    out: TextIO,
    *,
    journal: Journal | None = None,
    limits: RecoveryLimits = RecoveryLimits(),
    interval_s: float = DEFAULT_INTERVAL_S,
    confirm: Confirm = lambda _q: True,
    probes: Probes = Probes(),
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    outdated: Callable[[], str | None] | None = None,
    passes: int | None = None,
) -> int:
    """`recover_pass` every `interval_s` seconds until the training run finished (0).

    The record is read again before every pass (`load`): a later `pulumi up` may have recorded
    another request. A pass that fails (an API or bucket hiccup) is one line and tried again;
    MAX_FAILED_CHECKS in a row end the watch. `outdated` (the controller's source changed) ends
    it between passes with 0. `passes` bounds the passes (tests, the rehearsal).

    Raises:
        OpsError: MAX_FAILED_CHECKS passes in a row failed, or more recoveries than allowed.
    """
    journal = journal or Journal()
    failures = count = 0
    print(
        f"{_stamp()} recover: watching every {interval_s:g} s until the training run finished "
        f"(at most {limits.max_recoveries} recoveries, {limits.max_attempts} new nodes per "
        f"failed boot, {limits.boot_deadline_s:.0f} s to the first step)",
        file=out,
        flush=True,
    )
    while passes is None or count < passes:
        count += 1
        try:
            stale = outdated() if outdated else None
            if stale:
                print(f"{_stamp()} recover: {stale}; stopping to start again on it", file=out)
                return 0
            result = recover_pass(
                api,
                load(),
                out,
                journal=journal,
                limits=limits,
                confirm=confirm,
                probes=probes,
                clock=clock,
                sleep=sleep,
                poll_s=min(60.0, interval_s),
            )
        except LimitReached:
            raise
        except OpsError as exc:
            failures = _failed(failures, str(exc), out, exc)
        except placement.PlacementError as exc:
            failures = _failed(failures, str(exc), out, exc)
        except Exception as exc:  # a transient API or GCS problem: try again next time
            failures = _failed(failures, errors.exception_line(exc), out, exc)
        else:
            failures = 0
            if result.outcome == FINISHED:
                return 0
        out.flush()
        sleep(interval_s)
    return 0


def _failed(failures: int, text: str, out: TextIO, exc: BaseException) -> int:
    failures += 1
    if failures >= MAX_FAILED_CHECKS:
        raise OpsError(f"{failures} checks in a row failed; last: {text}") from exc
    print(f"{_stamp()} recover: check failed ({failures}/{MAX_FAILED_CHECKS}): {text}", file=out)
    return failures


def controller(
    request_uri: str,
    *,
    api: placement.PlacementApi | None = None,
    journal_path: str | None = None,
    out: TextIO | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    limits: RecoveryLimits = RecoveryLimits(),
    passes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """What the recovery controller's service runs (`infra.ops recover --watch --request URI
    --journal PATH --yes`), as one call: watches the node recorded at `request_uri` (gs:// or a
    local path) through `api` (default: the Cloud TPU API at CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU,
    else Google's), keeping its counts in `journal_path`. 0 once the run finished.

    Raises:
        OpsError: the record cannot be read, or the watch gave up (MAX_FAILED_CHECKS, limits).
    """
    record_mod.load(request_uri)  # a bad URI is one line now, not five failed checks later
    return watch(
        api or tpu_api.GoogleTpuApi(tpu_api.client(None)),
        lambda: record_mod.load(request_uri),
        out or sys.stdout,
        journal=Journal(journal_path),
        limits=limits,
        interval_s=interval_s,
        sleep=sleep,
        passes=passes,
    )


# ---------------------------------------------------------------------------------------------
# command line (a subcommand of infra.ops)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m infra.ops recover` (its --vm comes from infra.ops)."""
    parser.add_argument(
        "--watch", action="store_true", help="keep checking; stop when the training run finished"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="seconds between checks with --watch",
    )
    parser.add_argument(
        "--max-recoveries",
        type=int,
        default=DEFAULT_MAX_RECOVERIES,
        metavar="N",
        help="recreate a lost VM at most N times",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULT_MAX_ATTEMPTS,
        metavar="N",
        help="new nodes in a row whose boot fails or that do not train, then give up",
    )
    parser.add_argument(
        "--boot-deadline",
        type=float,
        default=DEFAULT_BOOT_DEADLINE_S,
        metavar="S",
        help="seconds from a node's creation to its first training step",
    )
    parser.add_argument(
        "--request",
        metavar="URI",
        help="the recorded create request (gs://<training bucket>/recovery/<node>.json); "
        "default: the stack output <role>RecoveryRecord",
    )
    parser.add_argument(
        "--journal",
        metavar="PATH",
        help="keep the recovery counts in this JSON file between runs (default: in memory)",
    )
    parser.add_argument(
        "-y", "--yes", action="store_true", help="recreate without asking (needed without a TTY)"
    )
    parser.add_argument(
        "--until-new-source",
        nargs=2,
        metavar=("URI", "FILE"),
        # The recovery controller's own flag, hidden from `--help`: with --watch, stop (exit 0)
        # between checks once the archive at URI differs from FILE (its service then starts
        # again on the new source).
        help=argparse.SUPPRESS,
    )


def request_uri(args: argparse.Namespace) -> str:
    """--request, else the stack's `<vm>RecoveryRecord` output.

    Raises:
        OpsError: no such output (a stack written by an older checkout).
    """
    if args.request:
        return str(args.request)
    from infra.ops.stack_outputs import load_outputs, release_message

    outputs = load_outputs(args.stack, args.outputs)
    released = release_message(outputs, args.vm)  # a VM that gave its node back has no node
    if released is not None:
        from infra.errors import Released

        raise Released(released)
    uri = outputs.get(f"{args.vm}RecoveryRecord")
    if not isinstance(uri, str) or not uri:
        raise OpsError(
            f"the stack has no {args.vm}RecoveryRecord output: run `pulumi up` once with this "
            "checkout (it records the node's create request), or pass --request"
        )
    return uri


def run(
    args: argparse.Namespace,
    out: TextIO,
    *,
    tpu_client_factory: Callable[[], Any] | None = None,
    stdin: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """`python -m infra.ops recover` with parsed arguments; 0 on success.

    Raises:
        OpsError: every problem, as one line (infra.ops prints it).
    """
    for flag, seconds in (("--interval", args.interval), ("--boot-deadline", args.boot_deadline)):
        # float() takes nan and inf, which compare false with 0: a watch that never wakes, or
        # a boot that is never judged.
        if not (math.isfinite(seconds) and seconds > 0):
            raise OpsError(f"{flag} {seconds:g}: must be a finite number of seconds > 0")
    if args.max_recoveries < 0:
        raise OpsError(f"--max-recoveries {args.max_recoveries}: must be >= 0")
    if args.max_attempts < 1:
        raise OpsError(f"--max-attempts {args.max_attempts}: must be >= 1")
    stdin = stdin or sys.stdin
    if args.watch and not args.yes and not stdin.isatty():
        raise OpsError(
            "refusing to --watch without --yes when stdin is not a terminal "
            "(nobody could confirm a recovery): pass --yes"
        )
    if args.until_new_source and not args.watch:
        raise OpsError("--until-new-source: only with --watch")
    uri = request_uri(args)
    target = record_mod.load(uri)
    if target.role != args.vm:
        raise OpsError(f"{uri}: records the {target.role} VM, not --vm {args.vm}")
    api = tpu_api.GoogleTpuApi(tpu_api.client(tpu_client_factory))
    limits = RecoveryLimits(args.max_recoveries, args.max_attempts, args.boot_deadline)
    journal = Journal(args.journal)
    confirm = confirmer(args.yes, stdin, out)
    if args.watch:
        return watch(
            api,
            lambda: record_mod.load(uri),
            out,
            journal=journal,
            limits=limits,
            interval_s=args.interval,
            confirm=confirm,
            sleep=sleep,
            outdated=source_changed(*args.until_new_source) if args.until_new_source else None,
        )
    # A person asked for this pass: an earlier "gave up" is theirs to override.
    state = journal.load(request_digest(target.request))
    if state["gave_up"]:
        journal.save({**state, "gave_up": None})
    try:
        result = recover_pass(api, target, out, journal=journal, limits=limits, confirm=confirm)
    except placement.PlacementError as exc:
        raise OpsError(str(exc)) from None
    except OpsError:
        raise
    except Exception as exc:  # the API refused (a permission) or failed: one line, not a trace
        raise tpu_api.call_failed(f"recovering the {_label(target)}", exc) from None
    return 1 if result.outcome == GAVE_UP else 0
