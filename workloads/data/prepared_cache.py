"""The run's tokenized and packed data, kept beside its outputs so that a restart skips the work.

Rendering and tokenizing 10,000 CodeV-R1 rows with the chat template is the one part of a
restarted trainer that redoes a fixed amount of CPU work (tens of seconds on a TPU host). The
prepared samples and rows are therefore written once to `<train.output_dir>/prepared_data.npz`
(local or gs://, so a new VM after a preemption finds them too) and read back when their key
matches.

The key says everything the result depends on: the rows read (each row's prompt and response,
so a changed or longer file is a different key, while extra rows past `data.max_rows` are not),
the tokenizer (every non-weight file of the model directory, plus the transformers and tokenizers
versions), the data settings and micro-batch, and the source of the code that renders, cleans
and packs. A cache that does not match, or that cannot be read or fails its checks, is one line
and the data is prepared again (and the file replaced); it is never an error. The file is plain
numpy arrays and JSON (`allow_pickle=False`): reading it cannot run code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import json
import pathlib
import zipfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from workloads.common import storage
from workloads.contract import runconfig

if TYPE_CHECKING:
    from workloads.data import codev
    from workloads.data.pipeline import PreparedData

FILE_NAME = "prepared_data.npz"
# Bumped when the file's layout changes.
FORMAT = 1
# Files of a model directory that are weights, not tokenizer: left out of the key.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".npz")
# The modules whose code decides what the prepared data holds.
_CODE = ("chat.py", "codev.py", "packing.py", "pipeline.py", "prepared_cache.py")


class RowDigest:
    """A running digest of the rows `prepare` reads (fed by a pass of its own over them)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, row: codev.Row) -> None:
        for text in (row.prompt, row.response):
            data = text.encode("utf-8")
            self._hash.update(len(data).to_bytes(8, "little"))
            self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def path_for(output_dir: str) -> str:
    """Where a run directory keeps its prepared data."""
    return runconfig.join(output_dir, FILE_NAME)


def tokenizer_digest(model_dir: str) -> str:
    """sha256 over the model directory's non-weight files (names and bytes) and the versions
    of the libraries that load them."""
    digest = hashlib.sha256()
    for package in ("transformers", "tokenizers"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{package}=={version}\n".encode())
    root = pathlib.Path(model_dir)
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if path.name.endswith(_WEIGHT_SUFFIXES) or path.name.startswith("."):
            continue
        digest.update(f"{path.name}\n{path.stat().st_size}\n".encode())
        with path.open("rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def code_digest() -> str:
    """sha256 of the data modules' source."""
    digest = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for name in _CODE:
        digest.update(name.encode() + b"\n" + (here / name).read_bytes())
    return digest.hexdigest()


def cache_key(
    *, rows_digest: str, tokenizer: str, data_settings: dict[str, Any], micro_batch: int
) -> str:
    """The key of one preparation (see the module's docstring)."""
    settings = {k: v for k, v in data_settings.items() if k != "dataset"}
    text = json.dumps(
        {
            "format": FORMAT,
            "code": code_digest(),
            "rows": rows_digest,
            "tokenizer": tokenizer,
            "data": settings,
            "micro_batch": micro_batch,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def save(path: str, key: str, prepared: PreparedData) -> None:
    """Writes the prepared data under its key (atomically: readers see the old or the new)."""
    lengths = np.array([len(s) for s in prepared.samples], np.int64)
    row_lengths = np.array([len(r) for r in prepared.rows], np.int64)
    tokens = (
        np.concatenate([s.tokens for s in prepared.samples]).astype(np.int32, copy=False)
        if prepared.samples
        else np.zeros(0, np.int32)
    )
    meta = {
        "key": key,
        "stats": dataclasses.asdict(prepared.stats),
        "max_seq_len": prepared.max_seq_len,
        "micro_batch": prepared.micro_batch,
        "seed": prepared.seed,
        "shuffle": prepared.shuffle,
        "pad_id": prepared.pad_id,
    }
    buffer = io.BytesIO()
    np.savez(
        buffer,
        meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        tokens=tokens,
        sample_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        prompt_lens=np.array([s.prompt_len for s in prepared.samples], np.int64),
        row_items=np.array([i for r in prepared.rows for i in r], np.int64),
        row_offsets=np.concatenate([[0], np.cumsum(row_lengths)]).astype(np.int64),
    )
    storage.write_bytes_atomic(path, buffer.getvalue())


class _Damaged(ValueError):
    pass


def load(
    path: str,
    key: str,
    *,
    host_index: int,
    host_count: int,
    log: Callable[[str], None] | None,
) -> PreparedData | None:
    """The prepared data stored at `path` if its key is `key` and it passes its checks; else
    None (with one line saying why, unless there is simply no file)."""
    from workloads.data import chat
    from workloads.data.pipeline import DataStats, PreparedData

    def say(message: str) -> None:
        if log is not None:
            log(message)

    try:
        if not storage.exists(path):
            return None
        data = storage.read_bytes(path)
    except Exception as exc:  # a cache that cannot be read is only a miss
        say(f"data: {path} could not be read ({type(exc).__name__}); preparing the data again")
        return None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            meta = json.loads(bytes(arrays["meta"]).decode())
            if meta.get("key") != key:
                say(f"data: {path} was prepared from other inputs; preparing the data again")
                return None
            tokens = arrays["tokens"]
            offsets = arrays["sample_offsets"]
            prompt_lens = arrays["prompt_lens"]
            items = arrays["row_items"]
            row_offsets = arrays["row_offsets"]
        _check(tokens, offsets, prompt_lens, items, row_offsets)
        samples = tuple(
            chat.Example(tokens=tokens[offsets[i] : offsets[i + 1]], prompt_len=int(p))
            for i, p in enumerate(prompt_lens)
        )
        rows = tuple(
            tuple(int(x) for x in items[row_offsets[i] : row_offsets[i + 1]])
            for i in range(len(row_offsets) - 1)
        )
        prepared = PreparedData(
            stats=DataStats(**meta["stats"]),
            samples=samples,
            rows=rows,
            max_seq_len=int(meta["max_seq_len"]),
            micro_batch=int(meta["micro_batch"]),
            host_index=0,
            host_count=1,
            seed=int(meta["seed"]),
            shuffle=bool(meta["shuffle"]),
            pad_id=int(meta["pad_id"]),
        )
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        OSError,
        EOFError,
        zipfile.BadZipFile,
    ) as exc:
        say(f"data: {path} is damaged ({type(exc).__name__}: {exc}); preparing the data again")
        return None
    return prepared.with_host(host_index, host_count)


def prepare_cached(
    cfg: runconfig.RunConfig,
    model_dir: str,
    make_tokenizer: Callable[[], Any],
    *,
    host_index: int,
    host_count: int,
    write: bool,
    log: Callable[[str], None] | None = print,
) -> PreparedData:
    """`pipeline.prepare`, or its result read back from the run directory when the key matches.

    Args:
        make_tokenizer: builds the tokenizer (only called when the data is prepared).
        write: whether this process stores a fresh preparation (one host of a slice does).
    """
    import time

    from workloads.data import codev, pipeline

    started = time.monotonic()
    rows = RowDigest()
    for row in codev.iter_rows(cfg.data.dataset, cfg.data.max_rows):
        rows.add(row)
    key = cache_key(
        rows_digest=rows.hexdigest(),
        tokenizer=tokenizer_digest(model_dir),
        data_settings=cfg.data.model_dump(mode="json"),
        micro_batch=cfg.train.micro_batch,
    )
    path = path_for(cfg.train.output_dir)
    cached = load(path, key, host_index=host_index, host_count=host_count, log=log)
    if cached is not None:
        if log is not None:
            log(cached.stats.summary())
            log(
                f"data: read back from {path} (key {key[:12]}, "
                f"{time.monotonic() - started:.1f} s): not tokenized again"
            )
        return cached
    prepared = pipeline.prepare(
        cfg, make_tokenizer(), host_index=host_index, host_count=host_count, log=log
    )
    if write:
        try:
            save(path, key, prepared)
        except Exception as exc:  # the run goes on; the next start prepares again
            if log is not None:
                log(
                    f"data: could not keep the prepared data at {path} "
                    f"({type(exc).__name__}: {exc})"
                )
    return prepared


def _check(
    tokens: np.ndarray,
    offsets: np.ndarray,
    prompt_lens: np.ndarray,
    items: np.ndarray,
    row_offsets: np.ndarray,
) -> None:
    """Raises _Damaged unless the arrays describe samples and rows consistently."""
    n = len(prompt_lens)

    def monotone(values: Iterable[int] | np.ndarray, end: int) -> bool:
        array = np.asarray(values)
        return bool(
            array.ndim == 1
            and len(array) >= 1
            and array[0] == 0
            and array[-1] == end
            and np.all(np.diff(array) >= 0)
        )

    if tokens.dtype != np.int32 or tokens.ndim != 1:
        raise _Damaged("tokens are not a flat int32 array")
    if len(offsets) != n + 1 or not monotone(offsets, len(tokens)):
        raise _Damaged("sample offsets do not cover the tokens")
    if n and (np.any(prompt_lens < 0) or np.any(prompt_lens > np.diff(offsets))):
        raise _Damaged("a prompt is longer than its sample")
    if not monotone(row_offsets, len(items)):
        raise _Damaged("row offsets do not cover the row items")
    if len(items) and (items.min() < 0 or items.max() >= n):
        raise _Damaged("a row names a sample that is not there")
