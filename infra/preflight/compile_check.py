"""The stack's training step compiled for its TPU without a TPU: does it fit, how fast might it be.

    python -m infra.preflight --compile [--stack prod]

Compiling the 60-layer 31B step takes too long for a 2-core laptop or CI, so the step is compiled
at reduced depths with the real per-layer shapes (multiples of 6 layers keep the 5 sliding :
1 global pattern) and every figure is extrapolated linearly to the model's depth: per layer the
step adds the same weights, adapters, optimizer state and activations, so memory, FLOPs and
XLA's time estimate are close to affine in the layer count. The fit is a least-squares line
through every compiled depth (6, 12 and 18 by default) and prints its largest relative residual;
a compile at the model's full depth, when one is cached, is used as it is instead of any fit.
Fitting 6 and 12 alone fell 4-5% short of a direct 60-layer compile (0.629 s against 0.660 s
per micro-step for prod); with 18 in the fit it is 1% off in time and 5% over in memory.

XLA's step time is the optimistic end of a band, not a prediction (see `Estimate.band`): the
attention kernels, which XLA cannot see, are charged at a stated fraction of the chip's peak,
and XLA's own part is calibrated on the one step of this model a TPU has really run (the
paper's). Throughput is given as real tokens/s and as the share of the chips' peak that XLA's
own FLOP count implies; a "6N MFU" would overstate a LoRA step, which computes no gradients for
the frozen weights.

Results are cached in `.compile-check/` by a hash of every input (the training settings of the
stack, the model, the topology, the versions of JAX, libtpu, Tunix, Qwix and Flax, and the
code of the step, comments and docstrings aside), so a second run, and `pulumi preview`, show
the last result without compiling. Every time and throughput here is XLA's cost-model
estimate, not a measurement.

The step itself is in workloads/train/compile_step.py.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from infra.config import model as config_mod
from infra.config import runconfig_render
from workloads.contract import catalog, runconfig
from workloads.train import packed_attention

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".compile-check"
# benchmarks/step_levers.py's results: the step with one lever changed, and its collectives read
# from the compiled HLO ("baseline" is the step unchanged).
LEVER_DIR = CACHE_DIR / "levers"
# The depths compiled by default; the line is fitted through all of them.
DEPTHS = (6, 12, 18)
# Real (non-padding) share of the computed tokens of the CodeV-R1 rows at max_seq_len 3072, as
# `benchmarks/packing_efficiency.py` measures it: one sample per row vs best-fit packing.
REAL_FRACTION = {False: 0.299, True: 0.994}
# Below this share of free HBM the step is said to fit, but with a warning: XLA's peak is a
# compile-time figure and the runtime adds its own buffers.
HEADROOM_WARNING = 0.10
DOES_NOT_FIT = "DOES NOT FIT"

# The fraction of the chip's bf16 peak the splash kernels are charged at: the fast and the slow
# end of the band. Flash-style kernels reach well below peak on short blocks; 50-80% brackets what
# published Pallas/flash kernels report for head dimensions of 256-512.
KERNEL_EFFICIENCY = (0.80, 0.50)
# XLA's optimism, measured on the one step of Gemma 4 31B a TPU has run: the paper's padded step
# (dense mask, full remat, one row per micro-step) took 3.34 h for 1,244 x 8 micro-steps, 1.21 s
# each, where this check compiled the same step at an estimated 0.638 s (the "before" row of the
# README's sweep). The slow end of the band divides XLA's own part of the step by that factor.
PAPER_MICRO_STEPS_PER_STEP = 8
XLA_ESTIMATE_OF_PAPER_STEP_SECONDS = 0.638
# XLA's cost analysis counts the body of a loop once, not once per trip: the loss's scan over
# chunks of positions (workloads/train/vocab_loss.py) shows one chunk's logits matmuls, three of
# them (forward, its recomputation in the backward pass, the hidden states' gradient). The
# estimate adds the other chunks' matmuls at peak, as XLA's part of the step (compiles of the
# same step with the whole logits and with chunks differ by exactly that many FLOPs).
LOSS_CHUNK_MATMULS = 3


def uncounted_loss_flops(settings: dict[str, Any], chips: int) -> float:
    """Per chip and micro-step: the logits matmuls of the chunks XLA's count leaves out."""
    from workloads.train import vocab_loss

    spec = catalog.model(settings["model"])
    length = settings["max_seq_len"]
    chunk = min(length, vocab_loss.CHUNK_POSITIONS)
    chunks = -(-length // chunk)
    per_chunk = 2 * spec.vocab_size * spec.embed_dim * settings["micro_batch"] * chunk / chips
    return LOSS_CHUNK_MATMULS * per_chunk * (chunks - 1)


# Sources whose change changes the compiled step (their hash is part of the cache key).
STEP_SOURCES = (
    "workloads/model/gemma4.py",
    "workloads/model/lora.py",
    "workloads/train/step.py",
    "workloads/train/checkpoints.py",
    "workloads/train/compile_step.py",
    "workloads/train/packed_attention.py",
    "workloads/train/vocab_loss.py",
)
PACKAGES = ("jax", "jaxlib", "libtpu", "google-tunix", "qwix", "flax", "optax")
_FIELDS = (
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
    "code_bytes",
    "flops",
    "bytes_accessed",
    "optimal_seconds",
    "kernel_flops",
    "kernel_seconds",
)


@dataclasses.dataclass(frozen=True)
class DepthResult:
    """XLA's figures for the step compiled at one depth (per chip), or why it did not compile."""

    layers: int
    figures: dict[str, float]
    compile_seconds: float
    error: str | None = None

    @property
    def peak_bytes(self) -> float:
        f = self.figures
        return (
            f["argument_bytes"]
            + f["output_bytes"]
            - f["alias_bytes"]
            + f["temp_bytes"]
            + f["code_bytes"]
        )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The step at the model's full depth, per chip, extrapolated from the compiled depths."""

    stack: str
    accelerator: str
    layers: int
    settings: dict[str, Any]
    depths: tuple[DepthResult, ...]
    peak_bytes: float
    hbm_bytes: float
    flops: float
    step_seconds: float
    computed_tokens_per_step: int
    real_fraction: float
    base_parameters: int
    chips: int
    peak_flops_per_chip: float
    fit_note: str
    kernel_flops: float = 0.0
    kernel_seconds: float = 0.0
    error: str | None = None
    # Per chip and micro-step at the model's depth: (buffer bytes, bytes a ring sends) of the
    # collectives in the compiled HLO, and the depths they come from; None: not counted.
    collectives: tuple[float, float, tuple[int, ...]] | None = None

    @property
    def fits(self) -> bool:
        return self.error is None and self.peak_bytes <= self.hbm_bytes

    @property
    def headroom(self) -> float:
        return 1 - self.peak_bytes / self.hbm_bytes

    @property
    def xla_seconds(self) -> float:
        """XLA's own time estimate for what it can see (the step without the kernels)."""
        return self.step_seconds - self.kernel_seconds

    @property
    def xla_optimism(self) -> float:
        """The paper's measured micro-step over XLA's estimate of that same step."""
        measured = (
            catalog.PAPER.train_hours_tpu
            * 3600
            / (catalog.PAPER.train_steps * PAPER_MICRO_STEPS_PER_STEP)
        )
        return measured / XLA_ESTIMATE_OF_PAPER_STEP_SECONDS

    @property
    def band(self) -> tuple[float, float, float]:
        """Seconds per micro-step: (fast, middle, slow).

        fast: XLA's estimate, the kernels at the higher efficiency; slow: XLA's part divided by
        its optimism on the paper's step, the kernels at the lower efficiency; middle: their
        geometric mean (the band is wide in ratio, not in seconds).
        """
        peak = self.peak_flops_per_chip
        fast = self.xla_seconds + self.kernel_flops / (peak * KERNEL_EFFICIENCY[0])
        slow = self.xla_seconds * self.xla_optimism + self.kernel_flops / (
            peak * KERNEL_EFFICIENCY[1]
        )
        return fast, (fast * slow) ** 0.5, slow

    @property
    def real_tokens_band(self) -> tuple[float, float, float]:
        """Real tokens/s for the whole slice: (slow, middle, fast)."""
        real = self.computed_tokens_per_step * self.real_fraction
        return tuple(real / t if t else 0.0 for t in reversed(self.band))  # type: ignore[return-value]

    @property
    def peak_share_band(self) -> tuple[float, float, float]:
        """XLA's FLOPs (kernels as they run) over the chip's peak: (slow, middle, fast)."""
        return tuple(  # type: ignore[return-value]
            self.flops / (t * self.peak_flops_per_chip) if t else 0.0 for t in reversed(self.band)
        )

    @property
    def computed_tokens_per_s(self) -> float:
        """Computed tokens/s at the band's middle."""
        middle = self.band[1]
        return self.computed_tokens_per_step / middle if middle else 0.0

    @property
    def real_tokens_per_s(self) -> float:
        """Real tokens/s at the band's middle."""
        return self.computed_tokens_per_s * self.real_fraction


# --------------------------------------------------------------------------- inputs and cache


def step_settings(cfg: config_mod.StackConfig) -> dict[str, Any]:
    """The stack's settings that shape the compiled training step."""
    t = cfg.training
    return {
        "accelerator": t.accelerator,
        "model": cfg.model.name,
        "max_seq_len": cfg.data.max_seq_len,
        "packing": cfg.data.packing,
        "micro_batch": t.micro_batch,
        "grad_accum": t.grad_accum,
        "mesh": {"fsdp": t.mesh.fsdp, "tp": t.mesh.tp},
        "remat": t.remat,
        "attention": t.attention,
        "lora": {
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha,
            "dropout": cfg.lora.dropout,
            "targets": sorted(cfg.lora.targets),
        },
        "weight_decay": t.weight_decay,
    }


def _versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _code_only(source: str) -> str:
    """The code of a module without its comments and docstrings (an edit to those does not
    change the compiled step, so it keeps the cached results)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
    return ast.dump(tree)


def _sources_digest(root: pathlib.Path = ROOT) -> str:
    digest = hashlib.sha256()
    for rel in STEP_SOURCES:
        digest.update(rel.encode())
        digest.update(_code_only((root / rel).read_text()).encode())
    return digest.hexdigest()


# ModelSpec fields validation reads that never reach the traced step: leaving them out keeps
# a committed result valid when such a bound is added or corrected.
_NOT_TRACED = ("max_context",)


def _model_payload(name: str) -> dict[str, Any]:
    fields = dataclasses.asdict(catalog.model(name))
    return {k: v for k, v in fields.items() if k not in _NOT_TRACED}


def cache_key(settings: dict[str, Any]) -> str:
    """A hash of every input of the compiled step except the depth."""
    accelerator = catalog.accelerator(settings["accelerator"])
    payload = {
        "settings": settings,
        "topology": dataclasses.asdict(accelerator.topology) if accelerator.topology else None,
        "model": _model_payload(settings["model"]),
        "versions": _versions(),
        "sources": _sources_digest(),
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class ResultCache:
    """One JSON file per (inputs hash, depth) under a directory; written atomically."""

    def __init__(self, directory: pathlib.Path | None = None):
        self.directory = directory if directory is not None else CACHE_DIR

    def _path(self, key: str, layers: int) -> pathlib.Path:
        return self.directory / f"{key}-{layers}.json"

    def get(self, key: str, layers: int) -> DepthResult | None:
        path = self._path(key, layers)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return DepthResult(
                layers=int(data["layers"]),
                figures={k: float(data["figures"][k]) for k in _FIELDS}
                if data.get("figures")
                else {},
                compile_seconds=float(data["compile_seconds"]),
                error=data.get("error"),
            )
        except (ValueError, KeyError, TypeError):
            return None  # a damaged entry is compiled again

    def put(self, key: str, result: DepthResult, settings: dict[str, Any]) -> None:
        payload = {**dataclasses.asdict(result), "settings": settings, "versions": _versions()}
        write_result(self._path(key, result.layers), payload)


def write_result(path: pathlib.Path, payload: dict[str, Any]) -> None:
    """Writes a committed result file atomically (a kill leaves the old file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a committed result from other users
    os.replace(tmp, path)


def lever_path(key: str, lever: str, layers: int) -> pathlib.Path:
    """Where benchmarks/step_levers.py keeps the step of `key` with `lever`, at `layers`."""
    return LEVER_DIR / f"{key}-{lever}-{layers}.json"


def collectives_at(
    settings: dict[str, Any], layers: int
) -> tuple[float, float, tuple[int, ...]] | None:
    """The unchanged step's collectives (buffer bytes, ring bytes) per chip and micro-step at
    `layers`, from step_levers' counts at the depths it compiled; None when it has none."""
    key = cache_key(settings)
    points: list[tuple[int, float, float]] = []
    for path in sorted(LEVER_DIR.glob(f"{key}-baseline-*.json")):
        try:
            data = json.loads(path.read_text())
            found = data["collectives"]
            points.append(
                (
                    int(data["layers"]),
                    float(sum(found["buffer_bytes"].values())),
                    float(sum(found["ring_bytes"].values())),
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a damaged entry is counted again by the benchmark
    if not points:
        return None
    depths = tuple(sorted(p[0] for p in points))
    buffers = line_at([(p[0], p[1]) for p in points], layers)
    ring = line_at([(p[0], p[2]) for p in points], layers)
    return buffers, ring, depths


# --------------------------------------------------------------------------- compiling


CompileFn = Callable[[int], DepthResult]


def compile_depth(cfg: config_mod.StackConfig) -> CompileFn:
    """A function that compiles the stack's step at a given depth (imports JAX lazily)."""

    def run(layers: int) -> DepthResult:
        from workloads.model import tiny_model
        from workloads.train import compile_step

        run_cfg = _compile_run_config(cfg)
        hf_config = tiny_model.catalog_hf_config(catalog.model(cfg.model.name))
        accelerator = catalog.accelerator(cfg.training.accelerator)
        try:
            step = compile_step.compile_train_step(run_cfg, hf_config, accelerator, layers=layers)
        except compile_step.StepDoesNotFit as exc:
            return DepthResult(layers, {}, 0.0, error=str(exc))
        figures = {k: float(getattr(step, k)) for k in _FIELDS}
        return DepthResult(layers, figures, step.compile_seconds)

    return run


def _compile_run_config(cfg: config_mod.StackConfig) -> runconfig.RunConfig:
    """The run config the training VM would read (its paths are never touched here)."""
    return runconfig_render.render_run_config(cfg)


def results_at(
    settings: dict[str, Any],
    depths: Sequence[int],
    compile_fn: CompileFn | None,
    cache: ResultCache,
    *,
    hbm_bytes: float,
    log: Callable[[str], None] = print,
) -> list[DepthResult]:
    """The step at each depth, from the cache or compiled (and cached). Stops early when a depth
    already needs more HBM than the chip has: deeper slices only need more.

    Args:
        compile_fn: None: cached results only (depths not in the cache are left out).
    """
    key = cache_key(settings)
    results = []
    for layers in depths:
        result = cache.get(key, layers)
        if result is None and compile_fn is not None:
            log(f"compile-check: compiling the step at {layers} layers (a few minutes)...")
            result = compile_fn(layers)
            cache.put(key, result, settings)
            if result.error is None:
                log(
                    f"compile-check: {layers} layers compiled in {result.compile_seconds:.0f} s, "
                    f"peak {_gib(result.peak_bytes)} per chip"
                )
        if result is None:
            continue
        results.append(result)
        if result.error is not None or result.peak_bytes > hbm_bytes:
            break
    return results


# --------------------------------------------------------------------------- extrapolation


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (layers, value) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    return mean_y - slope * mean_x, slope


def line_at(points: Sequence[tuple[int, float]], layers: int) -> float:
    """The value at `layers` of the least-squares line through (layers, value) points."""
    if len(points) == 1:  # one depth: scale the per-layer share, nothing fixed (an over-estimate)
        return points[0][1] * layers / points[0][0]
    intercept, slope = _line(points)
    return intercept + slope * layers


def extrapolate(fit: Sequence[DepthResult], layers: int, field: str | None = None) -> float:
    """The value of a figure (or of the peak, field None) at `layers`, from a linear fit."""
    return line_at([(r.layers, _value(r, field)) for r in fit], layers)


def _value(r: DepthResult, field: str | None) -> float:
    return r.peak_bytes if field is None else r.figures[field]


def fit_residual(fit: Sequence[DepthResult]) -> float | None:
    """The largest relative miss of the fitted line at a compiled depth, over the step time and the
    peak; None with fewer than three depths (two points always lie on their line)."""
    if len(fit) < 3:
        return None
    return max(
        abs(extrapolate(fit, r.layers, field) - _value(r, field)) / _value(r, field)
        for r in fit
        for field in ("optimal_seconds", None)
    )


def estimate(
    stack: str,
    cfg: config_mod.StackConfig,
    results: Sequence[DepthResult],
) -> Estimate | None:
    """The full-depth estimate from compiled depths (None when nothing compiled): the compile at
    the model's depth when there is one, else a least-squares line through every depth."""
    accelerator = catalog.accelerator(cfg.training.accelerator)
    spec = catalog.model(cfg.model.name)
    settings = step_settings(cfg)
    common: dict[str, Any] = {
        "stack": stack,
        "accelerator": accelerator.name,
        "layers": spec.layers,
        "settings": settings,
        "depths": tuple(results),
        "hbm_bytes": float(accelerator.hbm_bytes_per_chip),
        "computed_tokens_per_step": cfg.training.micro_batch * cfg.data.max_seq_len,
        "real_fraction": REAL_FRACTION[cfg.data.packing],
        "base_parameters": spec.text_parameters(),
        "chips": accelerator.jax_devices,
        "peak_flops_per_chip": accelerator.peak_bf16_flops_per_chip,
    }
    failed = [r for r in results if r.error is not None]
    if failed:
        return Estimate(
            **common,
            peak_bytes=float("inf"),
            flops=0.0,
            step_seconds=0.0,
            fit_note="",
            error=f"at {failed[0].layers} layers XLA refused: {failed[0].error}",
        )
    if not results:
        return None
    direct = next((r for r in results if r.layers == spec.layers), None)
    fit = [direct] if direct is not None else sorted(results, key=lambda r: r.layers)
    if direct is not None:
        note = f"compiled at all {spec.layers} layers, no fit"
    else:
        residual = fit_residual(fit)
        depths = ", ".join(str(r.layers) for r in fit)
        note = f"linear fit of {depths} layers" + (
            f", largest residual {residual:.1%}" if residual is not None else ", no residual"
        )

    def at_depth(field: str | None) -> float:
        return extrapolate(fit, spec.layers, field)

    loss_flops = uncounted_loss_flops(settings, accelerator.jax_devices)
    return Estimate(
        **common,
        peak_bytes=at_depth(None),
        flops=at_depth("flops") + loss_flops,
        step_seconds=at_depth("optimal_seconds")
        + loss_flops / accelerator.peak_bf16_flops_per_chip,
        kernel_flops=at_depth("kernel_flops"),
        kernel_seconds=at_depth("kernel_seconds"),
        fit_note=note,
        collectives=collectives_at(settings, spec.layers),
    )


# --------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe(settings: dict[str, Any]) -> str:
    mesh = settings["mesh"]
    return (
        f"mesh fsdp={mesh['fsdp']} tp={mesh['tp']}, micro-batch {settings['micro_batch']} x "
        f"{settings['max_seq_len']} tokens, remat {settings['remat']}, "
        f"{'packed' if settings['packing'] else 'padded'} rows, "
        f"{settings.get('attention', 'dense')} attention, "
        f"LoRA rank {settings['lora']['rank']}"
    )


def _kernel_note(r: DepthResult) -> str:
    """The attention kernels' share, which XLA's cost analysis cannot see and the compile adds
    at peak (the band charges them below peak)."""
    flops = r.figures.get("kernel_flops", 0.0)
    if not flops:
        return ""
    return (
        f", of which attention kernels {flops / 1e12:.1f} TFLOP and "
        f"{r.figures.get('kernel_seconds', 0.0):.3f} s at peak"
    )


def _band_text(values: tuple[float, float, float], fmt: str) -> str:
    low, middle, high = values
    return f"{fmt.format(middle)} (band {fmt.format(low)} - {fmt.format(high)})"


def report(est: Estimate) -> str:
    """The per-chip table, the estimate as a band with its assumptions, and the verdict line."""
    lines = [
        f"compile-check: stack {est.stack}, {est.accelerator} ({est.chips} chips), "
        f"{describe(est.settings)}",
    ]
    for r in est.depths:
        if r.error is None:
            lines.append(
                f"  compiled at {r.layers:>2} layers: peak {_gib(r.peak_bytes)}, "
                f"{r.figures['flops'] / 1e12:.1f} TFLOP, {r.figures['optimal_seconds']:.3f} s "
                f"per micro-step{_kernel_note(r)} (compile {r.compile_seconds:.0f} s)"
            )
        else:
            lines.append(f"  compiled at {r.layers:>2} layers: {r.error}")
    if est.error is None:
        fast, middle, slow = est.band
        lines += [
            f"per chip at {est.layers} layers ({est.fit_note}); estimates, not measurements:",
            f"  peak HBM             {_gib(est.peak_bytes)} of {_gib(est.hbm_bytes)} "
            f"({est.headroom:.0%} free)",
            f"  FLOPs per micro-step {est.flops / 1e12:.1f} TFLOP (XLA's "
            f"{(est.flops - est.kernel_flops) / 1e12:.1f} + attention kernels "
            f"{est.kernel_flops / 1e12:.1f}: {packed_attention.FORWARD_BLOCK_MATMULS} forward and "
            f"{packed_attention.BACKWARD_BLOCK_MATMULS} backward matmuls per visited block)",
            f"  est. step time       {middle:.3f} s per micro-step of "
            f"{est.computed_tokens_per_step:,} tokens (band {fast:.3f} - {slow:.3f} s; "
            f"XLA alone: {est.step_seconds:.3f} s)",
            f"  est. tokens/s        {_band_text(est.real_tokens_band, '{:,.0f}')} real, at "
            f"{est.real_fraction:.1%} real tokens (the paper measured "
            f"{catalog.PAPER.train_tokens_per_s_tpu:,.0f})",
            f"  share of peak        {_band_text(est.peak_share_band, '{:.0%}')} (XLA's FLOPs "
            f"over {est.chips} x {est.peak_flops_per_chip / 1e12:.0f} TFLOP/s)",
            _collectives_line(est),
            f"  assumptions: fast end = XLA's cost model, kernels at "
            f"{KERNEL_EFFICIENCY[0]:.0%} of peak; slow end = XLA's part x"
            f"{est.xla_optimism:.2f} (its optimism on the paper's measured step), kernels at "
            f"{KERNEL_EFFICIENCY[1]:.0%}; middle = geometric mean",
        ]
    lines.append(verdict_line(est))
    return "\n".join(lines)


def _collectives_line(est: Estimate) -> str:
    if est.collectives is None:
        return (
            "  collectives          not counted for these settings "
            "(benchmarks/step_levers.py reads them from the compiled HLO)"
        )
    buffers, ring, depths = est.collectives
    return (
        f"  collectives          {buffers / 1e9:.1f} GB of buffers per micro-step, "
        f"{ring / 1e9:.1f} GB sent per chip by a ring (from the HLO at "
        f"{', '.join(map(str, depths))} layers; XLA's time prices them, a TPU run shows how "
        f"much hides behind compute)"
    )


def verdict_line(est: Estimate) -> str:
    """One line: fits, fits tightly, or does not fit with the keys to change."""
    keys = "training.microBatch, data.maxSeqLen, training.mesh or training.remat"
    if est.error is not None:
        return f"compile-check: {DOES_NOT_FIT} on {est.accelerator}: {est.error}; change {keys}"
    if not est.fits:
        return (
            f"compile-check: {DOES_NOT_FIT}: the step needs an estimated {_gib(est.peak_bytes)} of "
            f"HBM per chip, {est.accelerator} has {_gib(est.hbm_bytes)}; lower {keys}"
        )
    if est.headroom < HEADROOM_WARNING:
        return (
            f"compile-check: fits, tightly ({est.headroom:.0%} of HBM free, under "
            f"{HEADROOM_WARNING:.0%}); the runtime's own buffers may not fit: consider {keys}"
        )
    return f"compile-check: fits ({_gib(est.peak_bytes)} of {_gib(est.hbm_bytes)} per chip)"


def check(
    stack: str,
    cfg: config_mod.StackConfig,
    *,
    compile_fn: CompileFn | None,
    cache: ResultCache | None = None,
    depths: Sequence[int] = DEPTHS,
    log: Callable[[str], None] = print,
) -> Estimate | None:
    """Compiles (or reads from the cache) the stack's step at `depths` and extrapolates.

    Args:
        compile_fn: None: only cached results are used (what `pulumi preview` shows).
    """
    cache = cache or ResultCache()
    accelerator = catalog.accelerator(cfg.training.accelerator)
    results = results_at(
        step_settings(cfg),
        depths,
        compile_fn,
        cache,
        hbm_bytes=accelerator.hbm_bytes_per_chip,
        log=log,
    )
    return estimate(stack, cfg, results)


def cached_summary(stack: str, cfg: config_mod.StackConfig) -> str | None:
    """The last compile check's verdict for these exact settings, or None (nothing compiled)."""
    try:
        est = check(stack, cfg, compile_fn=None, log=lambda _: None)
    except (OSError, KeyError):
        return None
    if est is None:
        return None
    return verdict_line(est)
