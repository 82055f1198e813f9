"""The stack-config reference (`docs/config.md`), generated from the schema and the rules.

    .venv/bin/python -m infra.config.reference            # rewrite docs/config.md
    .venv/bin/python -m infra.config.reference --check    # exit 1 when it is out of date

Every key comes from the pydantic model (`infra.config.model.StackConfig`): its camelCase path as
users type it, type, default, the range or values the model allows and its description. "Checked by"
lists the rules of `infra.config.validation` that read the key, as each rule declares them
(`validation.READS`; a test runs the rules on recording configs and fails on an undeclared
read). The same key walk drives the schema's property test (tests/infra/config/test_model_fuzz.py),
so a new key is documented and fuzzed without anyone listing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import inspect
import pathlib
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

import pydantic

from infra.config import model as config_mod
from infra.config import validation

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"


@dataclasses.dataclass(frozen=True)
class Key:
    """One leaf key of the stack config.

    Attributes:
        path: as users type it (`training.mesh.tp`).
        attrs: the attribute names on the model (`("training", "mesh", "tp")`).
        annotation: the field's type (Optional/Literal/tuple as declared).
        field: pydantic's FieldInfo (default, description, constraints).
        owner: the model that declares the key (its field validators check the key too).
    """

    path: str
    attrs: tuple[str, ...]
    annotation: Any
    field: Any
    owner: type[pydantic.BaseModel] = pydantic.BaseModel

    @property
    def required(self) -> bool:
        return bool(self.field.is_required())

    @property
    def default(self) -> Any:
        if self.field.default_factory is not None:
            return self.field.default_factory()
        return None if self.required else self.field.default

    @property
    def nullable(self) -> bool:
        return type(None) in typing.get_args(self.annotation)

    @property
    def base(self) -> Any:
        """The annotation without `| None`."""
        args = [a for a in typing.get_args(self.annotation) if a is not type(None)]
        if _is_union(self.annotation) and len(args) == 1:
            return args[0]
        return self.annotation

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The allowed values of a Literal or Enum key, else None."""
        base = _unannotated(self.base)
        if typing.get_origin(base) is typing.Literal:
            return typing.get_args(base)
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return tuple(m.value for m in base)
        return None

    @property
    def checks(self) -> list[str]:
        """What the model's own validators of this key allow (their "Allowed: ..." docstrings)."""
        name = self.attrs[-1]
        out = []
        for decorator in self.owner.__pydantic_decorators__.field_validators.values():
            doc = inspect.getdoc(decorator.func) or ""
            if name in decorator.info.fields and doc.startswith("Allowed: "):
                out.append(doc.removeprefix("Allowed: ").rstrip("."))
        return out

    @property
    def bounds(self) -> dict[str, float]:
        """Numeric constraints of the model: ge/gt/le/lt."""
        out = {}
        for item in self.field.metadata:
            for name in ("ge", "gt", "le", "lt"):
                value = getattr(item, name, None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[name] = value
        return out


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _unannotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _submodel(annotation: Any) -> type[pydantic.BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, pydantic.BaseModel):
            return candidate
    return None


def iter_keys(
    model: type[pydantic.BaseModel] = config_mod.StackConfig,
    prefix: str = "",
    attrs: tuple[str, ...] = (),
) -> Iterator[Key]:
    """Every leaf key of `model`, depth first in declaration order."""
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from iter_keys(sub, path + ".", (*attrs, name))
        else:
            yield Key(path, (*attrs, name), field.annotation, field, model)


def sections() -> dict[str, type[pydantic.BaseModel]]:
    """Top-level path -> section model (for headings and their docstrings)."""
    out: dict[str, type[pydantic.BaseModel]] = {}

    def visit(model: type[pydantic.BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = _submodel(field.annotation)
            if sub is not None:
                path = prefix + (field.alias or name)
                out[path] = sub
                visit(sub, path + ".")

    visit(config_mod.StackConfig, "")
    return out


# --------------------------------------------------------------------------- rules -> keys


def _covered(declared: str, keys: dict[str, Key]) -> list[str]:
    """The leaf keys a declared path names: itself, or every key under a section."""
    if declared in keys:
        return [declared]
    under = [path for path in keys if path.startswith(declared + ".")]
    if not under:
        raise ValueError(f"infra.config.validation.READS names {declared!r}, which is no stack key")
    return under


@functools.cache
def rules_by_key() -> dict[str, tuple[str, ...]]:
    """Key path -> names of the validation rules that read it (from validation.READS)."""
    keys = {key.path: key for key in iter_keys()}
    out: dict[str, set[str]] = {}
    for rule, declared in validation.READS.items():
        for path in declared:
            for key in _covered(path, keys):
                out.setdefault(key, set()).add(rule)
    return {key: tuple(sorted(names)) for key, names in out.items()}


# --------------------------------------------------------------------------- rendering


def _type_name(annotation: Any) -> str:
    annotation = _unannotated(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(f"`{v}`" for v in typing.get_args(annotation))
    if _is_union(annotation):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin in (tuple, list):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"map {_type_name(key)} -> {_type_name(value)}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(key: Key) -> str:
    if key.required:
        return "required"
    value = key.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(str(v) for v in value) + "]" if value else "[]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return f"{value}"


def _allowed(key: Key) -> str:
    parts = []
    names = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts += [f"{names[k]} {v}" for k, v in key.bounds.items()]
    parts += key.checks
    choices = key.choices
    if choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in choices))
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole docs/config.md."""
    rules = rules_by_key()
    heads = sections()
    lines = [
        "# Stack configuration reference",
        "",
        "<!-- Generated by `python -m infra.config.reference` from infra/config/model.py and "
        "infra/config/validation.py; do not edit by hand (a test fails when it is stale). -->",
        "",
        "Every key of `Pulumi.<stack>.yaml` under the `gemma4-tpu:` namespace, as you type it "
        "(`pulumi config set --path gemma4-tpu:training.microBatch 2`). Unknown keys are errors. "
        "**Allowed** is what the schema itself enforces (a wrong type, an empty string or a "
        "non-finite number is refused for every key); **checked by** names the rules in "
        "`infra/config/validation.py` that read the key and refuse values that do not fit the "
        "catalog (accelerators, zones, memory) or another key. `pulumi preview` reports every "
        "problem at once, one line each, before anything is created. The Hugging Face token is the "
        "secret key `hfToken` (`pulumi config set --secret gemma4-tpu:hfToken hf_...`); "
        "`recoverySshKey` and `recoveryPassphrase`, which the recovery controller read while it "
        "ran `pulumi up`, are accepted and no longer read. Secret keys are never part of this "
        "schema.",
        "",
    ]
    current = None
    for key in iter_keys():
        section = key.path.rsplit(".", 1)[0] if "." in key.path else ""
        if section != current:
            current = section
            if section:
                doc = inspect.getdoc(heads[section]) or ""
                lines += ["", f"## `{section}`", "", doc.splitlines()[0] if doc else ""]
            else:
                lines += ["## Top level", ""]
            lines += [
                "",
                "| key | type | default | allowed | checked by | meaning |",
                "|---|---|---|---|---|---|",
            ]
        checked = ", ".join(f"`{r}`" for r in rules.get(key.path, ()))
        lines.append(
            f"| `{key.path}` | {_cell(_type_name(key.annotation))} | "
            f"{_cell(_default(key))} | {_cell(_allowed(key))} | {checked} | "
            f"{_cell(key.field.description or '')} |"
        )
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if docs/config.md is not what it would be"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(
                f"{DOC.relative_to(ROOT)}: out of date with the schema; run "
                "`.venv/bin/python -m infra.config.reference` and commit it",
                file=sys.stderr,
            )
            return 1
        print(f"{DOC.relative_to(ROOT)}: up to date")
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    tmp = DOC.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(DOC)
    print(f"wrote {DOC.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
