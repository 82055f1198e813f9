"""The PNG plots: produced, non-trivial, for local and remote result dirs, partial sweeps too."""

from __future__ import annotations

import math

from tests.bench.vllm_results import vllm_result
from workloads.bench import plots, results
from workloads.common import storage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(rates=(1, 2, 4, 8, 16, 32, 64, math.inf), shapes=((512, 256), (4096, 512))):
    return results.sort_rows(
        results.row_from_result(
            vllm_result(
                input_len=i,
                output_len=o,
                request_rate=r,
                duration=100 / min(r, 100),
                ttft_ms=20 + i / 100 * r if r < math.inf else 5000,
            ),
            source="x.json",
        )
        for i, o in shapes
        for r in rates
    )


def test_both_plots_are_written_as_real_pngs(tmp_path):
    written = plots.write_plots(str(tmp_path), _rows())
    assert [p.rsplit("/", 1)[-1] for p in written] == [plots.THROUGHPUT_PNG, plots.TTFT_PNG]
    for name in (plots.THROUGHPUT_PNG, plots.TTFT_PNG):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 20_000


def test_plots_go_to_a_remote_dir_and_survive_a_partial_sweep(memory_url):
    rows = _rows(rates=(2, math.inf), shapes=((1024, 512),))  # no rate 4: no paper QPS-4 star
    plots.write_plots(f"{memory_url}/bench", rows)
    assert storage.read_bytes(f"{memory_url}/bench/{plots.TTFT_PNG}").startswith(PNG_MAGIC)
    assert storage.file_sizes(f"{memory_url}/bench")[plots.THROUGHPUT_PNG] > 10_000


def _legend(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_the_papers_v6e_8_figures_are_drawn_beside_ours():
    throughput = _legend(plots.throughput_figure(_rows(shapes=((4096, 512),))))
    assert throughput == [
        "ours: 4096 in / 512 out",
        "paper v6e-8 peak, 4096 in / 512 out (1206)",
        "paper 2x H100 peak, 4096 in / 512 out (728)",
    ]
    ttft = _legend(plots.ttft_figure(_rows(rates=(1, 4, math.inf), shapes=((4096, 512),))))
    assert ttft[1:] == [
        "paper v6e-8: 4096 in, 4 req/s, p50 61 ms",
        "paper v6e-8: 128 in burst, p50 235 ms",
    ]
    assert len(_legend(plots.ttft_figure(_rows(rates=(2,))))) == 2  # ours only


def test_the_papers_v6e_8_marks_take_the_colour_of_our_line_for_the_same_shape():
    rows = _rows(rates=(1, 4, math.inf), shapes=((512, 256), (4096, 512)))
    for figure in (plots.throughput_figure(rows), plots.ttft_figure(rows)):
        lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
        ours = lines[
            "ours: 4096 in / 512 out"
            + (" (p50; p99 dashed)" if figure.axes[0].get_yscale() == "log" else "")
        ]
        paper = next(
            line
            for label, line in lines.items()
            if label.startswith("paper v6e-8") and "4096" in label
        )
        assert (
            paper.get_color()
            == ours.get_color()
            != lines[next(label for label in lines if label.startswith("ours: 512"))].get_color()
        )
