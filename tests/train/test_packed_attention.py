"""Packed rows through the splash attention kernel (interpret mode on CPU) equal tunix's dense-mask
path: the attention itself, and the tiny Gemma 4's per-token losses and LoRA gradients."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.contract import runconfig

LENGTH = 384  # three 128-token kernel blocks: segments and the window cross block boundaries
WINDOW = 16


def packed_segments() -> np.ndarray:
    """Row 0: four samples (boundaries off the window and block grid) then padding; row 1: one
    sample filling the row."""
    seg = np.zeros((2, LENGTH), np.int32)
    for sample, (start, end) in enumerate(((0, 50), (50, 137), (137, 300), (300, 370)), start=1):
        seg[0, start:end] = sample
    seg[1, :] = 1
    return seg


def positions_of(segments: np.ndarray) -> np.ndarray:
    pos = np.zeros_like(segments)
    for r, row in enumerate(segments):
        for i in range(1, len(row)):
            pos[r, i] = pos[r, i - 1] + 1 if row[i] == row[i - 1] else 0
    return pos


def dense_reference(q, k, v, segments, window):
    """Attention written out in numpy: causal, same segment, not padding, within the window."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t = np.arange(q.shape[1])
    allowed = (t[None, :] <= t[:, None])[None] & (segments[:, :, None] == segments[:, None, :])
    allowed &= (segments != 0)[:, None, :]
    if window is not None:
        allowed &= (t[:, None] - t[None, :] < window)[None]
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("btnh,bsnh->btns", q, k)
    logits = np.where(allowed[:, :, None, :], logits, -1e30)  # padding rows: compared nowhere
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("btns,bsnh->btnh", probs, v)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["global", "sliding"])
def test_kernel_equals_written_out_attention_on_packed_rows(window):
    """Grouped heads (8 query over 4 KV heads); every real token of every sample matches."""
    import jax.numpy as jnp

    from workloads.train import packed_attention

    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, LENGTH, 8, 16)).astype(np.float32)
    k = rng.normal(size=(2, LENGTH, 4, 16)).astype(np.float32)
    v = rng.normal(size=(2, LENGTH, 4, 16)).astype(np.float32)
    segments = packed_segments()
    out = packed_attention.splash_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(segments),
        window=window,
        interpret=True,
    )
    real = segments != 0
    np.testing.assert_allclose(
        np.asarray(out)[real], dense_reference(q, k, v, segments, window)[real], atol=2e-5
    )


def test_kernel_costs_count_only_the_visited_blocks():
    """Global layers visit the causal half of the block grid (6 of 9 blocks at 3 x 3), sliding
    ones the diagonal and the block before it (5 of 9): the FLOPs the compile check adds."""
    import jax.numpy as jnp

    from workloads.train import packed_attention

    x = jnp.zeros((1, LENGTH, 2, 128), jnp.float32)
    segments = jnp.ones((1, LENGTH), jnp.int32)
    per_block = 2 * 128 * 128 * 128  # one block x block x head_dim matmul
    for window, blocks in ((None, 6), (WINDOW, 5)):
        with packed_attention.recording_costs() as costs:
            packed_attention.splash_attention(x, x, x, segments, window=window, interpret=True)
        assert costs.forward == 2 * per_block * blocks * 2  # 2 matmuls, 2 heads
        assert costs.backward == 5 * per_block * blocks * 2  # the fused backward: 5 matmuls


def test_block_size_is_the_largest_that_divides_the_row():
    from workloads.train import packed_attention

    assert packed_attention.block_size(3072) == 512
    assert packed_attention.block_size(384) == 128
    assert packed_attention.block_size(100) is None


@pytest.fixture(scope="module")
def lora_model(config_for, tiny_model_dir, tmp_path_factory):
    """The tiny LoRA model as the trainer builds it (all targets), on a tp=2 mesh: the kernel
    runs per shard of heads, with grouped and k = v global heads as the model has them."""
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


@pytest.mark.usefixtures("unoptimized_compiles")  # two compiles of the model's step, run once
@pytest.mark.parametrize("remat", ["none", "full"])
def test_kernel_path_gives_the_dense_paths_losses_and_lora_gradients(lora_model, remat):
    """Per-token losses on every predicted token and every LoRA gradient of the step's loss
    agree between tunix's dense-mask attention and the kernel, on packed rows whose samples are
    longer than the sliding window and cross the kernel's blocks; also with each decoder layer
    rematerialised (the kernel then runs again in the backward pass)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model

    from workloads.model import gemma4, lora
    from workloads.train import packed_attention, step

    model, mesh = lora_model
    gemma4.set_remat(model, remat)
    segments = packed_segments()
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, 200, segments.shape), jnp.int32)
    batch = step.PackedInput(
        tokens,
        jnp.asarray(segments != 0, jnp.int32),
        jnp.asarray(segments),
        jnp.asarray(positions_of(segments)),
    )
    inputs = step.model_inputs(batch)

    @nnx.jit
    def nll_loss_grads(model, inputs):
        nll = step.token_nll(
            model,
            inputs["input_tokens"],
            inputs["positions"],
            inputs["attention_mask"],
            inputs["segment_ids"],
        )
        grad_fn = nnx.value_and_grad(
            step.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True
        )
        (loss, _), grads = grad_fn(model, **inputs)
        return nll, loss, nnx.state(grads)

    def run():
        lora.seed_dropout(model, 0, 0, mesh)  # the same LoRA dropout masks every time
        nll, loss, grads = nll_loss_grads(model, inputs)
        return np.asarray(nll), float(loss), jax.tree.leaves(grads)

    with mesh:
        dense = run()
        assert packed_attention.use_kernel(model, interpret=True) == 6
        try:
            kernel = run()
        finally:
            for _, module in model.iter_modules():
                if isinstance(module, gemma4_model.Attention):
                    module.__class__ = gemma4_model.Attention
    predicted = np.asarray(batch.input_mask)[:, 1:] != 0
    np.testing.assert_allclose(kernel[0][predicted], dense[0][predicted], rtol=0, atol=2e-5)
    assert kernel[1] == pytest.approx(dense[1], rel=1e-5)
    assert len(kernel[2]) == len(dense[2]) > 0
    for got, want in zip(kernel[2], dense[2], strict=True):
        scale = float(np.abs(np.asarray(want)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-4 * scale)
