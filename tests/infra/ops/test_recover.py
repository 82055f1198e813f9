"""Recovery through the Cloud TPU API (infra/ops/recover.py) against the local Cloud TPU API and
the real client (tests/fixtures/tpu_api.py): preemption, zones without capacity, queued
resources, failed boots, no training progress, a caller restarted mid-recovery, two callers at
once, and the TpuNode provider's read and diff after such an out-of-band recreation."""

from __future__ import annotations

import io
import json
import pathlib
import threading
import time
from typing import Any

import pytest

from infra.ops import cli as ops
from infra.ops import recover
from infra.resources import tpu_node
from infra.tpu import api as tpu_api
from infra.tpu import placement
from infra.tpu import record as record_mod
from localcloud import tpu_api as local_tpu
from tests.fixtures import tpu_api as fixture

PROJECT = fixture.PROJECT
ZONE, ZONE_B = "us-central1-a", "us-east5-a"
NODE_ID = "gemma4-dev-train"
SPEC = {
    "accelerator_type": "v5p-8",
    "runtime_version": "v2-alpha-tpuv5",
    "labels": {"app": "gemma4-tpu", "stack": "dev", "role": "train"},
    "metadata": {"startup-script": "#!/bin/bash\n"},
    "scheduling_config": {"spot": True},
    "service_account": {"email": f"gemma4-vm@{PROJECT}.iam.gserviceaccount.com"},
}


def _props(zones: tuple[str, ...] = (ZONE, ZONE_B), queue: Any = None) -> dict[str, Any]:
    return {"project": PROJECT, "node_id": NODE_ID, "zones": list(zones), "queue": queue, **SPEC}


def _target(tmp_path: pathlib.Path, **kwargs: Any) -> record_mod.Recorded:
    """The recorded request as `pulumi up` writes it, read back the way recovery reads it."""
    run_dir, reports = tmp_path / "run", tmp_path / "boot"
    run_dir.mkdir(exist_ok=True)
    reports.mkdir(exist_ok=True)
    data = record_mod.to_record(
        _props(**kwargs),
        role="train",
        run_dir=str(run_dir),
        boot_reports=str(reports),
        node_keys=tpu_node.NODE_KEYS,
    )
    path = tmp_path / "train.json"
    path.write_text(record_mod.dumps(data))
    return record_mod.load(str(path))


def _name(zone: str = ZONE) -> str:
    return f"projects/{PROJECT}/locations/{zone}/nodes/{NODE_ID}"


def _place(target: record_mod.Recorded) -> placement.Placement:
    return placement.place(tpu_api.GoogleTpuApi(), target.request, say=lambda _: None, poll_s=0.05)


def _pass(target: record_mod.Recorded, **kwargs: Any) -> tuple[recover.Pass, list[str]]:
    out = io.StringIO()
    result = recover.recover_pass(
        tpu_api.GoogleTpuApi(), target, out, poll_s=0.05, sleep=time.sleep, **kwargs
    )
    return result, out.getvalue().splitlines()


def _train(target: record_mod.Recorded) -> None:
    """The trainer's step on the new node: a line in metrics.jsonl."""
    assert target.run_dir
    with open(f"{target.run_dir}/metrics.jsonl", "a") as handle:
        handle.write('{"step": 1}\n')


def _live(server: local_tpu.TpuApiServer) -> list[str]:
    return [n for n, node in server.nodes.items() if node["state"] not in ("DELETING",)]


def test_a_preempted_node_is_deleted_and_recreated_from_the_recorded_request(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    first = _place(target)
    old_id = tpu_cloud.nodes[_name()]["id"]
    tpu_cloud.preempt(_name())

    result, lines = _pass(target)
    assert result.outcome == recover.RECREATED and result.zone == ZONE, lines
    node = tpu_cloud.nodes[_name()]
    assert node["state"] == "READY" and node["id"] != old_id and _live(tpu_cloud) == [_name()]
    # The same spec as `pulumi up` placed: metadata, accelerator, spot, labels (+ placed-by).
    assert node["metadata"] == SPEC["metadata"] and node["schedulingConfig"] == {"spot": True}
    assert node["labels"] == {
        **SPEC["labels"],
        **placement.PLACED_BY,
        **recover.RECOVERED_BY,
        recover.ATTEMPT_LABEL: "1",
    }
    assert first.zone == ZONE
    assert any("recreating it (recovery 1/10)" in line for line in lines), lines
    assert "created in us-central1-a" in lines[-1], lines

    _train(target)
    again, lines = _pass(target)
    assert again.outcome == recover.HEALTHY and "READY and training" in lines[-1], lines


def test_a_recreated_serving_node_is_said_to_need_a_deploy(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    """The serving VM installs no release at boot (only the training VM, which the controller
    recovers, does): `recover --vm serve` recreates its node and says `pulumi up --refresh`
    deploys to it, not that a job resumes; it has no training run to call training."""
    data = record_mod.to_record(
        {**_props(), "node_id": "gemma4-dev-serve", "labels": {**SPEC["labels"], "role": "serve"}},
        role="serve",
        run_dir=None,
        boot_reports=str(tmp_path / "boot"),
        node_keys=tpu_node.NODE_KEYS,
    )
    path = tmp_path / "serve.json"
    path.write_text(record_mod.dumps(data))
    target = record_mod.load(str(path))
    _place(target)
    name = target.request.node_name(ZONE)
    tpu_cloud.preempt(name)
    result, lines = _pass(target)
    assert result.outcome == recover.RECREATED, lines
    assert "`pulumi up --refresh` deploys to it" in result.line and "resumes" not in result.line
    again, lines = _pass(target)
    assert again.outcome == recover.HEALTHY and "READY (recovered" in again.line, lines


def test_a_node_pulumi_up_made_is_left_to_its_deploy_even_when_its_boot_failed(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    """Its first boot may download the model from the hub for hours, and `pulumi up` waits for
    it and reports a failure to the person running it: recovery judges only its own nodes."""
    target = _target(tmp_path)
    assert target.boot_reports
    tpu_cloud.hooks = FailingBoot(pathlib.Path(target.boot_reports))
    _place(target)
    calls = len(tpu_cloud.calls)
    result, lines = _pass(target, limits=recover.RecoveryLimits(boot_deadline_s=0.1))
    assert result.outcome == recover.HEALTHY and lines == [lines[0]] and "READY" in lines[0]
    assert all(verb == "GET" for _, verb, _, _ in tpu_cloud.calls[calls:])


def test_a_training_node_and_a_finished_run_are_left_alone(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    _train(target)
    calls = len(tpu_cloud.calls)
    result, _ = _pass(target)
    assert result.outcome == recover.HEALTHY
    assert all(verb == "GET" for _, verb, _, _ in tpu_cloud.calls[calls:])
    assert target.run_dir
    pathlib.Path(target.run_dir, "train_summary.json").write_text("{}")
    tpu_cloud.preempt(_name())
    result, lines = _pass(target)
    assert result.outcome == recover.FINISHED and tpu_cloud.state(_name()) == "PREEMPTED", lines


def test_a_zone_without_capacity_sends_the_new_node_to_the_next_zone(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    tpu_cloud.zone(ZONE).capacity = False
    result, lines = _pass(target)
    assert result.outcome == recover.RECREATED and result.zone == ZONE_B, lines
    assert _live(tpu_cloud) == [_name(ZONE_B)]  # the preempted one in ZONE was deleted
    assert any("us-central1-a: cannot place" in line for line in lines), lines


def test_no_capacity_anywhere_is_one_line_and_counts_no_recovery(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    tpu_cloud.zone(ZONE).capacity = tpu_cloud.zone(ZONE_B).capacity = False
    journal = recover.Journal(str(tmp_path / "journal.json"))
    result, _ = _pass(target, journal=journal)
    assert result.outcome == recover.WAITING and "no zone could take it" in result.line
    assert _live(tpu_cloud) == []  # nothing bills while it waits for capacity
    assert journal.load(recover.request_digest(target.request))["recoveries"] == 0


def test_a_queued_resource_waits_for_capacity_then_its_node_comes_up(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path, zones=(ZONE,), queue={"spot": True, "valid_for_s": 600})
    _place(target)
    tpu_cloud.preempt(_name())  # its queued resource is SUSPENDED with it
    tpu_cloud.zone(ZONE).capacity = False
    threading.Timer(0.8, lambda: setattr(tpu_cloud.zone(ZONE), "capacity", True)).start()
    result, lines = _pass(target)
    assert result.outcome == recover.RECREATED, lines
    queued = f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{NODE_ID}"
    assert tpu_cloud.queued[queued]["state"]["state"] == "ACTIVE"
    assert tpu_cloud.nodes[_name()]["queuedResource"] == queued
    assert any("WAITING_FOR_RESOURCES" in line for line in lines), lines


class FailingBoot(local_tpu.NoWorkers):
    """Workers whose startup script fails: each writes its boot-failed line to the bucket's
    report folder, as templates/startup/_common.sh.j2's boot_ended does."""

    def __init__(self, reports: pathlib.Path) -> None:
        super().__init__()
        self.reports = reports

    def boot(self, node: dict[str, Any]) -> list[str]:
        workers = super().boot(node)
        for host in workers:
            line = f"stage venv failed (exit 1) on {host}: pip: 503 Service Unavailable"
            (self.reports / f"{host}.failed").write_text(line + "\n")
        return workers


def test_a_node_whose_boot_fails_is_retried_then_deleted_and_reported_in_one_line(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    assert target.boot_reports
    tpu_cloud.hooks = FailingBoot(pathlib.Path(target.boot_reports))
    tpu_cloud.preempt(_name())
    journal = recover.Journal(str(tmp_path / "journal.json"))
    limits = recover.RecoveryLimits(max_attempts=2)

    outcomes = []
    for _ in range(3):
        result, lines = _pass(target, journal=journal, limits=limits)
        outcomes.append(result.outcome)
    assert outcomes == [recover.RECREATED, recover.RECREATED, recover.GAVE_UP], lines
    assert "gave up after 2 new node(s)" in result.line and "503" in result.line
    assert "nothing of it bills" in result.line
    tpu_cloud.wait_state(_name(), (None,), 10)
    assert _live(tpu_cloud) == []
    # A restarted caller reads the journal: it stays given up and creates nothing.
    calls = len(tpu_cloud.calls)
    again, _ = _pass(target, journal=recover.Journal(str(tmp_path / "journal.json")))
    assert again.outcome == recover.GAVE_UP
    assert all(verb == "GET" for _, verb, _, _ in tpu_cloud.calls[calls:])


def test_a_ready_node_that_never_trains_is_replaced_after_the_deadline(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    # 4 s: the client polls a create's operation about 1 s apart.
    limits = recover.RecoveryLimits(boot_deadline_s=4.0)
    assert _pass(target, limits=limits)[0].outcome == recover.RECREATED
    result, lines = _pass(target, limits=limits)
    assert result.outcome == recover.WAITING and "no training step yet" in result.line, lines
    first_id = tpu_cloud.nodes[_name()]["id"]
    time.sleep(4.2)
    result, lines = _pass(target, limits=limits)
    assert result.outcome == recover.RECREATED, lines
    assert any("failed: no training step within 4 s of its creation" in line for line in lines)
    assert tpu_cloud.nodes[_name()]["id"] != first_id and _live(tpu_cloud) == [_name()]
    assert tpu_cloud.nodes[_name()]["labels"][recover.ATTEMPT_LABEL] == "2"
    _train(target)
    assert _pass(target, limits=limits)[0].outcome == recover.HEALTHY


def test_a_caller_restarted_mid_recovery_adopts_the_node_being_created(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    # The first controller deleted the preempted node and sent its create, then was killed.
    api = tpu_api.GoogleTpuApi()
    api.delete_node(_name())
    tpu_cloud.create_s = 1.0
    client = tpu_api.tpu_client()
    parent = target.request.parent(ZONE)
    client.create_node(
        parent=parent, node_id=NODE_ID, node=placement.marked(target.request.node)
    )  # not waited on
    assert tpu_cloud.state(_name()) == "CREATING"
    result, lines = _pass(target)  # the restarted controller
    assert result.outcome == recover.WAITING and result.line.endswith(": CREATING"), lines
    tpu_cloud.wait_state(_name(), ("READY",), 10)
    assert _live(tpu_cloud) == [_name()]


class Killed(BaseException):
    """The caller's process ends here (SIGKILL, a reboot): nothing after it runs."""


class KilledAtCreate:
    """A PlacementApi whose node create is sent, and the caller killed before it returns."""

    def __init__(self, api: tpu_api.GoogleTpuApi) -> None:
        self.api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def create_node(self, parent: str, node_id: str, node: Any) -> None:
        tpu_api.tpu_client().create_node(parent=parent, node_id=node_id, node=dict(node))
        raise Killed


def test_a_caller_killed_during_its_create_has_counted_the_recovery(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    """The restarted caller adopts the node without counting it: the count is the killed
    one's, journaled before its create (else a recovery is forgotten, and --max-recoveries
    counts one short per restart)."""
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    path = str(tmp_path / "journal.json")
    with pytest.raises(Killed):
        recover.recover_pass(
            KilledAtCreate(tpu_api.GoogleTpuApi()),
            target,
            io.StringIO(),
            journal=recover.Journal(path),
        )
    result, lines = _pass(target, journal=recover.Journal(path))  # the restarted caller
    assert result.outcome == recover.WAITING and not any("recreating" in x for x in lines), lines
    tpu_cloud.wait_state(_name(), ("READY",), 10)
    assert _live(tpu_cloud) == [_name()]
    assert recover.Journal(path).load(recover.request_digest(target.request))["recoveries"] == 1


class RefusedAtCreate(KilledAtCreate):
    """A PlacementApi whose node create the API refuses (a role without tpu.nodes.create)."""

    def create_node(self, parent: str, node_id: str, node: Any) -> None:
        from google.api_core import exceptions

        raise exceptions.PermissionDenied("Permission 'tpu.nodes.create' denied")


def test_a_recovery_whose_create_failed_is_not_counted(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    journal = recover.Journal(str(tmp_path / "journal.json"))
    with pytest.raises(Exception, match=r"tpu\.nodes\.create"):
        recover.recover_pass(
            RefusedAtCreate(tpu_api.GoogleTpuApi()), target, io.StringIO(), journal=journal
        )
    assert journal.load(recover.request_digest(target.request))["recoveries"] == 0


def test_a_caller_restarted_while_its_queue_waits_adopts_the_queue(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path, zones=(ZONE,), queue={"spot": True, "valid_for_s": 600})
    request = target.request
    tpu_cloud.zone(ZONE).capacity = False
    api = tpu_api.GoogleTpuApi()
    api.create_queued_resource(
        request.parent(ZONE), NODE_ID, placement.queued_body(request, ZONE)
    )  # the killed controller's request, still in line
    threading.Timer(0.8, lambda: setattr(tpu_cloud.zone(ZONE), "capacity", True)).start()
    result, lines = _pass(target)
    assert result.outcome == recover.RECREATED, lines
    assert any("from an earlier up is" in line and "waiting on it" in line for line in lines)
    assert list(tpu_cloud.queued) == [request.queued_name(ZONE)] and _live(tpu_cloud) == [_name()]


class Racing:
    """A PlacementApi whose first node create is preceded by another caller's create of the same
    node: the 409 ALREADY_EXISTS race of a laptop and the controller, made deterministic."""

    def __init__(self, api: tpu_api.GoogleTpuApi) -> None:
        self.api = api
        self.raced = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def create_node(self, parent: str, node_id: str, node: Any) -> None:
        if not self.raced:
            self.raced = True
            other = tpu_api.tpu_client()
            other.create_node(parent=parent, node_id=node_id, node=dict(node)).result(30)
        self.api.create_node(parent, node_id, node)


def test_a_create_refused_with_already_exists_adopts_the_other_callers_node(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    out = io.StringIO()
    result = recover.recover_pass(Racing(tpu_api.GoogleTpuApi()), target, out)
    assert result.outcome == recover.RECREATED, out.getvalue()
    assert "already exists (another caller created it" in out.getvalue()
    assert _live(tpu_cloud) == [_name()]
    assert [c for c in tpu_cloud.calls if c[1] == "POST" and c[3] == 409], tpu_cloud.calls


class DeletedMeanwhile:
    """A PlacementApi after whose first read of the lost node another caller deletes it (not
    waited on): the pass read PREEMPTED, its placement then finds the node DELETING."""

    def __init__(self, api: tpu_api.GoogleTpuApi) -> None:
        self.api = api
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def get_node(self, name: str) -> Any:
        node = self.api.get_node(name)
        self.reads += 1
        if self.reads == 1 and node is not None:
            tpu_api.tpu_client().delete_node(name=name)
        return node


def test_a_node_another_caller_is_deleting_is_waited_out_then_created(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    """Between this pass's look (PREEMPTED) and its placement, another caller deletes the node:
    the pass does not adopt a node on its way out as its recovery; it waits, saying so, until
    the name is free, then creates the one node."""
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    tpu_cloud.delete_s = 0.5
    out = io.StringIO()
    result = recover.recover_pass(
        DeletedMeanwhile(tpu_api.GoogleTpuApi()), target, out, poll_s=0.2, sleep=time.sleep
    )
    said = out.getvalue()
    assert result.outcome == recover.RECREATED, said
    assert "TPU node gemma4-dev-train is DELETING; waiting for it to go" in said
    assert "created in us-central1-a (READY" in result.line
    assert _live(tpu_cloud) == [_name()]


def test_a_laptop_and_the_controller_at_once_make_one_node(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    tpu_cloud.create_s = 0.5
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(_pass(target)[0].outcome)
        except Exception as exc:  # the test reports what either caller raised
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    tpu_cloud.wait_state(_name(), ("READY",), 10)
    assert _live(tpu_cloud) == [_name()], (results, tpu_cloud.calls)
    assert all(r in (recover.RECREATED, recover.WAITING) for r in results), results


def test_the_watch_recovers_and_stops_when_the_run_finished(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    out = io.StringIO()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 1:  # after the recovery, the new node trains, then finishes
            _train(target)
        if len(sleeps) == 2:
            pathlib.Path(str(target.run_dir), "train_summary.json").write_text("{}")

    code = recover.watch(tpu_api.GoogleTpuApi(), lambda: target, out, interval_s=5, sleep=sleep)
    lines = out.getvalue().splitlines()
    assert code == 0 and sleeps == [5, 5], lines
    said = [
        next(i for i, line in enumerate(lines) if words in line)
        for words in (
            "recreating it (recovery 1/10)",
            "created in us-central1-a",
            "READY and training",
            "training finished",
        )
    ]
    assert said == sorted(said), lines


def test_the_cli_runs_one_pass_from_the_recorded_request(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    out = io.StringIO()
    journal = str(tmp_path / "j.json")
    request = str(tmp_path / "train.json")
    code = ops.main(["recover", "--request", request, "--yes", "--journal", journal], out=out)
    assert code == 0 and tpu_cloud.state(_name()) == "READY", out.getvalue()
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"trainRecoveryRecord": str(tmp_path / "train.json")}))
    _train(target)
    out = io.StringIO()
    assert ops.main(["--outputs", str(outputs), "recover"], out=out) == 0
    assert "READY and training" in out.getvalue()


def test_the_cli_says_an_api_refusal_in_its_pass_in_one_line(
    tpu_cloud: local_tpu.TpuApiServer,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A laptop whose account may read and delete nodes but not create them: one line naming
    the permission and exit 4 (Google Cloud refused), not a traceback."""
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    member = f"reader@{PROJECT}.iam.gserviceaccount.com"
    tpu_cloud.iam.grant(
        f"serviceAccount:{member}",
        ["tpu.nodes.get", "tpu.nodes.list", "tpu.nodes.delete", "tpu.operations.get"],
    )
    monkeypatch.setenv(
        "GOOGLE_APPLICATION_CREDENTIALS", str(fixture.key_file(tpu_cloud, member, tmp_path))
    )
    request = str(tmp_path / "train.json")
    code = ops.main(["recover", "--request", request, "--yes"], out=io.StringIO())
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and len(err) == 1, err
    assert "recovering the train VM gemma4-dev-train" in err[0] and "tpu.nodes.create" in err[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--interval", "0"], "--interval 0: must be a finite number of seconds > 0"),
        (["--interval", "nan"], "--interval nan: must be a finite number of seconds > 0"),
        (["--interval", "inf"], "--interval inf: must be a finite number of seconds > 0"),
        (["--boot-deadline", "-1"], "--boot-deadline -1: must be a finite number of seconds > 0"),
        (["--boot-deadline", "nan"], "--boot-deadline nan: must be a finite number of seconds > 0"),
        (["--boot-deadline", "inf"], "--boot-deadline inf: must be a finite number of seconds > 0"),
        (["--max-attempts", "0"], "--max-attempts 0: must be >= 1"),
        (["--max-recoveries", "-1"], "--max-recoveries -1: must be >= 0"),
        (["--until-new-source", "gs://b/s", "f"], "--until-new-source: only with --watch"),
        (["--watch"], "refusing to --watch without --yes"),
    ],
)
def test_bad_options_are_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    code = ops.main(["recover", "--request", str(tmp_path / "none.json"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"version": 2}, "version 2: 1 (written by another checkout"),
        ({"extra": 1}, "key 'extra': one of version, role, request, run_dir, boot_reports"),
        ({"request": {"zones": []}}, "request key"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_key(
    change: dict[str, Any], expected: str, tmp_path: pathlib.Path
) -> None:
    data = record_mod.to_record(
        _props(), role="train", run_dir=None, boot_reports=None, node_keys=tpu_node.NODE_KEYS
    )
    if change.get("request") == {"zones": []}:
        data["request"]["zonez"] = []
    else:
        data.update(change)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(recover.OpsError, match=expected.replace("(", r"\(")):
        record_mod.load(str(path))


# -- Pulumi's state catches up: the provider's read and diff after an out-of-band recreation ----


def test_the_providers_read_and_diff_keep_a_node_recovery_recreated(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tpu_node, "known_hosts_file", lambda: tmp_path / "known_hosts")
    provider = tpu_node.TpuNodeProvider()
    props = _props()
    created = provider.create(dict(props))
    state = dict(created.outs or {})
    target = _target(tmp_path)
    tpu_cloud.preempt(created.id)
    assert _pass(target)[0].outcome == recover.RECREATED  # out of band: Pulumi is not told

    # `pulumi refresh` (or `up --refresh`): the same id reads the new node, READY.
    read = provider.read(created.id, state)
    assert read.id == created.id and (read.outs or {})["state"] == "READY"
    assert (read.outs or {})["network_endpoints"] != state["network_endpoints"]
    diff = provider.diff(created.id, read.outs or {}, dict(props))
    assert diff.changes is False and not diff.replaces  # no replacement churn
    # A plain `up` without refresh diffs against the old state: the node is READY, so it is kept.
    stale = provider.diff(created.id, state, dict(props))
    assert not stale.replaces


def test_a_recreation_in_another_zone_is_adopted_by_the_next_up(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tpu_node, "known_hosts_file", lambda: tmp_path / "known_hosts")
    provider = tpu_node.TpuNodeProvider()
    props = _props()
    created = provider.create(dict(props))
    target = _target(tmp_path)
    tpu_cloud.preempt(created.id)
    tpu_cloud.zone(ZONE).capacity = False
    assert _pass(target)[0].zone == ZONE_B

    # The state's id names the first zone, where nothing is left: read says gone, and the next
    # `up` creates the resource again, which adopts the node recovery placed (no second slice).
    assert provider.read(created.id, dict(created.outs or {})).id == ""
    again = provider.create(dict(props))
    assert again.id == _name(ZONE_B) and _live(tpu_cloud) == [_name(ZONE_B)]
    assert provider.diff(again.id, dict(again.outs or {}), dict(props)).changes is False


# -- the bucket as the controller reads it (gs:// on the GCS protocol server) -------------------


def test_the_controller_reads_the_record_progress_and_boot_reports_from_gs(
    tpu_cloud: local_tpu.TpuApiServer, gcs_bucket: str, tmp_path: pathlib.Path
) -> None:
    from workloads.common import storage

    data = record_mod.to_record(
        _props(),
        role="train",
        run_dir=f"{gcs_bucket}/checkpoints/run",
        boot_reports=f"{gcs_bucket}/recovery/{NODE_ID}-boot",
        node_keys=tpu_node.NODE_KEYS,
    )
    uri = f"{gcs_bucket}/recovery/{NODE_ID}.json"
    storage.write_text_atomic(uri, record_mod.dumps(data))
    target = record_mod.load(uri)
    _place(target)
    tpu_cloud.preempt(_name())
    before = time.time() - 5
    # A failure line from an earlier node is older than the new node: it does not count.
    storage.write_text_atomic(f"{target.boot_reports}/old-host.failed", "stage venv failed\n")
    time.sleep(1.1)

    out = io.StringIO()
    code = recover.controller(
        uri,
        journal_path=str(tmp_path / "journal.json"),
        out=out,
        interval_s=0.1,
        passes=2,
        limits=recover.RecoveryLimits(boot_deadline_s=600),
    )
    lines = out.getvalue().splitlines()
    assert code == 0 and "created in us-central1-a" in out.getvalue(), lines
    assert "READY, no training step yet" in lines[-1], lines
    assert recover.boot_failure(target.boot_reports, before) == "stage venv failed"
    created = recover._created(tpu_cloud.nodes[_name()], 0.0)
    assert recover.boot_failure(target.boot_reports, created) is None
    assert not recover.progressed(target.run_dir, created)
    storage.write_text_atomic(f"{target.run_dir}/metrics.jsonl", '{"step": 1}\n')
    assert recover.progressed(target.run_dir, created)
    # The new node's own failure line counts.
    storage.write_text_atomic(f"{target.boot_reports}/new-host.failed", "stage weights failed\n")
    assert recover.boot_failure(target.boot_reports, created) == "stage weights failed"


def test_more_recoveries_than_allowed_end_the_watch_in_one_line(
    tpu_cloud: local_tpu.TpuApiServer, tmp_path: pathlib.Path
) -> None:
    target = _target(tmp_path)
    _place(target)
    tpu_cloud.preempt(_name())
    with pytest.raises(recover.LimitReached, match=r"lost again after 0 recoveries"):
        recover.watch(
            tpu_api.GoogleTpuApi(),
            lambda: target,
            io.StringIO(),
            limits=recover.RecoveryLimits(max_recoveries=0),
            sleep=lambda _s: None,
        )
