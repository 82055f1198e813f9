"""workloads.model.tracer_sharding: probing a traced value's sharding no longer walks the trace,
and still answers as JAX does (no attribute, JAX's own message)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import partial_eval

from workloads.model import tracer_sharding


def _probe_walks(monkeypatch) -> int:
    """Traces 60 operations with a sharding probe after each, as flax's set_value does; returns
    how many times JAX walked the trace for an error message."""
    walks = []
    walk = partial_eval.JaxprStackFrame.find_progenitors

    def counted(frame, tracer):
        walks.append(1)
        return walk(frame, tracer)

    monkeypatch.setattr(partial_eval.JaxprStackFrame, "find_progenitors", counted)

    def f(x):
        for _ in range(60):
            x = x + 1
            assert getattr(x, "sharding", None) is None
        with pytest.raises(AttributeError, match=r"'sharding' attribute is not available.*typeof"):
            _ = x.sharding
        return x

    assert float(jax.jit(f)(jnp.float32(0))) == 60
    return len(walks)


def test_a_traced_values_sharding_is_absent_without_walking_the_trace(monkeypatch):
    tracer_sharding.install()
    tracer_sharding.install()  # idempotent
    assert _probe_walks(monkeypatch) == 0


def test_jaxs_own_property_walks_the_trace_on_every_probe(monkeypatch):
    """The premise, on the pinned JAX: without the module every probe walks the trace (when a
    JAX release stops doing so, this fails and the module can go)."""
    monkeypatch.delattr(partial_eval.DynamicJaxprTracer, "sharding", raising=False)
    assert _probe_walks(monkeypatch) >= 60
