"""The loss the trainer optimises: packed rows equal samples alone, prompts get no gradient."""

from __future__ import annotations

import numpy as np
import pytest


def test_attention_mask_is_causal_same_segment_and_not_padding():
    from workloads.train import step

    segments = np.array([[1, 1, 2, 2, 2, 0]], np.int32)
    mask = np.asarray(step.attention_mask(segments))[0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)


def test_packed_row_losses_equal_each_sample_alone(tiny_model_dir):
    """Per-token losses of 3 samples packed in one row equal those of each sample in a row of its
    own, in f32 to 1e-5. The samples are longer than the sliding window (16), so the local
    layers' band and the restarting positions both matter."""
    import jax

    from workloads.data import chat, packing
    from workloads.model import gemma4
    from workloads.train import step
    from workloads.train import stream as stream_lib

    length = 128
    rng = np.random.default_rng(0)
    lengths, prompt_lens = (50, 30, 40), (20, 10, 25)
    samples = [
        chat.Example(tokens=rng.integers(10, 1000, n).astype(np.int32), prompt_len=p)
        for n, p in zip(lengths, prompt_lens, strict=True)
    ]
    batch = packing.build_batch([[0, 1, 2], [0], [1], [2]], samples, length, pad_id=0)
    assert batch.segment_ids[0].max() == 3 and batch.positions[0][50] == 0

    mesh = gemma4.make_mesh(2, 1)
    with mesh:
        model = gemma4.load_model(tiny_model_dir, mesh=mesh, dtype="float32")
        inputs = step.model_inputs(stream_lib.to_input(batch))
        nll = np.asarray(
            jax.jit(lambda t, p, m: step.token_nll(model, t, p, m))(
                inputs["input_tokens"], inputs["positions"], inputs["attention_mask"]
            )
        )
    offset = 0
    for row, n in enumerate(lengths, start=1):
        packed = nll[0, offset : offset + n - 1]
        alone = nll[row, : n - 1]
        np.testing.assert_allclose(packed, alone, rtol=0, atol=1e-5)
        offset += n
    # The loss mask travels with its sample.
    np.testing.assert_array_equal(batch.loss_mask[0, 50:80], batch.loss_mask[2, :30])


@pytest.fixture(scope="module")
def prepared(config_for, tmp_path_factory, tiny_model_dir):
    from transformers import AutoTokenizer

    from workloads.data import pipeline

    cfg = config_for(tmp_path_factory.mktemp("unused"))
    return pipeline.prepare(cfg, AutoTokenizer.from_pretrained(str(tiny_model_dir)), log=None)


def test_prompt_and_padding_tokens_get_zero_gradient(prepared):
    """d loss / d logits is exactly zero at every position whose next token is prompt or padding,
    and non-zero at every position that predicts a model-turn token (incl. end of turn)."""
    import jax
    import jax.numpy as jnp

    from workloads.train import step
    from workloads.train import stream as stream_lib

    batch = stream_lib.to_input(next(prepared.batches(0)))
    inputs = step.model_inputs(batch)
    vocab = int(batch.input_tokens.max()) + 1
    logits = jax.random.normal(jax.random.key(0), (*batch.input_tokens.shape, vocab))

    def loss_of_logits(logits):
        stub = lambda tokens, positions, cache, mask: (logits, None)  # noqa: E731
        return step.loss_fn(stub, **inputs)[0]

    grad = np.asarray(jax.grad(loss_of_logits)(logits))
    predicts_target = np.asarray(batch.input_mask)[:, 1:] == 1
    per_position = np.abs(grad[:, :-1]).sum(-1)
    assert np.all(per_position[~predicts_target] == 0.0)
    assert np.all(per_position[predicts_target] > 0.0)
    assert np.all(grad[:, -1] == 0.0)  # the last position predicts nothing
    # Every model-turn token of the batch is predicted exactly once, no prompt token ever.
    assert predicts_target.sum() == int(np.asarray(batch.input_mask).sum())
    prompt = (np.asarray(batch.segment_ids) != 0) & (np.asarray(batch.input_mask) == 0)
    assert prompt.sum() > 0 and not np.any(predicts_target & prompt[:, 1:])
    del jnp


def test_learning_rate_warms_up_linearly_then_decays_to_zero(config_for, tmp_path):
    from workloads.train import step

    cfg = config_for(tmp_path, train={"warmup_steps": 10, "learning_rate": 1e-3})
    schedule = step.learning_rate_schedule(cfg.train, 100)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(55)) == pytest.approx(5e-4, rel=1e-3)  # cosine halfway
    assert float(schedule(100)) == pytest.approx(0.0, abs=1e-9)
