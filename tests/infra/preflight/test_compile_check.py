"""The deviceless compile check: extrapolation, cache, verdicts, CLI and `pulumi preview` paths
with recorded figures, and the real step compiled for a v5p-8 with libtpu's compile-only client.
"""

from __future__ import annotations

import copy
import dataclasses

import pulumi
import pytest

from infra.config import stack_config
from infra.preflight import checks as preflight
from infra.preflight import compile_check
from tests.fixtures import pulumi_mocks
from workloads.contract import catalog

GIB = 2**30


def _cfg(stack: str = "prod", **training: object):
    mapping = copy.deepcopy(pulumi_mocks.stack_file_config(stack))
    mapping["training"] = {**mapping["training"], **training}
    return stack_config.parse_stack_config(mapping, validate=False)


def _depth(layers: int, *, base_gib: float = 4.0, per_layer_gib: float = 0.5, error=None):
    """A DepthResult that is exactly affine in the layer count."""
    if error is not None:
        return compile_check.DepthResult(layers, {}, 0.0, error=error)
    gib = base_gib + per_layer_gib * layers
    figures = {
        "argument_bytes": gib * GIB / 2,
        "output_bytes": gib * GIB / 2,
        "alias_bytes": 0.0,
        "temp_bytes": 0.0,
        "code_bytes": 0.0,
        "flops": 1e12 + 3e12 * layers,
        "bytes_accessed": 1e9 * layers,
        "optimal_seconds": 0.01 + 0.01 * layers,
        "kernel_flops": 1e11 * layers,
        "kernel_seconds": 0.001 * layers,
    }
    return compile_check.DepthResult(layers, figures, 1.0)


class FakeCompiler:
    """Stands in for the compile at each depth; counts the calls."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[int] = []

    def __call__(self, layers: int):
        self.calls.append(layers)
        return _depth(layers, **self.kwargs)


# --------------------------------------------------------------------------- pure parts


def test_linear_extrapolation_through_every_compiled_depth(tmp_path):
    cfg = _cfg()
    est = compile_check.check(
        "prod", cfg, compile_fn=FakeCompiler(), cache=compile_check.ResultCache(tmp_path)
    )
    assert est is not None and est.layers == 60
    assert est.peak_bytes == pytest.approx((4.0 + 0.5 * 60) * GIB)
    # Plus the loss's chunks XLA counts once (a loop body): 5 of 6 chunks x 3 logits matmuls
    # of 4 rows x 512 positions over 262,144 x 5,376, split over 4 chips.
    loss = 5 * 3 * 2 * 262144 * 5376 * 4 * 512 / 4
    assert compile_check.uncounted_loss_flops(est.settings, 4) == pytest.approx(loss)
    assert est.step_seconds == pytest.approx(0.61 + loss / 459e12)
    assert est.flops == pytest.approx(1e12 + 3e12 * 60 + loss)
    assert est.fit_note == "linear fit of 6, 12, 18 layers, largest residual 0.0%"
    assert est.fits


def test_the_band_charges_the_kernels_as_they_run_and_calibrates_xla():
    """The kernels' FLOPs (recorded as they run: 2 + 5 matmuls per block) are charged at 80% of
    peak at the fast end, at 50% at the slow end with XLA's own part divided by its optimism on
    the paper's measured step; tokens/s and the share of peak follow from the band, never from
    a 6N count."""
    cfg = _cfg(remat="none")
    est = compile_check.estimate("prod", cfg, [_depth(6), _depth(12), _depth(18)])
    peak = 459e12
    kernels = 1e11 * 60
    assert est.kernel_flops == pytest.approx(kernels)
    loss = compile_check.uncounted_loss_flops(est.settings, 4)
    xla_part = 0.61 + loss / peak - 0.001 * 60
    paper_step = 3.34 * 3600 / (1244 * 8)
    assert est.xla_optimism == pytest.approx(paper_step / 0.638)
    fast, middle, slow = est.band
    assert fast == pytest.approx(xla_part + kernels / (0.8 * peak))
    assert slow == pytest.approx(xla_part * paper_step / 0.638 + kernels / (0.5 * peak))
    assert middle == pytest.approx((fast * slow) ** 0.5)
    real = cfg.training.micro_batch * 3072 * 0.994
    assert est.real_tokens_band == pytest.approx((real / slow, real / middle, real / fast))
    assert est.real_tokens_per_s == pytest.approx(real / middle)
    flops = 1e12 + 3e12 * 60 + loss
    assert est.peak_share_band[2] == pytest.approx(flops / (fast * peak))
    # Padded rows carry 29.9% real tokens.
    padded_cfg = stack_config.parse_stack_config(
        {**pulumi_mocks.stack_file_config("prod"), "data": {"packing": False}}, validate=False
    )
    padded = compile_check.estimate("prod", padded_cfg, est.depths)
    assert padded.real_tokens_per_s == pytest.approx(est.real_tokens_per_s * 0.299 / 0.994)
    text = compile_check.report(est)
    assert "MFU" not in text
    assert "band" in text and "assumptions:" in text


def test_the_band_brackets_the_papers_measured_step():
    """Calibrated on the paper's step, the slow end of that step's band is what the paper
    measured: the band cannot promise less than a TPU has really done."""
    cfg = stack_config.parse_stack_config(
        {
            **pulumi_mocks.stack_file_config("prod"),
            "data": {"packing": False},
            "training": {
                **pulumi_mocks.stack_file_config("prod")["training"],
                "remat": "full",
                "microBatch": 1,
                "attention": "dense",
            },
        },
        validate=False,
    )

    # XLA's estimate of the paper's step, the loss's uncounted chunks included, is 0.638 s.
    loss_seconds = compile_check.uncounted_loss_flops(compile_check.step_settings(cfg), 4) / 459e12

    def paper_like(layers: int) -> compile_check.DepthResult:
        result = _depth(layers)
        seconds = (0.638 - loss_seconds) * layers / 60
        result.figures.update(optimal_seconds=seconds, kernel_flops=0.0)
        result.figures["kernel_seconds"] = 0.0
        return result

    est = compile_check.estimate("prod", cfg, [paper_like(6), paper_like(12)])
    slow_tokens = est.real_tokens_band[0]
    assert slow_tokens == pytest.approx(763, rel=0.02)


def test_a_curved_depth_shows_its_residual(tmp_path):
    def curved(layers):
        result = _depth(layers)
        if layers == 18:
            result.figures["optimal_seconds"] *= 1.2
        return result

    est = compile_check.check(
        "prod", _cfg(), compile_fn=curved, cache=compile_check.ResultCache(tmp_path)
    )
    residual = compile_check.fit_residual(list(est.depths))
    assert residual is not None and residual > 0.05
    assert f"largest residual {residual:.1%}" in compile_check.report(est)


def test_a_compile_at_full_depth_is_used_instead_of_the_fit():
    est = compile_check.estimate("prod", _cfg(), [_depth(6), _depth(12), _depth(60, base_gib=9.0)])
    assert est.peak_bytes == pytest.approx((9.0 + 0.5 * 60) * GIB)
    assert est.fit_note == "compiled at all 60 layers, no fit"


def test_results_are_cached_by_every_input(tmp_path):
    cache = compile_check.ResultCache(tmp_path)
    first = FakeCompiler()
    compile_check.check("prod", _cfg(), compile_fn=first, cache=cache)
    assert first.calls == [6, 12, 18]
    again = FakeCompiler()
    est = compile_check.check("prod", _cfg(), compile_fn=again, cache=cache)
    assert again.calls == [] and est is not None
    # Any setting of the step is part of the key: it compiles again.
    for changed in (
        {"microBatch": 2},
        {"remat": "dots"},
        {"mesh": {"fsdp": 2, "tp": 2}},
        {"attention": "dense"},
    ):
        other = FakeCompiler()
        compile_check.check("prod", _cfg(**changed), compile_fn=other, cache=cache)
        assert other.calls == [6, 12, 18], changed
    # Settings that do not shape the step (the learning rate) share the entry.
    same = FakeCompiler()
    compile_check.check("prod", _cfg(learningRate=3e-4), compile_fn=same, cache=cache)
    assert same.calls == []


def test_the_source_of_the_step_is_part_of_the_key(monkeypatch):
    settings = compile_check.step_settings(_cfg())
    before = compile_check.cache_key(settings)
    monkeypatch.setattr(compile_check, "_sources_digest", lambda: "edited trainer")
    assert compile_check.cache_key(settings) != before


def test_model_shapes_are_part_of_the_key_and_validation_bounds_are_not(monkeypatch):
    settings = compile_check.step_settings(_cfg())
    before = compile_check.cache_key(settings)
    spec = catalog.model(settings["model"])
    models = dict(catalog.MODELS)
    monkeypatch.setattr(catalog, "MODELS", models)
    models[spec.name] = dataclasses.replace(spec, max_context=spec.max_context // 2)
    assert compile_check.cache_key(settings) == before
    models[spec.name] = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * 2)
    assert compile_check.cache_key(settings) != before


def test_comments_and_docstrings_do_not_change_the_key():
    code = 'def f(x):\n    """Doc."""\n    return x + 1  # why\n'
    other_words = 'def f(x):\n    """Other words."""\n    return x + 1\n'
    assert compile_check._code_only(code) == compile_check._code_only(other_words)
    assert compile_check._code_only(code) != compile_check._code_only(
        "def f(x):\n    return x + 2\n"
    )


def test_a_damaged_cache_entry_is_compiled_again(tmp_path):
    cache = compile_check.ResultCache(tmp_path)
    compile_check.check("prod", _cfg(), compile_fn=FakeCompiler(), cache=cache)
    for path in tmp_path.glob("*-6.json"):
        path.write_text("{not json")
    again = FakeCompiler()
    compile_check.check("prod", _cfg(), compile_fn=again, cache=cache)
    assert again.calls == [6]


def test_a_depth_over_the_chip_stops_the_compiles(tmp_path):
    big = FakeCompiler(base_gib=90.0, per_layer_gib=1.0)
    est = compile_check.check(
        "prod", _cfg(), compile_fn=big, cache=compile_check.ResultCache(tmp_path)
    )
    assert big.calls == [6]  # 96 GiB at 6 layers: deeper slices only need more
    assert not est.fits
    line = compile_check.verdict_line(est)
    assert line.startswith("compile-check: DOES NOT FIT")
    assert "training.microBatch, data.maxSeqLen, training.mesh or training.remat" in line
    assert "\n" not in line


def test_xla_refusing_the_step_is_a_does_not_fit_verdict(tmp_path):
    refused = FakeCompiler(error="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
    est = compile_check.check(
        "prod", _cfg(), compile_fn=refused, cache=compile_check.ResultCache(tmp_path)
    )
    assert not est.fits
    assert "at 6 layers XLA refused: RESOURCE_EXHAUSTED" in compile_check.verdict_line(est)


def test_tight_fit_warns(tmp_path):
    tight = FakeCompiler(base_gib=30.0, per_layer_gib=1.0)  # 90 of 95 GiB
    est = compile_check.check(
        "prod", _cfg(), compile_fn=tight, cache=compile_check.ResultCache(tmp_path)
    )
    assert est.fits and est.headroom < compile_check.HEADROOM_WARNING
    assert "fits, tightly" in compile_check.verdict_line(est)


def test_preview_shows_the_cached_result_without_compiling(tmp_path, monkeypatch):
    cfg = _cfg()
    monkeypatch.setattr(compile_check, "CACHE_DIR", tmp_path)
    assert compile_check.cached_summary("prod", cfg) is None
    compile_check.check(
        "prod", cfg, compile_fn=FakeCompiler(), cache=compile_check.ResultCache(tmp_path)
    )
    summary = compile_check.cached_summary("prod", cfg)
    assert summary is not None and summary.startswith("compile-check: fits (34.0 GiB of 95.0")


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_committed_results_are_those_of_todays_step(stack):
    """`.compile-check/` holds each checked-in stack's result for the step as the code stands, so
    `pulumi preview` shows a verdict and the figures of docs/benchmarks.md come from this code.
    After an edit to the step (STEP_SOURCES), a pin or a stack default, re-run
    `python -m infra.preflight --compile --stack <stack>` and commit what it writes."""
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config(stack), validate=False)
    est = compile_check.check(stack, cfg, compile_fn=None, log=lambda _: None)
    assert est is not None, f"no committed compile result for {stack}'s step as it stands"
    assert est.fits and est.headroom >= 0.10, compile_check.verdict_line(est)
    # docs/benchmarks.md (where the measured figures live) quotes the committed estimate as the
    # check prints it: middle and band.
    slow, middle, fast = est.real_tokens_band
    quoted = f"{middle:,.0f} (band {slow:,.0f} - {fast:,.0f})"
    page = (compile_check.ROOT / "docs" / "benchmarks.md").read_text()
    assert quoted in " ".join(page.split()), f"docs/benchmarks.md does not quote {stack}'s {quoted}"


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_analytic_hbm_rule_stays_on_the_safe_side_of_xla(stack):
    """`pulumi up`'s sum (infra/config/sizing.py) must not promise more room than XLA's compile of
    the same step finds: it is the only memory check a stack gets without a compile."""
    from infra.config import sizing

    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config(stack), validate=False)
    est = compile_check.check(stack, cfg, compile_fn=None, log=lambda _: None)
    assert est is not None
    assert sizing.training_hbm_bytes(cfg) >= est.peak_bytes


def test_pulumi_program_refuses_a_step_the_compile_check_found_too_big(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_check, "CACHE_DIR", tmp_path)
    mapping = pulumi_mocks.stack_file_config("prod")
    cfg = stack_config.parse_stack_config(copy.deepcopy(mapping), validate=False)
    compile_check.check(
        "prod",
        cfg,
        compile_fn=FakeCompiler(base_gib=90.0, per_layer_gib=1.0),
        cache=compile_check.ResultCache(tmp_path),
    )
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        pulumi_mocks.run_program("prod", mapping, hf_token="hf_x", recording=recording)
    assert "compile-check: DOES NOT FIT" in str(info.value)
    assert "nothing was created" in str(info.value)
    assert recording.resources == []


def test_cli_exit_status_and_one_line_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compile_check, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(
        compile_check, "compile_depth", lambda cfg: FakeCompiler(base_gib=90.0, per_layer_gib=1.0)
    )
    status = preflight.main(["--compile", "--stack", "prod"])
    out = capsys.readouterr().out
    assert status == 1
    assert out.strip().splitlines()[-1].startswith("compile-check: DOES NOT FIT")
    monkeypatch.setattr(compile_check, "compile_depth", lambda cfg: FakeCompiler())
    assert preflight.main(["--compile", "--stack", "dev"]) == 0
    out = capsys.readouterr().out
    for label in ("peak HBM", "FLOPs per micro-step", "est. step time", "est. tokens/s", "band"):
        assert label in out
    assert "estimates, not measurements" in out and "MFU" not in out


@pytest.mark.parametrize("bad", ["5", "6,6", "six", "0,6", "-6"])
def test_cli_refuses_depths_that_break_the_layer_pattern(bad, capsys):
    with pytest.raises(SystemExit):
        preflight.main(["--compile", "--stack", "prod", "--depths", bad])
    assert "--depths" in capsys.readouterr().err


# --------------------------------------------------------------------------- the real compile


def _real_compile(cfg, layers):
    return compile_check.compile_depth(cfg)(layers)


def _step(stack: str) -> dict:
    return compile_check.step_settings(
        stack_config.parse_stack_config(pulumi_mocks.stack_file_config(stack), validate=False)
    )


def test_the_dev_step_is_the_prod_step_with_a_smaller_adapter():
    """Why one real compile below covers both checked-in stacks: dev's step is prod's with a
    rank-16 adapter instead of rank 64 (same mesh, rows, tokens, remat, kernel, targets and
    dropout), so it compiles to the same program with smaller LoRA factors; its own figures are
    its committed result (test_the_committed_results_are_those_of_todays_step). A stack that
    starts to differ in anything else fails here, and then needs its own compile below."""
    dev, prod = _step("dev"), _step("prod")
    assert {k: v for k, v in dev.items() if k != "lora"} == {
        k: v for k, v in prod.items() if k != "lora"
    }
    assert {k: v for k, v in dev["lora"].items() if k not in ("rank", "alpha")} == {
        k: v for k, v in prod["lora"].items() if k not in ("rank", "alpha")
    }
    assert dev["lora"]["rank"] < prod["lora"]["rank"]


def test_the_stack_step_compiles_for_a_v5p8_without_a_tpu():
    """The 31B step of the prod stack (rank 64; mesh fsdp=1 tp=4, 4 x 3072 tokens, no remat) at a
    6-layer slice (5 sliding + 1 global, the real per-layer shapes), compiled for a v5p-8 by
    libtpu's compile-only client. (dev's step differs only in the adapter's rank: the test
    above.)"""
    pytest.importorskip("libtpu")
    cfg = _cfg("prod")
    result = _real_compile(cfg, 6)
    assert result.error is None
    spec = catalog.model("gemma-4-31b")
    # Arguments: the bf16 base weights of 6 layers + the embedding, split 4 ways by tp (plus the
    # small LoRA and AdamW state); a weight left replicated would show up here at once.
    per_layer = (spec.text_parameters() - spec.vocab_size * spec.embed_dim) / 60
    weights = 2 * (6 * per_layer + spec.vocab_size * spec.embed_dim) / 4
    assert weights < result.figures["argument_bytes"] < 1.25 * weights
    # FLOPs per chip: forward + input gradients, about 2 + 2 FLOPs per weight per token (LoRA
    # has no base-weight gradients), + 2 for the recomputed forward under full remat, plus
    # attention and the adapters: about 2.3x and 3.05x the forward's matmuls.
    tokens = cfg.training.micro_batch * 3072
    forward = 2 * (6 * per_layer + spec.vocab_size * spec.embed_dim) * tokens / 4
    passes = 3 if cfg.training.remat == "full" else 2
    # The loss recomputes the logits in its backward pass (a third pass over the embedding), and
    # XLA counts its loop over chunks of positions once: the check adds the other chunks.
    logits = 2 * spec.vocab_size * spec.embed_dim * tokens / 4
    settings = compile_check.step_settings(cfg)
    flops = result.figures["flops"] + compile_check.uncounted_loss_flops(settings, 4)
    expected = passes * forward + logits
    assert expected < flops < expected + 0.5 * forward
    assert 0 < result.figures["optimal_seconds"] < 1.0
    assert result.peak_bytes < catalog.accelerator("v5p-8").hbm_bytes_per_chip
    # Packed rows go through the splash kernel, whose FLOPs XLA cannot see and the check adds:
    # forward (2 matmuls) + backward (7) over the visited blocks, the same order as causal
    # attention over 3072 tokens at the local head size in every layer (the global layers' larger
    # heads and the sliding layers' band roughly cancel).
    assert cfg.training.attention == "kernel"
    causal = 2 * 3072 * 3072 * spec.head_dim * (spec.num_heads / 4) * cfg.training.micro_batch
    assert 0.5 < result.figures["kernel_flops"] / (6 * causal * 9 / 2) < 2.0


@pytest.mark.slow  # a real 6-layer compile that XLA refuses: minutes
def test_an_oversized_step_is_reported_as_not_fitting(tmp_path, monkeypatch, capsys):
    """16 rows of 32,768 tokens: already the 6-layer slice needs far more than a chip's 95 GiB
    (XLA refuses it), so the check stops there and says which keys to change. (4 rows of 32,768,
    the case before the loss went over the vocabulary in chunks, ran past the 15-minute test
    limit with the chunked loss.)"""
    pytest.importorskip("libtpu")
    monkeypatch.setattr(compile_check, "CACHE_DIR", tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    text = (pulumi_mocks.ROOT / "Pulumi.prod.yaml").read_text()
    assert "microBatch: 4\n" in text and "maxSeqLen: 3072\n" in text
    text = text.replace("microBatch: 4\n", "microBatch: 16\n")
    (root / "Pulumi.prod.yaml").write_text(text.replace("maxSeqLen: 3072\n", "maxSeqLen: 32768\n"))
    status = preflight.main(["--compile", "--stack", "prod", "--root", str(root)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert status == 1, lines
    assert lines[-1].startswith("compile-check: DOES NOT FIT on v5p-8: at 6 layers XLA refused")
    assert "exceeds available HBM" in lines[-1]
    assert "training.microBatch, data.maxSeqLen" in lines[-1]
    # The analytic rule of `pulumi up` refuses it too, and says so first.
    assert any(line.startswith("note: `pulumi up` refuses") for line in lines)


def test_every_sweep_setting_is_one_validation_accepts_on_its_slice():
    """The sweep's rows, multi-host slices included, are stacks `pulumi up` would accept (mesh
    multiplies to the slice's devices, micro-batch splits over fsdp and the hosts, HBM rule),
    with 8 rows per optimizer step; and the prod stack's own setting is one of them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "compile_sweep", compile_check.ROOT / "benchmarks" / "compile_sweep.py"
    )
    assert spec is not None and spec.loader is not None
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    slices = set()
    for setting in sweep.SETTINGS:
        cfg = sweep.sweep_config("prod", *setting, validate=True)  # raises on a refused stack
        t = cfg.training
        assert t.micro_batch * t.grad_accum == 8
        slices.add(t.accelerator)
    assert {"v5p-16", "v5p-32"} <= slices
    prod = _cfg()
    assert compile_check.step_settings(prod) in [
        compile_check.step_settings(sweep.sweep_config("prod", *s)) for s in sweep.SETTINGS
    ]


def test_the_collectives_come_from_the_step_levers_counts(tmp_path, monkeypatch):
    """The report carries the unchanged step's collectives per micro-step, extrapolated like the
    rest from the depths benchmarks/step_levers.py counted; other levers' and damaged entries
    are not read, and without a count the report says so instead of printing a figure."""
    import json

    monkeypatch.setattr(compile_check, "LEVER_DIR", tmp_path / "levers")
    cfg = _cfg()
    cache = compile_check.ResultCache(tmp_path)
    est = compile_check.check("prod", cfg, compile_fn=FakeCompiler(), cache=cache)
    assert est is not None and est.collectives is None
    assert "collectives          not counted for these settings" in compile_check.report(est)

    key = compile_check.cache_key(compile_check.step_settings(cfg))
    (tmp_path / "levers").mkdir()
    for lever, layers, gb in (("baseline", 6, 9.0), ("baseline", 12, 15.0), ("overlap", 6, 99)):
        entry = {
            "layers": layers,
            "collectives": {
                "buffer_bytes": {"all-reduce": 0.75 * gb * 1e9, "all-gather": 0.25 * gb * 1e9},
                "ring_bytes": {"all-reduce": 1.5 * gb * 1e9},
            },
        }
        compile_check.lever_path(key, lever, layers).write_text(json.dumps(entry))
    compile_check.lever_path(key, "baseline", 18).write_text("{not json")
    est = compile_check.check("prod", cfg, compile_fn=FakeCompiler(), cache=cache)
    assert est is not None and est.collectives is not None
    buffers, ring, depths = est.collectives
    assert depths == (6, 12)
    assert buffers == pytest.approx((9.0 + 54 * 1.0) * 1e9)  # 1 GB per layer from 6 to 60
    assert ring == pytest.approx(1.5 * buffers)
    assert (
        "collectives          63.0 GB of buffers per micro-step, 94.5 GB sent per chip by a ring "
        "(from the HLO at 6, 12 layers;"
    ) in compile_check.report(est)
