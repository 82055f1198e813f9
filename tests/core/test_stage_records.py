"""Stage records (workloads.common.stage_records): appended from several writers, read back per
boot, a torn line skipped, a stage cut short shown as such."""

from __future__ import annotations

import json
import multiprocessing
import pathlib

import pytest

from workloads.common import stage_records


def _write_many(path: str, source: str, count: int) -> None:
    log = stage_records.StageLog(path, source, boot="b1")
    for i in range(count):
        log.start(f"{source}-{i}")
        log.end(f"{source}-{i}", note="x" * 200)


def test_concurrent_writers_never_interleave_lines(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "state" / "stages.jsonl")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(path, f"w{n}", 200)) for n in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    lines = pathlib.Path(path).read_text().splitlines()
    assert len(lines) == 4 * 200 * 2
    assert all(json.loads(line)["boot"] == "b1" for line in lines)  # every line whole


def test_rows_of_the_latest_boot_in_boot_order_with_notes_and_failures(
    tmp_path: pathlib.Path,
) -> None:
    path = str(tmp_path / "stages.jsonl")
    old = stage_records.StageLog(path, "startup", boot="old")
    old.start("venv", at=100.0)
    old.end("venv")
    new = stage_records.StageLog(path, "startup", boot="new")
    new.start("boot", at=1000.0)
    new.end("boot", seconds=12.5)
    new.start("weights")
    new.end("weights", ok=False, note="network error")
    new.start("venv")
    new.end("venv", note="restored")
    trainer = stage_records.StageLog(path, "trainer", boot="new")
    trainer.start("compile")
    rows = stage_records.summarise(stage_records.read_records(path))
    assert [r["stage"] for r in rows] == ["boot", "venv", "weights", "compile"]
    by = {r["stage"]: r for r in rows}
    boot = by["boot"]
    assert (boot["start"], boot["seconds"], boot["state"]) == (1000.0, 12.5, "done")
    assert (by["venv"]["note"], by["venv"]["source"]) == ("restored", "startup")
    assert (by["weights"]["state"], by["weights"]["note"]) == ("failed", "network error")
    assert (by["compile"]["state"], by["compile"]["seconds"]) == ("running", None)
    lines = stage_records.format_rows(rows, now=by["compile"]["start"] + 30)
    assert lines[0] == "boot            started 00:16:40 UTC  12.5 s"
    assert lines[2].endswith(" FAILED  (network error)")
    assert lines[3].endswith("running for 30 s")
    # The old boot's stages are still there, for whoever asks for them.
    assert [
        r["stage"] for r in stage_records.summarise(stage_records.read_records(path), boot="old")
    ] == ["venv"]


def test_a_torn_last_line_and_a_stage_started_twice(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "stages.jsonl"
    log = stage_records.StageLog(str(path), "startup", boot="b")
    log.start("weights", at=10.0)
    log.start("weights", at=20.0)  # the first attempt was killed (no end)
    log.end("weights")
    with path.open("a") as f:
        f.write('{"stage": "venv", "event": "st')  # a writer killed mid-line
    (row,) = stage_records.summarise(stage_records.read_records(str(path)))
    assert (row["start"], row["state"]) == (20.0, "done")
    assert row["note"] == "an earlier attempt was cut short"


def test_a_failing_block_ends_its_stage_not_ok_and_an_unwritable_file_loses_nothing(
    tmp_path: pathlib.Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = stage_records.StageLog(
        str(blocker / "stages.jsonl"), "trainer", boot="b"
    )  # cannot be made
    with pytest.raises(RuntimeError), log.stage("load"):
        raise RuntimeError("boom")
    assert [(r["stage"], r["event"], r.get("ok")) for r in log.records] == [
        ("load", "start", None),
        ("load", "end", False),
    ]
    assert not log.is_open("load")
    assert [r["state"] for r in log.rows()] == ["failed"]  # from memory: no file


def test_the_boot_id_is_the_kernels(tmp_path: pathlib.Path) -> None:
    assert stage_records.boot_id(str(tmp_path / "missing")) == "unknown"
    (tmp_path / "id").write_text("abc-123\n")
    assert stage_records.boot_id(str(tmp_path / "id")) == "abc-123"
