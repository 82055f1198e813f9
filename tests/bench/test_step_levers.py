"""benchmarks/step_levers.py: the segment-skip count agrees with the mask it stands for, and the
report reads cached lever results without compiling."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from benchmarks import step_levers


def _brute_force(spans, length, block, window):
    """Blocks of the dense mask (same segment, causal, within the window) with any entry set."""
    seg = np.zeros(length, int)
    for i, (s, e) in enumerate(spans, start=1):
        seg[s:e] = i
    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    allowed = (seg[:, None] == seg[None, :]) & (seg[:, None] > 0) & (k <= q)
    if window is not None:
        allowed &= q - k < window
    blocks = allowed.reshape(length // block, block, length // block, block).any(axis=(1, 3))
    return int(blocks.sum())


def test_the_31b_rows_static_counts():
    whole = [(0, 3072)]
    assert step_levers.visited_blocks(whole, 3072, 512, None) == 21  # causal: 6 * 7 / 2
    assert step_levers.visited_blocks(whole, 3072, 512, 1024) == 15  # diagonal + 2 back
    two = [(0, 512), (512, 3072)]
    assert step_levers.visited_blocks(two, 3072, 512, None) == 1 + 15
    assert step_levers.visited_blocks(two, 3072, 512, 1024) == 1 + 12


@pytest.mark.parametrize("seed", range(20))
def test_segment_aware_count_matches_the_dense_mask(seed):
    rng = np.random.default_rng(seed)
    length, block = 96, 8
    cuts = sorted(rng.choice(np.arange(1, length), size=rng.integers(0, 6), replace=False))
    end = int(rng.integers(length // 2, length + 1))  # padding after the last sample
    bounds = [0, *[c for c in cuts if c < end], end]
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    for window in (None, 5, 12, 40):
        assert step_levers.visited_blocks(spans, length, block, window) == _brute_force(
            spans, length, block, window
        ), (spans, window)


def test_the_report_reads_cached_results_without_compiling(tmp_path, monkeypatch, capsys):
    from infra.preflight import compile_check

    monkeypatch.setattr(compile_check, "LEVER_DIR", tmp_path)
    monkeypatch.setattr(
        step_levers.subprocess, "run", lambda *a, **k: pytest.fail("compiled instead of reading")
    )
    key = compile_check.cache_key(compile_check.step_settings(step_levers.stack("prod")))

    def entry(lever, layers, peak, seconds, ring):
        result = {
            "lever": lever,
            "layers": layers,
            "peak_bytes": peak,
            "flops": 5e13 * layers / 6,
            "kernel_flops": 4e12 * layers / 6,
            "optimal_seconds": seconds,
            "compile_seconds": 1.0,
            "collectives": {
                "count": {"all-gather": 10 * layers},
                "buffer_bytes": {"all-gather": ring * 4 / 3},
                "ring_bytes": {"all-gather": ring},
                "unknown_trip_counts": 0,
            },
        }
        (tmp_path / f"{key}-{lever}-{layers}.json").write_text(json.dumps(result))

    for layers in (6, 12):
        scale = layers / 6
        entry("baseline", layers, 9e9 * scale, 0.2 * scale, 4e9 * scale)
        entry("split-backward", layers, 9.5e9 * scale, 0.19 * scale, 4e9 * scale)
    monkeypatch.setattr(
        step_levers,
        "segment_skip",
        lambda *a, **k: {
            "rows": 10.0,
            "static_global": 21.0,
            "static_local": 15.0,
            "aware_global": 10.5,
            "aware_local": 15.0,
        },
    )
    assert step_levers.main(["--depths", "6,12", "--only", "split-backward"]) == 0
    out = capsys.readouterr().out
    assert "| split-backward | 12 |" in out
    assert "split-backward  XLA time      2.000 ->    1.900 s (-5.0%)" in out
    assert "40.0 GB sent per chip by a ring" in out  # 4 GB per 6 layers, at 60 layers
    assert "global layers visit 21 blocks, 10.5 needed" in out


def test_an_unknown_lever_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        step_levers.main(["--only", "fast-please"])
    assert exc.value.code == 2
    assert "unknown lever(s) fast-please" in capsys.readouterr().err


def test_the_benchmarks_page_quotes_the_committed_lever_results():
    """The levers table of docs/benchmarks.md is what step_levers prints from the committed
    results of today's step (after a change of the step, re-run `benchmarks/step_levers.py
    --depths 6,12` and commit what it writes to .compile-check/levers/)."""
    from infra.preflight import compile_check

    key = compile_check.cache_key(compile_check.step_settings(step_levers.stack("prod")))
    page = (compile_check.ROOT / "docs" / "benchmarks.md").read_text()
    heading = "\n### Levers tried on the step\n"
    assert heading in page, "docs/benchmarks.md has no levers section"
    # The section: from its heading to the next heading of any level.
    section = re.split(r"\n#{1,6} ", page.split(heading, 1)[1], maxsplit=1)[0]
    assert "| lever |" in section, "the levers section of docs/benchmarks.md has no table"
    for lever in step_levers.LEVERS:
        paths = [compile_check.lever_path(key, lever, layers) for layers in (6, 12)]
        missing = [p.name for p in paths if not p.is_file()]
        assert not missing, f"no committed lever result for today's step: {missing}"
        results = [json.loads(p.read_text()) for p in paths]
        for value, text in (
            (lambda r: r["peak_bytes"] / 2**30, "{:.1f} GiB"),
            (lambda r: r["flops"] / 1e12, "{:.1f} TFLOP"),
            (lambda r: r["optimal_seconds"], "{:.3f} s"),
            (lambda r: sum(r["collectives"]["ring_bytes"].values()) / 1e9, "{:.1f} GB"),
        ):
            quoted = text.format(step_levers._at(results, 60, value))
            assert quoted in section, (
                f"docs/benchmarks.md's levers table does not quote {lever}'s {quoted}"
            )
