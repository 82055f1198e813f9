"""Metrics files: resume keeps the steps before the checkpoint, gs:// run dirs get a mirror,
run segments total a resumed run."""

from __future__ import annotations

import json

from workloads.common import storage
from workloads.train import metrics


def record(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.0 / step,
        "learning_rate": 1e-4,
        "grad_norm": 0.5,
        "tokens_per_s": 100.0,
        "computed_tokens_per_s": 120.0,
        "device_memory_bytes": None,
        "host_rss_bytes": 2**30,
        "step_seconds": 0.1,
    }


def test_resume_drops_records_after_the_checkpoint_and_a_cut_line(tmp_path, capsys):
    run = tmp_path / "run"
    first = metrics.RunLog(str(run), resume_step=0, total_steps=6)
    for step in range(1, 6):
        first.log(record(step))
    first.close()
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "lo')  # killed mid-write
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "step 1/6  loss 1.0000  lr 1.00e-04  grad_norm 0.500  100 real tok/s (120 computed)  "
        "mem rss 1.0GiB  0.10 s/step"
    )

    resumed = metrics.RunLog(str(run), resume_step=3, total_steps=6)
    assert [r["step"] for r in resumed.records] == [1, 2, 3]
    resumed.log(record(4))
    resumed.close()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per process


def test_remote_run_dir_is_written_through_a_local_mirror():
    run = "memory://bucket/runs/remote-test"
    log = metrics.RunLog(run, resume_step=0, total_steps=2)
    log.log(record(1))
    assert not storage.exists(f"{run}/metrics.jsonl")  # uploaded at checkpoints and at the end
    log.sync()
    assert json.loads(storage.read_text(f"{run}/metrics.jsonl"))["step"] == 1
    log.log(record(2))
    log.close()
    assert len(storage.read_text(f"{run}/metrics.jsonl").splitlines()) == 2
    assert any(name.startswith("tensorboard/") for name in storage.list_files(run))
    again = metrics.RunLog(run, resume_step=1, total_steps=2)
    assert [r["step"] for r in again.records] == [1]


def test_no_accelerator_peak_on_cpu():
    assert metrics.accelerator() == (None, None)
    assert metrics.device_memory() == (None, None)


def test_segments_total_wall_time_and_count_each_final_step_once(tmp_path):
    run = str(tmp_path / "run")
    # Process 1 recorded steps 1..6 and died; process 2 resumed from the checkpoint at step 4,
    # so steps 5 and 6 ran twice: their time is spent twice, their tokens are trained once.
    first = metrics.Segment(run, start_step=0, computed_per_step=100, accelerator=None)
    for step in range(1, 7):
        first.record(step, 10 * step)
    first.record(6, 60)  # idempotent
    first.write(wall_seconds=50.0)
    second = metrics.Segment(run, start_step=4, computed_per_step=100, accelerator=None)
    for step in range(5, 9):
        second.record(step, 11 * step)
    on_disk = second.write("finished", wall_seconds=30.0)
    assert on_disk["end_step"] == 8 and on_disk["real_tokens"] == 11 * (5 + 6 + 7 + 8)
    assert on_disk["computed_tokens"] == 400 and on_disk["status"] == "finished"

    found = metrics.read_segments(run)
    assert set(found) == {first.path, second.path}
    assert all(p.startswith(f"{run}/segments/") for p in found)
    totals = metrics.combine_segments(list(found.values()), 8)
    assert totals["segments"] == 2 and totals["wall_seconds"] == 80.0
    # Steps 1-4 from the first process, 5-8 (run twice) from the second one only.
    assert totals["real_tokens"] == 10 * (1 + 2 + 3 + 4) + 11 * (5 + 6 + 7 + 8)
    assert totals["computed_tokens"] == 8 * 100
    assert totals["steps_run"] == 10 and totals["untracked_steps"] == 0
    assert totals["tokens_per_second"] == totals["real_tokens"] / 80.0
    assert totals["compile_seconds"] is None  # no JAX compile events recorded here


def test_steps_without_a_segment_come_from_the_metrics_records_or_are_counted():
    seg = {
        "start_step": 2,
        "steps": 2,
        "wall_seconds": 5.0,
        "compile_seconds": 1.5,
        "computed_tokens_per_step": 100,
        "step_real_tokens": [30, 40],
        "started_at": 1.0,
    }
    totals = metrics.combine_segments([seg], 4, fallback={1: 7})
    assert totals["real_tokens"] == 7 + 30 + 40 and totals["untracked_steps"] == 1
    assert totals["computed_tokens"] == 300 and totals["compile_seconds"] == 1.5


def test_remote_segments_are_written_atomically_in_place():
    run = "memory://bucket/runs/segments-test"
    seg = metrics.Segment(run, start_step=0, computed_per_step=10, accelerator="v5p-8")
    seg.record(1, 5)
    seg.write()
    seg.record(2, 6)
    seg.write("stopped", wall_seconds=2.0)
    (data,) = metrics.read_segments(run).values()
    assert (data["end_step"], data["real_tokens"], data["status"]) == (2, 11, "stopped")
    assert (
        metrics.Segment(run, start_step=0, computed_per_step=1, accelerator=None).path != seg.path
    )
