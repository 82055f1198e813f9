"""The adapter metadata file written next to the LoRA checkpoints (`<checkpoints>/lora_meta.json`).

Training writes it before the first checkpoint; merge reads rank, alpha and targets from it (the
user never retypes them), and a resumed training run refuses a checkpoint dir whose rank,
alpha or targets differ from its config.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic

from workloads.common import errors, storage
from workloads.contract import runconfig

FILENAME = "lora_meta.json"


class AdapterMeta(pydantic.BaseModel):
    """What a LoRA checkpoint directory holds and how it was made."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rank: int = pydantic.Field(gt=0, description="LoRA rank r.")
    alpha: float = pydantic.Field(gt=0, description="LoRA alpha; delta scale is alpha / rank.")
    targets: tuple[str, ...] = pydantic.Field(description="Tunix module names that carry adapters.")
    dropout: float = pydantic.Field(0.0, description="LoRA dropout used in training.")
    base: str = pydantic.Field(description="Base model directory the adapters were trained on.")
    hf_config: dict[str, Any] = pydantic.Field(description="The base model's config.json.")
    run_name: str = pydantic.Field("", description="Run that wrote the checkpoints.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def path(checkpoint_dir: str) -> str:
    return runconfig.join(checkpoint_dir, FILENAME)


def write(checkpoint_dir: str, meta: AdapterMeta) -> None:
    storage.write_text_atomic(path(checkpoint_dir), meta.model_dump_json(indent=2))


def read(checkpoint_dir: str) -> AdapterMeta:
    """Reads the metadata of a checkpoint directory.

    Raises:
        errors.UserError: the file is missing or malformed.
    """
    file = path(checkpoint_dir)
    if not storage.exists(file):
        raise errors.UserError(
            f"{checkpoint_dir}: no {FILENAME}; is this a LoRA checkpoint dir written by "
            "`workloads train`?"
        )
    try:
        return AdapterMeta.model_validate(json.loads(storage.read_text(file)))
    except (json.JSONDecodeError, pydantic.ValidationError) as exc:
        raise errors.UserError(
            f"{file}: malformed adapter metadata: {str(exc).splitlines()[0]}"
        ) from None
