"""Next-token NLL over Gemma 4's 262,144-token vocabulary without holding the full logits.

Tunix's Gemma 4 returns logits for every position: `[rows, L, vocab]` in float32 (after the
final soft-cap), plus their bf16 product and, in the backward pass, a gradient of the same size.
For the 31B model at 4 rows x 3,072 tokens that is about 3 GiB per v5p chip at tp=4 for the
float32 logits alone, several times over with their companions: the buffers that decide whether
a micro-batch of 4 fits.

Here the model is run up to its final norm (the hidden states, `[rows, L, 5376]`), and the
logits are computed a chunk of positions at a time inside `lax.scan`, each chunk with tunix's own
decode (the tied embedding, in the model's dtype) and soft-cap, reduced at once to log-sum-exp
minus the target's logit. The chunk body is rematerialised, so the backward pass recomputes one
chunk's logits at a time instead of keeping them all: at most one chunk of logits is alive.

The hidden states are taken from the model's own forward pass: while `hidden_states()` is
active, tunix's `Embedder.decode` records its input (the final-norm output) and returns a
one-column placeholder, which XLA drops with the unused soft-cap on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

# Positions per chunk: at micro-batch 4 one chunk of float32 logits is 4 x 512 x 65,536 x 4 bytes
# = 0.5 GiB per chip at tp=4 (one sixth of a 3,072-token row's).
CHUNK_POSITIONS = 512


@contextlib.contextmanager
def hidden_states() -> Iterator[dict[str, Any]]:
    """While active, tunix's Gemma 4 stops at its final norm: `Embedder.decode` stores its input
    under "hidden" in the yielded dict (and the embedder under "embedder") and returns a
    `[..., 1]` placeholder instead of the logits. A model that never calls decode leaves the
    dict empty."""
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gemma4_model

    box: dict[str, Any] = {}
    original = gemma4_model.Embedder.decode

    def recording_decode(self: Any, x: Any) -> Any:
        box["hidden"] = x
        box["embedder"] = self
        return jnp.zeros((*x.shape[:-1], 1), self.config.dtype)

    gemma4_model.Embedder.decode = recording_decode  # type: ignore[method-assign,unused-ignore]
    try:
        yield box
    finally:
        gemma4_model.Embedder.decode = original  # type: ignore[method-assign,unused-ignore]


def chunked_nll(
    embedder: Any,
    hidden: jax.Array,
    targets: jax.Array,
    *,
    chunk: int | None = None,
) -> jax.Array:
    """[B, T] float32: logsumexp(logits) - logits[target] per position, where logits are what
    tunix's Gemma 4 would return for `hidden` ([B, T, D], the final-norm output), computed
    `chunk` positions at a time.

    Args:
        embedder: the model's tunix `Embedder` (tied embedding and config).
        targets: [B, T] token ids each position must predict.
        chunk: positions per chunk (default CHUNK_POSITIONS); T need not be a multiple of it.
    """
    import jax
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gemma4_model

    chunk = chunk or CHUNK_POSITIONS
    rows, length, width = hidden.shape
    chunks = -(-length // chunk)
    pad = chunks * chunk - length
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    softcap = embedder.config.final_logit_softcap
    shd = embedder.config.shd_config
    logits_spec = (shd.act_btd[0], None, shd.emb_vd[0])  # rows as activations, vocab as weights

    @jax.checkpoint
    def one_chunk(h: jax.Array, t: jax.Array) -> jax.Array:
        # Exactly tunix's Gemma4.__call__ after the final norm, for `chunk` positions.
        logits = gemma4_model.Embedder.decode(embedder, h).astype(jnp.float32)
        logits = gemma4_model.shard(logits, logits_spec)
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    def body(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        return carry, one_chunk(*xs)

    h_chunks = hidden.reshape(rows, chunks, chunk, width).swapaxes(0, 1)
    t_chunks = targets.reshape(rows, chunks, chunk).swapaxes(0, 1)
    _, nll = jax.lax.scan(body, None, (h_chunks, t_chunks))
    return nll.swapaxes(0, 1).reshape(rows, chunks * chunk)[:, :length]
