"""benchmarks/startup.py's estimate: every stage names its source, the bands add up, and a band
above its target says so and names the largest stage (no target is reached by omission)."""

from __future__ import annotations

import pytest

from benchmarks import startup

MEASURED = {
    "venv": {
        "subset": ["jax==0.10.2"],
        "subset_bytes": 440_000_000,
        "archive_bytes": 100_000_000,
        "pack_s": 4.6,
        "restore_s": 3.0,
        "install_s": 33.5,
        "install_error": None,
        "hub_client_s": 4.1,
    },
    "install": {"pip_s": 35.8, "uv_s": 14.1, "uv_dists": 104, "uv_bytes": 1_800_000_000},
    "data": {
        "rows": 10_000,
        "dataset_bytes": 9_000_000,
        "real_tokens": 1_510_000,
        "file_bytes": 6_300_000,
        "prepare_s": 4.2,
        "read_back_s": 0.13,
    },
    "staging": {"bytes": 1 << 30, "seconds": 3.8},
    "loading": {"bytes": 380_000_000, "devices": 4, "tunix": 3.9, "serial": 1.9, "parallel": 1.6},
}


def test_every_stage_has_a_source_and_the_totals_are_the_sums():
    scenarios = startup.estimate(MEASURED)
    assert [kind for _, kind, _ in scenarios] == ["cold", "warm", "new-vm"]
    text = startup.report(MEASURED)
    for title, _, stages in scenarios:
        assert all(source for *_, source in stages)
        assert all(0 < low <= high for _, low, high, _ in stages)
        low = sum(s[1] for s in stages)
        high = sum(s[2] for s in stages)
        assert f"# {title}: {startup._band(low, high)}" in text


def test_a_cold_band_above_ten_minutes_is_called_out():
    text = startup.report(MEASURED)
    cold = text.split("# COLD", 1)[1].split("\n# ", 1)[0]
    assert "-> above 10 min at the high end" in cold
    assert "compile || weights arrive + load" in cold  # the compile bounds the trainer's part


def stages_of(measured, kind):
    (stages,) = [s for _, k, s in startup.estimate(measured) if k == kind]
    return {stage[0]: stage for stage in stages}


def test_the_venv_restore_rate_comes_from_the_measurement():
    restore = stages_of(MEASURED, "new-vm")["venv archive, trainer start, data"]
    assert "0.15 GB/s" in restore[3]
    without = stages_of({}, "new-vm")["venv archive, trainer start, data"]
    assert "not measured" in without[3]


def test_a_new_vm_traces_the_step_while_the_bucket_copy_arrives():
    new_vm = stages_of(MEASURED, "new-vm")
    p = {k: v[0] for k, v in startup.PUBLIC.items()}
    before = new_vm["venv archive, trainer start, data"][1:3]
    _, low, high, source = new_vm["cached step || weights + load"]
    for i, value in enumerate((low, high)):
        gcs = startup.MODEL_GB / p["gcs_gbps"][::-1][i]
        load_after = max(gcs, before[i]) + p["load_s"][i] - before[i]
        assert value == max(p["cached_step_s"][i], load_after)
    assert "begun beside the venv" in source


def test_the_trainer_compiles_while_the_weights_arrive(monkeypatch):
    """Ready comes with the venv and the small files: the trainer's start, data and compile run
    beside the download, and the load waits for both the weights and the trainer."""
    cold = stages_of(MEASURED, "cold")
    assert "venv (uv) || hub client + weights" not in cold and "data: tokenize + pack" not in cold
    p = {k: v[0] for k, v in startup.PUBLIC.items()}
    ratio = 14.1 / 35.8
    venv = (14.1, 300 * ratio)
    hub = tuple(startup.MODEL_GB / g for g in p["hub_gbps"][::-1])
    client = (4.1, 3 * 4.1)
    _, low, high, source = cold["venv (uv), trainer start, data"]
    before = tuple(venv[i] + p["process_s"][i] + p["data_s"][i] for i in (0, 1))
    assert (low, high) == before
    assert "uv installs the whole pinned set in 14 s here (pip 36 s)" in source
    _, low, high, source = cold["compile || weights arrive + load"]
    for i, value in enumerate((low, high)):
        arrive_and_load = max(client[i] + hub[i], before[i]) + p["load_s"][i]
        assert value == max(p["compile_31b_s"][i], arrive_and_load - before[i])
    # With these figures the compile is the later at both ends: the download is hidden.
    assert (low, high) == p["compile_31b_s"]
    assert "the hub client's venv in 4 s here" in source
    # A slow download (0.05 GB/s: 21 min) is what the first step waits for instead.
    slow = dict(startup.PUBLIC, hub_gbps=((0.05, 0.05), "assumption: a slow hub"))
    monkeypatch.setattr(startup, "PUBLIC", slow)
    _, low, high, _ = stages_of(MEASURED, "cold")["compile || weights arrive + load"]
    download = startup.MODEL_GB / 0.05
    assert low == 4.1 + download + p["load_s"][0] - before[0]
    # Without the install measured, the venv is pip's and says it is an assumption.
    _, low, high, source = stages_of({}, "cold")["venv (uv), trainer start, data"]
    assert (low, high) == (150.0 + 20 + 15, 300.0 + 40 + 60)
    assert "uv not measured" in source


def test_a_restart_reads_the_data_back_at_the_measured_rate():
    warm = stages_of(MEASURED, "warm")
    assert "data: tokenize + pack" not in warm
    _, low, high, source = warm["data: read back"]
    rate = 1_510_000 / 0.13
    assert low == startup.EPOCH_REAL_TOKENS / rate and high == 4 * low
    assert "measured" in source
    assert "data" in stages_of(MEASURED, "cold")["venv (uv), trainer start, data"][0]
    text = startup.report(MEASURED)
    assert "read back from prepared_data.npz (6.3 MB) in 0.13 s (32x)" in text
    warm_line = next(line for line in text.splitlines() if line.startswith("# WARM"))
    assert "above" not in text.split("# WARM", 1)[1].split("\n# ", 1)[0]  # within 3 min
    assert warm_line.endswith("min")


COMPILE = {  # the tiny step: 8.6 s of compile after 9.3 s of load, 15.3 s when side by side
    "serial": {"load_s": 9.3, "total_s": 17.9},
    "overlapped": {"load_s": 15.3, "total_s": 15.3},
}


def _record(stage, event, at, **extra):
    return {"stage": stage, "event": event, "at": at, "boot": "b1", "source": "x", **extra}


def _records(compile_start, compile_end, weights_end=150.0):
    return [
        _record("weights", "start", 1000.0),
        _record("data", "start", 1040.0),
        _record("data", "end", 1060.0, ok=True),
        _record("compile_ahead", "start", 1000.0 + compile_start),
        _record("compile_ahead", "end", 1000.0 + compile_end, ok=True),
        _record("weights", "end", 1000.0 + weights_end, ok=True),
    ]


def test_the_compile_overlap_is_the_share_of_the_shorter_that_was_hidden():
    # 17.9 s serial, 15.3 s side by side: 2.6 s of the 8.6 s compile hidden.
    assert startup.compile_overlap(COMPILE) == pytest.approx(2.6 / 8.6)
    took_turns = {"serial": COMPILE["serial"], "overlapped": {"load_s": 9, "total_s": 19.0}}
    assert startup.compile_overlap(took_turns) == 0.0
    perfect = {"serial": COMPILE["serial"], "overlapped": {"load_s": 9.3, "total_s": 9.3}}
    assert startup.compile_overlap(perfect) == 1.0


def test_the_cold_stage_adds_what_the_measured_overlap_does_not_hide():
    measured = dict(MEASURED, compile=COMPILE)
    e = 2.6 / 8.6
    p = {k: v[0] for k, v in startup.PUBLIC.items()}
    before = stages_of(measured, "cold")["venv (uv), trainer start, data"][1:3]
    hub = tuple(startup.MODEL_GB / g for g in p["hub_gbps"][::-1])
    _, low, high, source = stages_of(measured, "cold")["compile || weights arrive + load"]
    for i, value in enumerate((low, high)):
        rest = max(4.1 * (1, 3)[i] + hub[i], before[i]) + p["load_s"][i] - before[i]
        a, b = p["compile_31b_s"][i], rest
        assert value == pytest.approx(max(a, b) + (1 - e) * min(a, b))
    assert "hid 30% of the shorter here" in source
    assert low > p["compile_31b_s"][0]  # not the perfect overlap any more


def test_stage_records_give_the_order_and_a_compile_after_the_weights_adds_up():
    inside = startup.record_overlap(_records(60.0, 120.0))
    assert inside["compile_inside"] == 1.0 and inside["data_start_s"] == 40.0
    half = startup.record_overlap(_records(120.0, 180.0))
    assert half["compile_inside"] == pytest.approx(0.5)
    measured = dict(MEASURED, compile=COMPILE, records=inside)
    _, _, _, source = stages_of(measured, "cold")["compile || weights arrive + load"]
    assert "compile beginning 60 s into the weights' 150 s (100% of it while they arrived)" in (
        source
    )
    late = dict(MEASURED, compile=COMPILE, records=startup.record_overlap(_records(170.0, 200.0)))
    p = {k: v[0] for k, v in startup.PUBLIC.items()}
    _, low, _, source = stages_of(late, "cold")["compile || weights arrive + load"]
    before = stages_of(late, "cold")["venv (uv), trainer start, data"][1]
    hub = startup.MODEL_GB / p["hub_gbps"][1]
    rest = max(4.1 + hub, before) + p["load_s"][0] - before
    assert low == pytest.approx(p["compile_31b_s"][0] + rest)  # no overlap: the sum
    assert "20 s after the weights were staged" in source
    with pytest.raises(ValueError, match="compile_ahead start"):
        startup.record_overlap([r for r in _records(1, 2) if r["stage"] != "compile_ahead"])
