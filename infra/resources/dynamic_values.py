"""How the project's dynamic providers (the SSH deployment, the TPU node) read their inputs and
write their state.

During `pulumi preview` an input that depends on a resource not created yet reaches the provider
as Pulumi's unknown-value placeholder; state comes back with tuples as lists, integers as floats
and unset values as None. `ProviderState` is the base of the typed inputs and outputs: pydantic
reads the wire's floats back as the integers they were, a None takes the field's default, and
keys of other versions of the state (older stacks) are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pydantic
from pulumi.runtime import rpc
from pydantic.config import JsonDict

UNKNOWN = rpc.UNKNOWN
"""The value a dynamic provider sees for an input that is not known yet (during preview)."""

FLAT: JsonDict = {"flat": True}
"""`pydantic.Field(json_schema_extra=FLAT)`: a nested model whose keys sit at the top level of
the state (SshAccess inside a deployment's state: `ssh_user`, `port`, ... next to `hosts`)."""


class ProviderState(pydantic.BaseModel):
    """A dynamic provider's inputs or outputs: one definition with its defaults, read from the
    props Pulumi passes (`model_validate`) and written as the props it stores (`props()`)."""

    model_config = pydantic.ConfigDict(
        frozen=True, extra="ignore", populate_by_name=True, serialize_by_alias=True
    )

    @classmethod
    def _flat_fields(cls) -> list[str]:
        return [n for n, f in cls.model_fields.items() if f.json_schema_extra == FLAT]

    @pydantic.model_validator(mode="before")
    @classmethod
    def _from_wire(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = {k: v for k, v in data.items() if v is not None}  # unset: the field's default
        for name in cls._flat_fields():
            if name not in data:
                data[name] = dict(data)  # the nested model picks its keys from the same level
        return data

    @pydantic.model_serializer(mode="wrap")
    def _to_wire(self, handler: pydantic.SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for name in self._flat_fields():
            out.update(out.pop(name))
        return out

    def props(self) -> dict[str, Any]:
        """The plain mapping Pulumi stores (read back by model_validate)."""
        return self.model_dump(mode="json")


def is_unknown(value: Any) -> bool:
    """Whether the value, or anything inside it, is not known yet."""
    if value == UNKNOWN:
        return True
    if isinstance(value, list | tuple):
        return any(is_unknown(v) for v in value)
    if isinstance(value, dict):
        return any(is_unknown(v) for v in value.values())
    return False


def comparable(value: Any) -> Any:
    """The value as it compares after a round trip through the state (tuples as lists, numbers
    as floats, unset dict entries dropped)."""
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if v is not None}
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    return value
