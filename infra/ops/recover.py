"""Recreating a preempted spot/preemptible TPU VM: `python -m infra.ops recover [--watch]`.

A preempted TPU node stays in state PREEMPTED: it cannot be restarted, only deleted, and a plain
`pulumi up` does not notice (the node's state is an output, not an input). This module reads the
node's state from the Cloud TPU API and, when the node is PREEMPTED, TERMINATED or gone, runs
`pulumi up --replace <URN of its TpuNode>` (infra/resources/tpu_node.py): Pulumi deletes the node
(and its queued resource) and creates it again in the first of its zones with capacity (the
resource is delete-before-replace), the deployment resource sees the new worker addresses and
redeploys, and the training unit resumes from the latest checkpoint on GCS. `--watch` repeats the
check until the run's train_summary.json exists.

Every step is a plain function taking its clients (the TPU API, the stack client of
infra.ops.stack_client, sleep), so tests drive it with fakes at those boundaries.

The parts it shares with the other operator commands live in infra.ops.stack_client and
infra.ops.stack_outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from infra.ops.stack_client import StackClient, StackClientError
from infra.ops.stack_outputs import OpsError, load_outputs, vm_info
from infra.resources import tpu_node
from infra.tpu import api as tpu_api
from workloads.common import errors

HELP = "recreate a preempted spot/preemptible TPU VM (pulumi up --replace); the job resumes"
TPU_NODE_TYPE = tpu_node.TYPE
# Node states after which nothing brings the node back: it has to be deleted and created again.
NEEDS_RECOVERY = frozenset({"PREEMPTED", "TERMINATED", "NOT_FOUND"})
DEFAULT_INTERVAL_S = 120.0
DEFAULT_MAX_RECOVERIES = 10
# A watch survives this many consecutive failed checks (API or GCS hiccups) before giving up.
MAX_FAILED_CHECKS = 5


class UpFailed(OpsError):
    """`pulumi up --replace` exited non-zero (capacity, quota, a locked stack): worth retrying."""


@dataclasses.dataclass(frozen=True)
class Target:
    """The TPU node of one role of the stack, and where its run writes."""

    role: str
    node: str
    zone: str
    project: str
    run_dir: str | None

    @property
    def resource_name(self) -> str:
        return tpu_api.node_path(self.project, self.zone, self.node)

    @property
    def label(self) -> str:
        return f"{self.role} VM {self.node} in {self.zone}"


def target_from_outputs(outputs: dict[str, Any], role: str) -> Target:
    """The node, zone, project and run directory of the stack's `role` VM.

    They come from `deployments.<role>` (what infra.ops reads), with the `<role>Node`,
    `<role>Zone` and `runDir` outputs as fallbacks.

    Raises:
        OpsError: no such VM in the stack, or its project or zone is not in the outputs.
    """
    info = vm_info(outputs, role, require_hosts=False)
    zone = info.zone or outputs.get(f"{role}Zone")
    node = info.vm if info.vm != role else str(outputs.get(f"{role}Node") or role)
    if not info.project or not zone:
        raise OpsError(
            f"the stack outputs name no project/zone for the {role} VM {node}: "
            "run `pulumi up` once with this checkout to refresh the outputs"
        )
    run_dir = outputs.get("runDir") or info.run_dir
    return Target(role, node, str(zone), str(info.project), str(run_dir) if run_dir else None)


def node_state(client: tpu_api.TpuApi, target: Target) -> str:
    """The node's state name (READY, PREEMPTED, ...); NOT_FOUND when the node does not exist.

    Raises:
        OpsError: the API call failed (credentials, permissions, network).
    """
    try:
        node = tpu_api.get_node(client, target.resource_name)
    except Exception as exc:
        raise tpu_api.call_failed(
            f"cannot read the state of TPU node {target.resource_name}", exc
        ) from exc
    return "NOT_FOUND" if node is None else tpu_api.state_name(node)


def find_urn(export: dict[str, Any], target: Target) -> str:
    """The URN of the TpuNode resource that manages `target`'s node, from `pulumi stack export`.

    Raises:
        OpsError: no such resource in the state, or more than one.
    """
    resources = (export.get("deployment") or {}).get("resources") or []
    matches = [
        r
        for r in resources
        if isinstance(r, dict)
        and r.get("type") == TPU_NODE_TYPE
        and not r.get("delete")  # an old copy pending deletion is not the live one
        and (r.get("inputs") or {}).get("node_id") == target.node
    ]
    if len(matches) > 1:
        in_zone = [r for r in matches if (r.get("outputs") or {}).get("zone") == target.zone]
        matches = in_zone or matches
    if not matches:
        raise OpsError(
            f"no {TPU_NODE_TYPE} resource for node {target.node} in the stack's state "
            "(`pulumi stack export`): this stack does not manage that node"
        )
    if len(matches) > 1:
        urns = ", ".join(str(r.get("urn")) for r in matches)
        raise OpsError(f"several {TPU_NODE_TYPE} resources for node {target.node}: {urns}")
    return str(matches[0]["urn"])


def stack_of(urn: str) -> str:
    """The stack name inside a URN (`urn:pulumi:<stack>::<project>::<type>::<name>`)."""
    return urn.split("::", 1)[0].rsplit(":", 1)[-1]


def stack_client(stack: str | None) -> StackClient:
    """The stack client recover replaces the node with (needed only once something is lost).

    Raises:
        OpsError: no pulumi CLI, or it cannot be used.
    """
    try:
        return StackClient(stack, needed_for="recover recreates the VM with `pulumi up --replace`")
    except StackClientError as exc:
        raise OpsError(str(exc)) from None


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


def recover_node(
    target: Target, state: str, pulumi: StackClient, confirm: Confirm, out: TextIO
) -> None:
    """Deletes and recreates the node through Pulumi (the deployment then redeploys the job).

    Raises:
        OpsError: the URN is not in the stack's state, or the user said no.
        UpFailed: `pulumi up` failed.
    """
    try:
        urn = find_urn(pulumi.export(), target)
    except StackClientError as exc:
        raise OpsError(str(exc)) from None
    if not confirm(f"recreate the {state} {target.label} (pulumi up --replace)"):
        raise OpsError(f"not confirmed: the {target.role} VM {target.node} stays {state}")
    print(f"{target.label} is {state}: recreating it with `pulumi up --replace {urn}`", file=out)
    out.flush()
    lock = threading.Lock()

    def show(line: str) -> None:  # Pulumi's progress, stdout and stderr, as it comes
        with lock:
            out.write(line + "\n")
            out.flush()

    try:
        pulumi.replace(urn, show, stack=stack_of(urn))
    except StackClientError as exc:
        raise UpFailed(str(exc)) from None
    resumes = "training resumes from its latest checkpoint" if target.role == "train" else ""
    print(
        f"{target.label} recreated and the job redeployed" + (f"; {resumes}" if resumes else ""),
        file=out,
    )


def recover_once(
    target: Target,
    client: tpu_api.TpuApi,
    confirm: Confirm,
    out: TextIO,
    *,
    stack: str | None = None,
) -> bool:
    """One check: recreates the node if it is PREEMPTED, TERMINATED or gone.

    Returns:
        True when the node was recreated, False when its state needed nothing.
    """
    state = node_state(client, target)
    if state not in NEEDS_RECOVERY:
        print(f"{target.label}: {state}; nothing to do", file=out)
        return False
    recover_node(target, state, stack_client(stack), confirm, out)
    return True


def run_finished(target: Target) -> str | None:
    """The train_summary.json path when the training run has finished, else None."""
    if target.role != "train" or not target.run_dir:
        return None
    from workloads.common import storage  # lazy: gcsfs only when the run dir is on GCS
    from workloads.train import metrics

    path = f"{target.run_dir.rstrip('/')}/{metrics.SUMMARY_FILE}"
    return path if storage.exists(path) else None


def source_changed(uri: str, local: str) -> Callable[[], str | None]:
    """A check that names the change once the archive at `uri` is no longer the `local` copy.

    The whole archive is read (a few hundred kB, from the bucket in the controller's region):
    simpler than trusting a hash the two filesystems may not both offer.
    """
    from workloads.common import storage  # lazy: gcsfs only on the controller

    # The installed copy does not change while the watch runs (the service installs at start).
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
    target: Target,
    client: tpu_api.TpuApi,
    confirm: Confirm,
    out: TextIO,
    *,
    stack: str | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    max_recoveries: int = DEFAULT_MAX_RECOVERIES,
    sleep: Callable[[float], None] = time.sleep,
    finished: Callable[[Target], str | None] = run_finished,
    outdated: Callable[[], str | None] | None = None,
) -> int:
    """Checks every `interval_s` seconds, one line per check, recreating the node when needed.

    A failed `pulumi up` (no capacity, a locked stack) is printed and retried at the next check;
    it counts as a recovery. Returns 0 when the training run's train_summary.json exists (the
    serving VM has no end: stop it with Ctrl-C), or when `outdated` names a reason to start
    again (the controller's source changed): asked between checks only, never during a
    `pulumi up`, so stopping there leaves no half-done update behind.

    Raises:
        OpsError: the node needs recovery once more than `max_recoveries` allow, MAX_FAILED_CHECKS
            checks in a row failed, or a problem that waiting will not fix.
    """
    pulumi = stack_client(stack)  # fail now, not at the first preemption hours later
    recoveries = failures = 0
    end = "until train_summary.json exists" if target.role == "train" else "until Ctrl-C"
    print(
        f"{_stamp()} watching {target.label} every {interval_s:g} s {end} "
        f"(at most {max_recoveries} recoveries)",
        file=out,
        flush=True,
    )
    while True:
        try:
            stale = outdated() if outdated else None
            done = None if stale else finished(target)
            state = None if stale or done else node_state(client, target)
        except Exception as exc:  # a transient API or GCS problem: try again next time
            failures += 1
            text = str(exc) if isinstance(exc, OpsError) else errors.exception_line(exc)
            if failures >= MAX_FAILED_CHECKS:
                raise OpsError(f"{failures} checks in a row failed; last: {text}") from exc
            print(f"{_stamp()} check failed ({failures}/{MAX_FAILED_CHECKS}): {text}", file=out)
        else:
            failures = 0
            if stale:
                print(f"{_stamp()} {stale}; stopping the watch to start again on it", file=out)
                return 0
            if done:
                print(f"{_stamp()} training finished ({done}); stopping the watch", file=out)
                return 0
            if state not in NEEDS_RECOVERY:
                print(f"{_stamp()} {target.label}: {state}", file=out)
            elif recoveries >= max_recoveries:
                raise OpsError(
                    f"{target.label} is {state} again after {recoveries} recoveries "
                    f"(--max-recoveries {max_recoveries}): run `python -m infra.ops recover` "
                    "or raise the limit"
                )
            else:
                recoveries += 1
                print(
                    f"{_stamp()} {target.label}: {state}; recovery {recoveries}/{max_recoveries}",
                    file=out,
                )
                try:
                    recover_node(target, str(state), pulumi, confirm, out)
                except UpFailed as exc:
                    print(f"{_stamp()} recovery {recoveries} failed: {exc}", file=out)
        out.flush()
        sleep(interval_s)


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


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
        help="recreate the VM at most N times with --watch",
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


def run(
    args: argparse.Namespace,
    out: TextIO,
    *,
    tpu_client_factory: Callable[[], tpu_api.TpuApi] | None = None,
    stdin: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """`python -m infra.ops recover` with parsed arguments; 0 on success.

    Raises:
        OpsError: every problem, as one line (infra.ops prints it).
    """
    if args.interval <= 0:
        raise OpsError(f"--interval {args.interval:g}: must be > 0 seconds")
    if args.max_recoveries < 0:
        raise OpsError(f"--max-recoveries {args.max_recoveries}: must be >= 0")
    stdin = stdin or sys.stdin
    target = target_from_outputs(load_outputs(args.stack, args.outputs), args.vm)
    confirm = confirmer(args.yes, stdin, out)
    if args.watch and not args.yes and not stdin.isatty():
        raise OpsError(
            "refusing to --watch without --yes when stdin is not a terminal "
            "(nobody could confirm a recovery): pass --yes"
        )
    if args.until_new_source and not args.watch:
        raise OpsError("--until-new-source: only with --watch")
    client = tpu_api.client(tpu_client_factory)
    if args.watch:
        return watch(
            target,
            client,
            confirm,
            out,
            stack=args.stack,
            interval_s=args.interval,
            max_recoveries=args.max_recoveries,
            sleep=sleep,
            outdated=source_changed(*args.until_new_source) if args.until_new_source else None,
        )
    recover_once(target, client, confirm, out, stack=args.stack)
    return 0
