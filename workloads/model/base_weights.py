"""Where a job on a VM reads the base model: the host's copy the startup script staged.

The training VM's startup script copies the base model into `model.stage_dir` (from the bucket,
or from the hub on the very first VM), its small files first (config, tokenizer), then the
weights; the copy from the hub into the bucket only runs after the weights are whole. Markers
beside the directory say how far it got (templates/startup/train.sh.j2 writes them):

- `<stage_dir>.files`: the config and tokenizer are there; the host is ready from then on, so the
  trainer prepares the data and compiles the step while the weights still arrive;
- `<stage_dir>.staged`: the weights are whole;
- `<stage_dir>.staging`: the PID of the shell staging them, while it runs;
- `<stage_dir>.failed`: why it stopped.

A job handed the bucket's URL (`model.base`) reads the staged copy instead whenever its small
files are there (the bucket's copy may still be on its way, and reading it twice would be wasted
time anyway); the trainer waits for `.staged` before it loads the weights (`wait_for_weights`).
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable

from workloads.common import errors, processes, storage

STAGED_SUFFIX = ".staged"
FILES_SUFFIX = ".files"
STAGING_SUFFIX = ".staging"
FAILED_SUFFIX = ".failed"
# As long as the startup script itself waits for another worker's copy to reach the bucket.
WAIT_TIMEOUT_S = 3 * 3600.0


def _marker(stage_dir: str, suffix: str) -> pathlib.Path:
    local = pathlib.Path(stage_dir.rstrip("/"))
    return local.with_name(local.name + suffix)


def model_dir(base: str, stage_dir: str, *, before_weights: bool = False) -> str:
    """`stage_dir` when `base` is a URL and the startup script's markers say the staged copy is
    whole (or, `before_weights`, has at least its small files: the trainer, which then waits for
    the weights); otherwise `base`, which workloads.model.gemma4.stage copies (or uses in place)."""
    local = pathlib.Path(stage_dir.rstrip("/"))
    suffixes = (STAGED_SUFFIX, FILES_SUFFIX) if before_weights else (STAGED_SUFFIX,)
    marked = any(_marker(stage_dir, s).is_file() for s in suffixes)
    if storage.is_remote(base) and marked and local.is_dir():
        return str(local)
    return base


def weights_pending(model_dir: str, stage_dir: str) -> bool:
    """Whether `model_dir` is the staged copy and its weights are not whole yet."""
    local = pathlib.Path(stage_dir.rstrip("/"))
    return (
        pathlib.Path(model_dir) == local
        and not _marker(stage_dir, STAGED_SUFFIX).is_file()
        and _marker(stage_dir, FILES_SUFFIX).is_file()
    )


def _staging_pid(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def shards_present(stage_dir: str) -> str | None:
    """`3 of 13 shard files present (14.6 GB)` from the staged index (one of the small files), or
    None without one. A file counts once its name is there (the hub client writes elsewhere and
    renames a finished file into place)."""
    local = pathlib.Path(stage_dir.rstrip("/"))
    try:
        index = json.loads((local / "model.safetensors.index.json").read_text())
        names = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    sizes = [(local / name).stat().st_size for name in names if (local / name).is_file()]
    return f"{len(sizes)} of {len(names)} shard files present ({sum(sizes) / 1e9:.1f} GB)"


def wait_for_weights(
    stage_dir: str,
    *,
    log: Callable[[str], None],
    timeout_s: float = WAIT_TIMEOUT_S,
    poll_s: float = 5.0,
    progress_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Returns once `<stage_dir>.staged` exists; says what is there every `progress_s`.

    Raises:
        errors.UserError: the staging stopped (its reason from `.failed`), nothing is staging the
            weights any more (no `.staging` with a live process), or `timeout_s` passed.
    """
    staged = _marker(stage_dir, STAGED_SUFFIX)
    failed = _marker(stage_dir, FAILED_SUFFIX)
    staging = _marker(stage_dir, STAGING_SUFFIX)
    started, announced = clock(), False
    reported = started
    while not staged.is_file():
        if failed.is_file():
            reason = failed.read_text(errors="replace").strip() or "no reason given"
            raise errors.UserError(
                f"{stage_dir}: the base model's weights did not arrive: {reason}; the next boot "
                "stages them again"
            )
        pid = _staging_pid(staging)
        if pid is None or not processes.alive(pid):
            if staged.is_file():  # finished between the two checks (.staged comes first)
                break
            raise errors.UserError(
                f"{stage_dir}: the weights are not staged and nothing is staging them (no "
                f"{staging.name} naming a live process); the next boot stages them again"
            )
        now = clock()
        waited = now - started
        if waited > timeout_s:
            raise errors.UserError(
                f"{stage_dir}: the weights were not staged within {timeout_s:g} s (the startup "
                f"script, PID {pid}, is still at it)"
            )
        if not announced:
            present = shards_present(stage_dir)
            log(
                f"waiting for the base model's weights in {stage_dir}: the startup script is "
                "still staging them (the data is prepared and the step compiles meanwhile)"
                + (f"; {present}" if present else "")
            )
            announced = True
        elif now - reported >= progress_s:
            reported = now
            present = shards_present(stage_dir)
            log(
                f"still waiting for the weights ({waited:.0f} s)"
                + (f"; {present}" if present else "")
            )
        sleep(poll_s)
