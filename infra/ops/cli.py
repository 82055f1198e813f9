"""Operator commands: `python -m infra.ops status|cost|logs|stop|restart|ssh|tunnel|recover`.

Everything comes from the stack's outputs (infra.ops.stack_client, or `--outputs FILE` written by
`pulumi stack output --json`), read into infra.ops.stack_outputs.VmInfo records.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import fabric

from infra import remote
from infra.errors import InfraError
from infra.ops import cost, leftovers, recover, stack_client
from infra.ops.stack_outputs import (
    CloudRefused,
    OpsError,
    Released,
    VmInfo,
    load_outputs,
    release_message,
    vm_info,
)
from infra.remote import ssh
from infra.tpu import api as tpu_api
from infra.vm import roles
from workloads.common import cli_options, errors, stage_records


def _connections(info: VmInfo) -> list[fabric.Connection]:
    return [ssh.connect(host, info.settings) for host in info.hosts]


def _sudo(argv: list[str], info: VmInfo) -> list[str]:
    return ["sudo", "-n", *argv] if info.use_sudo else argv


def _each(info: VmInfo, fn: Callable[[int, fabric.Connection], Any]) -> list[Any]:
    """Runs fn(index, connection) on every worker in parallel; a failure is returned, not raised."""
    conns = _connections(info)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(conns))
    try:
        futures = [pool.submit(fn, i, c) for i, c in enumerate(conns)]
        concurrent.futures.wait(futures)
        return [f.exception() or f.result() for f in futures]
    finally:
        # On Ctrl-C (logs -f) closing the connections ends the remote commands and the threads.
        for conn in conns:
            conn.close()
        pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# status


def tpu_state(info: VmInfo, client_factory: Callable[[], Any] | None = None) -> str:
    """The TPU node's state (READY, PREEMPTED, ...) from the Cloud TPU API, or why it is unknown."""
    return tpu_state_and_creation(info, client_factory)[0]


def _timestamp(value: Any) -> float | None:
    """A node's create_time (a datetime from proto-plus, or a protobuf Timestamp) as Unix time."""
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    seconds = getattr(value, "seconds", None)
    if isinstance(seconds, int) and seconds > 0:
        return seconds + getattr(value, "nanos", 0) / 1e9
    return None


def tpu_state_and_creation(
    info: VmInfo, client_factory: Callable[[], Any] | None = None
) -> tuple[str, float | None]:
    """tpu_state, and when the node was created (Unix time; None when unknown)."""
    if not (info.project and info.zone):
        return "unknown (no project/zone in the stack outputs)", None
    name = tpu_api.node_path(info.project, info.zone, info.vm)
    try:
        client = tpu_api.new_client(client_factory)
        node = client.get_node(name=name)
    except Exception as exc:
        return f"unknown ({errors.exception_line(exc)})", None
    created = _timestamp(getattr(node, "create_time", None))
    parts = [tpu_api.state_name(node)]
    health = getattr(getattr(node, "health", None), "name", None)
    if health and health != "HEALTH_UNSPECIFIED":
        parts.append(f"health {health}")
    queued = tpu_api.queued_state(client, node)
    if queued:
        parts.append(queued)
    return ", ".join(parts), created


def unit_states(conn: fabric.Connection, info: VmInfo) -> list[dict[str, str]]:
    """`systemctl show` of every unit on one worker."""
    states = []
    for unit in info.units:
        argv = _sudo(
            [
                "systemctl",
                "show",
                "--no-pager",
                "-p",
                "ActiveState",
                "-p",
                "SubState",
                "-p",
                "NRestarts",
                "-p",
                "Result",
                unit,
            ],
            info,
        )
        result = remote.run(conn, "status", argv)
        fields = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
        states.append({"unit": unit, **fields})
    return states


def stage_lines(conn: fabric.Connection, info: VmInfo, created: float | None) -> list[str]:
    """The worker's stages of its latest boot (workloads.common.stage_records, the file the startup
    script, the uploads and the trainer append to), one line each. create-to-boot (the node's
    creation to its kernel's start) is shown for the node's first boot only: the file lives on the
    node's disk, so a single boot id in it means this boot is the first since creation."""
    path = remote.RemoteLayout(info.remote_root).stages_file
    script = 'if [ -e "$0" ]; then cat "$0"; fi'
    text = remote.run(conn, "stages", _sudo(["sh", "-c", script, path], info)).stdout
    records = stage_records.parse(text)
    rows = stage_records.summarise(records)
    if not rows:
        return [f"no stages recorded yet ({path})"]
    lines = []
    boot = next((row for row in rows if row["stage"] == "boot"), None)
    first_boot = len({r.get("boot") for r in records}) == 1
    if created is not None and boot is not None and first_boot and boot["start"] >= created:
        lines.append(f"create-to-boot  {boot['start'] - created:.1f} s (Cloud TPU API createTime)")
    return lines + stage_records.format_rows(rows)


def _worker_status(
    conn: fabric.Connection, info: VmInfo, created: float | None
) -> tuple[list[dict[str, str]], list[str]]:
    """unit_states and stage_lines of one worker, over its one connection in turn; stages that
    cannot be read are one line, not a worker shown as unreachable."""
    units = unit_states(conn, info)
    try:
        lines = stage_lines(conn, info, created)
    except Exception as exc:
        lines = [f"cannot read them: {errors.exception_line(exc)}"]
    return units, lines


def last_metrics(info: VmInfo, conn: fabric.Connection | None) -> str:
    """'step N: loss X' from the run's metrics.jsonl (GCS, or the worker's disk), or why not."""
    if not info.run_dir:
        return "no run directory in the stack outputs"
    path = info.run_dir.rstrip("/") + "/metrics.jsonl"
    try:
        if "://" in path:
            from workloads.common import errors, storage

            try:
                text = storage.read_text(path)
            except errors.UserError:
                return f"no metrics yet ({path})"
        else:
            if conn is None:
                return f"cannot read {path}: no worker reachable"
            script = 'if [ -e "$0" ]; then tail -n 50 "$0"; fi'
            text = remote.run(conn, "metrics", _sudo(["sh", "-c", script, path], info)).stdout
    except Exception as exc:
        return f"cannot read {path}: {type(exc).__name__}: {exc}"
    for line in reversed(text.strip().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            loss = record.get("loss")
            loss_text = f"{loss:.4f}" if isinstance(loss, int | float) else str(loss)
            return f"step {record['step']}: loss {loss_text} ({path})"
    return f"no metrics yet ({path})"


def status_record(
    info: VmInfo, *, tpu_client_factory: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """What `status` reports about one VM, as data (what `status --json` prints): the TPU
    state, each worker's units and its latest boot's stages (boot to first step:
    workloads.common.stage_records), or why it is unreachable, and the training's last step."""
    state, created = tpu_state_and_creation(info, tpu_client_factory)
    record: dict[str, Any] = {
        "role": info.role,
        "vm": info.vm,
        "zone": info.zone,
        "tpu": state,
        "workers": [],
    }
    conns = _connections(info)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(conns)) as pool:
            futures = [pool.submit(_worker_status, c, info, created) for c in conns]
        for index, fut in enumerate(futures):
            exc = fut.exception()
            worker: dict[str, Any] = {"worker": info.label(index), "reachable": exc is None}
            if exc is not None:
                worker["error"] = str(exc)
            else:
                units, stage_text = fut.result()
                worker["units"] = [
                    {
                        "unit": st["unit"],
                        "activeState": st.get("ActiveState"),
                        "subState": st.get("SubState"),
                        "restarts": int(st["NRestarts"])
                        if st.get("NRestarts", "").isdigit()
                        else None,
                        "result": st.get("Result"),
                    }
                    for st in units
                ]
                worker["stages"] = stage_text
            record["workers"].append(worker)
        row = roles.find(info.role)
        if row is not None and row.has_training_metrics:
            reachable = next(
                (c for c, f in zip(conns, futures, strict=True) if f.exception() is None), None
            )
            record["lastMetrics"] = last_metrics(info, reachable)
    finally:
        for conn in conns:
            conn.close()
    record["failed"] = any(
        unit["activeState"] == "failed"
        for worker in record["workers"]
        for unit in worker.get("units", ())
    )
    return record


def print_status(record: dict[str, Any], out: TextIO) -> int:
    """Prints a status_record as text; 1 if a unit failed."""
    where = f" in {record['zone']}" if record["zone"] else ""
    print(f"{record['role']} VM {record['vm']}{where}: TPU {record['tpu']}", file=out)
    for worker in record["workers"]:
        if not worker["reachable"]:
            print(f"  {worker['worker']} unreachable: {worker['error']}", file=out)
            continue
        for st in worker["units"]:
            restarts = "?" if st["restarts"] is None else st["restarts"]
            print(
                f"  {worker['worker']} {st['unit']}: {st['activeState'] or '?'} "
                f"({st['subState'] or '?'}), restarts {restarts}, "
                f"result {st['result'] or '?'}",
                file=out,
            )
        print(f"  {worker['worker']} stages of the latest boot:", file=out)
        for line in worker["stages"]:
            print(f"    {line}", file=out)
    if "lastMetrics" in record:
        print(f"  last {record['lastMetrics']}", file=out)
    return 1 if record["failed"] else 0


def status(
    info: VmInfo, out: TextIO, *, tpu_client_factory: Callable[[], Any] | None = None
) -> int:
    """Prints TPU state, unit states and boot stages per worker and the last training step; 1
    if a unit failed."""
    return print_status(status_record(info, tpu_client_factory=tpu_client_factory), out)


# ---------------------------------------------------------------------------------------------
# logs, stop, restart


class _Prefixed:
    """A text stream that writes whole lines with a prefix, safely from several threads."""

    def __init__(self, prefix: str, out: TextIO, lock: threading.Lock) -> None:
        self.prefix, self.out, self.lock, self.buffer = prefix, out, lock, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        if lines:
            with self.lock:
                for line in lines:
                    self.out.write(f"{self.prefix} {line.rstrip(chr(13))}\n")  # pty: CR LF
                self.out.flush()
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.write("\n")


def logs(info: VmInfo, out: TextIO, *, follow: bool = False, lines: int = 100) -> int:
    """Streams the journal of the VM's units from every worker, each line prefixed by its host."""
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-n", str(lines)]
    for unit in info.units:
        argv += ["-u", unit]
    if follow:
        argv.append("-f")
    command = shlex.join(_sudo(argv, info))
    lock = threading.Lock()

    def one(index: int, conn: fabric.Connection) -> int:
        stream = _Prefixed(info.label(index), out, lock)
        result = conn.run(
            command,
            warn=True,
            hide=False,
            # With -f, a pty makes sshd hang up journalctl when we disconnect (Ctrl-C).
            pty=follow,
            in_stream=False,
            out_stream=stream,
            err_stream=stream,
        )
        stream.flush()
        return int(result.exited)

    results = _each(info, one)
    bad = [(i, r) for i, r in enumerate(results) if not isinstance(r, int) or r != 0]
    for index, problem in bad:
        print(f"{info.label(index)} journalctl failed: {problem}", file=sys.stderr)
    return 1 if bad else 0


def systemctl(info: VmInfo, action: str, out: TextIO) -> int:
    """`systemctl stop` (all units) or `restart` (the started units) on every worker."""
    units = info.units if action == "stop" else info.start
    argv = _sudo(
        ["systemctl", action, *(["--no-block"] if action == "restart" else []), *units], info
    )

    def one(index: int, conn: fabric.Connection) -> None:
        remote.run(conn, action, argv)

    results = _each(info, one)
    code = 0
    for index, problem in enumerate(results):
        if problem is None:
            print(f"{info.label(index)} {action}: {' '.join(units)}", file=out)
        else:
            code = 1
            print(f"{info.label(index)} {action} failed: {problem}", file=out)
    return code


# ---------------------------------------------------------------------------------------------
# ssh, tunnel


def ssh_argv(info: VmInfo, worker: int = 0, command: Sequence[str] = ()) -> list[str]:
    """The `ssh` command line to one worker (same identity and known_hosts as the deployment)."""
    _check_worker(info, worker)
    return [*ssh.ssh_command(info.hosts[worker], info.settings), *command]


def tunnel_argv(info: VmInfo, local_port: int | None = None, worker: int = 0) -> list[str]:
    """The `ssh -N -L` command line that forwards the serving port to localhost.

    Raises:
        OpsError: the VM has no serving port.
    """
    _check_worker(info, worker)
    if info.serve_port is None:
        raise OpsError(
            f"the {info.role} VM {info.vm} serves nothing (no serving port in the outputs)"
        )
    local = local_port or info.serve_port
    return ssh.ssh_command(
        info.hosts[worker],
        info.settings,
        "-N",
        "-o",
        "ExitOnForwardFailure=yes",
        "-L",
        f"127.0.0.1:{local}:127.0.0.1:{info.serve_port}",
    )


def _check_worker(info: VmInfo, worker: int) -> None:
    if not 0 <= worker < len(info.hosts):
        raise OpsError(
            f"the {info.role} VM {info.vm} has workers 0..{len(info.hosts) - 1}, not {worker}"
        )


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    parser = cli_options.parser("python -m infra.ops", __doc__.splitlines()[0])
    cli_options.add_stack(parser)
    parser.add_argument(
        "--outputs", metavar="FILE", help="read outputs from this JSON file instead of pulumi"
    )
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback on errors"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, help_text: str, description: str | None = None
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=description or help_text,
            formatter_class=parser.formatter_class,
        )
        cli_options.add_stack(p, on_subcommand=True)  # `ops status -s dev` as `ops -s dev status`
        return p

    def add(
        name: str, help_text: str, default_vm: roles.VmRole = roles.TRAIN
    ) -> argparse.ArgumentParser:
        p = command(name, help_text)
        p.add_argument("--vm", choices=roles.names(), default=default_vm.name, help="which VM")
        return p

    json_help = "print one JSON object instead of the text (for scripts; the keys are stable)"
    add("status", "TPU state, units and boot stages per worker, last step and loss")
    sub.choices["status"].add_argument("--json", action="store_true", help=json_help)
    command(
        "cost",
        "what the stack runs now, its hourly price and about what it has cost",
        cost.__doc__.splitlines()[0] if cost.__doc__ else None,
    ).add_argument("--json", action="store_true", help=json_help)
    p = add("logs", "the units' journal from every worker, prefixed by host")
    p.add_argument("-f", "--follow", action="store_true", help="keep streaming")
    p.add_argument("-n", "--lines", type=int, default=100, help="lines of history per worker")
    add("stop", "stop the job's units on every worker")
    add("restart", "restart the job on every worker (training resumes from its checkpoint)")
    p = add("ssh", "open a shell on a worker (or run a command there)")
    p.add_argument("--worker", type=int, default=0, help="worker index")
    p.add_argument(
        "remote_command", nargs=argparse.REMAINDER, help="command to run instead of a shell"
    )
    p = add("tunnel", "forward the serving port to localhost", roles.SERVE)
    p.add_argument("--port", type=int, help="local port (default: the serving port)")
    recover.add_arguments(add("recover", recover.HELP))
    return parser


def main(
    argv: list[str] | None = None,
    *,
    out: TextIO | None = None,
    tpu_client_factory: Callable[[], Any] | None = None,
    exec_fn: Callable[[list[str]], int] | None = None,
) -> int:
    """Runs one operator command; a problem is one line on stderr. Exit statuses:
    workloads.common.cli_options (2: the input, 4: Google Cloud refused a request)."""
    args = build_parser().parse_args(argv)
    out = out or sys.stdout
    try:
        if args.command == "recover":
            return recover.run(args, out, tpu_client_factory=tpu_client_factory)
        if args.command == "cost":
            return _cost(
                load_outputs(args.stack, args.outputs), out, tpu_client_factory, as_json=args.json
            )
        outputs = load_outputs(args.stack, args.outputs)
        if args.command == "status":
            fallback = _stack_file_scope(outputs, args.stack, args.outputs)
            return _status(
                outputs, args.vm, out, tpu_client_factory, as_json=args.json, fallback=fallback
            )
        info = vm_info(outputs, args.vm)
        if args.command == "logs":
            return logs(info, out, follow=args.follow, lines=args.lines)
        if args.command in ("stop", "restart"):
            return systemctl(info, args.command, out)
        if args.command == "ssh":
            return (exec_fn or _exec)(ssh_argv(info, args.worker, args.remote_command))
        if args.command == "tunnel":
            command = tunnel_argv(info, args.port)
            print(
                f"forwarding http://127.0.0.1:{args.port or info.serve_port} to {info.vm} port "
                f"{info.serve_port}; Ctrl-C to stop",
                file=sys.stderr,
            )
            return (exec_fn or _exec)(command)
    except InfraError as exc:  # every error infra raises on purpose (infra/errors.py)
        if args.traceback or os.environ.get("WORKLOADS_TRACEBACK") == "1":
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        if isinstance(exc, CloudRefused):
            return cli_options.EXIT_CLOUD_REFUSED
        return cli_options.EXIT_USAGE
    except KeyboardInterrupt:
        return cli_options.EXIT_INTERRUPTED
    raise AssertionError(f"unhandled command {args.command}")  # argparse restricts the choices


def _status(
    outputs: dict[str, Any],
    role: str,
    out: TextIO,
    tpu_client_factory: Callable[[], Any] | None,
    *,
    as_json: bool,
    fallback: leftovers.Scope | None = None,
) -> int:
    """`ops status`: the VM's record, who recovers it, what bills outside the state; 1 if a unit
    failed. With `as_json`, one object: {"vm": status_record or null, "released": why the
    training VM is gone or null, "recoveredBy": the controller line or null, "leftovers": [...],
    "notDeployed": why there is no VM to report (a destroyed stack) or null}. `fallback`: where
    to look for leftovers when the outputs do not say (the stack file's scope); with it, a stack
    with no deployments (destroyed) reports its leftovers instead of failing.

    Raises:
        OpsError: no such VM (and, without a scope to scan, no deployments at all).
    """
    watcher = _controller_line(outputs)
    recovered = roles.role(role).recovered_by_controller  # the controller watches this VM
    not_deployed = None
    try:
        info: VmInfo | None = vm_info(outputs, role)
        released = None
    except Released as exc:
        info, released = None, str(exc)  # the run's normal end, not an error
    except OpsError as exc:
        scope = leftovers.Scope.from_outputs(outputs) or fallback
        if outputs.get("deployments") or scope is None:
            raise
        info, released, not_deployed = None, None, str(exc)  # destroyed: what is left bills
    record = status_record(info, tpu_client_factory=tpu_client_factory) if info else None
    leftover_lines = leftovers.report_lines(
        outputs, _deployed(outputs), tpu_client_factory, fallback=fallback
    )[0]
    code = 1 if record and record["failed"] else 0
    if as_json:
        recovered_by = watcher.strip() if watcher and recovered else None
        json.dump(
            {
                "vm": record,
                "released": released,
                "recoveredBy": recovered_by,
                "leftovers": leftover_lines,
                "notDeployed": not_deployed,
            },
            out,
            indent=2,
        )
        out.write("\n")
        return code
    if record is None:
        print(f"{role} VM: {released or not_deployed}", file=out)
    else:
        print_status(record, out)
        if watcher and recovered:
            print(watcher, file=out)
    for line in leftover_lines:
        print(line, file=out)
    return code


def _stack_file_scope(
    outputs: dict[str, Any], stack: str | None, outputs_file: str | None
) -> leftovers.Scope | None:
    """Where the stack's TPUs can be according to its stack file, when its outputs (read from
    the stack) do not say (no `tpuScope`: a destroyed stack, or one made before that output);
    None when they do, when an --outputs file stands in for the stack (it wins over --stack),
    or when no stack is selected."""
    if outputs_file or leftovers.Scope.from_outputs(outputs) is not None:
        return None
    name = stack or stack_client.current_stack_name()
    return leftovers.scope_from_stack_file(name) if name else None


def _controller(outputs: dict[str, Any]) -> dict[str, Any] | None:
    """The stack's `recoveryController` output, when it declares the recovery controller."""
    controller = outputs.get("recoveryController")
    return controller if isinstance(controller, dict) else None


def _controller_line(outputs: dict[str, Any]) -> str | None:
    """Who recovers the training VM when it is preempted, when the stack has a controller."""
    controller = _controller(outputs)
    if controller is None:
        return None
    where = f" in {controller['zone']}" if controller.get("zone") else ""
    logs = f"; its log: {controller['logsCommand']}" if controller.get("logsCommand") else ""
    return (
        f"  recovered by the controller VM {controller.get('vm', '?')}{where} "
        f"(recover --watch){logs}"
    )


def _controller_cost(outputs: dict[str, Any]) -> list[cost.AlwaysOn]:
    """The recovery controller, when the stack declares one (its exported monthly estimate)."""
    controller = _controller(outputs)
    if controller is None:
        return []
    monthly = controller.get("estimatedMonthlyUsd")
    total = monthly.get("total") if isinstance(monthly, dict) else None
    if not isinstance(total, int | float):
        return []
    return [cost.AlwaysOn(f"recovery controller VM {controller.get('vm', '?')}", float(total))]


def _cost(
    outputs: dict[str, Any],
    out: TextIO,
    tpu_client_factory: Callable[[], Any] | None,
    *,
    as_json: bool = False,
) -> int:
    deployments = outputs.get("deployments")
    deployed = [r for r in roles.names() if isinstance(deployments, dict) and r in deployments]
    released = release_message(outputs)
    if released is None and not deployed:
        raise OpsError("the stack has no 'deployments' output: run `pulumi up` first")
    always_on = _controller_cost(outputs)
    infos = _deployed(outputs)
    lines, extra = leftovers.report_lines(outputs, infos, tpu_client_factory)
    client = tpu_api.client(tpu_client_factory) if deployed else None
    try:
        return cost.run(
            infos,
            out,
            client=client,
            always_on=always_on,
            leftover_lines=lines,
            leftover_costs=extra,
            released=released,
            as_json=as_json,
        )
    except Exception as exc:
        raise tpu_api.call_failed("cannot read the TPU nodes", exc) from exc


def _deployed(outputs: dict[str, Any]) -> list[VmInfo]:
    """The VMs the stack's state holds (its deployments; none when the training VM was
    released and serving is off)."""
    deployments = outputs.get("deployments")
    if not isinstance(deployments, dict):
        return []
    # A VM that gave its node back is gone, whatever deployment the state still records.
    return [
        vm_info({"deployments": deployments}, role, require_hosts=False)
        for role in roles.names()
        if role in deployments and release_message(outputs, role) is None
    ]


def _exec(argv: list[str]) -> int:
    os.execvp(argv[0], argv)  # noqa: S606 - replaces this process with ssh, argv built by us
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
