"""Recovery's failure paths as rehearsal cases (issue #42): the recovery controller as its own
process against the local cloud, each case ending in one node training, or in no node in the
API and one line naming why, and none leaving a READY node without a job.

The controller is `python -m infra.ops recover --vm train --watch --yes --request URI --journal
PATH --interval S`, the command its VM's unit runs (templates/startup/recover.sh.j2, less its
--until-new-source), in a process of its own as the controller's service account (a key file
the local IAM accepts) with the grants the program declared for it, against the local Cloud TPU
API (localcloud/tpu_api.py) and the bucket on the local GCS server, from the create request the
program recorded there. Nothing here calls its functions. Its watch checks every second
(`--interval 1`; the unit's is the stack's recovery.intervalSeconds); case (a) also gives it
`--max-attempts 2` (one retry; 3 by default) and a boot deadline long enough for a container's
boot.

The cases, and how each ends:

(a) a new node's boot fails: the release in the bucket is damaged, and every new VM (a container
    booting the program's startup script) fails at its `release` stage and reports it to the
    bucket. One retry, then the node is deleted: one line naming the stage, no node left.
(b) the first zone has no capacity (its create ends RESOURCE_EXHAUSTED): the node in the next
    zone, training.
(c) a queued resource (`provisioning: queued`) waits while no capacity comes: no node bills
    meanwhile; then ACTIVE, its node training.
(d) the controller is killed (SIGKILL) while its create is in flight and started again on the
    same journal: it adopts the node being created; one create, training.
(e) a laptop's `ops recover` (its own process, as the operator) and the controller read the
    preemption at the same moment (the API holds both reads until both have asked): one node,
    training.

Case (a) boots real Debian 12 containers (the startup script to its failing stage: apt, the venv
by uv; docs/benchmarks.md has the cases' times); the others use stand-in workers
(`StandIns`: a trainer that writes a step to the run's metrics.jsonl while its node lives), since
a container would add nothing to what they show. One cloud serves every case (the program
under mocks, the storage server, the API with the program's IAM); each case starts its own
controller with its own journal. Slow tests: CI runs them (`.ci/run`'s slow phase).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from infra.ops import recover
from infra.tpu import api as tpu_api
from infra.tpu import placement
from infra.tpu import record as record_mod
from localcloud import rehearse, stack_plan
from localcloud import tpu_api as local_tpu
from localcloud.errors import CannotBoot
from tests.fixtures.tmpfs import mount_tmpfs
from workloads.common import storage

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
ZONE, ZONE_B = "us-central1-a", "us-east5-a"
# The controller's watch interval here (seconds).
INTERVAL_S = 1
# The stack for the cases: the recovery controller, and a second zone to fail over to.
OVERLAY: dict[str, Any] = {
    "recovery": {"enabled": True, "intervalSeconds": 30},
    "training": {"zoneFallbacks": [ZONE_B]},
}
# Case (c)'s stack: the same with a queued resource that waits up to an hour per zone.
QUEUED: dict[str, Any] = {"training": {"provisioning": "queued", "queue": {"validForHours": 1}}}
# A stand-in trainer's step interval (seconds).
STEP_S = 0.5
# How long a READY node whose boot failed may bill before the controller deletes it: its next
# check (INTERVAL_S) and that check's reads and delete, with room for a busy machine.
IDLE_S = 15.0


class StandIns(local_tpu.NoWorkers):
    """Workers without a machine: each node's trainer is a thread that writes a step to the
    run's metrics.jsonl in the bucket every STEP_S seconds, from the node's boot until the API
    preempts or deletes it, or the test ends (`stop_every`)."""

    # Every trainer thread started in this process. A node still up when its test ends would
    # otherwise keep writing for the rest of the worker's life, to whatever gs:// server the
    # environment names by then: once another test's fault proxy (its one stalled POST taken by
    # this thread, that test failed) and, after the last server, storage.googleapis.com.
    _threads: ClassVar[list[tuple[threading.Thread, threading.Event]]] = []

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.metrics = f"{run_dir.rstrip('/')}/metrics.jsonl"
        self.trainers: dict[str, threading.Event] = {}  # node id -> its trainer's stop
        self._lock = threading.Lock()

    def boot(self, node: dict[str, Any]) -> list[str]:
        workers = super().boot(node)
        stop = threading.Event()
        with self._lock:
            self.trainers[str(node["id"])] = stop
        thread = threading.Thread(target=self._train, args=(str(node["id"]), stop), daemon=True)
        StandIns._threads.append((thread, stop))
        thread.start()
        return workers

    @classmethod
    def stop_every(cls) -> None:
        """Stops every trainer thread and waits for a write in flight to end."""
        threads, cls._threads = cls._threads, []
        for _, stop in threads:
            stop.set()
        for thread, _ in threads:
            thread.join(timeout=60)

    def _train(self, node_id: str, stop: threading.Event) -> None:
        step = 0
        while not stop.wait(STEP_S):
            step += 1
            with contextlib.suppress(Exception):  # the bucket's hiccup: the next step writes
                storage.write_text_atomic(
                    self.metrics, json.dumps({"step": step, "node": node_id}) + "\n"
                )

    def halt(self, node: dict[str, Any], why: str) -> None:
        super().halt(node, why)
        with self._lock:
            stop = self.trainers.pop(str(node["id"]), None)
        if stop is not None:
            stop.set()

    def training(self) -> set[str]:
        """The ids of the nodes whose trainer runs."""
        with self._lock:
            return set(self.trainers)


@pytest.fixture(autouse=True)
def _stand_ins_stop_with_their_test() -> Iterator[None]:
    yield
    StandIns.stop_every()


@dataclasses.dataclass
class Cloud:
    """The cases' cloud: the rehearsal's storage, API and container VMs, and what the program
    declared (the recorded requests, the release, the controller's account)."""

    rehearsal: rehearse.Rehearsal
    api: local_tpu.TpuApiServer
    vm_hooks: Any  # localcloud.control_plane.VmHooks: nodes boot as container VMs
    record_uri: str
    records: dict[str, bytes]  # "spot" / "queued": the program's recorded request
    release_uri: str
    run_dir: str
    boot_reports: str
    controller: str  # the controller's IAM member
    controller_key: pathlib.Path
    logs: pathlib.Path

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The API's nodes once none is being created or deleted."""
        deadline = time.monotonic() + 60
        while True:
            with self.api._lock:
                nodes = {name: dict(node) for name, node in self.api.nodes.items()}
            if all(n["state"] not in ("CREATING", "DELETING") for n in nodes.values()):
                return nodes
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes still changing after 60 s: {nodes}")
            time.sleep(0.1)

    def creates(self, since: int, member: str | None = None) -> list[tuple[str, str, str, int]]:
        """The create calls (node or queued resource) the API answered from call `since` on,
        by `member` or anyone."""
        return [
            call
            for call in list(self.api.calls)[since:]
            if call[1] == "POST"
            and call[2].endswith(("/nodes", "/queuedResources"))
            and (member is None or call[0] == member)
        ]


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    workdir = tmp_path_factory.mktemp("recovery-cases")
    r = rehearse.Rehearsal("dev", workdir, print)
    try:
        rehearse.rootfs.check_tools()
    except CannotBoot as exc:
        pytest.fail(str(exc), pytrace=False)
    # The VMs' disks in RAM: case (a)'s venvs install and go in seconds, where deleting their
    # files from a disk took a minute each on a busy 2-core machine. Nothing a case shows
    # depends on the disk (a machine that cannot mount one uses the disk).
    disks = mount_tmpfs(workdir / "vms", "8g")
    try:
        training = rehearse.prepare_training(r, OVERLAY)
        control = r.start_control_plane(training)
        queued = stack_plan.plan("dev", stack_plan.merged(training.plan.config, QUEUED))
        node_id = training.train.node_id
        record_uri = _object(training.plan.objects, f"/recovery/{node_id}.json")
        target = record_mod.load(record_uri)
        assert target.run_dir and target.boot_reports
        account = training.plan.vms["controller"].service_account
        project = str(training.plan.config["project"])
        key = workdir / "controller-key.json"
        key.write_text(
            json.dumps(control.api.iam.new_key_file(account, project, f"{control.api.url}/token"))
        )
        logs = workdir / "controllers"
        logs.mkdir()
        control.api.queue_s = [("WAITING_FOR_RESOURCES", 0.3), ("PROVISIONING", 0.3)]
        # A deleted node stays DELETING a moment, its name taken (minutes on GCP).
        control.api.delete_s = 0.5
        yield Cloud(
            rehearsal=r,
            api=control.api,
            vm_hooks=control.hooks,
            record_uri=record_uri,
            records={
                "spot": training.plan.objects[record_uri],
                "queued": queued.objects[record_uri],
            },
            release_uri=_object(training.plan.objects, "-release.tar.gz"),
            run_dir=target.run_dir,
            boot_reports=target.boot_reports,
            controller=f"serviceAccount:{account}",
            controller_key=key,
            logs=logs,
        )
    finally:
        r.close()
        if disks:
            subprocess.run(["umount", "-l", str(workdir / "vms")], check=False)


def _object(objects: dict[str, bytes], suffix: str) -> str:
    found = [uri for uri in objects if uri.endswith(suffix)]
    assert len(found) == 1, (suffix, sorted(objects))
    return found[0]


class Controller:
    """The recovery controller's command in a process of its own, its output in a file."""

    def __init__(self, cloud: Cloud, journal: pathlib.Path, *flags: str) -> None:
        self.log = cloud.logs / f"{journal.stem}-{time.monotonic_ns()}.log"
        argv = [
            *(sys.executable, "-m", "infra.ops", "recover", "--vm", "train", "--watch", "--yes"),
            *("--request", cloud.record_uri, "--journal", str(journal)),
            *("--interval", str(INTERVAL_S), *flags),
        ]
        env = {**os.environ, "GOOGLE_APPLICATION_CREDENTIALS": str(cloud.controller_key)}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def wait_for(self, words: str, timeout_s: float, after: int = 0) -> tuple[int, str]:
        """The first line from index `after` on that holds `words`: (its index, the line)."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self.lines()
            for i, line in enumerate(lines[after:], after):
                if words in line:
                    return i, line
            if self.proc.poll() is not None:
                raise AssertionError(f"the controller exited ({self.proc.returncode}): {lines}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{words!r} not within {timeout_s:.0f} s: {lines[-20:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL, as a VM that reboots or an OOM kill ends it: nothing runs on the way out."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def controllers(cloud: Cloud, tmp_path: pathlib.Path) -> Iterator[Callable[..., Controller]]:
    """controllers(*flags, journal=None): a new controller; each is stopped after the case.
    The same journal file is the same controller's disk across its restarts."""
    started: list[Controller] = []

    def start(*flags: str, journal: pathlib.Path | None = None) -> Controller:
        controller = Controller(cloud, journal or tmp_path / "journal-train.json", *flags)
        started.append(controller)
        return controller

    yield start
    for controller in started:
        controller.stop()


@dataclasses.dataclass(frozen=True)
class Case:
    started: float  # time.monotonic()
    calls: int  # the API's calls before it


def _fresh(cloud: Cloud, hooks: local_tpu.Hooks, record: str = "spot") -> Case:
    """An empty cloud for a case: no node or queued resource, every zone with capacity, the
    run's progress and boot reports cleared, `record` the recorded request, `hooks` booting
    the nodes."""
    api = tpu_api.GoogleTpuApi()  # as the operator
    for name, node in cloud.nodes().items():
        placement.remove(api, name, node.get("queuedResource") or None)
    for name in list(cloud.api.queued):
        api.delete_queued_resource(name)
    cloud.api.zones.clear()
    cloud.api.create_s = 0.2
    cloud.api.hooks = hooks
    for folder in (cloud.run_dir, cloud.boot_reports):
        storage.remove_tree(folder)
    storage.write_bytes_atomic(cloud.record_uri, cloud.records[record])
    return Case(time.monotonic(), len(cloud.api.calls))


def _up(cloud: Cloud) -> str:
    """`pulumi up`'s node (the TpuNode provider's placement, as the operator); its name."""
    request = record_mod.load(cloud.record_uri).request
    placed = placement.place(tpu_api.GoogleTpuApi(), request, say=lambda _: None, poll_s=0.2)
    return request.node_name(placed.zone)


def _watching(controller: Controller, node: str) -> int:
    """Waits for the controller's first look at `pulumi up`'s node; the index of that line."""
    zone = node.split("/locations/")[1].split("/")[0]
    return controller.wait_for(f"in {zone}: READY", 60)[0]


def _one_training(cloud: Cloud, hooks: StandIns, zone: str) -> dict[str, Any]:
    """The end of a case that recovers: one node, the controller's, READY with its trainer
    running; every READY node has a job (here the only one)."""
    nodes = cloud.nodes()
    name = _node_name(cloud, zone)
    assert list(nodes) == [name], nodes
    node = nodes[name]
    assert node["state"] == "READY"
    assert recover.RECOVERED_BY.items() <= node["labels"].items(), node["labels"]
    ready = {n["id"] for n in nodes.values() if n["state"] == "READY"}
    assert ready <= hooks.training(), (ready, hooks.training())
    return node


def _node_name(cloud: Cloud, zone: str) -> str:
    return record_mod.load(cloud.record_uri).request.node_name(zone)


def _took(case: Case, name: str) -> None:
    print(f"case {name}: {time.monotonic() - case.started:.1f} s")


# ---------------------------------------------------------------------------------------------
# (a) the new node boots, but its boot fails


def test_a_new_node_whose_boot_fails_is_retried_then_deleted_in_one_line(
    cloud: Cloud, controllers: Callable[..., Controller]
) -> None:
    stand_ins = StandIns(cloud.run_dir)
    case = _fresh(cloud, stand_ins)
    node = _up(cloud)
    # The release `pulumi up` pushed is damaged (cut in half): every new VM fails installing it.
    release = storage.read_bytes(cloud.release_uri)
    halts: dict[str, float] = {}
    real_halted = cloud.vm_hooks.halted

    def halted(vm: Any) -> None:
        halts[vm.name] = time.time()
        real_halted(vm)

    cloud.vm_hooks.halted = halted
    booted = set(cloud.vm_hooks.vms.values())
    try:
        storage.write_bytes_atomic(cloud.release_uri, release[: len(release) // 2])
        controller = controllers("--max-attempts", "2", "--boot-deadline", "900")
        seen = _watching(controller, node)
        cloud.api.preempt(node)
        cloud.api.hooks = cloud.vm_hooks  # the new nodes boot as container VMs
        i, gave_up = controller.wait_for("gave up after 2 new node(s)", 600, seen)
        # It stays given up: the next checks say so and create nothing.
        creates = len(cloud.creates(case.calls))
        controller.wait_for("gave up earlier", 30, i + 1)
        assert len(cloud.creates(case.calls)) == creates
    finally:
        cloud.vm_hooks.halted = real_halted
        storage.write_bytes_atomic(cloud.release_uri, release)
    lines = controller.lines()

    assert "stage release failed" in gave_up and "nothing of it bills" in gave_up, gave_up
    assert sum("gave up after" in line for line in lines) == 1, lines
    assert cloud.nodes() == {} and cloud.api.queued == {}
    # Two new nodes, the controller's (its account through the program's grants), each a VM
    # whose boot reported its failure to the bucket and that was deleted within IDLE_S of it.
    assert [c[3] for c in cloud.creates(case.calls, cloud.controller)] == [200, 200], (
        cloud.api.calls
    )
    vms = [vm for vm in cloud.rehearsal.vms if vm not in booted and vm.name in halts]
    assert len(vms) == 2, [vm.name for vm in cloud.rehearsal.vms]
    for vm in vms:
        report = f"{cloud.boot_reports}/{vm.name}.failed"
        assert "stage release failed" in storage.read_text(report), vm.startup_log()[-2000:]
        written = recover.modified(report)
        assert written is not None and halts[vm.name] - written < IDLE_S, (vm.name, halts)
        assert not vm.machine.running()
        print(f"{vm.name}: deleted {halts[vm.name] - written:.1f} s after its boot failed")
    _took(case, "a")


# ---------------------------------------------------------------------------------------------
# (b) the first zone has no capacity


def test_a_zone_without_capacity_sends_the_new_node_to_the_next_zone(
    cloud: Cloud, controllers: Callable[..., Controller]
) -> None:
    stand_ins = StandIns(cloud.run_dir)
    case = _fresh(cloud, stand_ins)
    node = _up(cloud)
    controller = controllers()
    seen = _watching(controller, node)
    cloud.api.zone(ZONE).capacity = False
    cloud.api.preempt(node)
    controller.wait_for(f"in {ZONE_B}: READY and training", 60, seen)
    lines = controller.lines()[seen:]

    assert any(f"{ZONE}: cannot place" in line and "capacity" in line for line in lines), lines
    assert any(f"created in {ZONE_B}" in line for line in lines), lines
    # The controller's own creates, through its grants: the refused one, then the next zone's.
    zones = [c[2].split("/")[3] for c in cloud.creates(case.calls, cloud.controller)]
    assert zones == [ZONE, ZONE_B], cloud.api.calls
    _one_training(cloud, stand_ins, ZONE_B)
    _took(case, "b")


# ---------------------------------------------------------------------------------------------
# (c) a queued resource waits, then becomes ACTIVE


def test_a_queued_resource_waits_with_nothing_billing_then_its_node_trains(
    cloud: Cloud, controllers: Callable[..., Controller]
) -> None:
    stand_ins = StandIns(cloud.run_dir)
    case = _fresh(cloud, stand_ins, "queued")
    node = _up(cloud)
    controller = controllers()
    seen = _watching(controller, node)
    cloud.api.zone(ZONE).capacity = False
    cloud.api.preempt(node)  # its queued resource is SUSPENDED with it
    waiting = controller.wait_for("WAITING_FOR_RESOURCES", 60, seen)[0]
    time.sleep(3 * INTERVAL_S)
    queue = _node_name(cloud, ZONE).replace("/nodes/", "/queuedResources/")
    assert cloud.nodes() == {}  # nothing bills while it waits
    assert cloud.api.queued[queue]["state"]["state"] == "WAITING_FOR_RESOURCES"
    cloud.api.zone(ZONE).capacity = True
    controller.wait_for(f"in {ZONE}: READY and training", 60, waiting)

    assert list(cloud.api.queued) == [queue]
    assert [c[2] for c in cloud.creates(case.calls, cloud.controller)] == [queue.rsplit("/", 1)[0]]
    assert cloud.api.queued[queue]["state"]["state"] == "ACTIVE"
    assert _one_training(cloud, stand_ins, ZONE)["queuedResource"] == queue
    _took(case, "c")


# ---------------------------------------------------------------------------------------------
# (d) the controller is restarted in the middle of a recovery


def test_a_controller_killed_mid_recovery_is_restarted_and_adopts_its_node(
    cloud: Cloud, controllers: Callable[..., Controller], tmp_path: pathlib.Path
) -> None:
    stand_ins = StandIns(cloud.run_dir)
    case = _fresh(cloud, stand_ins)
    node = _up(cloud)
    cloud.api.create_s = 3.0  # the new node stays CREATING a while
    journal = tmp_path / "journal-train.json"
    first = controllers(journal=journal)
    _watching(first, node)
    cloud.api.preempt(node)
    deadline = time.monotonic() + 30
    while not (cloud.api.state(node) == "CREATING" and cloud.creates(case.calls, cloud.controller)):
        assert time.monotonic() < deadline, (cloud.api.state(node), first.lines()[-5:])
        time.sleep(0.05)
    first.kill()  # its create is in flight; systemd starts it again
    second = controllers(journal=journal)
    second.wait_for(f"in {ZONE}: READY and training", 60)
    lines = second.lines()

    assert not any("recreating" in line for line in lines), lines
    # Two creates, both answered: up's and the killed controller's; none by the restarted one.
    assert [c[3] for c in cloud.creates(case.calls)] == [200, 200], cloud.api.calls
    node_now = _one_training(cloud, stand_ins, ZONE)
    assert node_now["labels"][recover.ATTEMPT_LABEL] == "1"
    # The killed one journaled the recovery before its create: the count survives it.
    assert json.loads(journal.read_text())["recoveries"] == 1
    _took(case, "d")


# ---------------------------------------------------------------------------------------------
# (e) a laptop's `ops recover` and the controller at once


def test_a_laptops_recover_and_the_controller_at_once_make_one_node(
    cloud: Cloud, controllers: Callable[..., Controller], monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_ins = StandIns(cloud.run_dir)
    case = _fresh(cloud, stand_ins)
    node = _up(cloud)
    controller = controllers()
    seen = _watching(controller, node)
    # The laptop: one pass, as the operator (this process's credentials). The API answers
    # nobody from the preemption until the laptop has asked too (its token, then its first
    # read): both read PREEMPTED at the same moment and both set out to recreate the node.
    asked = threading.Event()
    issue = cloud.api.iam.issue_token

    def token_for(member: str) -> str:
        asked.set()  # the controller's token is cached: this is the laptop's
        return issue(member)

    monkeypatch.setattr(cloud.api.iam, "issue_token", token_for)
    said = cloud.logs / f"laptop-{time.monotonic_ns()}.log"
    with cloud.api._lock, said.open("w") as out:
        cloud.api.preempt(node)
        laptop = subprocess.Popen(
            [
                *(sys.executable, "-m", "infra.ops", "recover", "--vm", "train", "--yes"),
                *("--request", cloud.record_uri),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        assert asked.wait(60), "the laptop asked for no token"
        time.sleep(1.0)  # its first read follows the token at once, as the controller's came
    try:
        laptop.wait(60)
    except subprocess.TimeoutExpired:
        laptop.kill()
        laptop.wait()
        raise AssertionError(
            f"the laptop's pass did not end: {said.read_text()} {cloud.api.calls[case.calls :]}"
        ) from None
    controller.wait_for(f"in {ZONE}: READY and training", 60, seen)

    laptop_lines = said.read_text().splitlines()
    # Its pass ends in one line: the node created, adopted, or found DELETING or CREATING and
    # left to the controller; or, where the controller's delete of the lost node took the
    # laptop's new one (read before it was made), its create aborted, named (exit 4).
    aborted = "was deleted while being created" in laptop_lines[-1]
    assert laptop.returncode == (4 if aborted else 0), laptop_lines
    for who, lines in (("the laptop", laptop_lines), ("the controller", controller.lines())):
        assert any("PREEMPTED, TERMINATED or gone; recreating it" in x for x in lines), lines
        print(f"{who}: {[x.split(' recover: ', 1)[-1][:90] for x in lines[-3:]]}")
    # Creates answered: up's and one recoverer's, and a third only where one's new node was
    # taken by the other's delete (that create aborted, its caller told).
    taken = aborted or any("was deleted while being created" in x for x in controller.lines())
    ok = [c for c in cloud.creates(case.calls) if c[3] == 200]
    assert len(ok) == (3 if taken else 2), cloud.api.calls
    _one_training(cloud, stand_ins, ZONE)
    _took(case, "e")
