"""infra/preflight/hlo_collectives.py on programs XLA really compiled (2 CPU devices), and on HLO
text shapes the CPU backend does not print (async pairs, loops bounded only by their condition or
not at all, the forms of replica groups)."""

from __future__ import annotations

import pathlib

import pytest

from infra.preflight import hlo_collectives

ROWS, COLS, TRIPS = 512, 128, 5


def _mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 JAX devices (tests/conftest.py sets XLA_FLAGS)")
    return Mesh(np.array(jax.devices()[:2]), ("x",))


def test_an_all_gather_inside_a_loop_counts_once_per_trip():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    split = NamedSharding(mesh, P("x"))

    def program(a):
        def body(carry, _):
            whole = jax.lax.with_sharding_constraint(carry, NamedSharding(mesh, P()))
            return jax.lax.with_sharding_constraint(whole * 2.0, split), whole.sum()

        _, sums = jax.lax.scan(body, a, None, length=TRIPS)
        return sums.sum()

    arg = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=split)
    text = jax.jit(program, in_shardings=split).lower(arg).compile().as_text()
    found = hlo_collectives.count(text, devices=2)
    whole_bytes = ROWS * COLS * 4
    assert found.count["all-gather"] == TRIPS
    assert found.buffer_bytes["all-gather"] == TRIPS * whole_bytes
    assert found.ring_bytes["all-gather"] == TRIPS * whole_bytes / 2  # (n-1)/n of it, n = 2
    assert found.unknown_trip_counts == 0


def test_an_all_reduce_is_charged_twice_the_ring_share():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    by_columns = NamedSharding(mesh, P(None, "x"))

    def program(a, b):  # the contracted dimension is split: partial products are summed
        return a @ b

    a = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=by_columns)
    b = jax.ShapeDtypeStruct((COLS, COLS), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    compiled = jax.jit(program, out_shardings=NamedSharding(mesh, P())).lower(a, b).compile()
    found = hlo_collectives.count(compiled.as_text(), devices=2)
    assert found.count["all-reduce"] == 1
    assert found.buffer_bytes["all-reduce"] == ROWS * COLS * 4
    assert found.ring_bytes["all-reduce"] == ROWS * COLS * 4  # 2 (n-1)/n = 1 at n = 2


# HLO text in the shapes TPU compiles print (async pairs, loops, the three forms of groups).
SYNTHETIC = (pathlib.Path(__file__).parents[2] / "fixtures" / "collectives.hlo").read_text()


def test_async_pairs_fusions_groups_and_loops_without_a_trip_count():
    found = hlo_collectives.count(SYNTHETIC, devices=4)
    gathered = 8 * 1024 * 2
    assert found.count == {
        "all-gather": 3 + 1,  # %body's 3 trips, and the async fusion's copies once
        "reduce-scatter": 1,
        "collective-permute": 1,
        "all-reduce": 4,  # %w3's bound read from its condition: counter < 4
    }
    # The start counted, the done not; one collective split into a start and a continuation
    # fusion (the same channel id) counted once.
    assert found.buffer_bytes["all-gather"] == 3 * gathered + 8 * 64 * 2
    assert found.ring_bytes["all-gather"] == (3 * gathered + 8 * 64 * 2) * 3 / 4  # groups of 4
    assert found.ring_bytes["reduce-scatter"] == 16 * 4 / 2  # the input, groups of 2
    assert found.ring_bytes["collective-permute"] == gathered
    assert found.ring_bytes["all-reduce"] == 4 * 16 * 4 * 2 * 3 / 4  # axes a and b: 4 devices
    assert found.unknown_trip_counts == 1  # %w2: counted once, and said


def test_no_entry_computation_counts_nothing():
    found = hlo_collectives.count("not hlo at all", devices=4)
    assert found.total_buffer_bytes == 0 and found.total_ring_bytes == 0
