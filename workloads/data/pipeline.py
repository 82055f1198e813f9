"""CodeV-R1 JSONL -> deterministic, host-sharded, fixed-shape training batches.

`prepare` reads the first `data.max_rows` rows, cleans each response, renders prompt and target
with the model's chat template, drops empty samples, samples whose text holds a control token of
the tokenizer and samples longer than `data.max_seq_len` (never truncates), then packs the kept
samples into rows (or puts one per row) and groups the rows into micro-batches of
`train.micro_batch` rows. Every host runs the same computation and takes
its own slice of each micro-batch, so hosts get disjoint rows and the same number of batches.

Order is a pure function of the data, the tokenizer, the config and the epoch: rows are listed by
their first sample's position in the file, then (with `data.shuffle`) permuted by a generator
seeded with (data.seed, epoch). A restarted run that skips the batches it already trained on
therefore sees exactly the batches an uninterrupted run would have seen next.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from workloads.common import errors
from workloads.contract import runconfig
from workloads.data import chat, codev, packing
from workloads.data.packing import Batch

__all__ = ["Batch", "DataStats", "PreparedData", "prepare"]

# Samples rendered (and tokenized) together.
_RENDER_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class DataStats:
    """Exact counts of one preparation (the same on every host; tokens are per epoch, all hosts).

    Attributes:
        rows_read: JSONL rows read (at most data.max_rows).
        kept: samples that go into training.
        dropped_too_long: samples longer than max_seq_len tokens (dropped, never truncated).
        dropped_empty: rows with an empty prompt, a response with no Verilog left after
            cleaning (empty, thinking only, no code), or an answer the chat template hides
            (the model turn it renders is empty).
        dropped_control_tokens: rows whose prompt or cleaned answer holds a control token of
            the tokenizer (`<bos>`, `<|turn>`, `<turn|>`, ...): trained as written, it would
            forge turns of the conversation, so the row is left out.
        rows_out: training rows holding at least one sample.
        pad_rows: all-padding rows appended so that the last micro-batch is full.
        real_tokens: tokens of kept samples (prompt + target).
        target_tokens: tokens under the loss mask.
        computed_tokens: (rows_out + pad_rows) * max_seq_len.
        max_seq_len: tokens per row.
        packing: whether rows hold several samples.
    """

    rows_read: int
    kept: int
    dropped_too_long: int
    dropped_empty: int
    dropped_control_tokens: int
    rows_out: int
    pad_rows: int
    real_tokens: int
    target_tokens: int
    computed_tokens: int
    max_seq_len: int
    packing: bool

    @property
    def real_fraction(self) -> float:
        """Fraction of computed tokens that are real (not padding)."""
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def summary(self) -> str:
        layout = "packed" if self.packing else "one sample per row"
        return (
            f"data: {self.rows_read} rows read, {self.kept} kept, {self.dropped_too_long} "
            f"dropped as longer than {self.max_seq_len} tokens, {self.dropped_empty} dropped "
            f"as empty, {self.dropped_control_tokens} dropped for control tokens in their text; "
            f"{layout} into {self.rows_out} rows (+{self.pad_rows} padding rows); "
            f"{self.real_tokens} real of {self.computed_tokens} computed tokens "
            f"({100 * self.real_fraction:.1f}% real), {self.target_tokens} under the loss"
        )


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """Kept samples and planned rows, as seen by one host.

    Attributes:
        stats: counts (global).
        samples: the kept samples, in file order.
        rows: planned rows (lists of sample indices) in their canonical order.
        max_seq_len: tokens per row.
        micro_batch: rows per global micro-batch.
        host_index, host_count: this host's slice of every micro-batch.
        seed, shuffle: the row order per epoch.
        pad_id: token id written into padding positions.
    """

    stats: DataStats
    samples: tuple[chat.Example, ...]
    rows: tuple[tuple[int, ...], ...]
    max_seq_len: int
    micro_batch: int
    host_index: int
    host_count: int
    seed: int
    shuffle: bool
    pad_id: int

    @property
    def rows_per_batch(self) -> int:
        """Rows of each Batch this host yields (train.micro_batch // host_count)."""
        return self.micro_batch // self.host_count

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch; the same on every host."""
        return -(-len(self.rows) // self.micro_batch)

    def with_host(self, host_index: int, host_count: int) -> PreparedData:
        """The same data as seen by another host (nothing is recomputed)."""
        _check_hosts(self.micro_batch, host_index, host_count)
        return dataclasses.replace(self, host_index=host_index, host_count=host_count)

    def row_order(self, epoch: int) -> list[int | None]:
        """Global row order of an epoch, padded with None (an all-padding row) to whole batches."""
        order: list[int | None] = list(range(len(self.rows)))
        if self.shuffle:
            rng = np.random.default_rng([self.seed % 2**64, epoch])  # entropy must be >= 0
            order = [int(i) for i in rng.permutation(len(self.rows))]
        return order + [None] * (self.batches_per_epoch * self.micro_batch - len(order))

    def batches(self, epoch: int, *, skip: int = 0) -> Iterator[Batch]:
        """This host's micro-batches of an epoch from batch `skip` on (skipping costs nothing)."""
        order = self.row_order(epoch)
        per_host = self.rows_per_batch
        for b in range(skip, self.batches_per_epoch):
            start = b * self.micro_batch + self.host_index * per_host
            rows = [None if i is None else self.rows[i] for i in order[start : start + per_host]]
            yield packing.build_batch(rows, self.samples, self.max_seq_len, pad_id=self.pad_id)


def _check_hosts(micro_batch: int, host_index: int, host_count: int) -> None:
    if host_count < 1 or not 0 <= host_index < host_count:
        raise errors.UserError(f"host index {host_index} is not in 0..{host_count - 1}")
    if micro_batch % host_count:
        raise errors.UserError(
            f"train.micro_batch {micro_batch} must be a multiple of the number "
            f"of hosts ({host_count}): every host feeds the same number of rows"
        )


def prepare(
    cfg: runconfig.RunConfig,
    tokenizer: Any,
    *,
    host_index: int = 0,
    host_count: int = 1,
    log: Callable[[str], None] | None = print,
) -> PreparedData:
    """Reads, cleans, renders, filters and plans the training data of a run.

    Args:
        cfg: the run config (data.*, train.micro_batch).
        tokenizer: the model's Hugging Face tokenizer (with its chat template).
        host_index, host_count: this host's position in a multi-host slice.
        log: where progress lines and the counts go (None: silent).

    Raises:
        errors.UserError: missing file, wrong fields, a micro-batch that hosts cannot share, or no
            sample left.
    """
    data = cfg.data
    _check_hosts(cfg.train.micro_batch, host_index, host_count)
    started = time.monotonic()
    formatter = chat.ChatFormat(tokenizer)
    rows_read = dropped_empty = dropped_too_long = dropped_control = 0
    samples: list[chat.Example] = []
    pending: list[tuple[str, str]] = []

    def render_pending() -> None:
        nonlocal dropped_too_long, dropped_empty
        for example in formatter.render_many(pending):
            if len(example) - example.prompt_len <= formatter.empty_target_len:
                dropped_empty += 1  # the template hid the whole answer
            elif len(example) > data.max_seq_len:
                dropped_too_long += 1
            else:
                samples.append(example)
        pending.clear()

    for row in codev.iter_rows(data.dataset, data.max_rows):
        rows_read += 1
        answer = codev.clean_response(row.response)
        if not row.prompt.strip() or not answer:
            dropped_empty += 1
            continue
        if formatter.find_control_token(row.prompt) or formatter.find_control_token(answer):
            dropped_control += 1
            continue
        pending.append((row.prompt, answer))
        if len(pending) == _RENDER_CHUNK:
            render_pending()
    render_pending()
    if not samples:
        raise errors.UserError(
            f"{data.dataset}: no training sample left ({rows_read} rows read, {dropped_empty} "
            f"empty, {dropped_control} with control tokens, {dropped_too_long} longer than "
            f"data.max_seq_len={data.max_seq_len})"
        )
    lengths = [len(s) for s in samples]
    plan = packing.plan_packed if data.packing else packing.plan_unpacked
    rows = sorted((tuple(r) for r in plan(lengths, data.max_seq_len)), key=min)
    micro_batch = cfg.train.micro_batch
    pad_rows = -len(rows) % micro_batch
    stats = DataStats(
        rows_read=rows_read,
        kept=len(samples),
        dropped_too_long=dropped_too_long,
        dropped_empty=dropped_empty,
        dropped_control_tokens=dropped_control,
        rows_out=len(rows),
        pad_rows=pad_rows,
        real_tokens=sum(lengths),
        target_tokens=sum(len(s) - s.prompt_len for s in samples),
        computed_tokens=(len(rows) + pad_rows) * data.max_seq_len,
        max_seq_len=data.max_seq_len,
        packing=data.packing,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prepared = PreparedData(
        stats=stats,
        samples=tuple(samples),
        rows=tuple(rows),
        max_seq_len=data.max_seq_len,
        micro_batch=micro_batch,
        host_index=host_index,
        host_count=host_count,
        seed=data.seed,
        shuffle=data.shuffle,
        pad_id=int(pad_id),
    )
    if log is not None:
        log(stats.summary())
        log(
            f"data: {prepared.batches_per_epoch} micro-batches of {micro_batch} rows per epoch; "
            f"host {host_index}/{host_count} takes {prepared.rows_per_batch} rows of each "
            f"({time.monotonic() - started:.1f} s)"
        )
    return prepared
