"""Compiles the training step while the weights load, into JAX's persistent compilation cache.

The step needs only shapes, dtypes and shardings, not weights, so it can be traced, lowered and
compiled from an abstract model (`nnx.eval_shape`, ShapeDtypeStruct leaves with the mesh's
NamedShardings, as the deviceless compile check builds it: workloads.train.compile_step) while
the 62.5 GB of weights are still being read and moved to the chips. The executable lands in the
persistent compilation cache (train.compile_cache_dir); the trainer's own jitted step then lowers
to the same module with the same compile options, finds the entry and skips XLA (minutes for the
31B step on the host).

For the key to match, the abstract step must be exactly the one the trainer runs: the same mesh
(the trainer's `jax.make_mesh` device order), the same learning-rate schedule (its step counts are
constants in the program, so the run's real total_steps), the same remat and attention choices,
and tunix's own activation-sharding helper (no patch: that is only for compiling on a CPU host
for a TPU). `CacheReport` reads JAX's own log of hits and misses, so the run states whether its
first step was served from the cache.

A failure in the background thread is kept and reported as one line when the trainer waits for
it; the run then compiles in its first step as it would without this module. An executable that
does not fit the chips' memory stops the run at once (the first step would fail the same way).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workloads.common import errors, stage_records
from workloads.contract import runconfig
from workloads.model import gemma4
from workloads.model import lora as lora_lib
from workloads.train import compile_step, packed_attention
from workloads.train import step as step_lib

if TYPE_CHECKING:
    import jax
    from flax import nnx

# The name JAX gives the trainer's jitted step (step.TrainableOnlyStep jits a function `pure`).
STEP_MODULE = "jit_pure"


class StepCompileError(errors.UserError):
    """The training step cannot be compiled for these chips (e.g. it does not fit in HBM)."""


def lower_step(
    cfg: runconfig.RunConfig,
    hf_config: dict[str, Any],
    mesh: jax.sharding.Mesh,
    total_steps: int,
    *,
    kernel: bool,
) -> Any:
    """The trainer's training micro-step lowered from abstract shapes on `mesh`.

    Args:
        cfg: the run config (model dtype, lora, train, data.max_seq_len and seed are used).
        hf_config: the base model's config.json.
        mesh: the mesh the trainer trains on (same devices, same order).
        total_steps: the run's optimizer steps (the schedule's constants are in the program).
        kernel: packed rows go through the splash kernel (trainer.uses_kernel).

    Returns:
        A `jax.stages.Lowered`; `.compile()` compiles it (through the persistent cache).
    """
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model

    model_cfg = gemma4.tunix_config_from_hf(hf_config, dtype=cfg.model.dtype)
    schedule = step_lib.learning_rate_schedule(cfg.train, total_steps)
    with mesh:

        def build() -> nnx.Module:
            base = gemma4_model.Gemma4(model_cfg, rngs=nnx.Rngs(params=0))
            return lora_lib.apply_lora(base, cfg.lora, mesh=mesh, seed=cfg.data.seed)

        model = nnx.eval_shape(build)
        gemma4.set_remat(model, cfg.train.remat)
        if kernel:
            packed_attention.use_kernel(model)
        compile_step._with_shardings(model, mesh)
        made: dict[str, Any] = {}

        def build_optimizer(m: nnx.Module) -> nnx.Module:
            made["trainer"] = step_lib.make_trainer(m, cfg.train, schedule, None)
            return made["trainer"].optimizer

        optimizer = nnx.eval_shape(build_optimizer, model)
        compile_step._with_shardings(optimizer, mesh)
        jitted = step_lib.TrainableOnlyStep(
            model, optimizer, made["trainer"].create_train_step_fn()
        )
        return jitted.lower(compile_step.abstract_inputs(cfg, mesh))


# The stage record of the background compile (workloads.common.stage_records).
STAGE = "compile_ahead"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _does_not_fit(exc: BaseException) -> bool:
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


@dataclasses.dataclass
class Outcome:
    """What the background compile did: its wall time (and when it ran, time.monotonic()), or
    the one line of its failure."""

    seconds: float | None = None
    error: str | None = None
    started: float | None = None
    finished: float | None = None


class CompileAhead:
    """Runs `compile_fn` (lower + compile into the persistent cache) in a daemon thread.

    `wait()` joins it: the compiled seconds, or None after logging one line when it failed
    (the first step then compiles as usual); StepCompileError when the step cannot fit.
    """

    def __init__(
        self,
        compile_fn: Callable[[], Any],
        log: Callable[[str], None],
        stage_log: stage_records.StageLog | None = None,
    ):
        self._compile_fn = compile_fn
        self._log = log
        # Its own stage record (compile_ahead), so a boot's records show it beside the weights
        # stage: the overlap the design promises, readable on the VM and in the rehearsal.
        self._stage_log = stage_log
        self.outcome = Outcome()
        self._fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="compile-ahead", daemon=True)

    def start(self) -> CompileAhead:
        self.outcome.started = time.monotonic()
        if self._stage_log is not None:
            self._stage_log.start(STAGE)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._compile_fn()
        except BaseException as exc:  # kept for wait(): a thread's exception would be lost
            self.outcome.error = _first_line(exc)
            if _does_not_fit(exc):
                self._fatal = exc
        else:
            self.outcome.seconds = time.monotonic() - (self.outcome.started or 0.0)
        finally:
            self.outcome.finished = time.monotonic()
            if self._stage_log is not None:
                error = self.outcome.error
                self._stage_log.end(STAGE, ok=error is None, note=error or "")

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> float | None:
        """Blocks until the compile ended; logs how it went (one line).

        Raises:
            StepCompileError: XLA refused the step for lack of accelerator memory.
        """
        waited = time.monotonic()
        self._thread.join()
        waited = time.monotonic() - waited
        if self._fatal is not None:
            raise StepCompileError(
                f"the training step does not fit the accelerator: {self.outcome.error}"
            )
        if self.outcome.error is not None:
            self._log(
                f"compile-ahead: failed ({self.outcome.error}); the first step compiles instead"
            )
            return None
        self._log(
            f"compile-ahead: train step compiled in {self.outcome.seconds:.1f} s beside the "
            f"loading (waited {waited:.1f} s for it after loading)"
        )
        return self.outcome.seconds


def start(
    cfg: runconfig.RunConfig,
    hf_config: dict[str, Any],
    mesh: jax.sharding.Mesh,
    total_steps: int,
    *,
    kernel: bool,
    log: Callable[[str], None],
    stage_log: stage_records.StageLog | None = None,
) -> CompileAhead | None:
    """Starts compiling the run's step in the background; None (and a line saying why) when
    there is no persistent cache to compile into (train.compile_cache_dir unset)."""
    if not cfg.train.compile_cache_dir:
        log("compile-ahead: off (no persistent compilation cache: train.compile_cache_dir unset)")
        return None

    def compile_fn() -> Any:
        return lower_step(cfg, hf_config, mesh, total_steps, kernel=kernel).compile()

    return CompileAhead(compile_fn, log, stage_log).start()


class CacheReport:
    """Which jitted modules JAX served from the persistent compilation cache and which it
    compiled, read from JAX's own log lines while active (a context manager).

    JAX logs hits and misses at DEBUG: the logger is lowered to DEBUG meanwhile and a filter on
    it reads those records and drops the ones below the level it had, so nothing new is printed.
    """

    _HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
    _MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")
    _LOGGER = "jax._src.compiler"

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.misses: list[str] = []
        self._level = logging.NOTSET
        self._shown_from = logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if match := self._HIT.search(message):
            self.hits.append(match.group(1))
        elif match := self._MISS.search(message):
            self.misses.append(match.group(1))
        return record.levelno >= self._shown_from

    def __enter__(self) -> CacheReport:
        logger = logging.getLogger(self._LOGGER)
        self._level = logger.level
        self._shown_from = logger.getEffectiveLevel()
        logger.setLevel(logging.DEBUG)
        logger.addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeFilter(self)
        logger.setLevel(self._level)

    def step_line(self) -> str:
        """One line on the train step's compile: served from the cache, or compiled."""
        if STEP_MODULE in self.hits:
            return "first step: the train step came from the persistent compilation cache"
        if STEP_MODULE in self.misses:
            return "first step: the train step was not in the persistent cache (compiled now)"
        return "first step: no persistent compilation cache lookup for the train step"
