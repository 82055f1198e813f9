"""Stops a run that would save or ship a broken model: a non-finite loss or gradient norm, and a
full disk during a checkpoint save, each as one line.

A NaN or Inf loss or gradient norm poisons the LoRA weights at that very update, and every step
after it trains on them, so the run stops at the first one, before a checkpoint of that step can
be written. Running the same steps again from the same checkpoint gives the same result (the data
order and dropout masks are deterministic), so the exit status (EXIT_NON_FINITE) is one the
training unit does not restart on, and the merge and release units, which follow only a
successful run, never start.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from typing import Any

from workloads.common import errors
from workloads.common.disk_space import free_space_text

# Distinct from 0 (done), 2 (bad input) and 143 (SIGTERM after a checkpoint).
EXIT_NON_FINITE = 3


class NonFiniteError(errors.UserError):
    """The loss or the gradient norm of a step is NaN or infinite."""

    exit_status = EXIT_NON_FINITE


def check_step(
    step: int, loss: float, grad_norm: float, *, resumed_from: int, checkpoint_dir: str
) -> None:
    """Raises NonFiniteError when `loss` or `grad_norm` of optimizer step `step` is not finite.

    The message names the step, the values and where the run started from, so the user knows
    which checkpoint (or none: the base model) reproduces it.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    origin = (
        f"resumed from checkpoint step {resumed_from} in {checkpoint_dir}"
        if resumed_from
        else "started from the base model (no checkpoint)"
    )
    raise NonFiniteError(
        f"step {step}: loss {loss} and gradient norm {grad_norm} (not finite); this run "
        f"{origin}; stopped before saving step {step} (lower train.learning_rate or set "
        "train.max_grad_norm)"
    )


def disk_full_error(path: str, kept: list[int]) -> errors.UserError:
    """The one line for a full disk while writing under `path`; `kept`: the intact checkpoints."""
    steps = ", ".join(map(str, kept)) if kept else "none"
    return errors.UserError(
        f"{path}: disk full while saving a checkpoint ({free_space_text(path)}); earlier "
        f"checkpoints kept (steps: {steps}); free space or move train.output_dir, then run "
        "again to resume"
    )


class HeldBackgroundErrors:
    """Holds the tracebacks of Orbax's and TensorStore's background threads while training runs.

    A failed checkpoint save (a full disk) is reported by every one of its writer threads: absl
    ERROR records with a traceback, and exceptions that TensorStore's callbacks print through
    sys.excepthook or, with no object to name, sys.unraisablehook (a bare traceback per writer
    callback that finds Orbax's event loop already closed: about 100 of them after a real full
    disk), hundreds of lines around the one line that says what happened, some of them
    while the interpreter shuts down. They are held here: dropped (for good, until exit) when the
    run ends in a one-line error, printed as they were when it ends any other way.
    """

    def __init__(self) -> None:
        self.held: list[tuple[str, Any]] = []
        self.dropping = False
        # absl: Orbax's writer threads; asyncio: their tasks' errors, logged when collected.
        self._loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
        self._excepthook = sys.excepthook
        self._unraisablehook = sys.unraisablehook

    # The holder left installed by an earlier run in this process (one that ended in a one-line
    # error stays installed, dropping): a new run replaces it, or its filter would drop the new
    # run's records before the new holder saw them.
    _installed: HeldBackgroundErrors | None = None

    def __enter__(self) -> HeldBackgroundErrors:
        previous = HeldBackgroundErrors._installed
        if previous is not None:
            for logger in previous._loggers:
                logger.removeFilter(previous._filter)
            if sys.excepthook == previous._hold_exception:
                sys.excepthook = previous._excepthook
            if sys.unraisablehook == previous._hold_unraisable:
                sys.unraisablehook = previous._unraisablehook
        HeldBackgroundErrors._installed = self
        self._excepthook = sys.excepthook
        self._unraisablehook = sys.unraisablehook
        for logger in self._loggers:
            logger.addFilter(self._filter)
        sys.excepthook = self._hold_exception
        sys.unraisablehook = self._hold_unraisable
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, errors.UserError):
            self.dropping = True  # and stay installed: the writer threads may go on failing
            self.held.clear()
            # The failed save's writer coroutines that never ran are collected at exit, each a
            # "coroutine ... was never awaited" RuntimeWarning after the one line.
            warnings.filterwarnings(
                "ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning
            )
            return
        for logger in self._loggers:
            logger.removeFilter(self._filter)
        if HeldBackgroundErrors._installed is self:
            HeldBackgroundErrors._installed = None
        sys.excepthook = self._excepthook
        sys.unraisablehook = self._unraisablehook
        for what, item in self.held:
            if what == "log":
                print(
                    logging.Formatter("%(levelname)s:%(name)s:%(message)s").format(item),
                    file=sys.stderr,
                )
            elif what == "unraisable":
                self._unraisablehook(item)
            else:
                self._excepthook(*item)
        self.held.clear()

    def _filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        if not self.dropping:
            self.held.append(("log", record))
        return False

    def _hold_exception(self, kind: Any, value: BaseException, tb: Any) -> None:
        if not self.dropping:
            self.held.append(("exception", (kind, value, tb)))

    def _hold_unraisable(self, unraisable: Any) -> None:
        if not self.dropping:
            self.held.append(("unraisable", unraisable))
