"""The LoRA fine-tune in phases: set up (config checks, mesh, data, model), restore (the latest
checkpoint, if any), loop (PeftTrainer over the packed stream, with metrics and preemption
handling) and summary (train_summary.json over every process of the run).

The step itself is workloads.train.step; the checkpoint directory workloads.train.checkpoints;
the data stream workloads.train.stream. SIGTERM (a spot preemption notice) stops at the next
optimizer-step boundary and saves a final checkpoint; a restarted run resumes from the latest
one, replaying and skipping the deterministic data stream.

Every process records its segment of the run (metrics.Segment, in `segments/`) at its first
step, before each checkpoint save and when it ends; train_summary.json totals them, so the wall
time of a preempted and resumed run covers all its processes and its tokens count each step of
the final trajectory once.

The stages of set-up and loop (data, load, compile, first_step) are stage records
(workloads.common.stage_records): on a VM appended to the host's file next to the startup script's,
which `ops status` shows; train_summary.json keeps the boot's stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workloads.checkpoint import adapter_meta, lora_restore
from workloads.common import disk_space, errors, logs, stage_records, storage
from workloads.contract import catalog, runconfig
from workloads.model import base_weights, gemma4, parallel_load
from workloads.model import lora as lora_lib
from workloads.train import (
    checkpoints,
    compile_ahead,
    guards,
    hosts,
    packed_attention,
    resume,
    runlock,
    step,
)
from workloads.train import metrics as metrics_lib
from workloads.train import stream as stream_lib

if TYPE_CHECKING:
    import jax
    import optax
    from flax import nnx

EXIT_PREEMPTED = 128 + signal.SIGTERM


def _make_hooks(
    on_step_start: Callable[[Any], None], on_step_end: Callable[[Any, int, float], None]
) -> Any:
    from tunix.sft import hooks

    class Hooks(hooks.TrainingHooks):
        def on_train_start(self, train_ctx: Any) -> None:
            pass

        def on_train_end(self, train_ctx: Any) -> None:
            pass

        def on_train_step_start(self, train_ctx: Any) -> None:
            on_step_start(train_ctx)

        def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: float) -> None:
            on_step_end(train_ctx, train_step, float(train_loss))

        def on_eval_step_start(self, train_ctx: Any) -> None:
            pass

        def on_eval_step_end(self, train_ctx: Any, eval_loss: float) -> None:
            pass

    return Hooks()


@dataclasses.dataclass
class TrainResult:
    """What one `train()` call did."""

    summary: dict[str, Any]
    final_step: int
    resumed_from: int
    interrupted: bool
    checkpoint_dir: str
    records: list[dict[str, Any]]

    @property
    def exit_status(self) -> int:
        return EXIT_PREEMPTED if self.interrupted else 0


_say = logs.say("train")  # notes as `train: ...` on stderr; the metrics lines stay on stdout


def load_data(cfg: runconfig.RunConfig, model_dir: str) -> stream_lib.BatchSource:
    """Reads, renders and packs the dataset with the base model's tokenizer (workloads.data)."""
    import jax

    from workloads.data import prepared_cache

    try:
        import transformers
    except ImportError:
        raise errors.UserError(
            "training needs `transformers` for the model's tokenizer and chat "
            "template: pip install 'gemma4-tpu[workloads]'"
        ) from None
    return prepared_cache.prepare_cached(
        cfg,
        model_dir,
        lambda: transformers.AutoTokenizer.from_pretrained(model_dir),
        host_index=jax.process_index(),
        host_count=jax.process_count(),
        write=jax.process_index() == 0,
    )


def total_optimizer_steps(cfg: runconfig.RunConfig, data: stream_lib.BatchSource) -> int:
    """train.max_steps, or as many whole optimizer steps as `train.epochs` epochs hold.

    Raises:
        errors.UserError: the data does not fill one optimizer step.
    """
    train = cfg.train
    if train.max_steps is not None:
        return train.max_steps  # epochs follow one another until then
    total = data.batches_per_epoch * train.epochs // train.grad_accum
    if total < 1:
        raise errors.UserError(
            f"{cfg.data.dataset}: too little data for one optimizer step "
            f"(train.grad_accum={train.grad_accum} micro-batches of {train.micro_batch} rows)"
        )
    return total


def build_lora_model(
    cfg: runconfig.RunConfig, model_dir: pathlib.Path, mesh: jax.sharding.Mesh
) -> tuple[nnx.Module, int]:
    """The base model with adapters, sharded on the mesh. Returns it and the base's size."""
    with mesh:  # no host copy for matching dtypes, transfers in parallel (parallel_load)
        base = parallel_load.load_model(model_dir, mesh=mesh, dtype=cfg.model.dtype)
    base_params = gemma4.parameter_count(base)
    model = lora_lib.apply_lora(base, cfg.lora, mesh=mesh, seed=cfg.data.seed)
    gemma4.set_remat(model, cfg.train.remat)
    if uses_kernel(cfg, mesh):
        packed_attention.use_kernel(model)
    return model, base_params


def uses_kernel(cfg: runconfig.RunConfig, mesh: jax.sharding.Mesh) -> bool:
    """Packed rows go through the splash attention kernel on a TPU (unless train.attention is
    "dense"); elsewhere (the CPU demo and tests) through tunix's dense-mask attention, the
    reference the kernel is tested against."""
    on_tpu = bool(mesh.devices.size) and mesh.devices.flat[0].platform == "tpu"
    return on_tpu and cfg.train.attention == "kernel"


class _StepMetrics:
    """PeftTrainer's per-step hook: turns what the step did into a metrics record, and stops the
    run at the first step whose loss or gradient norm is not finite (workloads.train.guards).

    PeftTrainer reports step s only once step s+1 has run, after the checkpoint of step s was
    saved; `before_save` records a step that is about to be checkpointed ahead of its hook (and
    checks it), so a kill right after the checkpoint does not lose its line in metrics.jsonl and
    a non-finite step is never saved.
    """

    def __init__(
        self,
        *,
        cfg: runconfig.RunConfig,
        schedule: optax.Schedule,
        run_log: metrics_lib.RunLog,
        segment: metrics_lib.Segment,
        last_step: int,
        resumed_from: int,
        stage_log: stage_records.StageLog | None = None,
        lock: runlock.RunLock | None = None,
    ):
        self.cfg = cfg
        self.lock = lock
        self.stage_log = stage_log
        self.schedule = schedule
        self.run_log = run_log
        self.segment = segment
        self.last_step = last_step
        self.resumed_from = resumed_from
        self.logged_through = resumed_from
        train = cfg.train
        self.computed_per_step = train.micro_batch * cfg.data.max_seq_len * train.grad_accum
        self.real_tokens = self.computed_tokens = self.steps = 0
        self.clock = time.time()

    def start(self) -> None:
        self.clock = time.time()

    def __call__(self, ctx: Any, step: int, loss: float) -> None:
        if step <= self.logged_through:
            return  # recorded ahead of its checkpoint (before_save)
        # tunix's: the global norm of each micro-batch's gradient, averaged over the step.
        grad_norm = float(ctx.metrics_logger.get_metric_history("", "grad_norm", "train")[-1])
        self._record(ctx, step, loss, grad_norm, force_write=False)

    def _first_step_done(self) -> None:
        """Ends stages compile (the time JAX spent tracing, lowering and compiling, or fetching
        from the persistent cache, up to here) and first_step (the wall time from the loop's
        start, which the compilation is part of)."""
        if self.stage_log is None:
            return
        compiled = self.segment.compile.seconds
        if self.stage_log.is_open("compile"):
            self.stage_log.end(
                "compile",
                seconds=compiled,
                note="" if compiled is not None else "JAX reported no compile events: wall time",
            )
        if self.stage_log.is_open("first_step"):
            self.stage_log.end("first_step")

    def before_save(self, trainer: Any, step: int) -> None:
        """Checks and records step `step` before its checkpoint is written (PeftTrainer still
        holds its losses and gradient norms in its metrics buffer)."""
        import numpy as np

        if step <= self.logged_through:
            return
        buffered = getattr(trainer, "_prev_buffered_train_metrics", None)
        if buffered is None or buffered.step + 1 != step:
            return  # not this step's buffer (a tunix change): its hook records it later
        norms = buffered.additional_metrics.get("grad_norm", ([float("nan")], np.mean))[0]
        grad_norm = float(np.mean(np.asarray([np.asarray(x, np.float32) for x in norms])))
        self._record(trainer, step, float(buffered.loss), grad_norm, force_write=True)

    def _record(
        self, ctx: Any, step: int, loss: float, grad_norm: float, *, force_write: bool
    ) -> None:
        import jax

        if self.lock is not None:  # metrics.jsonl and the segment are written below
            self.lock.check()
        guards.check_step(
            step,
            loss,
            grad_norm,
            resumed_from=self.resumed_from,
            checkpoint_dir=self.cfg.train.checkpoint_dir,
        )
        self.logged_through = step
        # PeftTrainer reports step s once step s+1 is queued, so this is ~ step s's wall time.
        now = time.time()
        seconds, self.clock = now - self.clock, now
        real = sum(int(x) for x in jax.device_get(ctx.step_aux.pop(step, [])))
        self.real_tokens += real
        self.computed_tokens += self.computed_per_step
        self.steps += 1
        self.segment.record(step, real)
        if self.steps == 1:  # a segment killed before its first checkpoint still shows up
            self.segment.write()
            self._first_step_done()
        in_use, peak = metrics_lib.device_memory()
        tokens_per_s = real / seconds if seconds > 0 else 0.0
        computed_per_s = self.computed_per_step / seconds if seconds > 0 else 0.0
        record = {
            "step": step,
            "loss": loss,
            "learning_rate": float(self.schedule(step - 1)),
            "grad_norm": grad_norm,
            "real_tokens": real,
            "computed_tokens": self.computed_per_step,
            "step_seconds": seconds,
            "tokens_per_s": tokens_per_s,
            "computed_tokens_per_s": computed_per_s,
            "device_memory_bytes": in_use,
            "peak_device_memory_bytes": peak,
            "host_rss_bytes": metrics_lib.host_rss(),
        }
        if force_write or step % self.cfg.train.log_every == 0 or step == self.last_step:
            self.run_log.log(record)
        else:
            self.run_log.records.append(record)
        if force_write or step % self.cfg.train.save_every == 0:
            self.run_log.sync()


@dataclasses.dataclass
class _Prepared:
    """What the set-up phase hands to the others."""

    cfg: runconfig.RunConfig
    mesh: jax.sharding.Mesh
    hf_config: dict[str, Any]
    data: stream_lib.BatchSource
    total_steps: int
    model: nnx.Module
    base_params: int
    lora_params: int
    primary: bool  # this process writes the run dir's files (one host of a slice)
    started: float
    resume_step: int  # the newest intact checkpoint (0: none)
    lock: runlock.RunLock | None  # held by the writing process until the run ends
    stage_log: (
        stage_records.StageLog
    )  # data, load, compile, first_step (workloads.common.stage_records)
    ahead: compile_ahead.CompileAhead | None = None  # the step compiling beside the loading


@dataclasses.dataclass
class _Loop:
    """What the loop phase did."""

    trainer: Any
    resumed_from: int
    run_log: metrics_lib.RunLog
    segment: metrics_lib.Segment
    step_metrics: _StepMetrics
    this_segment: dict[str, Any]
    loop_started: float


def train(
    cfg: runconfig.RunConfig,
    *,
    data: stream_lib.BatchSource | None = None,
    stop_after_steps: int | None = None,
    log: Callable[[str], None] = _say,
    handle_sigterm: bool = True,
    fresh_optimizer_state: bool = False,
    on_lock_lost: Callable[[runlock.LockLost], None] | None = None,
) -> TrainResult:
    """Runs (or resumes) the LoRA fine-tune described by `cfg`: set up, restore, loop, summary.

    Args:
        cfg: the run config (model, data, lora, train sections are used).
        data: prepared batches; None reads `cfg.data` through workloads.data.pipeline.
        stop_after_steps: end this process after this many optimizer steps (checkpointed like a
            SIGTERM); for tests and the demo's resume illustration.
        log: where progress lines go.
        handle_sigterm: install the SIGTERM handler (main thread only).
        fresh_optimizer_state: resume from a checkpoint that has no optimizer state, with a new
            one (otherwise that is an error: workloads.train.resume).
        on_lock_lost: called from whichever thread finds out that another trainer took a gs://
            run directory's lock over (workloads.train.runlock); the command exits there. Either
            way the run stops before its next write with runlock.LockLost.

    Returns:
        A TrainResult; train_summary.json is written when the run reached its last step.

    Raises:
        errors.UserError: bad mesh, tp, data, model directory or checkpoint directory; another
            trainer holds the run directory; no intact checkpoint; a full disk (naming the path
            and the free space; earlier checkpoints are kept); runlock.LockLost: another trainer
            took the run directory over (nothing more is written).
        guards.NonFiniteError: a step's loss or gradient norm is not finite (nothing of it or
            after it is saved).
    """
    # On a VM ($GEMMA4_STAGES_FILE) these go to the host's stage records next to the startup
    # script's; `ops status` and train_summary.json show them.
    stage_log = stage_records.StageLog.from_env("trainer", log=log)
    prepared = _set_up(cfg, data, log, fresh_optimizer_state, stage_log, on_lock_lost)
    if isinstance(prepared, TrainResult):
        return prepared  # a finished run started again
    try:
        trainer, schedule, resumed_from = _restore(prepared, log)
        loop = _loop(
            prepared, trainer, schedule, resumed_from, stop_after_steps, log, handle_sigterm
        )
        return _summarise(prepared, loop, log)
    except Exception as exc:
        if disk_space.is_disk_full(exc) and not isinstance(exc, errors.UserError):
            raise _disk_full(cfg.train) from None
        raise
    finally:
        if prepared.lock is not None:
            prepared.lock.release()


def _disk_full(train_cfg: runconfig.TrainingRunSection) -> errors.UserError:
    """The one line for a full disk: the half-written save is removed first (it only holds
    space; the next run removes what writer threads still left), so the free space named is
    what the user has to work with."""
    ckpt = train_cfg.checkpoint_dir
    with contextlib.suppress(OSError):  # its writer threads may still be at it
        resume.remove_partial_saves(ckpt)
    return guards.disk_full_error(ckpt, lora_restore.saved_steps(ckpt))


def _set_up(
    cfg: runconfig.RunConfig,
    data: stream_lib.BatchSource | None,
    log: Callable[[str], None],
    fresh_optimizer_state: bool,
    stage_log: stage_records.StageLog,
    on_lock_lost: Callable[[runlock.LockLost], None] | None = None,
) -> _Prepared | TrainResult:
    """Cheap checks first (config.json is read in place, even on gs://), then the run
    directory's lock (the writing process), staging, data, the checkpoint to resume from and
    the LoRA model on the mesh. A run whose last checkpoint is already the last step ends here.
    The lock is given back if anything fails here; otherwise `train` gives it back."""
    import jax

    started = time.time()
    train_cfg = cfg.train
    base = base_weights.model_dir(cfg.model.base, cfg.model.stage_dir, before_weights=True)
    hf_config = gemma4.read_hf_config(base)
    gemma4.check_tp(gemma4.tunix_config_from_hf(hf_config), train_cfg.mesh.tp)
    mesh = gemma4.make_mesh(train_cfg.mesh.fsdp, train_cfg.mesh.tp)
    # A slice's hosts must all see one run directory: caught here, before a fresh run trains
    # with each host saving its part of every checkpoint where the others cannot read it.
    hosts.check_shared_directory(train_cfg.output_dir)
    has_meta = checkpoints.check_checkpoint_dir(cfg)
    primary = jax.process_index() == 0
    lock = runlock.RunLock(train_cfg.output_dir, log, on_lost=on_lock_lost) if primary else None
    if lock is not None:
        lock.acquire()
    try:
        return _set_up_locked(
            cfg,
            data,
            log,
            fresh_optimizer_state,
            hf_config,
            mesh,
            has_meta,
            lock,
            started,
            base,
            stage_log,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _set_up_locked(
    cfg: runconfig.RunConfig,
    data: stream_lib.BatchSource | None,
    log: Callable[[str], None],
    fresh_optimizer_state: bool,
    hf_config: dict[str, Any],
    mesh: jax.sharding.Mesh,
    has_meta: bool,
    lock: runlock.RunLock | None,
    started: float,
    base: str,
    stage_log: stage_records.StageLog,
) -> _Prepared | TrainResult:
    import jax

    train_cfg = cfg.train
    primary = jax.process_index() == 0
    gemma4.set_compilation_cache(train_cfg.compile_cache_dir)
    # A URL the startup script did not stage (a run off the VMs) is copied here: stage weights.
    copying = storage.is_remote(base)
    with stage_log.stage("weights") if copying else contextlib.nullcontext():
        model_dir = gemma4.stage(base, cfg.model.stage_dir)
    if data is None:
        with stage_log.stage("data"):
            data = load_data(cfg, str(model_dir))
    total_steps = total_optimizer_steps(cfg, data)
    done = lora_restore.saved_steps(train_cfg.checkpoint_dir)
    if (
        done
        and done[-1] >= total_steps
        and resume.fence_problem(train_cfg.checkpoint_dir, done[-1], done) is None
        and resume.step_problem(train_cfg.checkpoint_dir, done[-1])[0] is None
    ):
        # A finished run started again (a restarted unit): leave its outputs as they are.
        log(f"{train_cfg.checkpoint_dir}: already at step {done[-1]}/{total_steps}; nothing to do")
        if lock is not None:
            lock.release()
        return TrainResult(
            summary=read_summary(train_cfg.output_dir),
            final_step=done[-1],
            resumed_from=done[-1],
            interrupted=False,
            checkpoint_dir=train_cfg.checkpoint_dir,
            records=[],
        )
    # Before the model is built: a run that cannot resume says so at once.
    resume_step = _agreed_resume_step(train_cfg, fresh_optimizer_state, primary, log)
    if train_cfg.warmup_steps >= total_steps:
        log(
            f"note: train.warmup_steps={train_cfg.warmup_steps} >= {total_steps} steps; "
            f"warming up over {max(total_steps - 1, 0)} steps instead"
        )
    # The step compiles from abstract shapes while the weights load (compile_ahead).
    ahead = compile_ahead.start(
        cfg,
        hf_config,
        mesh,
        total_steps,
        kernel=uses_kernel(cfg, mesh),
        log=log,
        stage_log=stage_log,
    )
    # On a new VM the host is ready before its weights are whole: wait for them here, after the
    # data and with the step compiling (workloads.model.base_weights).
    if base_weights.weights_pending(str(model_dir), cfg.model.stage_dir):
        with stage_log.stage("weights_wait"):
            base_weights.wait_for_weights(cfg.model.stage_dir, log=log)
    log(
        f"loading {model_dir} ({cfg.model.dtype}) on mesh fsdp={train_cfg.mesh.fsdp} "
        f"tp={train_cfg.mesh.tp} ({jax.device_count()} {jax.devices()[0].platform} devices)"
    )
    with stage_log.stage("load"):
        model, base_params = build_lora_model(cfg, model_dir, mesh)
    lora_params = sum(x.size for x in jax.tree.leaves(lora_lib.lora_state(model)))
    log(
        f"model: {base_params:,} base parameters, {lora_params:,} LoRA parameters (rank "
        f"{cfg.lora.rank}, alpha {cfg.lora.alpha:g}, targets {', '.join(cfg.lora.targets)})"
    )
    log(
        "attention: packed rows through the splash kernel (segment ids)"
        if uses_kernel(cfg, mesh)
        else "attention: dense segment mask (no TPU: the kernel's reference path)"
    )
    if primary and not has_meta:
        if lock is not None:
            lock.check()
        adapter_meta.write(
            train_cfg.checkpoint_dir,
            adapter_meta.AdapterMeta(
                rank=cfg.lora.rank,
                alpha=cfg.lora.alpha,
                targets=tuple(cfg.lora.targets),
                dropout=cfg.lora.dropout,
                base=cfg.model.base,
                hf_config=hf_config,
                run_name=cfg.run_name,
            ),
        )
    return _Prepared(
        cfg,
        mesh,
        hf_config,
        data,
        total_steps,
        model,
        base_params,
        lora_params,
        primary,
        started,
        resume_step,
        lock,
        stage_log,
        ahead,
    )


def _agreed_resume_step(
    train_cfg: runconfig.TrainingRunSection,
    fresh_optimizer_state: bool,
    primary: bool,
    log: Callable[[str], None],
) -> int:
    """The step every host resumes from. Every host checks the checkpoints (Orbax's reads
    synchronise the hosts, so all must take part; only the writing host moves damaged steps
    aside), then all take the writing host's answer: no two hosts may restore different steps
    (their collectives would then disagree).

    Raises:
        errors.UserError: as resume.choose_step; or this host found another step than the
            writing host (a checkpoint directory each worker has its own copy of, not storage
            every worker shares).
    """
    import jax

    mine = resume.choose_step(
        train_cfg, fresh_optimizer_state=fresh_optimizer_state, move_damaged=primary, log=log
    )
    if jax.process_count() == 1:
        return mine
    import numpy as np
    from jax.experimental import multihost_utils

    hosts.barrier("resume-step")
    agreed = int(multihost_utils.broadcast_one_to_all(np.int32(mine)))
    if mine != agreed:
        raise errors.UserError(
            f"{train_cfg.checkpoint_dir}: host {jax.process_index()} found checkpoint step "
            f"{mine}, host 0 resumes from step {agreed}; train.output_dir must be storage every "
            "host shares (a gs:// bucket on a slice)"
        )
    return agreed


def _restore(prepared: _Prepared, log: Callable[[str], None]) -> tuple[Any, optax.Schedule, int]:
    """The trainer on the model; PeftTrainer restores the latest checkpoint, if any."""
    train_cfg = prepared.cfg.train
    schedule = step.learning_rate_schedule(train_cfg, prepared.total_steps)
    with prepared.mesh:
        trainer = step.make_trainer(prepared.model, train_cfg, schedule, train_cfg.checkpoint_dir)
    resumed_from = trainer.train_steps
    if resumed_from != prepared.resume_step:  # the directory changed under this trainer
        raise errors.UserError(
            f"{train_cfg.checkpoint_dir}: restored step {resumed_from}, expected the newest "
            f"intact step {prepared.resume_step}; is another process writing this run directory?"
        )
    if resumed_from:
        log(f"resuming from checkpoint step {resumed_from} in {train_cfg.checkpoint_dir}")
    return trainer, schedule, resumed_from


def _loop(
    prepared: _Prepared,
    trainer: Any,
    schedule: optax.Schedule,
    resumed_from: int,
    stop_after_steps: int | None,
    log: Callable[[str], None],
    handle_sigterm: bool,
) -> _Loop:
    """PeftTrainer over the micro-batch stream, with the metrics and checkpoint hooks and the
    SIGTERM handler; the segment file is written whatever happens."""
    import jax

    if prepared.ahead is not None:  # its executable must be in the cache before the step asks
        prepared.ahead.wait()
    cfg, train_cfg = prepared.cfg, prepared.cfg.train
    stop_at = prepared.total_steps
    if stop_after_steps is not None:
        stop_at = min(prepared.total_steps, resumed_from + stop_after_steps)
    grad_accum = train_cfg.grad_accum
    stream = stream_lib.Stream(
        prepared.data,
        total_micro=stop_at * grad_accum,
        grad_accum=grad_accum,
        skip=resumed_from * grad_accum,
        preempted=stream_lib.preemption_sync_point() if jax.process_count() > 1 else None,
        place=stream_lib.global_batches(prepared.mesh) if jax.process_count() > 1 else None,
    )
    acc_name, _ = metrics_lib.accelerator()
    run_log = metrics_lib.RunLog(
        train_cfg.output_dir,
        resume_step=resumed_from,
        total_steps=prepared.total_steps,
        write=prepared.primary,
    )
    segment = metrics_lib.Segment(
        train_cfg.output_dir,
        start_step=resumed_from,
        computed_per_step=train_cfg.micro_batch * cfg.data.max_seq_len * grad_accum,
        accelerator=acc_name,
        write=prepared.primary,
    )
    step_metrics = _StepMetrics(
        cfg=cfg,
        schedule=schedule,
        run_log=run_log,
        segment=segment,
        last_step=stop_at,
        resumed_from=resumed_from,
        stage_log=prepared.stage_log,
        lock=prepared.lock,
    )

    def before_save(step: int, force: bool) -> None:
        # Record the segment and the step's metrics up to `step` before its checkpoint can
        # exist: whatever checkpoint a later process resumes from, these files already count
        # the steps up to it. Step `step`'s token count is still in step_aux (its metrics hook
        # comes one step later). A non-finite step stops here, before it is saved.
        if step <= resumed_from or not (force or step % train_cfg.save_every == 0):
            return
        # Proves the run directory is still this trainer's (a renewal that fails its generation
        # precondition if another trainer took over while this one was frozen or cut off).
        if prepared.lock is not None:
            prepared.lock.check(renew=True)
        step_metrics.before_save(trainer, step)
        if step in trainer.step_aux:  # the final forced save comes after the step's hook
            segment.record(step, sum(int(x) for x in jax.device_get(trainer.step_aux[step])))
        segment.write()

    trainer.checkpoint_manager.before_save = before_save
    if prepared.lock is not None and prepared.lock.fence is not None:
        # Each step records the lock generation it was saved under (resume.fence_problem).
        trainer.checkpoint_manager.custom_metadata[runlock.FENCE_KEY] = prepared.lock.fence
    mesh, seed = prepared.mesh, cfg.data.seed
    cache_report = compile_ahead.CacheReport()
    reported = False

    def on_step_end(ctx: Any, step: int, loss: float) -> None:
        nonlocal reported
        step_metrics(ctx, step, loss)
        if not reported and train_cfg.compile_cache_dir:
            reported = True
            log(cache_report.step_line())

    trainer.with_training_hooks(
        _make_hooks(
            lambda ctx: lora_lib.seed_dropout(ctx.model, seed, ctx.iter_steps, mesh),
            on_step_end,
        )
    )

    previous_handler = None
    # Multi-host: JAX's own SIGTERM notifier drives the preemption sync point (a Python handler
    # would replace it), so the handler is for single-host slices and CPU runs only.
    if (
        handle_sigterm
        and stream.preempted is None
        and threading.current_thread() is threading.main_thread()
    ):

        def on_sigterm(signum: int, frame: Any) -> None:
            log("SIGTERM: stopping at the next optimizer-step boundary and saving a checkpoint")
            stream.stop_requested.set()

        previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    loop_started = time.time()
    step_metrics.start()
    segment.start()
    if resumed_from < stop_at:  # the first step compiles the step function: two stages open
        prepared.stage_log.start("compile", at=loop_started)
        prepared.stage_log.start("first_step", at=loop_started)
    status = "failed"
    hosts.barrier("first-step")  # the hosts may have compiled the step at different speeds
    try:
        with mesh, segment.compile, cache_report:
            trainer.train(stream)  # closes the trainer: final metrics + final checkpoint
        status = "finished" if trainer.train_steps >= prepared.total_steps else "stopped"
    except BaseException:
        # A save of an earlier step may still be in flight: let it finish (or fail) cleanly.
        with contextlib.suppress(Exception):
            trainer.checkpoint_manager.close()
        for name in ("compile", "first_step"):  # stopped before the first step
            if prepared.stage_log.is_open(name):
                prepared.stage_log.end(name, ok=False)
        raise
    finally:
        train_seconds = time.time() - loop_started
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        this_segment: dict[str, Any] = {}
        if _holds(prepared.lock):  # else they are another trainer's files now
            run_log.close()
            this_segment = segment.write(status, wall_seconds=train_seconds)
    return _Loop(trainer, resumed_from, run_log, segment, step_metrics, this_segment, loop_started)


def _holds(lock: runlock.RunLock | None) -> bool:
    """Whether this process may still write the run directory; never raises (it is asked on
    the way out of the loop, whatever ended it)."""
    if lock is None:
        return True
    try:
        lock.check()
    except runlock.LockLost:
        return False
    return True


def _summarise(prepared: _Prepared, loop: _Loop, log: Callable[[str], None]) -> TrainResult:
    """train_summary.json over every process of the run (written once the last step is done)."""
    if prepared.lock is not None:  # train_summary.json is written below
        prepared.lock.check()
    cfg, train_cfg = prepared.cfg, prepared.cfg.train
    final_step = loop.trainer.train_steps
    ckpt_steps = lora_restore.saved_steps(train_cfg.checkpoint_dir)
    log(
        f"checkpoints in {train_cfg.checkpoint_dir}: steps "
        f"{', '.join(map(str, ckpt_steps)) or 'none'}"
    )
    records = loop.run_log.records
    losses = [r["loss"] for r in records]
    # The other hosts of a slice write no segment and total only their own.
    others = metrics_lib.read_segments(train_cfg.output_dir) if prepared.primary else {}
    others.pop(loop.segment.path, None)
    totals = metrics_lib.combine_segments(
        [*others.values(), loop.this_segment],
        final_step,
        fallback={
            int(r["step"]): int(r["real_tokens"])
            for r in records
            if "step" in r and "real_tokens" in r
        },
    )
    if totals["untracked_steps"]:
        log(
            f"note: {totals['untracked_steps']} steps of the run have no recorded token counts "
            "(segment files missing); real_tokens leaves them out"
        )
    last_segment = {k: v for k, v in loop.this_segment.items() if k != "step_real_tokens"}
    summary = {
        "run_name": cfg.run_name,
        "steps": final_step,
        # Totals over every process of the run (metrics.combine_segments): wall time actually
        # spent, first-step compilation and re-run steps included; tokens of the final
        # trajectory, each step once; tokens/s = those tokens over that wall time.
        "wall_seconds": totals["wall_seconds"],
        "real_tokens": totals["real_tokens"],
        "computed_tokens": totals["computed_tokens"],
        "tokens_per_second": totals["tokens_per_second"],
        "computed_tokens_per_second": totals["computed_tokens_per_second"],
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "accelerator": loop.segment.accelerator,
        # first_loss is step 1's even after a resume.
        "segments": totals["segments"],
        "compile_seconds": totals["compile_seconds"],
        "steps_run": totals["steps_run"],
        "untracked_steps": totals["untracked_steps"],
        "last_segment": last_segment,
        "total_steps": prepared.total_steps,
        "resumed_from_step": loop.resumed_from,
        "steps_this_run": loop.step_metrics.steps,
        "setup_seconds": loop.loop_started - prepared.started,
        # The paper's v5p-8 run, measured the same way (real tokens over wall time).
        "paper_tokens_per_second": catalog.PAPER.train_tokens_per_s_tpu,
        "base_parameters": prepared.base_params,
        "lora_parameters": prepared.lora_params,
        "checkpoint_dir": train_cfg.checkpoint_dir,
        "checkpoint_steps": ckpt_steps,
        "data": _stats_dict(prepared.data),
        # This boot's stages, from VM boot (startup script) to the first step
        # (workloads.common.stage_records).
        "stages": prepared.stage_log.rows(),
    }
    interrupted = final_step < prepared.total_steps
    if prepared.primary and not interrupted:
        log(f"wrote {metrics_lib.write_summary(train_cfg.output_dir, summary)}")
    return TrainResult(
        summary=summary,
        final_step=final_step,
        resumed_from=loop.resumed_from,
        interrupted=interrupted,
        checkpoint_dir=train_cfg.checkpoint_dir,
        records=list(records),
    )


def read_summary(output_dir: str) -> dict[str, Any]:
    """train_summary.json of a finished run ({} when there is none)."""
    path = runconfig.join(output_dir, metrics_lib.SUMMARY_FILE)
    return json.loads(storage.read_text(path)) if storage.exists(path) else {}


def _stats_dict(data: stream_lib.BatchSource) -> dict[str, Any] | None:
    """The data pipeline's counts (DataStats) as plain JSON values."""
    stats = getattr(data, "stats", None)
    if stats is None or not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        return None
    out = dataclasses.asdict(stats)
    out["real_fraction"] = getattr(stats, "real_fraction", None)
    return out
