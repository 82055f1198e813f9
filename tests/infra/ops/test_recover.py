"""`python -m infra.ops recover`: a fake Cloud TPU client and a fake `pulumi` executable on PATH."""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys
import types
from typing import Any

import pytest
from google.api_core import exceptions as gexc

from infra.ops import cli as ops
from infra.ops import recover

PARENT = f"urn:pulumi:dev::gemma4-tpu::gemma4-tpu:infra:TpuVm${recover.TPU_NODE_TYPE}"
URN = f"{PARENT}::train-node"
SERVE_URN = f"{PARENT}::serve-node"
TRAIN_NODE = "projects/my-project/locations/us-central1-a/nodes/gemma4-train"

FAKE_PULUMI = """\
#!{python}
# A stand-in for the pulumi CLI: serves files next to it and records every call.
import json, pathlib, sys
here = pathlib.Path(__file__).parent
args = [a for a in sys.argv[1:] if a != "--non-interactive"]
if args == ["version"]:  # the Automation API's version check
    print("v3.200.0")
    sys.exit(0)
with open(here / "calls.jsonl", "a") as log:
    log.write(json.dumps(args) + "\\n")
if args[:3] == ["stack", "output", "--json"]:
    sys.stdout.write((here / "outputs.json").read_text())
elif args[:2] == ["stack", "export"]:
    sys.stdout.write((here / "export.json").read_text())
elif args == ["stack", "ls", "--json"]:
    print(json.dumps([dict(name="dev", current=True), dict(name="prod", current=False)]))
elif args[:1] == ["up"]:
    print("Updating (dev): replacing the TpuNode")
    rc = here / "up_rc"
    sys.exit(int(rc.read_text()) if rc.exists() else 0)
else:
    sys.exit("fake pulumi: unexpected arguments " + " ".join(args))
"""


class FakeTpu:
    """The Cloud TPU API boundary: get_node(name=...) answers the next state of a script."""

    def __init__(self, *states: str) -> None:
        self.states, self.calls = list(states), []

    def __call__(self) -> FakeTpu:  # used as the client factory
        return self

    def get_node(self, *, name: str) -> Any:
        self.calls.append(name)
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if state == "NOT_FOUND":
            raise gexc.NotFound(f"Resource '{name}' was not found")
        if state == "DENIED":
            raise gexc.PermissionDenied("tpu.nodes.get denied on my-project")
        return types.SimpleNamespace(state=types.SimpleNamespace(name=state))


def _deployment(role: str, node: str, zone: str, run_dir: str) -> dict[str, Any]:
    return {
        "vm": node,
        "role": role,
        "project": "my-project",
        "zone": zone,
        "hosts": ["203.0.113.7"],
        "ssh_user": "gemma4",
        "units": [f"gemma4-{role}.service"],
        "run_dir": run_dir,
    }


def _tpu_node(urn: str, node: str, zone: str, **extra: Any) -> dict[str, Any]:
    """A TpuNode in `pulumi stack export`: the zone it was placed in is an output."""
    return {
        "urn": urn,
        "type": recover.TPU_NODE_TYPE,
        "id": f"projects/my-project/locations/{zone}/nodes/{node}",
        "inputs": {"node_id": node, "zones": ["us-central1-a", "us-east5-a"]},
        "outputs": {"node_id": node, "zone": zone, "state": "READY"},
        **extra,
    }


@pytest.fixture
def cli(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A fake `pulumi` first on PATH serving a train + serve stack; `.calls()` lists its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outputs = {
        "trainNode": "gemma4-train",
        "trainZone": "us-central1-a",
        "runDir": str(run_dir),
        "deployments": {
            "train": _deployment("train", "gemma4-train", "us-central1-a", str(run_dir)),
            "serve": _deployment("serve", "gemma4-serve", "asia-northeast1-b", str(run_dir)),
        },
    }
    export = {
        "version": 3,
        "deployment": {
            "manifest": {"version": "v3.200.0"},
            "resources": [
                {"urn": "urn:pulumi:dev::gemma4-tpu::pulumi:pulumi:Stack::gemma4-tpu-dev",
                 "type": "pulumi:pulumi:Stack"},
                {"urn": "urn:pulumi:dev::gemma4-tpu::gemma4-tpu:infra:TpuVm::train",
                 "type": "gemma4-tpu:infra:TpuVm"},
                # A leftover of an interrupted replacement: must not be picked.
                _tpu_node(URN, "gemma4-train", "us-central1-a", delete=True),
                _tpu_node(URN, "gemma4-train", "us-central1-a"),
                _tpu_node(SERVE_URN, "gemma4-serve", "asia-northeast1-b"),
            ],
        },
    }  # fmt: skip
    (bin_dir / "outputs.json").write_text(json.dumps(outputs))
    (bin_dir / "export.json").write_text(json.dumps(export))
    fake = bin_dir / "pulumi"
    fake.write_text(FAKE_PULUMI.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    def calls() -> list[list[str]]:
        log = bin_dir / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return types.SimpleNamespace(
        bin=bin_dir, pulumi=str(fake), run_dir=run_dir, outputs=outputs, export=export, calls=calls
    )


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(
    argv: list[str], tpu: FakeTpu, stdin: io.StringIO | None = None, **kwargs: Any
) -> tuple[int, str]:
    out = io.StringIO()
    args = ops.build_parser().parse_args(argv)
    code = recover.run(args, out, tpu_client_factory=tpu, stdin=stdin or io.StringIO(), **kwargs)
    return code, out.getvalue()


def _main(argv: list[str], tpu: FakeTpu, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = ops.main(argv, out=io.StringIO(), tpu_client_factory=tpu)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("state", ["PREEMPTED", "TERMINATED", "NOT_FOUND"])
def test_a_lost_node_is_replaced_with_the_exact_pulumi_up(cli, state: str) -> None:
    tpu = FakeTpu(state)
    code, out = _run(["--stack", "dev", "recover", "--yes"], tpu)
    assert code == 0
    assert tpu.calls == [TRAIN_NODE]
    assert cli.calls() == [  # secrets are never decrypted: no --show-secrets anywhere
        ["stack", "output", "--json", "--stack", "dev"],
        ["stack", "export", "--stack", "dev"],
        ["up", "--yes", "--skip-preview", "--replace", URN, "--stack", "dev"],
    ]
    assert f"train VM gemma4-train in us-central1-a is {state}: recreating it" in out
    assert "recreated and the job redeployed; training resumes from its latest checkpoint" in out


def test_the_stack_comes_from_the_urn_when_none_is_selected(cli) -> None:
    code, _ = _run(["recover", "--vm", "serve", "-y"], FakeTpu("PREEMPTED"))
    assert code == 0
    assert cli.calls()[-1] == [
        "up", "--yes", "--skip-preview", "--replace", SERVE_URN, "--stack", "dev"
    ]  # fmt: skip


@pytest.mark.parametrize("state", ["READY", "CREATING", "REPAIRING"])
def test_a_live_node_is_left_alone(cli, state: str) -> None:
    code, out = _run(["recover"], FakeTpu(state))  # no --yes, no terminal: never needed
    assert code == 0
    assert out == f"train VM gemma4-train in us-central1-a: {state}; nothing to do\n"
    assert cli.calls() == [  # the current stack, never selected: named in every command
        ["stack", "ls", "--json"],
        ["stack", "output", "--json", "--stack", "dev"],
    ]


def test_confirmation_is_asked_on_a_terminal_and_refused_without_one(cli, capsys) -> None:
    code, err = _main(["recover"], FakeTpu("PREEMPTED"), capsys)
    assert (code, err.count("\n")) == (2, 1)
    assert err.startswith("error: refusing to recreate the PREEMPTED train VM gemma4-train")
    assert err.endswith("(stdin is not a terminal): pass --yes\n")

    with pytest.raises(ops.OpsError, match="not confirmed: the train VM gemma4-train stays"):
        _run(["recover"], FakeTpu("PREEMPTED"), stdin=Tty("n\n"))
    assert not any(call[0] == "up" for call in cli.calls())

    code, out = _run(["recover"], FakeTpu("PREEMPTED"), stdin=Tty("y\n"))
    assert code == 0
    assert "Recreate the PREEMPTED train VM gemma4-train in us-central1-a" in out
    assert cli.calls()[-1][:5] == ["up", "--yes", "--skip-preview", "--replace", URN]


def test_watch_recovers_once_and_stops_when_the_run_finished(cli) -> None:
    tpu = FakeTpu("READY", "PREEMPTED", "CREATING", "READY")
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 4:  # the trainer writes its summary during the fourth wait
            (cli.run_dir / "train_summary.json").write_text("{}")

    code, out = _run(["recover", "--watch", "--interval", "7", "--yes"], tpu, sleep=sleep)
    assert code == 0
    assert naps == [7.0] * 4
    assert len(tpu.calls) == 4
    assert [c for c in cli.calls() if c[0] == "up"] == [
        ["up", "--yes", "--skip-preview", "--replace", URN, "--stack", "dev"]
    ]
    checks = [line.split(" ", 1)[1] for line in out.splitlines() if line[:1].isdigit()]
    assert checks == [
        "watching train VM gemma4-train in us-central1-a every 7 s until train_summary.json "
        "exists (at most 10 recoveries)",
        "train VM gemma4-train in us-central1-a: READY",
        "train VM gemma4-train in us-central1-a: PREEMPTED; recovery 1/10",
        "train VM gemma4-train in us-central1-a: CREATING",
        "train VM gemma4-train in us-central1-a: READY",
        f"training finished ({cli.run_dir}/train_summary.json); stopping the watch",
    ]


def test_watch_retries_a_failed_up_and_is_bounded_by_max_recoveries(cli) -> None:
    (cli.bin / "up_rc").write_text("255")
    tpu = FakeTpu("PREEMPTED")
    with pytest.raises(ops.OpsError) as info:
        _run(["recover", "--watch", "--max-recoveries", "2", "-y"], tpu, sleep=lambda _s: None)
    assert str(info.value) == (
        "train VM gemma4-train in us-central1-a is PREEMPTED again after 2 recoveries "
        "(--max-recoveries 2): run `python -m infra.ops recover` or raise the limit"
    )
    assert len([c for c in cli.calls() if c[0] == "up"]) == 2


def test_watch_survives_a_few_failed_checks_but_not_many(cli) -> None:
    tpu = FakeTpu("DENIED", "READY", "DENIED")
    naps: list[float] = []
    with pytest.raises(ops.OpsError, match=r"^5 checks in a row failed; last: cannot read"):
        _run(["recover", "--watch", "-y"], tpu, sleep=naps.append)
    assert len(tpu.calls) == 7  # 1 failure, 1 READY, then 5 failures in a row
    assert naps == [recover.DEFAULT_INTERVAL_S] * 6


def test_watch_without_yes_needs_a_terminal(cli, capsys) -> None:
    code, err = _main(["recover", "--watch"], FakeTpu("READY"), capsys)
    assert (code, err) == (
        2,
        "error: refusing to --watch without --yes when stdin is not a terminal "
        "(nobody could confirm a recovery): pass --yes\n",
    )


def test_problems_are_one_line_errors(
    cli, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def error(argv: list[str], state: str = "PREEMPTED", status: int = 2) -> str:
        code, err = _main(argv, FakeTpu(state), capsys)
        assert code == status
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err.removeprefix("error: ").rstrip("\n")

    # No such VM in this stack.
    only_train = {**cli.outputs, "deployments": {"train": cli.outputs["deployments"]["train"]}}
    (cli.bin / "outputs.json").write_text(json.dumps(only_train))
    assert error(["recover", "--vm", "serve"]) == (
        "the stack has no serve VM (the serving VM exists only with serving.enabled: true); "
        "it has: train"
    )
    (cli.bin / "outputs.json").write_text(json.dumps(cli.outputs))

    # The URN is not in the export.
    export = {"deployment": {"resources": cli.export["deployment"]["resources"][:2]}}
    (cli.bin / "export.json").write_text(json.dumps(export))
    assert error(["recover", "-y"]) == (
        f"no {recover.TPU_NODE_TYPE} resource for node gemma4-train in the stack's state "
        "(`pulumi stack export`): this stack does not manage that node"
    )
    (cli.bin / "export.json").write_text(json.dumps(cli.export))

    # pulumi up fails.
    (cli.bin / "up_rc").write_text("3")
    assert error(["--stack", "dev", "recover", "-y"]) == (
        f"`pulumi up --yes --skip-preview --replace '{URN}' --stack dev` failed with exit code 3 "
        "(its output is above)"
    )

    # The TPU API refuses: its own exit status (4), not a usage error's.
    assert error(["recover", "-y"], "DENIED", status=4) == (
        f"cannot read the state of TPU node {TRAIN_NODE}: PermissionDenied: "
        "403 tpu.nodes.get denied on my-project"
    )

    # No pulumi CLI (outputs from a file): only needed once there is something to recreate.
    outputs_file = tmp_path / "outputs.json"
    outputs_file.write_text(json.dumps(cli.outputs))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    code, _ = _main(["--outputs", str(outputs_file), "recover"], FakeTpu("READY"), capsys)
    assert code == 0
    assert error(["--outputs", str(outputs_file), "recover", "-y"]).startswith(
        "the pulumi CLI is not on PATH: recover recreates the VM with `pulumi up --replace`"
    )
    assert error(["--outputs", str(outputs_file), "recover", "--interval", "0"]) == (
        "--interval 0: must be > 0 seconds"
    )


def test_find_urn_matches_the_node_name_and_the_zone_it_was_placed_in() -> None:
    target = recover.Target("train", "n1", "us-east5-a", "p", None)
    other_zone = _tpu_node(
        "urn:pulumi:prod::x::pulumi-python:dynamic/gemma4:TpuNode::b", "n1", "europe-west4-a"
    )
    same = _tpu_node(
        "urn:pulumi:prod::x::pulumi-python:dynamic/gemma4:TpuNode::a", "n1", "us-east5-a"
    )
    export = {"deployment": {"resources": [other_zone, same]}}
    assert recover.find_urn(export, target) == same["urn"]
    assert recover.stack_of(same["urn"]) == "prod"


def test_the_cli_entry_point_runs_the_ops_module(cli, tmp_path: pathlib.Path) -> None:
    """`python -m infra.ops recover` end to end in a subprocess (one-line error, exit 2)."""
    root = pathlib.Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-m", "infra.ops", "recover", "--vm", "serve", "--interval", "-1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (2, "error: --interval -1: must be > 0 seconds\n")
    assert proc.stdout == ""


def test_watch_ends_between_checks_when_a_new_source_is_uploaded(cli, tmp_path) -> None:
    """The recovery controller's service starts again on the source a later `pulumi up`
    uploaded; the watch ends only between checks, never inside a recovery."""
    uploaded, installed = tmp_path / "uploaded.tar.gz", tmp_path / "installed.tar.gz"
    uploaded.write_bytes(b"source 1")
    installed.write_bytes(b"source 1")
    tpu = FakeTpu("READY", "PREEMPTED", "READY")
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:  # the user's `pulumi up` uploads a new archive after the recovery
            uploaded.write_bytes(b"source 2")

    argv = ["recover", "--watch", "-y", "--until-new-source", str(uploaded), str(installed)]
    code, out = _run(argv, tpu, sleep=sleep)
    assert code == 0
    assert len(tpu.calls) == 2 and len(naps) == 2
    assert len([c for c in cli.calls() if c[0] == "up"]) == 1
    assert out.splitlines()[-1].split(" ", 1)[1] == (
        f"a new source was uploaded to {uploaded}; stopping the watch to start again on it"
    )


def test_until_new_source_needs_watch(cli) -> None:
    with pytest.raises(ops.OpsError, match=r"^--until-new-source: only with --watch$"):
        _run(["recover", "-y", "--until-new-source", "a", "b"], FakeTpu("READY"))
