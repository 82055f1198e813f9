"""The micro-batch stream stops at an optimizer-step boundary: on SIGTERM (one host), or at the
step all hosts agreed on after a preemption notice (multi-host: JAX's sync point)."""

from __future__ import annotations

import types

import numpy as np

from workloads.train import stream as stream_lib

ROWS, LENGTH = 1, 8


class _Data:
    batches_per_epoch = 10

    def batches(self, epoch, skip=0):
        for i in range(skip, self.batches_per_epoch):
            fill = np.full((ROWS, LENGTH), epoch * 100 + i, dtype=np.int32)
            yield types.SimpleNamespace(**{name: fill for name in stream_lib.BATCH_FIELDS})


def test_multi_host_stream_stops_exactly_at_the_agreed_step_and_never_mid_accumulation():
    asked = []

    def sync_point(step):
        asked.append(step)
        return step == 3

    stream = stream_lib.Stream(_Data(), total_micro=40, grad_accum=2, skip=0, preempted=sync_point)
    items = list(stream)
    assert len(items) == 3 * 2  # three whole optimizer steps, then stop
    assert asked == [1, 2, 3]  # every host asks at every step boundary, in order


def test_single_host_stream_stops_at_the_next_boundary_after_sigterm():
    stream = stream_lib.Stream(_Data(), total_micro=40, grad_accum=4, skip=0)
    items = []
    for item in stream:
        items.append(item)
        if len(items) == 5:  # SIGTERM arrives in the middle of step 2's accumulation
            stream.stop_requested.set()
    assert len(items) == 8


def test_without_a_stop_the_stream_runs_to_the_end_across_epochs():
    never = lambda step: False  # noqa: E731
    stream = stream_lib.Stream(_Data(), total_micro=25, grad_accum=5, skip=5, preempted=never)
    items = list(stream)
    assert items[:5] == [None] * 5  # resumed: the skipped micro-batches are placeholders
    assert len(items) == 25
    assert int(items[-1].input_tokens[0, 0]) == 2 * 100 + 4  # epoch 2, batch 4


def test_a_hosts_rows_become_one_array_split_over_the_data_axis_that_tunix_passes_on():
    """`place`: each micro-batch as one array over the mesh, its rows split over fsdp (here one
    process with the conftest's two CPU devices, one row each); tunix's shard_input, which
    would otherwise pick the split from the host's row count, passes it on unchanged."""
    import jax
    from jax.sharding import PartitionSpec
    from tunix.sft import sharding_utils

    from workloads.model import gemma4

    mesh = gemma4.make_mesh(2, 1)

    class _TwoRows(_Data):
        def batches(self, epoch, skip=0):
            for i in range(skip, self.batches_per_epoch):
                rows = np.arange(2 * LENGTH, dtype=np.int32).reshape(2, LENGTH) + i
                yield types.SimpleNamespace(**{name: rows for name in stream_lib.BATCH_FIELDS})

    stream = stream_lib.Stream(
        _TwoRows(), total_micro=2, grad_accum=1, skip=1, place=stream_lib.global_batches(mesh)
    )
    skipped, placed = list(stream)
    assert skipped is None  # resume's placeholders are not moved to the devices
    assert isinstance(placed.input_tokens, jax.Array)
    assert placed.input_tokens.sharding.spec == PartitionSpec(("fsdp",))
    assert placed.input_tokens.shape == (2, LENGTH)
    shards = sorted(placed.segment_ids.addressable_shards, key=lambda s: s.index[0].start or 0)
    assert [np.asarray(s.data).tolist() for s in shards] == [
        [list(range(1, LENGTH + 1))],
        [list(range(LENGTH + 1, 2 * LENGTH + 1))],
    ]
    with mesh:
        assert sharding_utils.shard_input(placed, ("fsdp",)) is placed
