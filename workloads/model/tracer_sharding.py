"""A cheap `getattr(tracer, "sharding", None)` while JAX traces the model.

flax's `Variable.set_value` compares `getattr(value, "sharding", None)` of the new and the old
value on every whole-value replace: every RNG draw (its counter), and every adapter Qwix's LoRA
init pass creates. On a value being traced the attribute does not exist, and JAX's `sharding`
property builds the AttributeError's message (which `getattr` then throws away) by walking every
equation traced so far to say where the value came from (`find_progenitors`). Done once per
replace, that walk is quadratic in the length of the program: 245 such probes took 1.0 of the
1.8 s of the tiny model's LoRA init trace, and the 8-step reference run of tests/train/conftest.py
took 26.1 s with them, 23.2-24.4 s without (four runs).

`install` gives the tracer of `jax.jit`/`nnx.eval_shape` traces a `sharding` property that
raises the AttributeError JAX's own `Tracer.__getattr__` raises for it (the same message,
without the walk). Nothing else changes: the values, the traced program, and every other error.
"""

from __future__ import annotations

from typing import Any

_MESSAGE = (
    "The 'sharding' attribute is not available on {}. "
    "To query sharding information on tracers, use `jax.typeof(x)`."
)


def _no_sharding(tracer: Any) -> Any:
    raise AttributeError(_MESSAGE.format(tracer._error_repr()))


_PROPERTY = property(_no_sharding)


def install() -> None:
    """Makes the probe cheap for the rest of the process (idempotent)."""
    from jax._src.interpreters import partial_eval

    tracer = partial_eval.DynamicJaxprTracer
    if tracer.__dict__.get("sharding") is not _PROPERTY:
        setattr(tracer, "sharding", _PROPERTY)  # noqa: B010 (a property on a class)
