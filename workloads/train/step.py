"""The training step: packed inputs, loss, optimizer and the jitted step, as the VM runs it and
as the deviceless compile check (workloads.train.compile_step) compiles it.

Inside the jitted step the attention mask is built as causal AND same segment AND not padding,
with positions restarting per sample, so a packed sample sees exactly what it would see alone
(the model adds the sliding-window band itself). The loss is the mean next-token NLL over the
tokens the model must predict (loss_mask, shifted by one: position t predicts token t + 1).
Only the LoRA weights, the optimizer state and the dropout RNG go in and out of the step
(TrainableOnlyStep); the frozen base weights are read only. The vocabulary's logits are
computed in chunks of positions (workloads.train.vocab_loss), never all at once.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.struct

from workloads.checkpoint import checksums
from workloads.contract import runconfig
from workloads.model import tracer_sharding
from workloads.train import checkpoints, packed_attention, vocab_loss

if TYPE_CHECKING:
    import jax
    import optax
    from flax import nnx

DATA_AXES = ("fsdp",)
# Exit status of a run stopped by SIGTERM after saving (128 + SIGTERM, as a shell reports it).


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
    model: nnx.Module,
    input_tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """[B, T-1] float32: -log p(token t+1 | tokens <= t) under the model, at every position.

    With `segment_ids`, attention layers swapped by `packed_attention.use_kernel` run the kernel
    on them (the dense mask then goes unused and XLA drops it); other layers use the mask.
    The logits over the vocabulary are never held whole: the model stops at its final norm and
    `vocab_loss.chunked_nll` computes them a chunk of positions at a time. A model without
    tunix's embedder (a stand-in returning logits) is scored on the logits it returns.
    """
    import jax
    import jax.numpy as jnp

    packed = (
        packed_attention.packed_rows(segment_ids)
        if segment_ids is not None
        else contextlib.nullcontext()
    )
    with packed, vocab_loss.hidden_states() as captured:
        logits, _ = model(input_tokens, positions, None, attention_mask)
    targets = input_tokens[:, 1:]
    if "hidden" in captured:
        # Every position is scored (the last one against a dummy target) and the last dropped:
        # the hidden states keep their length, a multiple of the chunk.
        padded = jnp.pad(targets, ((0, 0), (0, 1)))
        return vocab_loss.chunked_nll(captured["embedder"], captured["hidden"], padded)[:, :-1]
    logits = logits[:, :-1].astype(jnp.float32)
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

    nll = token_nll(model, input_tokens, positions, attention_mask, segment_ids)
    weights = input_mask[:, 1:].astype(jnp.float32)
    loss = jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss, {"real_tokens": jnp.sum(segment_ids != 0)}


def learning_rate_schedule(train: runconfig.TrainingRunSection, total_steps: int) -> optax.Schedule:
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
    train: runconfig.TrainingRunSection, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """AdamW (optional global-norm clipping first); PeftTrainer adds gradient accumulation."""
    import optax

    adamw = optax.adamw(learning_rate=schedule, weight_decay=train.weight_decay)
    if train.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(train.max_grad_norm), adamw)


class SaveHook:
    """PeftTrainer's checkpoint manager with a hook called with (step, force) before every save
    attempt (the trainer records its run segment there); everything else goes to the manager.
    Every step saved is marked as carrying a checksum manifest (workloads.checkpoint.checksums), and
    carries `custom_metadata` in its step metadata (the run lock's fencing token)."""

    def __init__(self, manager: Any):
        self.manager = manager
        self.before_save: Callable[[int, bool], None] | None = None
        self.custom_metadata: dict[str, Any] = {}

    def save(self, step: int, *args: Any, **kwargs: Any) -> Any:
        if self.before_save is not None:
            self.before_save(step, bool(kwargs.get("force", False)))
        kwargs["custom_metadata"] = checksums.mark(
            {**self.custom_metadata, **(kwargs.get("custom_metadata") or {})}
        )
        return self.manager.save(step, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


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
            super().__init__(*args, **kwargs)  # restores the latest checkpoint, if any
            self.step_aux: dict[int, list[Any]] = {}
            manager: Any = self.checkpoint_manager  # type: ignore[has-type]
            self.checkpoint_manager = SaveHook(manager)

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

        tracer_sharding.install()  # the step's trace (see the module)
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
    train_cfg: runconfig.TrainingRunSection,
    schedule: optax.Schedule,
    checkpoint_dir: str | None,
) -> Any:
    """The project's PeftTrainer with its optimizer, loss and inputs: the one training step that
    both the VM runs and the deviceless compile check (workloads.train.compile_step) compiles.

    Args:
        checkpoint_dir: where checkpoints go and the latest one is restored from; None: no
            checkpointing (the compile check).
    """
    import jax
    from tunix.sft import peft_trainer

    # Each saved step's checksums, written as Orbax finalizes it (workloads.checkpoint.checksums).
    on_finalized = (
        checksums.ManifestWriter(checkpoint_dir, primary=jax.process_index() == 0)
        if checkpoint_dir is not None
        else None
    )
    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=sys.maxsize,
        max_steps=None,  # the data stream ends the run; PeftTrainer's tqdm bar stays off
        gradient_accumulation_steps=train_cfg.grad_accum if train_cfg.grad_accum > 1 else None,
        checkpoint_root_directory=checkpoint_dir,
        checkpointing_options=checkpoints.options(train_cfg, on_finalized),
        data_sharding_axis=DATA_AXES,
        pbar_description=None,
    )
    optimizer = make_optimizer(train_cfg, schedule)
    trainer = _make_peft_trainer_class()(model, optimizer, training_config)
    return trainer.with_loss_fn(loss_fn, has_aux=True).with_gen_model_input_fn(model_inputs)
