"""benchmarks/startup.py's estimate: every stage names its source, the bands add up, and a band
above its target says so and names the largest stage (no target is reached by omission)."""

from __future__ import annotations

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
    assert "load || compile" in cold  # the compile bounds the trainer's part


def test_the_venv_restore_rate_comes_from_the_measurement():
    stages = dict((s[0], s) for s in startup.estimate(MEASURED)[2][2])
    restore = stages["venv: archive from the bucket"]
    assert "0.15 GB/s" in restore[3]
    without = dict((s[0], s) for s in startup.estimate({})[2][2])
    assert "not measured" in without["venv: archive from the bucket"][3]
