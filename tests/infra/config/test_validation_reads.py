"""Every validation rule declares the stack keys it reads (`validation.READS`), and docs/config.md's
"Checked by" column is made from those declarations. This test holds them to the code: each rule
runs on configs that record every attribute the rule (or a helper, or a StackConfig property it
uses) takes from them, over both checked-in stacks and variants that switch each section and
choice, and a read the rule does not declare fails with its name and key."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pydantic
import pytest

from infra.config import reference as config_reference
from infra.config import stack_config, validation
from tests.fixtures import pulumi_mocks

KEYS = list(config_reference.iter_keys())
BY_ATTRS = {key.attrs: key.path for key in KEYS}


class Recording:
    """A stand-in for a pydantic model that records the attribute paths read through it.

    A field holding a model answers with another Recording; a leaf field records its path and
    answers with the real value; a property or method of the project's own models runs with the
    Recording as `self`, so its reads are recorded too; `model_fields_set` (which keys a user
    wrote, not their values) records nothing; anything else pydantic offers (`model_dump`...)
    counts as a read of the whole section.
    """

    def __init__(self, model: pydantic.BaseModel, attrs: tuple[str, ...], seen: set):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_attrs", attrs)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str) -> Any:
        model, attrs, seen = self._model, self._attrs, self._seen
        if name == "model_fields_set":
            return model.model_fields_set
        static = inspect.getattr_static(type(model), name, None)
        own = not hasattr(pydantic.BaseModel, name)
        if own and isinstance(static, property) and static.fget is not None:
            return static.fget(self)
        if own and isinstance(static, functools.cached_property):
            return static.func(self)
        if own and inspect.isfunction(static):
            return functools.partial(static, self)
        value = getattr(model, name)
        if name in type(model).model_fields:
            if isinstance(value, pydantic.BaseModel):
                return Recording(value, (*attrs, name), seen)
            seen.add((*attrs, name))
            return value
        seen.add(attrs)
        return value


def _variants(stack: str) -> list[Any]:
    """The stack as checked in, and with each bool flipped and each choice taken in turn."""
    base = pulumi_mocks.stack_file_config(stack)
    mappings = [base]
    for key in KEYS:
        choices = key.choices
        if choices:
            mappings += [pulumi_mocks.with_key(base, key.path, choice) for choice in choices]
    configs = []
    for mapping in mappings:
        try:
            configs.append(stack_config.parse_stack_config(mapping, validate=False))
        except Exception:  # a variant the schema refuses says nothing about the rules
            continue
    return configs


def _declared_keys(rule: str) -> set[str]:
    keys = {key.path for key in KEYS}
    out: set[str] = set()
    for path in validation.READS[rule]:
        out |= {k for k in keys if k == path or k.startswith(path + ".")}
    return out


def _read_keys(seen: set[tuple[str, ...]]) -> set[str]:
    """User paths of what was read: a leaf's own key, or every key under a section read whole."""
    out: set[str] = set()
    for attrs in seen:
        out |= {path for key_attrs, path in BY_ATTRS.items() if key_attrs[: len(attrs)] == attrs}
    return out


RULES = [*validation.RULES, validation.rule_hf_token]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_a_rule_reads_only_the_keys_it_declares(rule):
    undeclared: set[str] = set()
    read: set[str] = set()
    for stack in ("dev", "prod"):
        for cfg in _variants(stack):
            seen: set[tuple[str, ...]] = set()
            proxy: Any = Recording(cfg, (), seen)
            args = (proxy, False) if rule is validation.rule_hf_token else (proxy,)
            rule(*args)
            read |= _read_keys(seen)
    undeclared = read - _declared_keys(rule.__name__)
    assert not undeclared, f"{rule.__name__} reads {sorted(undeclared)} but does not declare it"
    assert read, f"{rule.__name__}: nothing recorded (the recording config is not reached)"


def test_every_rule_declares_what_it_reads_and_only_stack_keys():
    names = {rule.__name__ for rule in RULES}
    assert set(validation.READS) == names
    for rule, paths in validation.READS.items():
        for path in paths:
            assert _declared_keys(rule) and any(
                k == path or k.startswith(path + ".") for k in _declared_keys(rule)
            ), f"{rule} declares {path!r}, which is no stack key"


def test_an_undeclared_read_is_caught(monkeypatch):
    """The check can fail: rule_merge with one declaration taken away."""
    monkeypatch.setitem(validation.READS, "rule_merge", ("merge.enabled",))
    with pytest.raises(AssertionError, match=r"rule_merge reads \['serving.enabled'\]"):
        test_a_rule_reads_only_the_keys_it_declares(validation.rule_merge)
