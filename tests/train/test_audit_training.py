"""Training parts the end-to-end runs do not pin down on their own: AdamW decay and optional
clipping, gradient accumulation through PeftTrainer, no recompilation with fixed shapes,
per-decoder-layer remat and fitted LoRA/optimizer shardings as the trainer builds the model,
Orbax every N keep K, a gs:// base staged once and reused, the persistent compilation cache
(local and gs://), and the TensorBoard scalars."""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from workloads.contract import runconfig


def train_section(**overrides) -> runconfig.TrainingRunSection:
    return runconfig.TrainingRunSection(output_dir="unused", weight_decay=0.01, **overrides)


def updates(optimizer, grads_seq, params):
    state = optimizer.init(params)
    out = []
    for grads in grads_seq:
        update, state = optimizer.update(grads, state, params)
        out.append(np.asarray(update["w"]))
    return out


def test_adamw_decays_the_weights_and_clipping_is_optional():
    import jax.numpy as jnp
    import optax

    from workloads.train import step

    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    lr = 0.1
    # Zero gradients: AdamW's update is the decoupled weight decay alone, -lr * wd * w.
    (decay,) = updates(
        step.make_optimizer(train_section(), lambda step: lr), [{"w": jnp.zeros(3)}], params
    )
    np.testing.assert_allclose(decay, -lr * 0.01 * np.asarray(params["w"]), rtol=1e-6)

    # Adam is invariant to one uniform gradient scale, not to clipping only the large step.
    grads = [{"w": jnp.array([300.0, 400.0, 0.0])}, {"w": jnp.array([-0.3, 0.4, 0.1])}]
    plain = updates(step.make_optimizer(train_section(), lambda s: lr), grads, params)
    clipped = updates(
        step.make_optimizer(train_section(max_grad_norm=1.0), lambda s: lr), grads, params
    )
    reference = updates(
        optax.adamw(lr, weight_decay=0.01),
        [{"w": g["w"] * min(1.0, 1.0 / float(jnp.linalg.norm(g["w"])))} for g in grads],
        params,
    )
    np.testing.assert_allclose(clipped[1], reference[1], rtol=1e-5)
    assert np.max(np.abs(plain[1] - clipped[1])) > 1e-3


def remat_count(model) -> int:
    """Remat regions (jax.checkpoint: `remat2` in jax 0.10, `checkpoint` elsewhere) in the jaxpr
    of a forward pass through the model."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx

    tokens = jnp.ones((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), jnp.bool_)), (2, 8, 8))
    graphdef, state = nnx.split(model)

    def forward(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions, None, mask)
        return logits.astype(jnp.float32).mean()

    text = str(jax.make_jaxpr(forward)(state))
    return len(re.findall(r"= (?:checkpoint|remat2?)\[", text))


@pytest.fixture(scope="module")
def tp2_lora_model(config_for, tiny_model_dir, tmp_path_factory):
    """The LoRA model as the trainer builds it (all 7 targets, remat on) on a fsdp=1 x tp=2 mesh."""
    from workloads.model import gemma4
    from workloads.train import trainer

    mesh = gemma4.make_mesh(1, 2)
    cfg = config_for(
        tmp_path_factory.mktemp("unused") / "run",
        train={"remat": True},
        lora={"targets": list(runconfig.ALL_LORA_TARGETS)},
    )
    lora_model, _ = trainer.build_lora_model(cfg, tiny_model_dir, mesh)
    return lora_model, mesh


def test_the_trainer_rematerialises_every_decoder_layer_of_the_lora_model(tp2_lora_model):
    from workloads.model import gemma4

    lora_model, mesh = tp2_lora_model
    with mesh:
        on = remat_count(lora_model)
        gemma4.set_remat(lora_model, False)
        off = remat_count(lora_model)
        gemma4.set_remat(lora_model, True)
    assert (on, off) == (6, 0)  # one region per decoder layer, none without remat


@pytest.mark.usefixtures("unoptimized_compiles")  # three compiles, each run once
def test_every_remat_policy_gives_the_same_lora_gradients(tp2_lora_model):
    """ "dots" remats each decoder layer with a save-the-weight-matmuls policy; "full", "dots" and
    "none" only change what is kept for the backward pass, never the gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from workloads.model import gemma4, lora
    from workloads.train import step

    lora_model, mesh = tp2_lora_model
    segment_ids = jnp.array([[1] * 5 + [2] * 9 + [0] * 2, [1] * 16], jnp.int32)
    positions = jnp.array([list(range(5)) + list(range(9)) + [0, 0], list(range(16))], jnp.int32)
    tokens = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 7) % 50 + 3
    inputs = step.model_inputs(
        step.PackedInput(tokens, (segment_ids != 0).astype(jnp.int32), segment_ids, positions)
    )

    def grads(policy):
        gemma4.set_remat(lora_model, policy)
        lora.seed_dropout(lora_model, 0, 0, mesh)  # the same LoRA dropout masks every time
        graphdef, state = nnx.split(lora_model)

        # Jitted, as the trainer runs it: op by op, the backward pass of a model on a 2-device
        # mesh dispatched hundreds of small sharded programs, and once in CI one of them never
        # returned (the test hit pytest's 900 s timeout in JAX's dispatch).
        @jax.jit
        def loss_and_grads(state):
            grad_fn = nnx.value_and_grad(
                step.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True
            )
            (loss, _), g = grad_fn(nnx.merge(graphdef, state), **inputs)
            return loss, nnx.state(g)

        loss, g = loss_and_grads(state)
        return float(loss), jax.tree.leaves(g)

    try:
        with mesh:
            counts = {}
            results = {}
            for policy in ("full", "dots", "none"):
                results[policy] = grads(policy)
                counts[policy] = remat_count(lora_model)
    finally:
        gemma4.set_remat(lora_model, True)
    assert counts == {"full": 6, "dots": 6, "none": 0}
    for policy in ("dots", "none"):
        assert results[policy][0] == pytest.approx(results["full"][0], rel=1e-6)
        for a, b in zip(results[policy][1], results["full"][1], strict=True):
            # Equal up to float32 reassociation (each policy is its own compiled program): within
            # 1e-5 of the factor's largest gradient, where a wrong gradient is off by its size.
            a, b = np.asarray(a), np.asarray(b)
            assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), (policy, a.shape)


def test_adamw_moments_take_the_fitted_lora_shardings(tp2_lora_model):
    """Every LoRA factor sits on the mesh with a spec that fits its shape, and AdamW's moments
    (what PeftTrainer's nnx.Optimizer creates and checkpoints) have exactly the same sharding."""
    import optax
    from flax import nnx

    from workloads.model import lora
    from workloads.train import step

    lora_model, mesh = tp2_lora_model
    params = {path: var.get_value() for path, var in nnx.to_flat_state(lora.lora_state(lora_model))}
    assert len(params) == 6 * 7 * 2 - 2 * 5 - 2
    for path, value in params.items():
        spec = tuple(value.sharding.spec) + (None,) * (value.ndim - len(value.sharding.spec))
        assert lora.fit_spec(spec, value.shape, mesh) == spec, path  # every axis divides
    assert "tp" in tuple(params[("layers", 5, "attn", "k_einsum", "w_lora_b")].sharding.spec)
    with mesh:
        optimizer = nnx.Optimizer(
            lora_model,
            step.make_optimizer(train_section(), optax.constant_schedule(1e-3)),
            wrt=nnx.LoRAParam,
        )
    moments = dict(nnx.to_flat_state(nnx.state(optimizer)))
    checked = 0
    for path, value in params.items():
        for kind in ("mu", "nu"):
            key = next(k for k in moments if kind in k and tuple(k[-len(path) :]) == tuple(path))
            got = moments[key].get_value() if hasattr(moments[key], "get_value") else moments[key]
            assert got.sharding.is_equivalent_to(value.sharding, value.ndim), (kind, path)
            checked += 1
    assert checked == 2 * len(params)


@pytest.fixture
def remote_model(tiny_model_dir):
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in pathlib.Path(tiny_model_dir).iterdir():
        fs.pipe_file(f"/audit-bucket/models/tiny/{path.name}", path.read_bytes())
    yield "memory://audit-bucket/models/tiny"
    fs.rm("/audit-bucket", recursive=True)


def test_a_remote_base_is_staged_once_and_reused(remote_model, tmp_path, monkeypatch, capsys):
    from workloads.common import storage
    from workloads.model import gemma4

    downloads = []
    real = storage.copy_tree

    def copy_tree(src: str, dest: str, **kwargs: Any) -> list[str]:
        copied = real(src, dest, **kwargs)
        downloads.extend(f"{src}/{rel}" for rel in copied)
        return copied

    monkeypatch.setattr(storage, "copy_tree", copy_tree)
    stage = tmp_path / "shm" / "base"
    first = gemma4.stage(remote_model, str(stage))
    names = storage.list_files(remote_model)
    assert first == stage and sorted(d.rsplit("/", 1)[-1] for d in downloads) == names
    assert gemma4.read_hf_config(remote_model) == gemma4.read_hf_config(str(stage))
    downloads.clear()
    assert gemma4.stage(remote_model, str(stage)) == stage and downloads == []
    assert "staging memory://audit-bucket/models/tiny" in capsys.readouterr().out
    loaded = gemma4.load_model(stage, mesh=None, dtype="float32")
    assert loaded.config.num_layers == 6


_CACHE_PROBE = """
import sys
from workloads.model import gemma4
gemma4.set_compilation_cache(sys.argv[1])
import jax, jax.numpy as jnp
print(jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).sum())
"""


def test_compilation_cache_local_dir_is_created_and_filled(tmp_path):
    cache = tmp_path / "cache" / "jax"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    done = subprocess.run(
        [sys.executable, "-c", _CACHE_PROBE, str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert cache.is_dir() and any(cache.iterdir())


def test_compilation_cache_on_gcs_is_passed_to_jax_without_a_local_dir(tmp_path, monkeypatch):
    import jax

    from workloads.model import gemma4

    calls = {}
    monkeypatch.setattr(jax.config, "update", lambda key, value: calls.__setitem__(key, value))
    monkeypatch.chdir(tmp_path)
    gemma4.set_compilation_cache("gs://bucket/jax-cache")
    assert calls["jax_compilation_cache_dir"] == "gs://bucket/jax-cache"
    assert list(tmp_path.iterdir()) == []
    calls.clear()
    gemma4.set_compilation_cache(None)
    assert calls == {}


def tensorboard_tags(directory: pathlib.Path) -> dict[str, float]:
    """tag -> value of every scalar in the TFRecord event files under `directory`."""
    from tensorboardX.proto import event_pb2

    found = {}
    for path in directory.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found[value.tag] = value.simple_value
    return found


def test_tensorboard_gets_loss_lr_grad_norm_tokens_per_s_and_device_memory(tmp_path, capsys):
    from workloads.train import metrics

    record = {
        "step": 1,
        "loss": 2.5,
        "learning_rate": 1e-4,
        "grad_norm": 0.75,
        "tokens_per_s": 763.0,
        "computed_tokens_per_s": 2540.0,
        "device_memory_bytes": 2**30,
        "peak_device_memory_bytes": 2**31,
        "host_rss_bytes": 2**32,
        "step_seconds": 4.0,
    }
    log = metrics.RunLog(str(tmp_path / "run"), resume_step=0, total_steps=1)
    log.log(record)
    log.close()
    tags = tensorboard_tags(tmp_path / "run" / "tensorboard")
    keys = ("loss", "learning_rate", "grad_norm", "tokens_per_s", "computed_tokens_per_s")
    for key in (*keys, "device_memory_bytes", "peak_device_memory_bytes"):
        assert tags[f"train/{key}"] == pytest.approx(record[key], rel=1e-6), key
    line = capsys.readouterr().out.strip()
    assert "\r" not in line and "mfu" not in line.lower()  # no 6N figure for a LoRA step
    assert "763 real tok/s (2540 computed)" in line and "mem 1.0GiB" in line


def test_checkpoints_every_n_steps_keep_the_last_k(tmp_path):
    """The trainer's Orbax options through tunix's CheckpointManager (what PeftTrainer uses):
    saves at multiples of save_every only (not step 1), the oldest beyond keep_checkpoints go."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import checkpoint_manager

    from workloads.checkpoint import lora_restore
    from workloads.train import checkpoints

    class Adapter(nnx.Module):
        def __init__(self):
            self.w = nnx.LoRAParam(jnp.zeros(3))

    options = checkpoints.options(train_section(save_every=3, keep_checkpoints=2))
    root = str(tmp_path / "checkpoints")
    manager = checkpoint_manager.CheckpointManager(root, options)
    adapter = Adapter()
    for step in range(1, 11):
        adapter.w.set_value(jnp.full(3, float(step)))
        manager.save(step, adapter, save_only_lora_params=True)
    manager.close()
    assert lora_restore.saved_steps(root) == [6, 9]


class _Toy:
    """A bigram 'model' with the tunix Gemma 4 call signature: logits = (base + lora)[tokens]."""

    @staticmethod
    def make(vocab: int = 16):
        import jax
        from flax import nnx

        class Toy(nnx.Module):
            def __init__(self):
                self.base = nnx.Param(jax.random.normal(jax.random.key(0), (vocab, vocab)))
                self.lora = nnx.LoRAParam(jax.random.normal(jax.random.key(1), (vocab, vocab)))

            def __call__(self, tokens, positions, cache, attention_mask):
                return (self.base[...] + self.lora[...])[tokens], None

        return Toy()


def toy_rows(seed: int, rows: int, length: int = 8):
    """Rows of one sample each with the same number of target tokens (5 of 8)."""
    from workloads.train import step

    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length), np.int32)
    mask[:, 3:] = 1
    return step.PackedInput(
        input_tokens=rng.integers(0, 16, (rows, length)).astype(np.int32),
        input_mask=mask,
        segment_ids=np.ones((rows, length), np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
    )


def toy_train(batches, grad_accum):
    import jax
    import optax
    from tunix.sft import peft_trainer

    from workloads.model import gemma4
    from workloads.train import step

    mesh = gemma4.make_mesh(1, 2)
    toy = _Toy.make()
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9,
        max_steps=None,
        gradient_accumulation_steps=grad_accum,
        data_sharding_axis=("fsdp",),
        pbar_description=None,
    )
    events: list[str] = []  # JAX tracing/lowering/compilation events, in order
    seen_at_pull: list[int] = []  # len(events) when each batch was pulled

    def stream():
        for batch in batches:
            seen_at_pull.append(len(events))
            yield batch

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: events.append(event) if "compile" in event else None
    )
    try:
        with mesh:
            peft = step._make_peft_trainer_class()(toy, optax.sgd(1.0), config)
            peft = peft.with_loss_fn(step.loss_fn, has_aux=True)
            peft = peft.with_gen_model_input_fn(step.model_inputs)
            peft.train(stream())
    finally:
        jax.monitoring.clear_event_listeners()
    return np.asarray(toy.lora[...]), peft.train_steps, seen_at_pull


def test_gradient_accumulation_averages_micro_batches_into_one_step():
    """Through PeftTrainer with this project's loss: 2 micro-batches of 1 row accumulated equal
    one step on both rows (same target-token counts), and differ from a step on one row."""
    both = toy_rows(0, 2)
    halves = [
        type(both)(*(np.asarray(getattr(both, f))[i : i + 1] for f in
                     ("input_tokens", "input_mask", "segment_ids", "positions")))
        for i in (0, 1)
    ]  # fmt: skip
    accumulated, steps_a, _ = toy_train(halves, grad_accum=2)
    together, steps_b, _ = toy_train([both], grad_accum=None)
    first_only, _, _ = toy_train(halves[:1], grad_accum=None)
    assert steps_a == steps_b == 1
    np.testing.assert_allclose(accumulated, together, rtol=0, atol=1e-6)
    assert np.max(np.abs(accumulated - first_only)) > 1e-3


def test_fixed_shapes_compile_the_train_step_once():
    """After the first steps nothing is traced or compiled again (fixed shapes, pinned
    shardings): the counts of JAX compile events seen at each later batch are equal."""
    batches = [toy_rows(seed, 2) for seed in range(6)]
    _, steps, seen_at_pull = toy_train(batches, grad_accum=None)
    assert steps == 6
    assert len(set(seen_at_pull[3:])) == 1, seen_at_pull
