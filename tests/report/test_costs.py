"""The cost model recomputes the paper's tables from the paper's inputs (catalog.PAPER)."""

import pytest

from workloads.contract import catalog
from workloads.report import costs


def test_formulas():
    assert costs.train_cost(16.80, 3.34) == pytest.approx(56.112)
    assert costs.usd_per_million_tokens(21.52, 1206) == pytest.approx(21.52 / 4.3416)
    assert costs.tco(56.112, 21.52, 24) == pytest.approx(572.592)
    with pytest.raises(ValueError):
        costs.usd_per_million_tokens(21.52, 0)
    with pytest.raises(ValueError):
        costs.train_cost(-1, 1)


def test_paper_tables():
    tpu, gpu = costs.paper_tables()
    # Training: v5p-8 3.34 h vs a3-highgpu-2g 5.39 h.
    assert round(tpu.train_cost, 2) == 56.11
    assert round(gpu.train_cost, 2) == 119.23
    # Serving at 4096 input tokens: 1206 vs 728 output tokens/s.
    assert round(tpu.serving[(4096, 512)][1], 2) == 4.96
    assert round(gpu.serving[(4096, 512)][1], 2) == 8.44
    # TCO: training + H hours of serving.
    assert round(tpu.tco[1], 2) == 77.63 and round(gpu.tco[1], 2) == 141.35
    assert round(tpu.tco[24], 2) == 572.59 and round(gpu.tco[24], 2) == 650.11
    assert round(tpu.tco[8], 2) == round(56.112 + 8 * 21.52, 2)
    # The TPU training throughput prices a 1M training tokens at rate / (763 x 0.0036).
    assert tpu.train_usd_per_m_tokens == pytest.approx(16.80 / (763 * 0.0036))
    assert gpu.train_usd_per_m_tokens is None  # the paper gives no GPU training throughput


def test_our_platform_from_records():
    train = {"wall_seconds": 2 * 3600, "tokens_per_second": 1000.0, "accelerator": "v5p-8"}
    bench = [
        {"input_len": 4096, "output_len": 512, "request_rate": 1, "output_throughput": 300.0},
        {"input_len": 4096, "output_len": 512, "request_rate": 8, "output_throughput": 1500.0},
        {"input_len": 512, "output_len": 256, "request_rate": 8, "output_throughput": 2000.0},
        {"input_len": 512, "output_len": 256, "request_rate": 16, "output_throughput": 0},
    ]
    ours = costs.our_platform(
        train_summary=train, train_accelerator="v5p-8", bench_rows=bench, serve_accelerator="v6e-8"
    )
    assert ours.train_cost == pytest.approx(33.60)
    assert ours.train_usd_per_m_tokens == pytest.approx(16.80 / 3.6)
    assert ours.serving == {
        (512, 256): (2000.0, pytest.approx(21.52 / 7.2)),
        (4096, 512): (1500.0, pytest.approx(21.52 / 5.4)),
    }
    assert ours.tco == {
        1: pytest.approx(33.60 + 21.52),
        8: pytest.approx(33.60 + 8 * 21.52),
        24: pytest.approx(33.60 + 24 * 21.52),
    }


def test_missing_inputs_stay_unmeasured():
    ours = costs.our_platform(
        train_summary=None, train_accelerator=None, bench_rows=None, serve_accelerator=None
    )
    assert (ours.train_cost, ours.train_usd_per_m_tokens, ours.serving, ours.tco) == (
        None,
        None,
        {},
        {},
    )
    # Throughput without a serving machine: tokens/s known, dollars not.
    rows = [{"input_len": 128, "output_len": 256, "request_rate": 1, "output_throughput": 900.0}]
    ours = costs.our_platform(
        train_summary={"wall_seconds": 3600},
        train_accelerator=None,
        bench_rows=rows,
        serve_accelerator=None,
    )
    assert ours.serving == {(128, 256): (900.0, None)}
    assert ours.train_hours == 1.0 and ours.train_cost is None


def test_rates_come_from_the_catalog():
    assert catalog.ACCELERATORS["v5p-8"].hourly_usd == 16.80
    assert catalog.ACCELERATORS["v6e-8"].hourly_usd == 21.52
    assert catalog.GPU_A3_HIGHGPU_2G.hourly_usd == 22.12
