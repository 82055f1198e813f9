"""The labels the program puts on the stack's resources and where its TPUs can be: pure functions
of the stack config, read by the program and by `infra.ops` when a stack has no outputs."""

from __future__ import annotations

import re
from typing import Any

from infra.config import model as config_mod


def label_value(text: str) -> str:
    """`text` as a valid label value (lower case, [a-z0-9_-], at most 63 characters)."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def base_labels(cfg: config_mod.StackConfig, stack: str) -> dict[str, str]:
    """The labels every resource of the stack carries (the user's `labels` on top)."""
    return {
        "app": "gemma4-tpu",
        "stack": label_value(stack),
        "run": label_value(cfg.run_name),
        **cfg.labels,
    }


def tpu_scope(cfg: config_mod.StackConfig, labels: dict[str, str]) -> dict[str, Any]:
    """The project, every zone either VM may be placed in, and the labels that mark the stack's
    TPUs (what infra.ops.leftovers scans)."""
    zones = [*cfg.training.zones, *(cfg.serving.zones if cfg.serving.enabled else ())]
    return {
        "project": cfg.project,
        "zones": list(dict.fromkeys(zones)),
        "labels": {k: labels[k] for k in ("app", "stack")},
    }
