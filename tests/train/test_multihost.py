"""The multi-host slice on JAX's real multi-process runtime: one trainer process per "host" on
this machine, each with 4 CPU devices, joined by jax.distributed (gloo collectives) on the
v5p-16 mesh shape fsdp=2 x tp=4 (v5p-32: 4 hosts, fsdp=4 x tp=4), exactly as the VMs start them
(workloads.train.hosts reads the same variables).

The trainer runs take minutes on 2 shared cores (each process compiles the step), so they are
marked slow; the parsing and the bounded exit of a lost host's peers run by default.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from workloads.common import errors
from workloads.train import hosts

STEPS = 8
SAVE_EVERY = 4
# A host killed mid-run: its peers must be gone within the heartbeat timeout the tests set
# (hosts.rehearsal_env) plus the time JAX takes to notice and abort, not hang in a collective.
HEARTBEAT_S = 5
PEERS_GONE_WITHIN_S = 60


# --- where a worker stands (fast) ---------------------------------------------------------


def test_the_worker_list_and_number_give_coordinator_count_and_id():
    env = {
        hosts.ENDPOINTS_ENV: "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3",
        hosts.WORKER_ENV: "1",
    }
    assert hosts.from_env(env) == hosts.Hosts("10.0.0.2:8482", 2, 1)
    env = {**env, hosts.ENDPOINTS_ENV: "w-0,w-1,w-2,w-3", hosts.PORT_ENV: "9000"}
    env[hosts.HEARTBEAT_ENV] = "7"
    assert hosts.from_env(env) == hosts.Hosts("w-0:9000", 4, 1, heartbeat_timeout_s=7)


def test_one_worker_or_none_is_a_one_host_run():
    assert hosts.from_env({}) is None
    assert hosts.from_env({hosts.ENDPOINTS_ENV: "10.0.0.2", hosts.WORKER_ENV: "0"}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {hosts.ENDPOINTS_ENV: "a,b", hosts.WORKER_ENV: "2"},
            "GEMMA4_WORKER='2': must be an integer from 0 to 1",
        ),
        ({hosts.ENDPOINTS_ENV: "a,b"}, "GEMMA4_WORKER='': must be an integer from 0 to 1"),
        (
            {hosts.ENDPOINTS_ENV: "a,,b", hosts.WORKER_ENV: "0"},
            "GEMMA4_WORKER_ENDPOINTS='a,,b': entry '' is neither an address nor name:id:address",
        ),
        (
            {hosts.ENDPOINTS_ENV: "a,b", hosts.WORKER_ENV: "0", hosts.PORT_ENV: "70000"},
            "GEMMA4_COORDINATOR_PORT='70000': must be an integer from 1 to 65535",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_variable(env, message):
    with pytest.raises(errors.UserError) as caught:
        hosts.from_env(env)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


_PEER = """
import sys, time
from workloads.train import hosts
hosts.join(hosts.from_env())
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
print("joined", jax.process_count(), jax.device_count(), flush=True)
while True:
    multihost_utils.process_allgather(jnp.ones(4))
    time.sleep(0.05)
"""


def test_a_killed_host_ends_its_peers_within_the_heartbeat_then_all_join_again(tmp_path):
    """The JAX runtime alone (no model): kill host 1, restart it alone as systemd would; host 0
    must exit non-zero within the bound (not wait in a collective), and once every host is
    started again they form a slice again."""
    argv = [sys.executable, "-c", _PEER]
    port = hosts.free_port()

    def start(index=None):
        return hosts.launch_local(
            2,
            argv,
            port=port,
            devices_per_host=2,
            log_dir=str(tmp_path),
            index=index,
            heartbeat_s=HEARTBEAT_S,
        )

    procs = start()
    try:
        _wait_for(lambda: _log(tmp_path, 0).count("joined 2 4") == 1, 120, procs)
        _wait_for(lambda: _log(tmp_path, 1).count("joined 2 4") == 1, 120, procs)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs[1].wait(30)
        procs.update(start(1))  # the lost worker's unit restarts it alone
        code = procs[0].wait(PEERS_GONE_WITHIN_S)
        gone_after = time.time() - killed_at
        assert code != 0, _log(tmp_path, 0)
        # Every unit restarted: whatever is left of worker 1 goes too (systemd stops a unit's
        # old process before starting it again).
        if procs[1].poll() is None:
            procs[1].kill()
            procs[1].wait(30)
        procs = start()
        _wait_for(lambda: _log(tmp_path, 0).count("joined 2 4") == 2, 120, procs)
        _wait_for(lambda: _log(tmp_path, 1).count("joined 2 4") >= 2, 120, procs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert gone_after < PEERS_GONE_WITHIN_S, gone_after


def _log(log_dir: pathlib.Path, index: int) -> str:
    path = log_dir / f"host{index}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(condition, timeout_s: float, procs: dict) -> None:
    """Waits until condition() holds. Fails at once when every host process has exited first
    (nothing is left that could make it true: without this a slice that died at start-up, say
    a collective's setup timing out on a starved machine, held the test for its whole limit),
    naming their exit statuses; else after timeout_s."""
    deadline = time.time() + timeout_s
    while not condition():
        codes = [p.poll() for p in procs.values()]
        if codes and None not in codes:
            if condition():
                return
            raise AssertionError(f"every host exited (statuses {codes}) before the wait ended")
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s")
        time.sleep(0.2)


# --- a run directory every host must share -----------------------------------------------

# Joining, one check and the exit: a host that does not see host 0's token looks again for
# hosts.SHARED_LOOK_S; JAX's start and the shutdown barrier take the rest.
UNSHARED_STOPS_WITHIN_S = 120

_CHECK = """
import sys
from workloads.train import hosts
hosts.join(hosts.from_env())
hosts.check_shared_directory(sys.argv[1])
print("shared", flush=True)
"""


def _start_each(argvs: list[list[str]], log_dir: pathlib.Path, devices: int = 2) -> dict:
    """Worker i of a 2-host slice runs argvs[i] (each its own command line, as each VM has its
    own disk and its own config)."""
    port = hosts.free_port()
    procs: dict = {}
    for i, argv in enumerate(argvs):
        procs.update(
            hosts.launch_local(
                len(argvs),
                argv,
                port=port,
                devices_per_host=devices,
                log_dir=str(log_dir),
                index=i,
                heartbeat_s=HEARTBEAT_S,
            )
        )
    return procs


def _wait_all(procs: dict, timeout_s: float) -> list[int | None]:
    deadline = time.time() + timeout_s
    try:
        while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return [procs[i].returncode if time.time() < deadline else None for i in sorted(procs)]


def test_hosts_sharing_the_run_directory_pass_the_check_and_leave_no_token(tmp_path):
    shared = tmp_path / "run"
    argv = [sys.executable, "-c", _CHECK, str(shared)]
    codes = _wait_all(_start_each([argv, argv], tmp_path / "logs"), UNSHARED_STOPS_WITHIN_S)
    assert codes == [0, 0], [_log(tmp_path / "logs", i)[-2000:] for i in (0, 1)]
    assert all("shared" in _log(tmp_path / "logs", i) for i in (0, 1))
    assert list(shared.iterdir()) == []  # the token is removed once every host has looked


def test_a_fresh_run_whose_hosts_have_their_own_local_run_directory_stops_at_once(
    slice_config, tmp_path
):
    """Each worker given its own local output_dir (a VM's own disk): before anything is
    trained, every host exits 2 with one line naming its directory and what is allowed. Before
    the check they trained on, each saving its part of every checkpoint where the other could
    not read it."""
    logs = tmp_path / "logs"
    configs = [slice_config(tmp_path / f"vm{i}") for i in (0, 1)]
    argvs = [[sys.executable, "-m", "workloads", "train", "--config", str(c)] for c in configs]
    started = time.time()
    codes = _wait_all(_start_each(argvs, logs, devices=4), UNSHARED_STOPS_WITHIN_S)
    took = time.time() - started
    assert codes == [2, 2], ([_log(logs, i)[-2000:] for i in (0, 1)], took)
    for i in (0, 1):
        errors_said = [line for line in _log(logs, i).splitlines() if line.startswith("error:")]
        assert errors_said == [
            f"error: train.output_dir={tmp_path / f'vm{i}' / 'run'}: host(s) 1 of 2 do not see "
            "the files host 0 writes there; a multi-host run needs a directory every host "
            "shares (a gs:// bucket or a shared filesystem)"
        ], _log(logs, i)[-2000:]
        assert not (tmp_path / f"vm{i}" / "run" / "checkpoints").exists()
    assert took < UNSHARED_STOPS_WITHIN_S


# --- the trainer on 2 and 4 hosts (slow) --------------------------------------------------


@pytest.fixture(scope="module")
def tp4_model_dir(tmp_path_factory):
    """The tiny model with 4 global KV heads: tp=4 (a v5p worker's 4 chips) must divide them."""
    from workloads.model import tiny_model

    return tiny_model.write_tiny_model(
        tmp_path_factory.mktemp("tp4_model") / "model",
        seed=0,
        global_kv_heads=tiny_model.TP4_GLOBAL_KV_HEADS,
    )


@pytest.fixture(scope="module")
def slice_config(base_config, tp4_model_dir):
    """`slice_config(dir, fsdp, output_dir, steps)`: the reference run config on mesh fsdp x
    tp=4 (2 rows per host per micro-batch), output under output_dir (default dir/run), `steps`
    optimizer steps (default STEPS); returns the config file, written to dir."""

    def make(
        directory: pathlib.Path, fsdp: int = 2, output_dir: str = "", steps: int = STEPS
    ) -> pathlib.Path:
        from workloads.contract import runconfig

        data = copy.deepcopy(base_config)
        data["model"]["base"] = str(tp4_model_dir)
        data["train"].update(
            output_dir=output_dir or str(directory / "run"),
            micro_batch=2 * fsdp,
            mesh={"fsdp": fsdp, "tp": 4},
            log_every=1,
            max_steps=steps,
        )
        cfg = runconfig.parse(data)
        path = directory / "run.json"
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg.model_dump(mode="json")))
        return path

    return make


def _worker_argv(config: pathlib.Path, report: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "tests.train.multihost_worker", str(config), str(report)]


def _run_slice(config, report, count=2, timeout_s=900, extra_env=None) -> list[int]:
    procs = hosts.launch_local(
        count,
        _worker_argv(config, report),
        port=hosts.free_port(),
        devices_per_host=4,
        log_dir=str(report),
        heartbeat_s=HEARTBEAT_S,
        extra_env=extra_env,
    )
    deadline = time.time() + timeout_s
    try:
        while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            time.sleep(0.5)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return [p.wait() for p in procs.values()]


def _report(report: pathlib.Path, index: int) -> dict:
    return json.loads((report / f"host{index}.json").read_text())


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_started(slice_config, tmp_path_factory):
    """The same global batch as two_host_run on one process with all 8 devices (no worker
    list), started in the background before that slice: the slice's two processes wait for
    each other at every collective, and this run uses the core they leave idle (the two ran
    one after the other in 148 s in CI at 15f02bb). Yields (dir, process, log file)."""
    top = tmp_path_factory.mktemp("one_process")
    config, report = slice_config(top), top / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMMA4_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    log_path = top / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _worker_argv(config, report), env=env, stdout=log, stderr=subprocess.STDOUT
        )
    yield top, proc, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def two_host_run(slice_config, tmp_path_factory, one_process_started):
    """An uninterrupted 2-host run: (run dir, report dir). The one-process run of the same
    batch runs beside it (one_process_started)."""
    top = tmp_path_factory.mktemp("two_hosts")
    config, report = slice_config(top), top / "report"
    codes = _run_slice(config, report)
    assert codes == [0, 0], [_log(report, i)[-3000:] for i in (0, 1)]
    return top / "run", report


@pytest.fixture(scope="module")
def one_process_run(one_process_started):
    """The one-process run, finished: (run dir, report dir)."""
    top, proc, log_path = one_process_started
    assert proc.wait(timeout=900) == 0, log_path.read_text()[-6000:]
    return top / "run", top / "report"


@pytest.mark.slow
@pytest.mark.alone
def test_each_host_feeds_its_own_rows_and_together_every_row_once(two_host_run, one_process_run):
    _, report = two_host_run
    # The stream builds one micro-batch past the last step before it sees the end: not fed.
    hosts_fed = [_report(report, i)["fed"][: STEPS * 2] for i in (0, 1)]
    whole = _report(one_process_run[1], 0)["fed"][: STEPS * 2]
    assert len(hosts_fed[0]) == len(hosts_fed[1]) == len(whole) == STEPS * 2
    for batch, first, second in zip(whole, *hosts_fed, strict=True):
        assert first[0] == second[0] == batch[0]  # the same micro-batch position
        # Host 0 the first half of the global micro-batch, host 1 the second: what the
        # fsdp axis puts on their devices.
        assert first[1:] + second[1:] == batch[1:]
    # Over the first epoch every planned row is fed exactly once, by one host; the rest of
    # the last micro-batch is all-padding rows (identical, so one digest several times).
    info = _report(report, 0)
    per_epoch = info["batches_per_epoch"]
    assert per_epoch <= STEPS * 2  # the run covers a whole epoch
    epoch = collections.Counter(
        row for fed in hosts_fed for batch in fed if int(batch[0]) < per_epoch for row in batch[1:]
    )
    once = [row for row, n in epoch.items() if n == 1]
    repeated = {row: n for row, n in epoch.items() if n > 1}
    assert len(once) == info["planned_rows"]
    assert len(repeated) <= 1
    padding = per_epoch * info["global_micro_batch"] - info["planned_rows"]
    assert sum(repeated.values()) == padding


@pytest.mark.slow
@pytest.mark.alone
def test_only_the_primary_host_writes_metrics_and_summaries(two_host_run):
    run_dir, report = two_host_run
    primary, other = _report(report, 0), _report(report, 1)
    assert other["writes"] == [], other["writes"]
    written = set(primary["writes"])
    assert {"metrics.jsonl", "train_summary.json"} <= written, written
    assert any(path.startswith("segments/") for path in written), written
    steps = [r["step"] for r in _metrics(run_dir)]
    assert steps == list(range(1, STEPS + 1))  # one writer: every step once
    assert len(list((run_dir / "segments").iterdir())) == 1


@pytest.mark.slow
@pytest.mark.alone
def test_two_hosts_follow_the_one_process_loss_curve(two_host_run, one_process_run):
    ours = [r["loss"] for r in _metrics(two_host_run[0])]
    single = [r["loss"] for r in _metrics(one_process_run[0])]
    # Same global batch, same mesh, same program: only the reductions that cross hosts go
    # through gloo instead of in-process, which sums float32 partials in another order (~1e-7
    # relative each). Measured over 8 AdamW steps: at most 6.2e-7 relative; a wrong row split
    # or a host training on its own would be off by 1e-2 and more.
    np.testing.assert_allclose(ours, single, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.alone
def test_the_merge_reads_what_two_hosts_saved(two_host_run, tp4_model_dir, tmp_path):
    from workloads import merge

    out = str(tmp_path / "merged")
    merge.merge_lora(str(tp4_model_dir), str(two_host_run[0] / "checkpoints"), out, progress=False)
    report = merge.verify_merged(out, base=str(tp4_model_dir))
    assert report.ok, report.summary()
    logits = merge.compare_logits(str(tp4_model_dir), str(two_host_run[0] / "checkpoints"), out)
    assert logits.max_abs_diff < 1e-4, logits.summary()


def _kill_host_1_once_saved(argv: list[str], log_dir: pathlib.Path, saved) -> float:
    """Starts a 2-host slice slowed down after checkpoint SAVE_EVERY, SIGKILLs host 1 once
    `saved()` is true, restarts it alone (its unit), then restarts every worker that fails (a
    supervisor standing in for systemd's Restart=on-failure) until all have exited 0.

    Returns:
        The seconds host 0 took to exit after the kill.
    """
    slow = {"MH_DELAY_AFTER_STEP": str(SAVE_EVERY), "MH_DELAY_S": "2"}
    port = hosts.free_port()

    def start(index=None, env=None):
        return hosts.launch_local(
            2,
            argv,
            port=port,
            devices_per_host=4,
            log_dir=str(log_dir),
            index=index,
            heartbeat_s=HEARTBEAT_S,
            extra_env=env,
        )

    procs = start(env=slow)
    try:
        _wait_for(saved, 900, procs)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs[1].wait(30)
        procs.update(start(1))
        code = procs[0].wait(PEERS_GONE_WITHIN_S)
        gone_after = time.time() - killed_at
        assert code != 0
        deadline = time.time() + 900
        while time.time() < deadline:
            codes = {i: p.poll() for i, p in procs.items()}
            if all(c == 0 for c in codes.values()):
                break
            for i, c in codes.items():
                if c not in (None, 0):
                    procs.update(start(i))
            time.sleep(1)
        assert all(p.poll() == 0 for p in procs.values()), _log(log_dir, 0)[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return gone_after


def _worst_weight_diff(checkpoints: str, reference: str) -> float:
    from workloads.checkpoint import lora_restore

    ours = lora_restore.restore_lora_params(checkpoints, STEPS)
    theirs = lora_restore.restore_lora_params(reference, STEPS)
    assert ours.keys() == theirs.keys()
    return max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours)


@pytest.mark.slow
@pytest.mark.alone
def test_a_host_killed_mid_run_ends_the_slice_and_all_resume_to_the_same_weights(
    two_host_run, slice_config, tmp_path
):
    """SIGKILL host 1 after the first checkpoint; its unit restarts it alone; host 0 must exit
    within the bound; then every worker is restarted and the run resumes and ends on the
    uninterrupted run's weights."""
    config = slice_config(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    gone_after = _kill_host_1_once_saved(
        _worker_argv(config, tmp_path / "report"),
        tmp_path / "logs",
        lambda: (checkpoints / str(SAVE_EVERY) / "_CHECKPOINT_METADATA").is_file(),
    )
    assert gone_after < PEERS_GONE_WITHIN_S, gone_after
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == SAVE_EVERY
    worst = _worst_weight_diff(str(checkpoints), str(two_host_run[0] / "checkpoints"))
    # Same data order, dropout keys and optimizer state as the uninterrupted run.
    assert worst <= 1e-6, worst


@pytest.mark.slow
@pytest.mark.alone
def test_a_host_killed_mid_gs_run_and_all_resume_from_the_bucket_to_the_same_weights(
    two_host_run, slice_config, gcs_bucket, tmp_path
):
    """The same on the TPU VMs' layout: the run directory (checkpoints, metrics, lock, data
    cache) in a gs:// bucket of the GCS protocol server, written by both hosts' Orbax through
    TensorStore's GCS driver. The restart resumes from the bucket's newest checkpoint and ends
    on the uninterrupted local 2-host run's weights (same data, mesh and settings)."""
    from workloads.checkpoint import lora_restore
    from workloads.common import storage

    run = f"{gcs_bucket}/run"
    config = slice_config(tmp_path, output_dir=run)
    gone_after = _kill_host_1_once_saved(
        _worker_argv(config, tmp_path / "report"),
        tmp_path / "logs",
        # GCS has no rename: a step is complete once its commit marker is there.
        lambda: storage.exists(f"{run}/checkpoints/{SAVE_EVERY}/commit_success.txt"),
    )
    assert gone_after < PEERS_GONE_WITHIN_S, gone_after
    assert lora_restore.saved_steps(f"{run}/checkpoints") == [SAVE_EVERY, STEPS]
    summary = json.loads(storage.read_text(f"{run}/train_summary.json"))
    assert summary["resumed_from_step"] == SAVE_EVERY
    assert summary["checkpoint_steps"] == [SAVE_EVERY, STEPS]
    steps = [
        json.loads(line)["step"] for line in storage.read_text(f"{run}/metrics.jsonl").splitlines()
    ]
    assert steps == list(range(1, STEPS + 1))
    assert not storage.exists(f"{run}/train.lock")
    worst = _worst_weight_diff(f"{run}/checkpoints", str(two_host_run[0] / "checkpoints"))
    assert worst <= 1e-6, worst


@pytest.mark.slow
@pytest.mark.alone
def test_sigterm_on_one_host_stops_every_host_at_the_same_checkpointed_step(slice_config, tmp_path):
    config = slice_config(tmp_path)
    procs = hosts.launch_local(
        2,
        _worker_argv(config, tmp_path / "report"),
        port=hosts.free_port(),
        devices_per_host=4,
        log_dir=str(tmp_path / "logs"),
        heartbeat_s=HEARTBEAT_S,
        extra_env={"MH_DELAY_AFTER_STEP": "1", "MH_DELAY_S": "1"},
    )
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics_file.exists() and metrics_file.read_text().strip(), 900, procs)
        procs[1].send_signal(signal.SIGTERM)  # the notice reaches one worker only
        codes = [p.wait(300) for p in procs.values()]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert codes == [143, 143], _log(tmp_path / "logs", 0)[-3000:]
    from workloads.checkpoint import lora_restore

    saved = lora_restore.saved_steps(str(tmp_path / "run" / "checkpoints"))
    last = _metrics(tmp_path / "run")[-1]["step"]
    assert saved and saved[-1] == last < STEPS


@pytest.mark.slow
@pytest.mark.alone
def test_four_hosts_train_the_v5p_32_mesh_shape(slice_config, tmp_path):
    """4 processes x 4 CPU devices, fsdp=4 x tp=4 (the v5p-32 shape), to the first checkpoint:
    SAVE_EVERY steps. Each step's collectives cross 4 processes through gloo, the slowest steps
    of the suite on 2 cores; what more steps would show (resuming, every row fed once, the loss
    curve), the 2-host tests show."""
    config = slice_config(tmp_path, fsdp=4, steps=SAVE_EVERY)
    codes = _run_slice(config, tmp_path / "report", count=4, timeout_s=1500)
    assert codes == [0, 0, 0, 0], _log(tmp_path / "report", 0)[-3000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["steps"] == SAVE_EVERY
    assert summary["checkpoint_steps"] == [SAVE_EVERY]
    assert [_report(tmp_path / "report", i)["count"] for i in range(4)] == [4] * 4
