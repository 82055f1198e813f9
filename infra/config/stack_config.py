"""A stack's config, read and checked: from the running Pulumi program or from a stack file.

`parse_stack_config(mapping)` is pure (tests call it directly): the type check of the model in
infra/config/model.py, then the rules of infra/config/validation.py, every problem at once, one
line each (`key: bad value: what is allowed`). `load_stack_config()` reads the running Pulumi
program's config and calls it. This module sits above both the model and the rules, so neither
imports the other's caller.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pydantic

from infra.config import validation
from infra.config.model import (
    HF_TOKEN_KEY,
    PROJECT,
    SECRET_KEYS,
    ConfigError,
    StackConfig,
)
from workloads.contract import settings

# The checkout this program runs from: the stack files, pyproject.toml and the sources the VMs get.
ROOT = pathlib.Path(__file__).resolve().parents[2]


def stack_file(stack: str) -> str:
    """The stack's config file name, relative to ROOT."""
    return f"Pulumi.{stack}.yaml"


# ---------------------------------------------------------------------------------------------
# Parsing and error formatting


def format_pydantic_errors(errors: list[Any]) -> list[str]:
    """One line per problem of `ValidationError.errors()`: `key: bad value: what is allowed`."""
    return settings.problem_lines(errors, StackConfig)


def _child(data: Any, part: Any) -> Any:
    if isinstance(data, dict):
        return data.get(part)
    if isinstance(data, list) and isinstance(part, int) and part < len(data):
        return data[part]
    return None


def _drop(data: Any, loc: tuple[Any, ...]) -> None:
    """Removes the value at `loc` so that the field's default applies (for a second pass)."""
    for part in loc[:-1]:
        data = _child(data, part)
    if isinstance(data, dict):
        data.pop(loc[-1], None)
    elif isinstance(data, list) and isinstance(loc[-1], int) and loc[-1] < len(data):
        data.pop(loc[-1])


def parse_stack_config(
    mapping: dict[str, Any], *, has_hf_token: bool | None = None, validate: bool = True
) -> StackConfig:
    """Validates a mapping of top-level stack config keys (without the `gemma4-tpu:` prefix).

    Type errors and rule violations are reported together: after a type error the rules still
    run on the rest of the config (the bad key falls back to its default for that pass).

    Args:
        mapping: e.g. {"project": "p", "training": {"accelerator": "v5p-8", ...}}.
        has_hf_token: whether the hfToken secret is set; None = unknown (rule skipped).
        validate: run the rules of infra/config/validation.py after the type check.

    Raises:
        ConfigError: every problem, one line each.
    """
    if not isinstance(mapping, dict):
        raise ConfigError([f"(top level): {mapping!r}: a mapping of config keys"])
    try:
        return _validated(StackConfig.model_validate(mapping), has_hf_token, validate)
    except pydantic.ValidationError as exc:
        type_errors = exc.errors()
    # Second pass without the badly typed values (their defaults apply), so that the rules
    # report everything else too; rule lines about the badly typed keys are left out.
    problems = format_pydantic_errors(type_errors)
    repaired = json.loads(json.dumps(mapping, default=str))
    for problem in type_errors:
        _drop(repaired, tuple(problem["loc"]))
    try:
        cfg = StackConfig.model_validate(repaired)
    except pydantic.ValidationError:
        raise ConfigError(problems) from None
    if validate:
        bad_keys = {".".join(str(p) for p in e["loc"]) for e in type_errors}
        problems += [
            p
            for p in validation.check(cfg, has_hf_token=has_hf_token)
            if not any(p.startswith((k + ":", k + ".", k + "[")) for k in bad_keys)
        ]
    raise ConfigError(problems)


def _validated(cfg: StackConfig, has_hf_token: bool | None, validate: bool) -> StackConfig:
    if validate:
        problems = validation.check(cfg, has_hf_token=has_hf_token)
        if problems:
            raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------------------------------------
# Reading the config from Pulumi or from a stack file


def _top_level_keys_in_pulumi_config() -> set[str]:
    """Every `gemma4-tpu:*` key the engine passed to this program (to catch top-level typos)."""
    from pulumi.runtime import config as runtime_config

    keys = set(runtime_config.CONFIG.get()) | set(runtime_config.get_config_env())
    prefix = PROJECT + ":"
    return {k[len(prefix) :] for k in keys if k.startswith(prefix)}


def read_pulumi_mapping() -> dict[str, Any]:
    """The stack config as a plain mapping (the secret keys excluded)."""
    import pulumi

    config = pulumi.Config(PROJECT)
    string_keys = {
        str(f.alias) for f in StackConfig.model_fields.values() if f.annotation in (str, str | None)
    }
    mapping: dict[str, Any] = {}
    for key in sorted(_top_level_keys_in_pulumi_config() - set(SECRET_KEYS)):
        raw = config.get(key)
        if raw is None:
            continue
        if key in string_keys:
            mapping[key] = raw  # a name that looks like a number is still a name
            continue
        try:
            mapping[key] = json.loads(raw)
        except json.JSONDecodeError:
            mapping[key] = raw
    return mapping


def _secret_config(key_name: str, problems: list[str]) -> Any:
    """A secret config value of this project (an Output), or None; a plain-text one is a
    problem (it would sit unencrypted in the stack file)."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    value = pulumi.Config(PROJECT).get_secret(key_name)
    key = f"{PROJECT}:{key_name}"
    is_secret = (
        runtime_config.is_config_secret(key) or key in runtime_config.get_config_secret_keys_env()
    )
    if value is not None and not is_secret:
        problems.append(
            f"{key_name}: stored in plain text: set it with "
            f"`pulumi config set --secret {key_name} ...`"
        )
    if value is not None and not (pulumi.Config(PROJECT).get(key_name) or "").strip():
        # Set but empty: it would pass here and fail only on a VM (a download, a login).
        problems.append(
            f"{key_name}: empty: set its value with `pulumi config set --secret {key_name} ...`, "
            f"or remove it (`pulumi config rm {key_name}`)"
        )
    return value


def load_stack_config() -> tuple[StackConfig, Any]:
    """Reads and validates the running program's stack config.

    Returns:
        (config, hf_token) where hf_token is a secret `pulumi.Output[str]` or None.

    Raises:
        ConfigError: every problem, one line each.
    """
    problems: list[str] = []
    token = _secret_config(HF_TOKEN_KEY, problems)
    try:
        cfg = parse_stack_config(read_pulumi_mapping(), has_hf_token=token is not None)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return cfg, token


def read_stack_file(path: str | pathlib.Path) -> dict[str, Any]:
    """The `gemma4-tpu:*` keys of a Pulumi.<stack>.yaml file as a mapping (secure values dropped).

    Raises:
        ConfigError: the file is missing or not a stack file.
    """
    import yaml

    path = pathlib.Path(path)
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"{path}: cannot read stack file: {exc}"]) from None
    if not isinstance(document, dict):
        raise ConfigError([f"{path}: {type(document).__name__}: a stack file is a mapping"])
    raw = document.get("config") or {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: config: {raw!r}: a mapping of keys"])
    prefix = PROJECT + ":"
    return {
        key[len(prefix) :]: value
        for key, value in raw.items()
        if key.startswith(prefix)
        and key[len(prefix) :] not in SECRET_KEYS
        and not (isinstance(value, dict) and "secure" in value)
    }


def _stack_document(path: str | pathlib.Path) -> dict[str, Any]:
    """A Pulumi.<stack>.yaml file as a mapping; empty when it cannot be read or is not one."""
    import yaml

    try:
        document = yaml.safe_load(pathlib.Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return document if isinstance(document, dict) else {}


def stack_file_has_hf_token(path: str | pathlib.Path) -> bool:
    """Whether Pulumi.<stack>.yaml holds the hfToken (as an encrypted `secure:` value or not)."""
    return f"{PROJECT}:{HF_TOKEN_KEY}" in (_stack_document(path).get("config") or {})


def pulumi_config_strings(mapping: dict[str, Any]) -> dict[str, str]:
    """The mapping as the engine hands it to a program: `gemma4-tpu:key` -> string (JSON for
    structured values). Used by tests with `pulumi.runtime.set_all_config`."""
    return {
        f"{PROJECT}:{key}": value if isinstance(value, str) else json.dumps(value)
        for key, value in mapping.items()
    }
