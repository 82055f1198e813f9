"""Renders the jinja2 templates in templates/ (startup scripts, systemd units, run configs).

Undefined variables are errors (StrictUndefined), and every value that reaches a shell goes
through the one quoting filter `q` (shlex.quote), so a template cannot paste an unquoted value.
"""

from __future__ import annotations

import pathlib
import shlex
from typing import Any

import jinja2

TEMPLATES_DIR = pathlib.Path(__file__).resolve().parents[2] / "templates"


def _quote(value: Any) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    return shlex.quote(str(value))


def _quote_list(values: Any) -> str:
    return shlex.join(str(v) for v in values)


def environment(templates_dir: pathlib.Path = TEMPLATES_DIR) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - shell and systemd text, not HTML; `q` quotes for the shell
    )
    env.filters["q"] = _quote
    env.filters["qlist"] = _quote_list
    return env


def render(template_name: str, **context: Any) -> str:
    """Renders `templates/<template_name>` with the given variables.

    Raises:
        jinja2.UndefinedError: a variable the template uses was not given.
    """
    return environment().get_template(template_name).render(**context)
