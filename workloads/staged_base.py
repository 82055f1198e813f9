"""Where a job on a VM reads the base model: the host's copy the startup script staged.

The training VM's startup script copies the base model into `model.stage_dir` (from the bucket,
or from the hub on the very first VM) and then writes `<stage_dir>.staged`; the copy from the hub
into the bucket only runs after the VM is ready, in the background. So a job that is handed the
bucket's URL (`model.base`) reads the staged copy instead whenever that marker says it is whole:
the bucket's copy may still be on its way, and reading it twice would be wasted time anyway.
"""

from __future__ import annotations

import pathlib

from workloads import storage

STAGED_SUFFIX = ".staged"  # templates/startup/train.sh.j2 writes "$STAGE_DIR.staged"


def model_dir(base: str, stage_dir: str) -> str:
    """`stage_dir` when `base` is a URL and the startup script's marker says the staged copy is
    complete; otherwise `base`, which workloads.model.stage copies (or uses in place)."""
    local = pathlib.Path(stage_dir.rstrip("/"))
    marker = local.with_name(local.name + STAGED_SUFFIX)
    if storage.is_remote(base) and marker.is_file() and local.is_dir():
        return str(local)
    return base
