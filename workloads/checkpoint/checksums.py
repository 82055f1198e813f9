"""Checksums of a checkpoint step's bytes: written with the step, checked before a resume or a
merge reads it.

A bit flip in a checkpoint's array data can decode to finite garbage (values up to 1e37), which
reads back, holds no NaN, and trains on or merges without a word. So every step this version
saves carries `<step>/checksums.json`, the relative path, size and CRC-32C (workloads.common.digest)
of every file of the step (sha256 where google-crc32c has no C extension):

    {"format": 1, "step": 8, "algorithm": "crc32c",
     "files": {"model_params/_METADATA": {"crc32c": "1a2b3c4d", "bytes": 2310},
               "model_params/d/3acd34ef...": {"crc32c": "...", "bytes": 40960}, ...}}

All but the two files Orbax writes when it commits the step, after the manifest: its step
metadata `_CHECKPOINT_METADATA` (rewritten with the commit time; it must be a JSON object) and
its commit marker.

It is written by Orbax's post-finalization callback: on the primary process only, after every
process has written its files (Orbax's barrier comes first, so the per-process files of a
multi-host save are all there) and before the step's temporary directory is renamed into place
(a gs:// step gets its commit file afterwards), so a finalized step of this version always has
its manifest; a kill in between leaves a temporary directory, which is no step.
The step's `_CHECKPOINT_METADATA` also says that a manifest belongs with it (custom_metadata
"checksums"), so a step of this version whose manifest went missing is damaged, while a step
saved by an earlier version (no manifest, no such entry) is accepted with a one-line notice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from workloads.common import digest, errors, logs, storage
from workloads.contract import runconfig

MANIFEST = "checksums.json"
FORMAT = 1
# The entry of the step's custom metadata (_CHECKPOINT_METADATA) that says this manifest exists.
MARK = "checksums"
STEP_METADATA = "_CHECKPOINT_METADATA"
# Orbax writes a local step under `<step>.orbax-checkpoint-tmp-...` and renames it when complete.
PARTIAL_MARK = ".orbax-checkpoint-tmp"

_say = logs.say("train")
# Not in the manifest: the manifest, and Orbax's step metadata, which Orbax rewrites when it
# commits the step, after the callback (it adds the commit time); its JSON is checked instead.
# Orbax's commit marker (`commit_success.txt`) is written after the callback too: files that
# the manifest does not list are not checked, the ones it lists must all be there.
_NOT_COVERED = (MANIFEST, STEP_METADATA)


def mark(custom_metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The custom metadata of a step that this version saves: the caller's, plus the mark."""
    return {**(custom_metadata or {}), MARK: MANIFEST}


def _step_files(step_dir: str) -> dict[str, int]:
    """Relative path -> size of every file under a step directory (local or gs://) but the
    manifest itself and Orbax's step metadata. fsspec's `find` on both, so hidden files count
    too."""
    fs, root = storage.filesystem(step_dir)
    prefix = root.rstrip("/") + "/"
    found = fs.find(root, detail=True)
    return {
        name[len(prefix) :]: int(info.get("size") or 0)
        for name, info in found.items()
        if name.startswith(prefix)
        and info.get("type", "file") != "directory"
        and name[len(prefix) :] not in _NOT_COVERED
    }


def _file_digest(path: str, algorithm: str) -> tuple[str, int]:
    fs, p = storage.filesystem(path)
    with fs.open(p, "rb") as handle:
        return digest.of_stream(handle, algorithm)


def write_manifest(step_dir: str, step: int) -> dict[str, Any]:
    """Checksums every file of `step_dir` and writes its manifest atomically. Returns it."""
    algorithm = digest.default_algorithm()
    files = {}
    for rel in sorted(_step_files(step_dir)):
        hexdigest, size = _file_digest(runconfig.join(step_dir, rel), algorithm)
        files[rel] = digest.record(algorithm, hexdigest, size)
    manifest = {"format": FORMAT, "step": step, "algorithm": algorithm, "files": files}
    storage.write_text_atomic(
        runconfig.join(step_dir, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True)
    )
    return manifest


def _in_flight(checkpoint_dir: str) -> tuple[str, int] | None:
    """(directory, step) of the save being finalized: a local `<step>.orbax-checkpoint-tmp...`
    directory, or a gs:// `<step>` without Orbax's commit file yet. One save is in flight at a
    time and steps only grow within a run (a run starts by removing the temporary directories
    of saves that died), so the highest such step is this one."""
    fs, root = storage.filesystem(checkpoint_dir)
    candidates = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        head = name.split(".", 1)[0]
        if not head.isdigit():
            continue
        full = runconfig.join(checkpoint_dir, name)
        if PARTIAL_MARK in name or (
            storage.is_remote(checkpoint_dir)
            and name == head
            and not storage.exists(runconfig.join(full, "commit_success.txt"))
        ):
            candidates.append((int(head), full))
    if not candidates:
        return None
    step, full = max(candidates)
    return full, step


class ManifestWriter:
    """Orbax's post-finalization callback: writes the manifest of the step being finalized.

    Orbax calls it on the primary process only (after its barrier over all processes); the
    `primary` flag guards against a version that would call it everywhere. A failure is
    logged and leaves the step without a manifest, which the next resume then treats as
    damaged (an older step is used): better than a step nobody can check.
    """

    def __init__(self, checkpoint_dir: str, *, primary: bool, log: Callable[[str], None] = _say):
        self.checkpoint_dir = checkpoint_dir
        self.primary = primary
        self.log = log
        self.written: list[int] = []  # steps whose manifest this process wrote (for tests)

    def __call__(self) -> None:
        if not self.primary:
            return
        try:
            found = _in_flight(self.checkpoint_dir)
            if found is None:
                self.log(
                    f"warning: {self.checkpoint_dir}: no checkpoint being saved found; "
                    f"no {MANIFEST} written"
                )
                return
            step_dir, step = found
            write_manifest(step_dir, step)
            self.written.append(step)
        except Exception as exc:  # a background thread: one line, never a traceback
            self.log(
                f"warning: {self.checkpoint_dir}: could not write {MANIFEST} "
                f"({errors.exception_line(exc)}); that step will count as damaged"
            )


def _metadata_problem(step_dir: str) -> str | None:
    """What is wrong with the step's _CHECKPOINT_METADATA (None: a JSON object, or absent,
    which the resume check names itself)."""
    path = runconfig.join(step_dir, STEP_METADATA)
    if not storage.exists(path):
        return None
    try:
        data = json.loads(storage.read_text(path))
    except (errors.UserError, ValueError) as exc:
        return f"{STEP_METADATA} unreadable ({errors.exception_line(exc)})"
    return None if isinstance(data, dict) else f"{STEP_METADATA} is not a JSON object"


def _expects_manifest(step_dir: str) -> bool:
    """Whether the step's _CHECKPOINT_METADATA says it was saved with a manifest."""
    try:
        data = json.loads(storage.read_text(runconfig.join(step_dir, STEP_METADATA)))
    except (errors.UserError, ValueError):
        return False  # unreadable metadata: the resume check names that itself
    custom = data.get("custom_metadata") if isinstance(data, dict) else None
    return isinstance(custom, dict) and custom.get(MARK) == MANIFEST


def check_step(step_dir: str, *, absent: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    """Checks a step's files against its manifest.

    Args:
        step_dir: the step's directory (local or gs://).
        absent: items (top-level directories) known to be gone as a whole, whose files are not
            looked for: a step without `optimizer_state/` is the resume's own case
            (`train --fresh-optimizer-state`), not a checksum mismatch.

    Returns:
        (problem, notice): problem names the first file that is missing or whose size or
        checksum differs (None: intact); notice is a line for a step saved by an earlier
        version, which has no manifest to check (None otherwise).
    """
    path = runconfig.join(step_dir, MANIFEST)
    metadata_problem = _metadata_problem(step_dir)
    if metadata_problem is not None:
        return metadata_problem, None
    if not storage.exists(path):
        if _expects_manifest(step_dir):
            return f"no {MANIFEST}, which this step was saved with", None
        return None, (
            f"note: {step_dir} has no {MANIFEST} (saved by an earlier version); its bytes "
            "are not checked"
        )
    try:
        manifest = json.loads(storage.read_text(path))
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files")
    except (errors.UserError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} unreadable ({errors.exception_line(exc)})", None
    present = _step_files(step_dir)
    for rel in sorted(files):
        if rel.split("/", 1)[0] in absent:
            continue
        entry = files[rel]
        want = digest.expected(entry) if isinstance(entry, dict) else None
        if want is None:
            return f"{MANIFEST}: no checksum recorded for {rel}", None
        if rel not in present:
            return f"{rel} is missing (listed in {MANIFEST})", None
        if present[rel] != entry.get("bytes"):
            return f"{rel} has {present[rel]} bytes, {MANIFEST} records {entry.get('bytes')}", None
        algorithm, expected = want
        got, _ = _file_digest(runconfig.join(step_dir, rel), algorithm)
        if got != expected:
            return f"{rel} does not match {MANIFEST} ({algorithm} {got}, recorded {expected})", None
    return None, None
