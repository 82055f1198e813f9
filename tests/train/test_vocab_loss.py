"""The loss over the vocabulary in chunks of positions equals the loss over the whole logits."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.contract import runconfig


def _full_logits_nll(model, tokens, positions, mask):
    """The reference: tunix's model returning every logit, scored as a whole."""
    import jax
    import jax.numpy as jnp

    logits, _ = model(tokens, positions, None, mask)
    logits = logits[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


@pytest.fixture(scope="module")
def lora_model(config_for, tiny_model_dir, tmp_path_factory):
    from workloads.model import gemma4
    from workloads.train import trainer

    mesh = gemma4.make_mesh(1, 2)
    cfg = config_for(
        tmp_path_factory.mktemp("unused") / "run",
        train={"remat": "none"},
        lora={"targets": list(runconfig.ALL_LORA_TARGETS)},
    )
    model, _ = trainer.build_lora_model(cfg, tiny_model_dir, mesh)
    return model, mesh


@pytest.mark.slow  # the tiny LoRA model and four jitted loss/gradient passes: ~1 min on 2 cores
@pytest.mark.usefixtures("unoptimized_compiles")  # each compiled pass runs once
@pytest.mark.parametrize("chunk", [64, 50], ids=["divides", "remainder"])
def test_chunked_loss_and_gradients_equal_the_whole_logits(lora_model, monkeypatch, chunk):
    """Per-token NLL, the mean loss and every LoRA gradient of the step's loss agree with the
    unchunked computation in f32 (NLL and loss to 1e-5, gradients to 1e-5 of their largest
    entry), on packed rows of 256 tokens split into 4 chunks, or 6 with a padded remainder;
    the soft-cap and the padding mask are the model's own. The LoRA B factors are set non-zero
    so that every adapter has a gradient through the loss."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from workloads.model import lora
    from workloads.train import step, vocab_loss

    model, mesh = lora_model
    monkeypatch.setattr(vocab_loss, "CHUNK_POSITIONS", chunk)
    rng = np.random.default_rng(3)
    length = 256
    segments = np.zeros((2, length), np.int32)
    segments[0, :100], segments[0, 100:230] = 1, 2
    segments[1, :] = 1
    positions = np.zeros_like(segments)
    for r, row in enumerate(segments):
        for i in range(1, length):
            positions[r, i] = positions[r, i - 1] + 1 if row[i] == row[i - 1] else 0
    batch = step.PackedInput(
        jnp.asarray(rng.integers(3, 250, segments.shape), jnp.int32),
        jnp.asarray((segments != 0) & (rng.random(segments.shape) < 0.7), jnp.int32),
        jnp.asarray(segments),
        jnp.asarray(positions),
    )
    inputs = step.model_inputs(batch)

    def reference_loss(
        model, input_tokens, input_mask, positions, attention_mask, segment_ids
    ):  # step.loss_fn over the whole logits
        nll = _full_logits_nll(model, input_tokens, positions, attention_mask)
        weights = input_mask[:, 1:].astype(jnp.float32)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0), {}

    def chunked_run(model, inputs):
        nll = step.token_nll(
            model, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"]
        )
        grad_fn = nnx.value_and_grad(
            step.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True
        )
        (loss, _), grads = grad_fn(model, **inputs)
        return nll, loss, nnx.state(grads)

    def whole_run(model, inputs):
        nll = _full_logits_nll(
            model, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"]
        )
        grad_fn = nnx.value_and_grad(
            reference_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True
        )
        (loss, _), grads = grad_fn(model, **inputs)
        return nll, loss, nnx.state(grads)

    with mesh:
        # Drawn in numpy and placed as each factor is: a jax.random draw would compile per shape.
        draw = np.random.default_rng(7)
        nnx.update(
            model,
            jax.tree.map(
                lambda v: jax.device_put(
                    (0.05 * draw.standard_normal(v.shape)).astype(v.dtype), v.sharding
                ),
                nnx.state(model, nnx.LoRAParam),
            ),
        )
        results = []
        for fn in (chunked_run, whole_run):
            lora.seed_dropout(model, 0, 0, mesh)  # the same LoRA dropout masks in both runs
            results.append(nnx.jit(fn)(model, inputs))
    (chunked, loss_c, grads_c), (whole, loss_w, grads_w) = results
    assert chunked.shape == whole.shape == (2, length - 1)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(loss_c), float(loss_w), rtol=1e-5)
    leaves_c, leaves_w = jax.tree.leaves(grads_c), jax.tree.leaves(grads_w)
    assert len(leaves_c) == len(leaves_w) > 0
    for gc, gw in zip(leaves_c, leaves_w, strict=True):
        gw = np.asarray(gw)
        assert np.abs(gw).max() > 0
        np.testing.assert_allclose(np.asarray(gc), gw, rtol=0, atol=1e-5 * np.abs(gw).max())


def test_no_logits_over_the_whole_row_are_computed():
    """The chunk body is the only place the vocabulary dimension appears: one chunk's logits at
    a time, never [rows, length, vocab]."""
    import jax
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gemma4_model

    from workloads.train import vocab_loss

    class Config:
        dtype = jnp.float32
        final_logit_softcap = 30.0
        shd_config = gemma4_model.ShardingConfig.get_default_sharding()

    class Weight:
        value = jnp.ones((1000, 8))

    class Embedder:  # what tunix's decode reads of its embedder
        config = Config()
        input_embedding = Weight()

    vocab, width, rows, length = 1000, 8, 2, 96
    embedder = Embedder()
    hidden = jnp.ones((rows, length, width))
    targets = jnp.zeros((rows, length), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda h: vocab_loss.chunked_nll(embedder, h, targets, chunk=32).sum())(
        hidden
    )
    text = str(jaxpr)
    assert f"{rows},32,{vocab}" in text  # one chunk's logits
    assert f"{rows},{length},{vocab}" not in text
