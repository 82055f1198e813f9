"""The LoRA fine-tune: tunix PeftTrainer on packed batches, resumable Orbax checkpoints.

Data comes as fixed-shape packed rows (workloads.data.packing: tokens, segment_ids, positions,
loss_mask).
Inside the jitted step the attention mask is built as causal AND same segment AND not padding,
with positions restarting per sample, so a packed sample sees exactly what it would see alone
(the model adds the sliding-window band itself). The loss is the mean next-token NLL over the
tokens the model must predict (loss_mask, shifted by one: position t predicts token t + 1).

Checkpoints are PeftTrainer's (LoRA params + optimizer state) every `train.save_every` steps,
keeping `train.keep_checkpoints`; a restarted run resumes from the latest one, replaying and
skipping the deterministic data stream. SIGTERM (a spot preemption notice) stops at the next
optimizer-step boundary and saves a final checkpoint.

Every process records its segment of the run (metrics.Segment, in `segments/`) at its first
step, before each checkpoint save and when it ends; train_summary.json totals them, so the wall
time of a preempted and resumed run covers all its processes and its tokens count each step of
the final trajectory once.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import flax.struct
import numpy as np

from workloads import adapter_meta, catalog, errors, runconfig, storage
from workloads import model as model_lib
from workloads.train import lora as lora_lib
from workloads.train import metrics as metrics_lib

if TYPE_CHECKING:
    import jax
    import optax
    from flax import nnx

BATCH_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")
# Mesh axes a micro-batch's rows are split over (PeftTrainer shards its inputs along them).
DATA_AXES = ("fsdp",)
# Exit status of a run stopped by SIGTERM after saving (128 + SIGTERM, as a shell reports it).
EXIT_PREEMPTED = 128 + signal.SIGTERM


class PreparedData(Protocol):
    """What workloads.data.pipeline.prepare returns; tests may pass their own."""

    @property
    def stats(self) -> Any: ...

    @property
    def batches_per_epoch(self) -> int: ...

    def batches(self, epoch: int, *, skip: int = 0) -> Iterator[Any]: ...


@flax.struct.dataclass(frozen=True)
class PackedInput:
    """One micro-batch as the trainer moves it to the devices ([rows, max_seq_len] int32 each)."""

    input_tokens: Any
    input_mask: Any  # loss mask: 1 on tokens the model must predict
    segment_ids: Any  # 1..k per sample in a row, 0 = padding
    positions: Any  # restart at 0 per sample


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] bool: query t sees key s iff s <= t, same segment, and s is not padding."""
    import jax.numpy as jnp

    length = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, None, :]
    return causal[None] & same & real


def model_inputs(batch: PackedInput) -> dict[str, jax.Array]:
    """PeftTrainer's gen_model_input_fn: the keyword arguments of `loss_fn`."""
    return {
        "input_tokens": batch.input_tokens,
        "input_mask": batch.input_mask,
        "positions": batch.positions,
        "attention_mask": attention_mask(batch.segment_ids),
        "segment_ids": batch.segment_ids,
    }


def token_nll(
    model: nnx.Module, input_tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array
) -> jax.Array:
    """[B, T-1] float32: -log p(token t+1 | tokens <= t) under the model, at every position."""
    import jax
    import jax.numpy as jnp

    logits, _ = model(input_tokens, positions, None, attention_mask)
    logits = logits[:, :-1].astype(jnp.float32)
    targets = input_tokens[:, 1:]
    # A gather instead of a one-hot over the vocabulary: [B, T, 262144] would not fit for 31B.
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def loss_fn(
    model: nnx.Module,
    input_tokens: jax.Array,
    input_mask: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    segment_ids: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean NLL over predicted tokens; aux counts the real (non-padding) tokens of the batch."""
    import jax.numpy as jnp

    nll = token_nll(model, input_tokens, positions, attention_mask)
    weights = input_mask[:, 1:].astype(jnp.float32)
    loss = jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss, {"real_tokens": jnp.sum(segment_ids != 0)}


def learning_rate_schedule(train: runconfig.TrainSection, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to train.learning_rate, then cosine decay to 0 at total_steps."""
    import optax

    warmup = min(train.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=0.0,
    )


def make_optimizer(
    train: runconfig.TrainSection, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """AdamW (optional global-norm clipping first); PeftTrainer adds gradient accumulation."""
    import optax

    adamw = optax.adamw(learning_rate=schedule, weight_decay=train.weight_decay)
    if train.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(train.max_grad_norm), adamw)


# --------------------------------------------------------------------------- checkpoint dir


def saved_steps(checkpoint_dir: str) -> list[int]:
    """Finished checkpoint steps in a checkpoint dir (half-written temporary ones excluded)."""
    import orbax.checkpoint as ocp

    if not storage.exists(checkpoint_dir):
        return []
    return sorted(ocp.utils.checkpoint_steps(checkpoint_dir))


def check_checkpoint_dir(cfg: runconfig.RunConfig) -> bool:
    """Refuses a checkpoint dir written with other LoRA settings. Returns whether it has metadata.

    Raises:
        errors.UserError: lora_meta.json differs in rank, alpha or targets, or there are step
            directories without lora_meta.json.
    """
    ckpt = cfg.train.checkpoint_dir
    if storage.exists(adapter_meta.path(ckpt)):
        meta = adapter_meta.read(ckpt)
        diffs = [
            f"{name} {old!r} (run config: {new!r})"
            for name, old, new in (
                ("rank", meta.rank, cfg.lora.rank),
                ("alpha", meta.alpha, cfg.lora.alpha),
                ("targets", sorted(meta.targets), sorted(cfg.lora.targets)),
            )
            if old != new
        ]
        if diffs:
            raise errors.UserError(
                f"{ckpt}: holds LoRA checkpoints with {'; '.join(diffs)}; use another "
                "train.output_dir or the same lora settings"
            )
        return True
    if saved_steps(ckpt):
        raise errors.UserError(
            f"{ckpt}: has checkpoints but no {adapter_meta.FILENAME}; refusing to resume from "
            "adapters of unknown rank/alpha/targets (use another train.output_dir)"
        )
    return False


def checkpoint_options(train: runconfig.TrainSection) -> Any:
    """Every `save_every` steps (and when JAX reports a preemption), keeping `keep_checkpoints`.

    The policy is spelled out because Orbax's default for `save_interval_steps` also saves the
    first step of a fresh run, which would take one of the kept slots for an untrained adapter.
    """
    import orbax.checkpoint as ocp

    policies = ocp.checkpoint_managers
    return ocp.CheckpointManagerOptions(
        save_interval_steps=train.save_every,
        max_to_keep=train.keep_checkpoints,
        save_decision_policy=policies.AnySavePolicy(
            [
                policies.FixedIntervalPolicy(train.save_every),
                policies.PreemptionCheckpointingPolicy(),
            ]
        ),
    )


# --------------------------------------------------------------------------- data stream


def _preemption_sync_point() -> Callable[[int], bool]:
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point


class _Stream:
    """The micro-batch stream PeftTrainer consumes: epochs chained, cut at `total_micro` items.

    On resume PeftTrainer pulls and drops the first `skip` items itself; those are cheap
    placeholders (the data pipeline skips them without building them). A stop request (SIGTERM)
    ends the stream at the next optimizer-step boundary, so the final checkpoint never holds a
    half-accumulated gradient.
    """

    def __init__(
        self,
        data: PreparedData,
        *,
        total_micro: int,
        grad_accum: int,
        skip: int,
        preempted: Callable[[int], bool] | None = None,
    ):
        """Args:
        preempted: on multi-host slices, `multihost_utils.reached_preemption_sync_point`: every
            host stops at the same step (the one JAX agreed on after a preemption notice), where
            a host-local SIGTERM flag would let hosts stop at different steps and hang the
            collectives of the others.
        """
        self.preempted = preempted
        self.data = data
        self.total_micro = total_micro
        self.grad_accum = grad_accum
        self.skip = skip
        self.stop_requested = threading.Event()

    def __iter__(self) -> Iterator[PackedInput | None]:
        per_epoch = self.data.batches_per_epoch
        for _ in range(min(self.skip, self.total_micro)):
            yield None
        index = self.skip
        while index < self.total_micro:
            epoch, offset = divmod(index, per_epoch)
            for batch in self.data.batches(epoch, skip=offset):
                if index >= self.total_micro:
                    return
                if index % self.grad_accum == 0 and self._stop_at(index // self.grad_accum):
                    return
                yield to_input(batch)
                index += 1

    def _stop_at(self, step: int) -> bool:
        if self.preempted is not None and step > 0 and self.preempted(step):
            return True
        return self.stop_requested.is_set()


def to_input(batch: Any) -> PackedInput:
    """A data-pipeline Batch -> PackedInput (int32 numpy)."""
    fields = {name: np.asarray(getattr(batch, name), dtype=np.int32) for name in BATCH_FIELDS}
    return PackedInput(
        input_tokens=fields["tokens"],
        input_mask=fields["loss_mask"],
        segment_ids=fields["segment_ids"],
        positions=fields["positions"],
    )


# --------------------------------------------------------------------------- trainer


def _make_peft_trainer_class() -> type:
    from tunix.sft import peft_trainer

    class Trainer(peft_trainer.PeftTrainer):
        """PeftTrainer that keeps the per-micro-step aux (real token counts) per optimizer step
        and pins the step's output shardings to the variables' specs.

        Without the pin XLA may return equivalent but differently spelled shardings (a size-1
        mesh axis added or dropped, as with fsdp=1), and the second step compiles the whole
        train step again: minutes on the 31B model.
        """

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.step_aux: dict[int, list[Any]] = {}
            # Called with (step, force) before every checkpoint save attempt.
            self.before_save: Callable[[int, bool], None] | None = None
            manager = self.checkpoint_manager
            save = manager.save

            def save_with_hook(step: int, *args: Any, **kwargs: Any) -> Any:
                if self.before_save is not None:
                    self.before_save(step, bool(kwargs.get("force", False)))
                return save(step, *args, **kwargs)

            manager.save = save_with_hook

        def create_train_step_fn(self) -> Callable[..., Any]:
            import jax
            from flax import nnx

            step = super().create_train_step_fn()

            def pinned_step(model: Any, optimizer: Any, inputs: Any) -> Any:
                out = step(model, optimizer, inputs)
                for module in (model, optimizer):
                    state = nnx.state(module)
                    nnx.update(
                        module,
                        jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)),
                    )
                return out

            return pinned_step

        def jit_train_and_eval_step(
            self, skip_jit: bool = False, cache_nnx_graph: bool = False
        ) -> tuple[Any, Any]:
            """PeftTrainer's step functions, with the train step jitted by TrainableOnlyStep."""
            import functools

            built: bool = getattr(self, "_jitted_train_step_fn", None) is not None
            train_step, eval_step = super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
            if skip_jit or built:
                return train_step, eval_step
            self._jitted_train_step_fn = functools.partial(
                TrainableOnlyStep(self.model, self.optimizer, self.create_train_step_fn())
            )
            return self._jitted_train_step_fn, eval_step

        def _post_process_train_step(self, aux: Any) -> None:
            self.step_aux.setdefault(self._train_steps + 1, []).append(aux["real_tokens"])

    return Trainer


class TrainableOnlyStep:
    """The train step jitted so that only what training changes crosses the step's boundary as
    a donated input and an output: LoRA weights, optimizer state, the dropout RNG.

    PeftTrainer jits the step over the whole model, so the frozen base weights come back out of
    every micro-step as a fresh output buffer: at 31B that is a second copy of the weights in
    HBM (about 15 GiB per v5p chip at tp=4) written for nothing. Here they are a plain input,
    read and never written.

    Called with a micro-batch, it runs the step and updates the model and optimizer in place,
    as PeftTrainer's jitted step does; `lower` gives the step for ahead-of-time compilation.
    """

    def __init__(self, model: nnx.Module, optimizer: nnx.Module, step: Callable[..., Any]):
        import jax
        from flax import nnx

        self.model = model
        self.optimizer = optimizer
        self.frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
        self.graphdef: Any = nnx.split((model, optimizer), self.frozen, ...)[0]

        def pure(frozen: Any, trainable: Any, inputs: Any) -> tuple[Any, Any]:
            model, optimizer = nnx.merge(self.graphdef, frozen, trainable)
            out = step(model, optimizer, inputs)
            changed = nnx.split((model, optimizer), self.frozen, ...)[-1]
            return out, changed

        self.jitted_fn = jax.jit(pure, donate_argnums=(1,))

    def _states(self) -> tuple[Any, Any]:
        from flax import nnx

        parts: tuple[Any, ...] = nnx.split((self.model, self.optimizer), self.frozen, ...)
        return parts[1], parts[2]

    def lower(self, inputs: Any) -> Any:
        return self.jitted_fn.lower(*self._states(), inputs)

    def __call__(self, inputs: Any) -> Any:
        from flax import nnx

        out, changed = self.jitted_fn(*self._states(), inputs)
        nnx.update((self.model, self.optimizer), changed)
        return out


def make_trainer(
    model: nnx.Module,
    train_cfg: runconfig.TrainSection,
    schedule: optax.Schedule,
    checkpoint_dir: str | None,
) -> Any:
    """The project's PeftTrainer with its optimizer, loss and inputs: the one training step that
    both the VM runs and the deviceless compile check (workloads.train.compile_step) compiles.

    Args:
        checkpoint_dir: where checkpoints go and the latest one is restored from; None: no
            checkpointing (the compile check).
    """
    from tunix.sft import peft_trainer

    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=sys.maxsize,
        max_steps=None,  # the data stream ends the run; PeftTrainer's tqdm bar stays off
        gradient_accumulation_steps=train_cfg.grad_accum if train_cfg.grad_accum > 1 else None,
        checkpoint_root_directory=checkpoint_dir,
        checkpointing_options=checkpoint_options(train_cfg),
        data_sharding_axis=DATA_AXES,
        pbar_description=None,
    )
    optimizer = make_optimizer(train_cfg, schedule)
    trainer = _make_peft_trainer_class()(model, optimizer, training_config)
    return trainer.with_loss_fn(loss_fn, has_aux=True).with_gen_model_input_fn(model_inputs)


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


def _say(message: str) -> None:
    print(message, flush=True)


def load_data(cfg: runconfig.RunConfig, model_dir: str) -> PreparedData:
    """Reads, renders and packs the dataset with the base model's tokenizer (workloads.data)."""
    import jax

    from workloads.data import pipeline

    try:
        import transformers
    except ImportError:
        raise errors.UserError(
            "training needs `transformers` for the model's tokenizer and chat "
            "template: pip install 'gemma4-tpu[workloads]'"
        ) from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return pipeline.prepare(
        cfg, tokenizer, host_index=jax.process_index(), host_count=jax.process_count()
    )


def total_optimizer_steps(cfg: runconfig.RunConfig, data: PreparedData) -> int:
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
    with mesh:
        base = model_lib.load_model(model_dir, mesh=mesh, dtype=cfg.model.dtype)
    base_params = model_lib.parameter_count(base)
    model = lora_lib.apply_lora(base, cfg.lora, mesh=mesh, seed=cfg.data.seed)
    model_lib.set_remat(model, cfg.train.remat)
    return model, base_params


class _StepMetrics:
    """PeftTrainer's per-step hook: turns what the step did into a metrics record."""

    def __init__(
        self,
        *,
        cfg: runconfig.RunConfig,
        schedule: optax.Schedule,
        base_params: int,
        peak_flops: float | None,
        run_log: metrics_lib.RunLog,
        segment: metrics_lib.Segment,
        last_step: int,
    ):
        self.cfg = cfg
        self.schedule = schedule
        self.base_params = base_params
        self.peak_flops = peak_flops
        self.run_log = run_log
        self.segment = segment
        self.last_step = last_step
        train = cfg.train
        self.computed_per_step = train.micro_batch * cfg.data.max_seq_len * train.grad_accum
        self.real_tokens = self.computed_tokens = self.steps = 0
        self.clock = time.time()

    def start(self) -> None:
        self.clock = time.time()

    def mfu(self, tokens_per_s: float) -> float | None:
        """6 * N * tokens/s over the devices' bf16 peak (None without a catalog peak). Counted
        on real tokens it is the paper's measure; on computed tokens (padding included) it is
        how busy the chips were."""
        if self.peak_flops is None:
            return None
        return 6 * self.base_params * tokens_per_s / self.peak_flops

    def __call__(self, ctx: Any, step: int, loss: float) -> None:
        import jax

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
        in_use, peak = metrics_lib.device_memory()
        tokens_per_s = real / seconds if seconds > 0 else 0.0
        computed_per_s = self.computed_per_step / seconds if seconds > 0 else 0.0
        record = {
            "step": step,
            "loss": loss,
            "learning_rate": float(self.schedule(step - 1)),
            # tunix's: the global norm of each micro-batch's gradient, averaged over the step.
            "grad_norm": float(ctx.metrics_logger.get_metric_history("", "grad_norm", "train")[-1]),
            "real_tokens": real,
            "computed_tokens": self.computed_per_step,
            "step_seconds": seconds,
            "tokens_per_s": tokens_per_s,
            "computed_tokens_per_s": computed_per_s,
            "mfu": self.mfu(tokens_per_s),
            "mfu_computed": self.mfu(computed_per_s),
            "device_memory_bytes": in_use,
            "peak_device_memory_bytes": peak,
            "host_rss_bytes": metrics_lib.host_rss(),
        }
        if step % self.cfg.train.log_every == 0 or step == self.last_step:
            self.run_log.log(record)
        else:
            self.run_log.records.append(record)
        if step % self.cfg.train.save_every == 0:
            self.run_log.sync()


def train(
    cfg: runconfig.RunConfig,
    *,
    data: PreparedData | None = None,
    stop_after_steps: int | None = None,
    log: Callable[[str], None] = _say,
    handle_sigterm: bool = True,
) -> TrainResult:
    """Runs (or resumes) the LoRA fine-tune described by `cfg`.

    Args:
        cfg: the run config (model, data, lora, train sections are used).
        data: prepared batches; None reads `cfg.data` through workloads.data.pipeline.
        stop_after_steps: end this process after this many optimizer steps (checkpointed like a
            SIGTERM); for tests and the demo's resume illustration.
        log: where progress lines go.
        handle_sigterm: install the SIGTERM handler (main thread only).

    Returns:
        A TrainResult; train_summary.json is written when the run reached its last step.

    Raises:
        errors.UserError: bad mesh, tp, data, model directory or checkpoint directory.
    """
    import jax

    t_start = time.time()
    train_cfg = cfg.train
    # Cheap checks first (config.json is read in place, even on gs://); staging comes later.
    hf_config = model_lib.read_hf_config(cfg.model.base)
    model_lib.check_tp(model_lib.tunix_config_from_hf(hf_config), train_cfg.mesh.tp)
    mesh = model_lib.make_mesh(train_cfg.mesh.fsdp, train_cfg.mesh.tp)
    has_meta = check_checkpoint_dir(cfg)
    model_lib.set_compilation_cache(train_cfg.compile_cache_dir)
    model_dir = model_lib.stage(cfg.model.base, cfg.model.stage_dir)
    if data is None:
        data = load_data(cfg, str(model_dir))
    total_steps = total_optimizer_steps(cfg, data)
    done = saved_steps(train_cfg.checkpoint_dir)
    if done and done[-1] >= total_steps:
        # A finished run started again (a restarted unit): leave its outputs as they are.
        log(f"{train_cfg.checkpoint_dir}: already at step {done[-1]}/{total_steps}; nothing to do")
        return TrainResult(
            summary=read_summary(train_cfg.output_dir),
            final_step=done[-1],
            resumed_from=done[-1],
            interrupted=False,
            checkpoint_dir=train_cfg.checkpoint_dir,
            records=[],
        )
    if train_cfg.warmup_steps >= total_steps:
        log(
            f"note: train.warmup_steps={train_cfg.warmup_steps} >= {total_steps} steps; "
            f"warming up over {max(total_steps - 1, 0)} steps instead"
        )

    log(
        f"loading {model_dir} ({cfg.model.dtype}) on mesh fsdp={train_cfg.mesh.fsdp} "
        f"tp={train_cfg.mesh.tp} ({jax.device_count()} {jax.devices()[0].platform} devices)"
    )
    model, base_params = build_lora_model(cfg, model_dir, mesh)
    lora_params = sum(x.size for x in jax.tree.leaves(lora_lib.lora_state(model)))
    log(
        f"model: {base_params:,} base parameters, {lora_params:,} LoRA parameters (rank "
        f"{cfg.lora.rank}, alpha {cfg.lora.alpha:g}, targets {', '.join(cfg.lora.targets)})"
    )
    primary = jax.process_index() == 0  # one host writes the run dir's files
    if primary and not has_meta:
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

    schedule = learning_rate_schedule(train_cfg, total_steps)
    with mesh:  # PeftTrainer restores the latest checkpoint here, if any
        trainer = make_trainer(model, train_cfg, schedule, train_cfg.checkpoint_dir)
    resumed_from = trainer.train_steps
    if resumed_from:
        log(f"resuming from checkpoint step {resumed_from} in {train_cfg.checkpoint_dir}")

    stop_at = total_steps
    if stop_after_steps is not None:
        stop_at = min(total_steps, resumed_from + stop_after_steps)
    grad_accum = train_cfg.grad_accum
    stream = _Stream(
        data,
        total_micro=stop_at * grad_accum,
        grad_accum=grad_accum,
        skip=resumed_from * grad_accum,
        preempted=_preemption_sync_point() if jax.process_count() > 1 else None,
    )
    acc_name, peak_flops = metrics_lib.accelerator()
    run_log = metrics_lib.RunLog(
        train_cfg.output_dir, resume_step=resumed_from, total_steps=total_steps, write=primary
    )
    segment = metrics_lib.Segment(
        train_cfg.output_dir,
        start_step=resumed_from,
        computed_per_step=train_cfg.micro_batch * cfg.data.max_seq_len * grad_accum,
        accelerator=acc_name,
        write=primary,
    )
    step_metrics = _StepMetrics(
        cfg=cfg,
        schedule=schedule,
        base_params=base_params,
        peak_flops=peak_flops,
        run_log=run_log,
        segment=segment,
        last_step=stop_at,
    )

    def before_save(step: int, force: bool) -> None:
        # Record the segment up to `step` before its checkpoint can exist: whatever checkpoint
        # a later process resumes from, this file already counts the steps up to it. Step
        # `step`'s token count is still in step_aux (its metrics hook comes one step later).
        if step <= resumed_from or not (force or step % train_cfg.save_every == 0):
            return
        if step in trainer.step_aux:  # the final forced save comes after the step's hook
            segment.record(step, sum(int(x) for x in jax.device_get(trainer.step_aux[step])))
        segment.write()

    trainer.before_save = before_save
    trainer.with_training_hooks(
        _make_hooks(
            lambda ctx: lora_lib.seed_dropout(ctx.model, cfg.data.seed, ctx.iter_steps, mesh),
            step_metrics,
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
    t_train = time.time()
    step_metrics.start()
    segment.start()
    status = "failed"
    try:
        with mesh, segment.compile:
            trainer.train(stream)  # closes the trainer: final metrics + final checkpoint
        status = "finished" if trainer.train_steps >= total_steps else "stopped"
    finally:
        train_seconds = time.time() - t_train
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        run_log.close()
        this_segment = segment.write(status, wall_seconds=train_seconds)
    final_step = trainer.train_steps
    ckpt_steps = saved_steps(train_cfg.checkpoint_dir)
    log(
        f"checkpoints in {train_cfg.checkpoint_dir}: steps "
        f"{', '.join(map(str, ckpt_steps)) or 'none'}"
    )

    losses = [r["loss"] for r in run_log.records]
    # The other hosts of a slice write no segment and total only their own.
    others = metrics_lib.read_segments(train_cfg.output_dir) if primary else {}
    others.pop(segment.path, None)
    totals = metrics_lib.combine_segments(
        [*others.values(), this_segment],
        final_step,
        fallback={
            int(r["step"]): int(r["real_tokens"])
            for r in run_log.records
            if "step" in r and "real_tokens" in r
        },
    )
    if totals["untracked_steps"]:
        log(
            f"note: {totals['untracked_steps']} steps of the run have no recorded token counts "
            "(segment files missing); real_tokens leaves them out"
        )
    last_segment = {k: v for k, v in this_segment.items() if k != "step_real_tokens"}
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
        "accelerator": acc_name,
        # Beyond the contract. first_loss is step 1's even after a resume.
        "segments": totals["segments"],
        "compile_seconds": totals["compile_seconds"],
        "steps_run": totals["steps_run"],
        "untracked_steps": totals["untracked_steps"],
        "last_segment": last_segment,
        "total_steps": total_steps,
        "resumed_from_step": resumed_from,
        "steps_this_run": step_metrics.steps,
        "setup_seconds": t_train - t_start,
        "mfu": step_metrics.mfu(totals["tokens_per_second"]),
        "mfu_computed": step_metrics.mfu(totals["computed_tokens_per_second"]),
        # The paper's v5p-8 run, measured the same way (real tokens over wall time).
        "paper_tokens_per_second": catalog.PAPER.train_tokens_per_s_tpu,
        "base_parameters": base_params,
        "lora_parameters": lora_params,
        "checkpoint_dir": train_cfg.checkpoint_dir,
        "checkpoint_steps": ckpt_steps,
        "data": _stats_dict(data),
    }
    interrupted = final_step < total_steps
    if primary and not interrupted:
        log(f"wrote {metrics_lib.write_summary(train_cfg.output_dir, summary)}")
    return TrainResult(
        summary=summary,
        final_step=final_step,
        resumed_from=resumed_from,
        interrupted=interrupted,
        checkpoint_dir=train_cfg.checkpoint_dir,
        records=list(run_log.records),
    )


def read_summary(output_dir: str) -> dict[str, Any]:
    """train_summary.json of a finished run ({} when there is none)."""
    path = runconfig.join(output_dir, metrics_lib.SUMMARY_FILE)
    return json.loads(storage.read_text(path)) if storage.exists(path) else {}


def _stats_dict(data: PreparedData) -> dict[str, Any] | None:
    """The data pipeline's counts (DataStats) as plain JSON values."""
    stats = getattr(data, "stats", None)
    if stats is None or not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        return None
    out = dataclasses.asdict(stats)
    out["real_fraction"] = getattr(stats, "real_fraction", None)
    return out
