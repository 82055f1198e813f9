"""The micro-batch stream the trainer consumes: packed rows from the data pipeline, epochs
chained, replayed and skipped on resume, cut at an optimizer-step boundary on preemption.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from workloads.train.step import DATA_AXES, PackedInput

BATCH_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")
# Mesh axes a micro-batch's rows are split over (PeftTrainer shards its inputs along them).


class BatchSource(Protocol):
    """What workloads.data.pipeline.prepare returns; tests may pass their own."""

    @property
    def stats(self) -> Any: ...

    @property
    def batches_per_epoch(self) -> int: ...

    def batches(self, epoch: int, *, skip: int = 0) -> Iterator[Any]: ...


def preemption_sync_point() -> Callable[[int], bool]:
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point


class Stream:
    """The micro-batch stream PeftTrainer consumes: epochs chained, cut at `total_micro` items.

    On resume PeftTrainer pulls and drops the first `skip` items itself; those are cheap
    placeholders (the data pipeline skips them without building them). A stop request (SIGTERM)
    ends the stream at the next optimizer-step boundary, so the final checkpoint never holds a
    half-accumulated gradient.
    """

    def __init__(
        self,
        data: BatchSource,
        *,
        total_micro: int,
        grad_accum: int,
        skip: int,
        preempted: Callable[[int], bool] | None = None,
        place: Callable[[PackedInput], Any] | None = None,
    ):
        """Args:
        preempted: on multi-host slices, `multihost_utils.reached_preemption_sync_point`: every
            host stops at the same step (the one JAX agreed on after a preemption notice), where
            a host-local SIGTERM flag would let hosts stop at different steps and hang the
            collectives of the others.
        place: what each micro-batch becomes before PeftTrainer gets it (`global_batches` on
            a multi-host slice); None: the host's numpy arrays as they are.
        """
        self.place = place
        self.preempted = preempted
        self.data = data
        self.total_micro = total_micro
        self.grad_accum = grad_accum
        self.skip = skip
        self.stop_requested = threading.Event()

    def __iter__(self) -> Iterator[PackedInput | None]:
        per_epoch = self.data.batches_per_epoch
        for _ in range(min(self.skip, self.total_micro)):
            yield None
        index = self.skip
        while index < self.total_micro:
            epoch, offset = divmod(index, per_epoch)
            for batch in self.data.batches(epoch, skip=offset):
                if index >= self.total_micro:
                    return
                if index % self.grad_accum == 0 and self._stop_at(index // self.grad_accum):
                    return
                inputs = to_input(batch)
                yield inputs if self.place is None else self.place(inputs)
                index += 1

    def _stop_at(self, step: int) -> bool:
        if self.preempted is not None and step > 0 and self.preempted(step):
            return True
        return self.stop_requested.is_set()


def global_batches(mesh: Any) -> Callable[[PackedInput], PackedInput]:
    """Each host's rows of a micro-batch -> one array per field over the whole slice, its rows
    split over the data axes (the host's rows on the host's devices).

    PeftTrainer would build these itself (tunix's shard_input) but picks the split from the
    host's own rows: when they do not divide by the data axis's size over the whole slice (one
    row per host on fsdp=2), it falls back to a replicated array, and every host's different
    rows become one "replicated" value. The step then trains on a batch of one host's size, the
    hosts disagree about it, and the executable no longer matches the one compiled ahead. Built
    here, PeftTrainer finds the arrays already split and passes them on as they are.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec(DATA_AXES))

    def place(inputs: PackedInput) -> PackedInput:
        return jax.tree.map(
            lambda rows: jax.make_array_from_process_local_data(sharding, rows), inputs
        )

    return place


def to_input(batch: Any) -> PackedInput:
    """A data-pipeline Batch -> PackedInput (int32 numpy)."""
    fields = {name: np.asarray(getattr(batch, name), dtype=np.int32) for name in BATCH_FIELDS}
    return PackedInput(
        input_tokens=fields["tokens"],
        input_mask=fields["loss_mask"],
        segment_ids=fields["segment_ids"],
        positions=fields["positions"],
    )
