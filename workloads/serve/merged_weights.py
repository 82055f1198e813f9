"""Merged weights onto the serving host: wait for the merge's completion marker, stage in
parallel, verify every shard's checksum against merge_metadata.json.

The merge writes `model.safetensors.index.json` last (workloads.merge.safetensors_io), and
`merge_metadata.json` lists every shard with its checksum (crc32c; sha256 from earlier versions:
workloads.common.digest) and size. Staging copies what is not yet
complete, checks each listed shard, re-downloads a bad one once, and fetches the two marker files
last, so an interrupted staging never looks complete. A small stamp file in the destination
remembers which shards were verified (size + mtime), so a restart does not re-hash 62.5 GB.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from workloads.common import digest, errors, logs, storage

LOG = logs.get("serve")

INDEX = "model.safetensors.index.json"
METADATA = "merge_metadata.json"
MARKERS = (INDEX, METADATA)
STAMP = ".staged.json"


class StagingError(errors.UserError):
    """The merged model is missing, incomplete or does not match its checksums."""


@dataclasses.dataclass(frozen=True)
class StageReport:
    """What staging did: files fetched, files that were already complete, bytes fetched."""

    downloaded: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_downloaded: int


def _fs(url: str) -> tuple[Any, str]:
    fs, root = storage.filesystem(url)
    return fs, root.rstrip("/")


def _child(url: str, rel: str) -> str:
    return f"{url.rstrip('/')}/{rel}"


def marker_present(model_dir: str) -> bool:
    """True when both completion-marker files exist in model_dir (local or remote)."""
    fs, root = _fs(model_dir)
    fs.invalidate_cache()
    return all(fs.exists(f"{root}/{name}") for name in MARKERS)


def wait_for_marker(
    model_dir: str,
    *,
    timeout_s: float,
    poll_s: float,
    cancelled: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Waits until the merge has finished writing model_dir.

    Returns:
        True when the marker is there, False when `cancelled()` became true first.

    Raises:
        StagingError: not there after timeout_s seconds, or model_dir is a file (waiting would
            never end well: the merge writes a directory there).
    """
    fs, root = _fs(model_dir)
    if fs.isfile(root):
        raise StagingError(
            f"{model_dir}: is a file; serve.model_dir must name the merged model's directory "
            f"(the one holding {INDEX} and {METADATA})"
        )
    deadline = clock() + timeout_s
    announced = False
    while True:
        if marker_present(model_dir):
            return True
        if cancelled():
            return False
        if clock() >= deadline:
            raise StagingError(
                f"{model_dir}: the merged model is not complete after {timeout_s:g} s "
                f"({' and '.join(MARKERS)} must both exist; the merge writes them last). "
                "Is the merge running? Raise serve.model_wait_timeout_s to wait longer."
            )
        if not announced:
            LOG.info(
                f"waiting for {model_dir}/{INDEX} and {METADATA} "
                f"(up to {timeout_s:g} s, every {poll_s:g} s)"
            )
            announced = True
        sleep(poll_s)


def read_metadata(model_dir: str) -> dict[str, dict[str, Any]]:
    """The `files` map of merge_metadata.json: shard name -> {"crc32c" or "sha256", "bytes"}.

    Raises:
        StagingError: the file is missing or malformed.
    """
    path = _child(model_dir, METADATA)
    try:
        data = json.loads(storage.read_text(path))
    except errors.UserError:
        raise StagingError(
            f"{path}: not found; the merged model has no checksums to verify"
        ) from None
    except json.JSONDecodeError as exc:
        raise StagingError(f"{path}: not valid JSON ({exc})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not files:
        raise StagingError(f'{path}: expected a non-empty "files" map of shard -> checksum/bytes')
    for name, entry in files.items():
        if not (
            isinstance(entry, dict)
            and digest.expected(entry) is not None
            and isinstance(entry.get("bytes"), int)
        ):
            raise StagingError(
                f"{path}: files.{name} needs a checksum ("
                + " or ".join(f'"{a}"' for a in digest.ALGORITHMS)
                + ', a str) and "bytes" (int)'
            )
    return files


def _want(entry: dict[str, Any]) -> tuple[str, str]:
    want = digest.expected(entry)
    assert want is not None  # read_metadata refused entries without one
    return want


def parallel_map(fn: Callable[[str], Any], items: Iterable[str], workers: int) -> dict[str, Any]:
    items = list(items)
    if not items:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return dict(zip(items, pool.map(fn, items), strict=True))


def _mismatch(path: str, expected: dict[str, Any], got: str) -> str:
    algorithm, want = _want(expected)
    return (
        f"{path}: {algorithm} {got} does not match merge_metadata.json "
        f"({want}, {expected['bytes']} bytes)"
    )


def verify_local(model_dir: str, *, workers: int = 16) -> None:
    """Checks every shard listed in merge_metadata.json of a local directory (size and checksum).

    Raises:
        StagingError: naming the first bad or missing shard.
    """
    files = read_metadata(model_dir)
    for name, entry in files.items():
        path = pathlib.Path(model_dir, name)
        if not path.is_file():
            raise StagingError(f"{path}: listed in merge_metadata.json but missing")
        if path.stat().st_size != entry["bytes"]:
            raise StagingError(
                f"{path}: {path.stat().st_size} bytes, merge_metadata.json says {entry['bytes']}"
            )
    checked = parallel_map(
        lambda name: digest.matches(pathlib.Path(model_dir, name), files[name]), files, workers
    )
    for name, (ok, got) in sorted(checked.items()):
        if not ok:
            raise StagingError(_mismatch(str(pathlib.Path(model_dir, name)), files[name], got))


def _load_stamp(dest: pathlib.Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((dest / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _stamp_entry(path: pathlib.Path, entry: dict[str, Any]) -> dict[str, Any]:
    """What the stamp remembers of a verified shard: the checksum it matched, size and mtime."""
    algorithm, want = _want(entry)
    stat = path.stat()
    return {algorithm: want, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def stage_model(src: str, dest: str, *, workers: int = 16) -> StageReport:
    """Copies a merged model directory to a local directory and verifies it.

    Files already in dest with the right size are kept (shards also need the right checksum,
    taken from the stamp when size and mtime are unchanged, else computed). Missing or incomplete
    files are downloaded in parallel; a shard with a wrong checksum is downloaded once more, then
    staging fails. The marker files are fetched last.

    Args:
        src: merged model directory (gs://, memory://, or a local path).
        dest: local directory (created).
        workers: parallel downloads and hashes.

    Raises:
        StagingError: a listed shard is missing in src or stays corrupt after one re-download.
    """
    files = read_metadata(src)
    sizes = storage.file_sizes(src)
    for name, entry in files.items():
        if name not in sizes:
            raise StagingError(f"{_child(src, name)}: listed in merge_metadata.json but missing")
        if sizes[name] != entry["bytes"]:
            raise StagingError(
                f"{_child(src, name)}: {sizes[name]} bytes, merge_metadata.json "
                f"says {entry['bytes']}"
            )
    root = pathlib.Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    stamp = _load_stamp(root)

    def complete(rel: str) -> bool:
        path = root / rel
        if not path.is_file() or path.stat().st_size != sizes[rel]:
            return False
        if rel not in files:
            return True
        known = stamp.get(rel)
        if known and known == _stamp_entry(path, files[rel]):
            return True
        if digest.matches(path, files[rel])[0]:
            stamp[rel] = _stamp_entry(path, files[rel])
            return True
        return False

    body = sorted(rel for rel in sizes if rel not in MARKERS and rel != STAMP)
    done = parallel_map(complete, body, workers)
    todo = [rel for rel in body if not done[rel]]
    skipped = tuple(rel for rel in body if done[rel])
    if todo:
        total = sum(sizes[rel] for rel in todo)
        LOG.info(
            f"staging {len(todo)} file(s), {total / 1e9:.2f} GB, from {src} to {dest} "
            f"({len(skipped)} already complete)"
        )

    def fetch(rel: str) -> str | None:
        """Downloads one file; for a shard, verifies it and retries once. Returns an error."""
        target = root / rel
        for attempt in (1, 2):
            storage.download_file(_child(src, rel), str(target))
            if rel not in files:
                return None
            ok, got = digest.matches(target, files[rel])
            if ok:
                stamp[rel] = _stamp_entry(target, files[rel])
                return None
            if attempt == 1:
                LOG.info(f"{target}: checksum mismatch after download, downloading it once more")
            target.unlink(missing_ok=True)
        return _mismatch(_child(src, rel), files[rel], got) + " (downloaded twice)"

    problems = [p for p in parallel_map(fetch, todo, workers).values() if p]
    storage.write_text_atomic(str(root / STAMP), json.dumps(stamp, indent=1, sort_keys=True))
    if problems:
        raise StagingError("; ".join(sorted(problems)))
    for name in MARKERS:
        storage.download_file(_child(src, name), str(root / name))
    extra = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and str(p.relative_to(root)) not in sizes and not p.name.startswith(".")
    )
    if extra:
        LOG.info(
            f"{dest} also holds files the source does not: {', '.join(extra[:5])}"
            f"{' ...' if len(extra) > 5 else ''} (left in place)"
        )
    return StageReport(tuple(todo), skipped, sum(sizes[rel] for rel in todo))


# Weight files: everything else of a merged model (config, tokenizer, chat template, the index
# and metadata) is small, and is what a client needs to tokenize.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def stage_tokenizer_files(model_dir: str, dest: str) -> str:
    """A local copy of model_dir's non-weight files (config, tokenizer, ...) in `dest`, for the
    clients that tokenize while vLLM streams the weights from a gs:// model_dir (serve.weights_from
    bucket): vLLM's bench loads its tokenizer from `--tokenizer`, else from `--model`, and
    transformers cannot read gs://. Files already there at the same size are kept.

    Returns:
        `dest`.

    Raises:
        StagingError: model_dir holds no tokenizer file.
    """
    sizes = storage.file_sizes(model_dir)
    small = sorted(rel for rel in sizes if not rel.endswith(WEIGHT_SUFFIXES))
    if not any(pathlib.PurePosixPath(rel).name.startswith("tokenizer") for rel in small):
        raise StagingError(
            f"{model_dir}: no tokenizer file (tokenizer.json, tokenizer_config.json, ...) beside "
            "the weights; the benchmark client tokenizes with the merged model's own tokenizer"
        )
    copied = storage.copy_tree(model_dir, dest, files=small, src_sizes=sizes)
    LOG.info(
        f"{len(small)} tokenizer and config file(s) of {model_dir} in {dest} ({len(copied)} copied)"
    )
    return dest
