"""`python -m infra.ops` against real sshd workers and a fake Cloud TPU client."""

from __future__ import annotations

import argparse
import datetime
import http.server
import io
import json
import pathlib
import socket
import subprocess
import threading
import time
import types
import urllib.request
from typing import Any, ClassVar

import pytest

from infra.ops import cli as ops
from infra.resources import ssh_access
from infra.resources.deployment_record import VmInfo
from tests.fixtures.sshd import Worker
from workloads.common import stage_records


def _info(workers: list[Worker], **extra: Any) -> dict[str, Any]:
    access = workers[0].access
    return {
        "vm": "gemma4-train",
        "role": "train",
        "project": "my-project",
        "zone": "us-central1-a",
        "hosts": [w.host for w in workers],
        **access.props(),
        "use_sudo": False,
        "remote_root": str(workers[0].root),
        "units": ["gemma4-merge.service", "gemma4-train.service"],
        "start": ["gemma4-train.service"],
        "run_dir": str(workers[0].root / "run"),
        "serve_port": None,
        **extra,
    }


def _outputs(tmp_path: pathlib.Path, **deployments: dict[str, Any]) -> str:
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"bucket": "gs://b", "deployments": deployments}))
    return str(path)


# When the fake node was created (its create_time, a datetime as proto-plus gives it).
CREATED = datetime.datetime(2026, 11, 25, 14, 0, 0, tzinfo=datetime.UTC)


class FakeTpu:
    """The Cloud TPU API boundary: get_node(name=...) -> a node with a state enum."""

    calls: ClassVar[list[str]] = []

    def get_node(self, *, name: str) -> Any:
        FakeTpu.calls.append(name)
        return types.SimpleNamespace(
            state=types.SimpleNamespace(name="READY"),
            health=types.SimpleNamespace(name="HEALTHY"),
            create_time=CREATED,
        )


def _main(
    argv: list[str], capsys: pytest.CaptureFixture[str], **kwargs: Any
) -> tuple[int, str, str]:
    out = io.StringIO()
    code = ops.main(argv, out=out, **kwargs)
    return code, out.getvalue(), capsys.readouterr().err


@pytest.mark.sshd
def test_status_shows_tpu_state_units_and_last_step(
    worker: Worker, tmp_path: pathlib.Path, capsys
) -> None:
    state = worker.root / "unit-state"
    state.mkdir()
    (state / "gemma4-train.service").write_text(
        "ActiveState=active\nSubState=running\nNRestarts=2\nResult=success\n"
    )
    run = worker.root / "run"
    run.mkdir(exist_ok=True)  # the worker has /run (the ready marker lives there)
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 41, "loss": 1.25})
        + "\n"
        + json.dumps({"step": 42, "loss": 0.987654})
        + "\n"
    )
    outputs = _outputs(tmp_path, train=_info([worker]))
    code, out, _ = _main(["--outputs", outputs, "status"], capsys, tpu_client_factory=FakeTpu)
    assert code == 0
    assert FakeTpu.calls[-1] == "projects/my-project/locations/us-central1-a/nodes/gemma4-train"
    assert "train VM gemma4-train in us-central1-a: TPU READY, health HEALTHY" in out
    assert (
        f"[gemma4-train w0 {worker.host}] gemma4-train.service: active (running), restarts 2" in out
    )
    assert f"[gemma4-train w0 {worker.host}] gemma4-merge.service: inactive (dead)" in out
    assert f"last step 42: loss 0.9877 ({run}/metrics.jsonl)" in out
    assert "recovered by" not in out
    stages_file = worker.root / "var" / "lib" / "gemma4" / "stages.jsonl"
    assert f"    no stages recorded yet ({stages_file})" in out

    # The stages the startup script and the trainer recorded: the node's first boot shows its
    # create-to-boot time from the Cloud TPU API.
    created = CREATED.timestamp()
    log = stage_records.StageLog(str(stages_file), "startup", boot="boot-1")
    log.start("boot", at=created + 95.0)
    log.end("boot", seconds=20.0)
    log.start("venv", at=created + 115.0)
    log.end("venv", seconds=8.5, note="restored from gs://b/venv/train-0123.tar.gz")
    stage_records.StageLog(str(stages_file), "trainer", boot="boot-1").start("compile")
    code, out, _ = _main(["--outputs", outputs, "status"], capsys, tpu_client_factory=FakeTpu)
    label = f"[gemma4-train w0 {worker.host}]"
    lines = out[out.index(f"  {label} stages of the latest boot:") :].splitlines()
    assert lines[1] == "    create-to-boot  95.0 s (Cloud TPU API createTime)"
    assert lines[2] == "    boot            started 14:01:35 UTC  20.0 s"
    assert lines[3] == (
        "    venv            started 14:01:55 UTC  8.5 s  (restored from "
        "gs://b/venv/train-0123.tar.gz)"
    )
    assert lines[4].startswith("    compile         started ") and "running for" in lines[4]

    # A later boot of the same node: its stages only, and no create-to-boot (not its first).
    later = stage_records.StageLog(str(stages_file), "startup", boot="boot-2")
    later.start("boot", at=created + 7200.0)
    later.end("boot", seconds=30.0)
    code, out, _ = _main(["--outputs", outputs, "status"], capsys, tpu_client_factory=FakeTpu)
    lines = out[out.index(f"  {label} stages of the latest boot:") :].splitlines()
    assert lines[1] == "    boot            started 16:00:00 UTC  30.0 s"
    assert lines[2].startswith("  last step 42")

    # With a recovery controller, status says who recovers the VM and where its log is.
    document = json.loads(pathlib.Path(outputs).read_text())
    document["recoveryController"] = {
        "vm": "gemma4-recover",
        "zone": "us-central1-a",
        "logsCommand": "gcloud compute ssh gemma4-recover -- journalctl -u gemma4-recover -f",
    }
    pathlib.Path(outputs).write_text(json.dumps(document))
    code, out, _ = _main(["--outputs", outputs, "status"], capsys, tpu_client_factory=FakeTpu)
    assert code == 0
    assert out.splitlines()[-1] == (
        "  recovered by the controller VM gemma4-recover in us-central1-a (recover --watch); its "
        "log: gcloud compute ssh gemma4-recover -- journalctl -u gemma4-recover -f"
    )


def test_the_tpu_state_of_a_queued_node_names_its_queued_resource() -> None:
    class QueuedTpu:
        def get_node(self, *, name: str) -> Any:
            return types.SimpleNamespace(
                state=types.SimpleNamespace(name="READY"),
                queued_resource="projects/p/locations/us-east5-a/queuedResources/gemma4-train",
            )

        def get_queued_resource(self, *, name: str) -> Any:
            assert name.endswith("/queuedResources/gemma4-train")
            return types.SimpleNamespace(
                state=types.SimpleNamespace(state=types.SimpleNamespace(name="ACTIVE"))
            )

    info = VmInfo(
        role="train",
        vm="gemma4-train",
        hosts=[],
        access=ssh_access.SshAccess(stack="dev", user="gemma4"),
        use_sudo=True,
        remote_root="/",
        units=[],
        start=[],
        project="p",
        zone="us-east5-a",
    )
    assert ops.tpu_state(info, QueuedTpu) == "READY, queued resource gemma4-train ACTIVE"


@pytest.mark.sshd
def test_status_reports_an_unknown_tpu_state_and_a_failed_unit(
    worker: Worker, tmp_path: pathlib.Path, capsys
) -> None:
    state = worker.root / "unit-state"
    state.mkdir()
    (state / "gemma4-train.service").write_text(
        "ActiveState=failed\nSubState=failed\nNRestarts=10\nResult=exit-code\n"
    )

    def no_credentials() -> Any:
        raise RuntimeError("Your default credentials were not found.")

    outputs = _outputs(tmp_path, train=_info([worker]))
    code, out, _ = _main(
        ["--outputs", outputs, "status"], capsys, tpu_client_factory=no_credentials
    )
    assert code == 1
    assert "TPU unknown (RuntimeError: Your default credentials were not found.)" in out
    assert "gemma4-train.service: failed (failed), restarts 10, result exit-code" in out
    assert "last no metrics yet" in out


@pytest.mark.sshd
def test_logs_streams_every_worker_with_a_host_prefix(
    sshd_factory, tmp_path: pathlib.Path, capsys
) -> None:
    workers: list[Worker] = [sshd_factory("w0"), sshd_factory("w1")]
    for index, w in enumerate(workers):
        (w.root / "journal.txt").write_text(f"step 1 on worker {index}\nstep 2 on worker {index}\n")
    # One slice of two workers; on this machine they differ by port (`address:port`).
    outputs = _outputs(
        tmp_path, train=_info(workers, hosts=[f"{w.host}:{w.port}" for w in workers])
    )
    code, out, _ = _main(["--outputs", outputs, "logs", "-f", "-n", "5"], capsys)
    assert code == 0
    for index, w in enumerate(workers):
        prefix = f"[gemma4-train w{index} {w.host}:{w.port}]"
        assert [line for line in out.splitlines() if line.startswith(prefix)] == [
            f"{prefix} step {i} on worker {index}" for i in (1, 2)
        ]
        assert w.journalctl_calls() == [
            [
                "--no-pager",
                "-o",
                "short-iso",
                "-n",
                "5",
                "-u",
                "gemma4-merge.service",
                "-u",
                "gemma4-train.service",
                "-f",
            ]
        ]
    assert len(out.splitlines()) == 4


@pytest.mark.sshd
def test_stop_and_restart_reach_systemctl_on_the_worker(
    worker: Worker, tmp_path: pathlib.Path, capsys
) -> None:
    outputs = _outputs(tmp_path, train=_info([worker]))
    assert _main(["--outputs", outputs, "stop"], capsys)[0] == 0
    assert _main(["--outputs", outputs, "restart"], capsys)[0] == 0
    assert worker.systemctl_calls() == [
        ["stop", "gemma4-merge.service", "gemma4-train.service"],
        ["restart", "--no-block", "gemma4-train.service"],
    ]


@pytest.mark.sshd
def test_ssh_runs_a_command_on_the_worker(worker: Worker, tmp_path: pathlib.Path, capsys) -> None:
    outputs = _outputs(tmp_path, train=_info([worker]))
    ran: list[str] = []

    def run(argv: list[str]) -> int:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        ran.append(proc.stdout)
        return proc.returncode

    code, _, err = _main(
        ["--outputs", outputs, "ssh", "echo", "hello from the worker"], capsys, exec_fn=run
    )
    assert code == 0, err
    assert ran == ["hello from the worker\n"]


@pytest.mark.sshd
def test_tunnel_forwards_the_serving_port(worker: Worker, tmp_path: pathlib.Path, capsys) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"data": [{"id": "gemma-4-31b-verilog"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    serve_port = server.server_address[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        local_port = sock.getsockname()[1]
    outputs = _outputs(
        tmp_path, serve=_info([worker], vm="gemma4-serve", role="serve", serve_port=serve_port)
    )
    tunnels: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str]) -> int:
        tunnels.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE))
        return 0

    try:
        code, _, err = _main(
            ["--outputs", outputs, "tunnel", "--port", str(local_port)], capsys, exec_fn=start
        )
        assert code == 0
        assert f"forwarding http://127.0.0.1:{local_port} to gemma4-serve port {serve_port}" in err
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{local_port}/v1/models", timeout=5
                ) as response:
                    assert json.load(response)["data"][0]["id"] == "gemma-4-31b-verilog"
                break
            except OSError:
                assert tunnels[0].poll() is None, (
                    tunnels[0].stderr.read() if tunnels[0].stderr else ""
                )
                assert time.monotonic() < deadline, "the tunnel did not come up"
                time.sleep(0.1)
    finally:
        for tunnel in tunnels:
            tunnel.terminate()
            try:
                tunnel.wait(timeout=5)
            except subprocess.TimeoutExpired:  # ssh can sit out SIGTERM mid-handshake
                tunnel.kill()
                tunnel.wait(timeout=10)
        server.shutdown()


def test_missing_vm_and_missing_outputs_are_one_line_errors(tmp_path: pathlib.Path, capsys) -> None:
    info = {
        "vm": "gemma4-train",
        "hosts": ["10.0.0.1"],
        "ssh_user": "gemma4",
        "units": ["gemma4-train.service"],
    }
    outputs = _outputs(tmp_path, train=info)
    code, _, err = _main(["--outputs", outputs, "tunnel"], capsys)
    assert code == 2
    assert err == (
        "error: the stack has no serve VM (the serving VM exists only with serving.enabled: true); "
        "it has: train\n"
    )
    code, _, err = _main(["--outputs", outputs, "status", "--vm", "serve"], capsys)
    assert "no serve VM" in err

    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    code, _, err = _main(["--outputs", str(empty), "status"], capsys)
    assert (code, err) == (
        2,
        "error: the stack has no 'deployments' output: run `pulumi up` first (or check --stack)\n",
    )

    outputs = _outputs(tmp_path, train={**info, "serve_port": None})
    code, _, err = _main(["--outputs", outputs, "tunnel", "--vm", "train"], capsys)
    assert "serves nothing" in err


def test_outputs_come_from_the_pulumi_cli(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "pulumi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = version ]; then echo v3.200.0; exit 0; fi\n'
        'echo "$@" >> "$(dirname "$0")/args"\n'
        'echo \'{"deployments": {"train": {}}}\'\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    assert ops.load_outputs("prod") == {"deployments": {"train": {}}}
    assert (fake.parent / "args").read_text().splitlines() == [
        "--non-interactive stack output --json --stack prod",
    ]

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ops.OpsError, match="pulumi CLI is not on PATH"):
        ops.load_outputs(None)


@pytest.mark.parametrize("command", ["status", "logs", "stop", "restart", "ssh", "tunnel"])
def test_every_command_fails_clearly_when_the_stack_has_no_such_vm(
    command: str, tmp_path: pathlib.Path, capsys
) -> None:
    train = {"vm": "gemma4-train", "hosts": ["10.0.0.1"], "ssh_user": "gemma4", "units": []}
    never = lambda argv: pytest.fail(f"{command} ran {argv}")  # noqa: E731 - nothing may run
    code, out, err = _main(
        ["--outputs", _outputs(tmp_path, train=train), command, "--vm", "serve"],
        capsys,
        exec_fn=never,
    )
    assert (code, out) == (2, "")
    assert err == (
        "error: the stack has no serve VM (the serving VM exists only with serving.enabled: true); "
        "it has: train\n"
    )
    # A VM that exists but has no worker addresses yet: also one line, naming the VM.
    outputs = _outputs(tmp_path, train={**train, "hosts": []})
    code, out, err = _main(["--outputs", outputs, command, "--vm", "train"], capsys, exec_fn=never)
    assert (code, out) == (2, "")
    assert err == (
        "error: the train VM gemma4-train has no worker addresses in the stack outputs yet\n"
    )


@pytest.mark.sshd
def test_status_json_is_one_parseable_object_with_stable_keys(
    worker: Worker, tmp_path: pathlib.Path, capsys
) -> None:
    state = worker.root / "unit-state"
    state.mkdir()
    (state / "gemma4-train.service").write_text(
        "ActiveState=failed\nSubState=failed\nNRestarts=3\nResult=exit-code\n"
    )
    outputs = _outputs(tmp_path, train=_info([worker]))
    # -s/--stack after the subcommand, as Pulumi's CLI takes it (the outputs file wins here).
    code, out, _ = _main(
        ["--outputs", outputs, "status", "-s", "dev", "--json"],
        capsys,
        tpu_client_factory=FakeTpu,
    )
    assert code == 1  # a failed unit, as the text form
    record = json.loads(out)
    assert set(record) == {"vm", "released", "recoveredBy", "leftovers", "notDeployed"}
    assert (record["released"], record["recoveredBy"], record["leftovers"]) == (None, None, [])
    vm = record["vm"]
    assert (vm["role"], vm["vm"], vm["zone"], vm["tpu"], vm["failed"]) == (
        "train",
        "gemma4-train",
        "us-central1-a",
        "READY, health HEALTHY",
        True,
    )
    assert vm["lastMetrics"].startswith("no metrics yet")
    [w0] = vm["workers"]
    assert w0["reachable"] is True
    assert w0["units"] == [
        {
            "unit": "gemma4-merge.service",
            "activeState": "inactive",
            "subState": "dead",
            "restarts": 0,
            "result": "success",
        },
        {
            "unit": "gemma4-train.service",
            "activeState": "failed",
            "subState": "failed",
            "restarts": 3,
            "result": "exit-code",
        },
    ]


def test_status_json_of_a_released_training_vm(tmp_path: pathlib.Path, capsys) -> None:
    path = tmp_path / "outputs.json"
    path.write_text(
        json.dumps(
            {
                "deployments": {"train": {"vm": "gemma4-train", "ssh_user": "u"}},
                "trainReleased": {"run_name": "r1", "node": "gemma4-train"},
            }
        )
    )
    code, out, _ = _main(["--outputs", str(path), "status", "--json"], capsys)
    assert code == 0
    record = json.loads(out)
    assert record["vm"] is None
    assert record["released"].startswith("the training VM gemma4-train was released")


def test_the_stack_option_is_taken_before_and_after_the_subcommand() -> None:
    parser = ops.build_parser()
    for argv in (
        ["--stack", "dev", "status"],
        ["-s", "dev", "status"],
        ["status", "--stack", "dev"],
        ["status", "-s", "dev"],
        ["cost", "-s", "dev", "--json"],
        ["recover", "-s", "dev"],
        ["-s", "prod", "logs", "-s", "dev"],  # the later one wins, as with any repeated option
    ):
        assert parser.parse_args(argv).stack == "dev", argv
    assert parser.parse_args(["status"]).stack is None  # the selected stack


@pytest.mark.parametrize(
    ("stack_file", "names"),
    [
        ("config:\n  gemma4-tpu:ssh:\n    user: [1, 2]\n", "Pulumi.dev.yaml: ssh.user"),
        (
            "config:\n  gemma4-tpu:ssh:\n    privateKeyFile: '~nosuchuser9/id'\n",
            "Pulumi.dev.yaml: ssh.privateKeyFile: '~nosuchuser9/id': no user 'nosuchuser9'",
        ),
        (
            'config:\n  gemma4-tpu:ssh:\n    privateKeyFile: "a\\0b"\n',
            "Pulumi.dev.yaml: ssh.privateKeyFile: 'a\\x00b': a file path",
        ),
        ("config:\n  gemma4-tpu:ssh: 5\n", "Pulumi.dev.yaml: ssh: 5: a mapping of ssh.* keys"),
        ("- 1\n", "Pulumi.dev.yaml: list: a stack file is a mapping"),
    ],
    ids=["user-list", "unknown-user-home", "nul-in-key-path", "ssh-not-mapping", "not-mapping"],
)
def test_a_bad_ssh_section_on_this_machine_is_one_line_exit_2(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys, stack_file: str, names: str
) -> None:
    (tmp_path / "Pulumi.dev.yaml").write_text(stack_file)
    monkeypatch.setattr(ssh_access, "PROJECT_DIR", tmp_path)
    info = {"vm": "gemma4-train", "hosts": ["10.0.0.1"], "ssh_user": "u", "stack": "dev"}
    never = lambda argv: pytest.fail(f"ran {argv}")  # noqa: E731 - nothing may run
    code, out, err = _main(
        ["--outputs", _outputs(tmp_path, train=info), "ssh"], capsys, exec_fn=never
    )
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert names in err and "Traceback" not in err


def test_internal_flags_are_hidden_from_help_but_work(capsys) -> None:
    parser = ops.build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    recover_parser = commands.choices["recover"]
    assert "--until-new-source" not in recover_parser.format_help()
    args = parser.parse_args(["recover", "--watch", "-y", "--until-new-source", "gs://b/s", "f"])
    assert args.until_new_source == ["gs://b/s", "f"]
