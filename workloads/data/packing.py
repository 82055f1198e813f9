"""Sequence packing: variable-length samples -> fixed [rows, max_seq_len] arrays.

Planning works on lengths only: `plan_packed` puts several samples per row by best-fit
decreasing (deterministic; no sample is ever split or truncated), `plan_unpacked` one per row.
`build_batch` turns planned rows into the arrays training consumes:
`segment_ids` number the samples of a row 1..k (0 = padding), `positions` restart at 0 for every
sample, `loss_mask` is the sample's own mask. With a block-diagonal causal mask built from the
segment ids, each sample sees only itself, so its per-token losses equal those of the sample
alone in a row.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Sample(Protocol):
    """What build_batch needs of a sample (workloads.data.chat.Example has it)."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def prompt_len(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch for one host; every array is int32 [rows, max_seq_len]."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray

    @property
    def real_tokens(self) -> int:
        return int(np.count_nonzero(self.segment_ids))


def _check_lengths(lengths: Sequence[int], max_seq_len: int) -> None:
    for index, length in enumerate(lengths):
        if not 0 < length <= max_seq_len:
            raise ValueError(
                f"sample {index} has length {length}; every sample must have "
                f"1..{max_seq_len} tokens (longer ones are dropped before packing)"
            )


def plan_unpacked(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """One sample per row, in order."""
    _check_lengths(lengths, max_seq_len)
    return [[index] for index in range(len(lengths))]


class _FreeSpace:
    """Open rows indexed by free space: the fullest row that still fits a length, in O(log n).

    A segment tree over free-space values 0..max_seq_len counts open rows per value; rows with
    the same free space are kept in a heap so that the lowest row id wins (determinism).
    """

    def __init__(self, max_seq_len: int) -> None:
        self._leaves = 1 << (max_seq_len + 1).bit_length()
        self._count = [0] * (2 * self._leaves)
        self._rows: dict[int, list[int]] = {}

    def _bump(self, free: int, delta: int) -> None:
        node = free + self._leaves
        while node:
            self._count[node] += delta
            node //= 2

    def add(self, free: int, row: int) -> None:
        heapq.heappush(self._rows.setdefault(free, []), row)
        self._bump(free, 1)

    def take_best_fit(self, need: int) -> tuple[int, int] | None:
        """Removes and returns (free, row) of the open row with the least free space >= need."""
        count, node = self._count, need + self._leaves
        if count[node] == 0:
            # Climb until a right sibling holds a row, then descend to its leftmost row.
            while node > 1 and not (node % 2 == 0 and count[node + 1]):
                node //= 2
            if node == 1:
                return None
            node += 1
            while node < self._leaves:
                node = 2 * node if count[2 * node] else 2 * node + 1
        free = node - self._leaves
        row = heapq.heappop(self._rows[free])
        self._bump(free, -1)
        return free, row


def plan_packed(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: samples from longest to shortest (ties: lower index first), each
    into the open row with the least free space that fits it, else into a new row.

    Returns:
        Rows as lists of sample indices (longest first within a row), in order of creation.
    """
    _check_lengths(lengths, max_seq_len)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free_space = _FreeSpace(max_seq_len)
    for index in order:
        length = lengths[index]
        found = free_space.take_best_fit(length)
        if found is None:
            free, row = max_seq_len, len(rows)
            rows.append([])
        else:
            free, row = found
        rows[row].append(index)
        if free - length:
            free_space.add(free - length, row)
    return rows


def build_batch(
    rows: Sequence[Sequence[int] | None],
    samples: Sequence[Sample],
    max_seq_len: int,
    *,
    pad_id: int = 0,
) -> Batch:
    """Fills [len(rows), max_seq_len] arrays; a None row is all padding.

    Raises:
        ValueError: a row's samples do not fit in max_seq_len.
    """
    shape = (len(rows), max_seq_len)
    tokens = np.full(shape, pad_id, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.int32)
    for r, row in enumerate(rows):
        start = 0
        for segment, index in enumerate(row or (), start=1):
            sample = samples[index]
            end = start + len(sample.tokens)
            if end > max_seq_len:
                raise ValueError(f"row {r} holds {end} or more tokens, more than {max_seq_len}")
            tokens[r, start:end] = sample.tokens
            segment_ids[r, start:end] = segment
            positions[r, start:end] = np.arange(end - start, dtype=np.int32)
            loss_mask[r, start + sample.prompt_len : end] = 1
            start = end
    return Batch(tokens=tokens, segment_ids=segment_ids, positions=positions, loss_mask=loss_mask)
