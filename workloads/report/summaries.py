"""The shape of train_summary.json as the report reads it, checked before any figure is drawn.

A summary the report cannot use (another file under the name, a hand edit, a summary cut short)
must be one line naming the file, the key, the bad value and what is allowed, not a traceback
from the middle of a cost formula or a report with made-up figures. Only the keys the report
reads are checked; the trainer writes many more, which pass through as they are.
"""

from __future__ import annotations

from typing import Any

import pydantic

from workloads.common import errors
from workloads.contract import settings

_Count = pydantic.NonNegativeInt
_Seconds = pydantic.NonNegativeFloat


class StageRow(pydantic.BaseModel):
    """One stage of the boot that trained (workloads.common.stage_records.summarise)."""

    model_config = pydantic.ConfigDict(extra="allow", allow_inf_nan=False, strict=False)

    stage: str = pydantic.Field(description="boot, venv, weights, data, load, compile, ...")
    start: float = pydantic.Field(description="Unix time the stage started.")
    seconds: _Seconds | None = pydantic.Field(None, description="Duration (None: not ended).")
    state: str = pydantic.Field(description="done, failed, running or interrupted.")


class TrainSummary(pydantic.BaseModel):
    """The keys of train_summary.json (workloads train) the report uses."""

    model_config = pydantic.ConfigDict(extra="allow", allow_inf_nan=False, strict=False)

    steps: _Count = pydantic.Field(description="Optimizer steps of the run.")
    wall_seconds: _Seconds = pydantic.Field(description="Wall time of all segments, seconds.")
    real_tokens: _Count = pydantic.Field(description="Tokens of kept samples trained on.")
    tokens_per_second: _Seconds = pydantic.Field(description="real_tokens / wall_seconds.")
    computed_tokens_per_second: _Seconds | None = pydantic.Field(
        None, description="Computed (padded) tokens per second."
    )
    accelerator: str | None = pydantic.Field(None, description="Training machine, e.g. v5p-8.")
    segments: pydantic.PositiveInt | None = pydantic.Field(
        None, description="Processes the run took (preempted and resumed)."
    )
    steps_run: _Count | None = pydantic.Field(None, description="Steps run, re-runs included.")
    resumed_from_step: _Count | None = pydantic.Field(
        None, description="Step the last process resumed from."
    )
    steps_this_run: _Count | None = pydantic.Field(None, description="Steps of the last process.")
    stages: list[StageRow] | None = pydantic.Field(
        None, description="Stages from VM boot to the first step (workloads.common.stage_records)."
    )

    @pydantic.field_validator("steps", "real_tokens", "steps_run", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("a whole number, not true/false")
        return value


def check_train_summary(data: Any, source: str) -> dict[str, Any]:
    """The summary, unchanged, once the keys the report reads have the right types.

    Raises:
        errors.UserError: one line, `source: key: bad value: what is allowed` (problems joined
            with "; ").
    """
    if not isinstance(data, dict):
        raise errors.UserError(
            f"{source}: expected a JSON object (train_summary.json of workloads train), "
            f"got {type(data).__name__}"
        )
    try:
        TrainSummary.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = settings.problem_lines(exc.errors(), TrainSummary)
        raise errors.UserError(
            f"{source}: not a train summary the report can use: {'; '.join(problems)}"
        ) from None
    return data
