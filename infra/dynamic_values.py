"""How the project's dynamic providers (the SSH deployment, the TPU node) read their inputs.

During `pulumi preview` an input that depends on a resource not created yet reaches the provider
as a fixed placeholder string; state comes back with tuples as lists and integers as floats.
"""

from __future__ import annotations

from typing import Any

UNKNOWN = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"
"""The value a dynamic provider sees for an input that is not known yet (during preview)."""


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
