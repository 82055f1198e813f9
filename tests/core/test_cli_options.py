"""The manners every command line shares (workloads.common.cli_options): defaults shown by the help
formatter, never restated by hand; one `--config` definition; the documented exit statuses."""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
from collections.abc import Iterator

import pytest

from infra.ops import cli as ops
from infra.preflight import checks as preflight
from workloads import cli
from workloads.common import cli_options
from workloads.train import guards

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser and sub-parser of the project's three command lines."""
    roots = {
        "python -m workloads": cli.build_parser(),
        "python -m infra.ops": ops.build_parser(),
        "python -m infra.preflight": preflight.build_parser(),
    }
    for name, parser in roots.items():
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield f"{name} {sub_name}", sub


PARSERS = dict(_parsers())


def _shown_default(action: argparse.Action) -> object:
    return getattr(action, cli_options.SHOWN_DEFAULT, action.default)


def test_every_command_is_covered() -> None:
    assert {f"python -m workloads {c}" for c in cli.COMMANDS} <= set(PARSERS)
    assert {"python -m infra.ops status", "python -m infra.ops recover"} <= set(PARSERS)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_defaults_are_shown_by_the_formatter_not_restated_by_hand(name: str) -> None:
    parser = PARSERS[name]
    text = " ".join(parser.format_help().split())  # the formatter wraps lines
    for action in parser._actions:
        value = _shown_default(action)
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        if value in (None, False, argparse.SUPPRESS):
            continue
        # A help that says "default" itself describes a computed default in words; one with a
        # value the formatter can show must leave it to the formatter.
        assert "default" not in (action.help or ""), (name, action.option_strings, action.help)
        shown = (
            ",".join(map(str, value))
            if isinstance(value, list | tuple)
            else f"{value:g}"
            if isinstance(value, float)
            else str(value)
        )
        assert f"(default: {shown})" in text, (name, action.option_strings)


def test_the_formatter_shows_config_backed_defaults() -> None:
    text = " ".join(PARSERS["python -m workloads eval"].format_help().split())
    assert "samples per problem (default: 5)" in text
    assert "comma separated (default: 1,5)" in text
    assert "(default: http://127.0.0.1:8000/v1)" in text
    merge = " ".join(PARSERS["python -m workloads merge"].format_help().split())
    assert "e.g. 5GB or 512MiB (default: 5GB)" in merge
    # A switch gets nothing appended.
    assert "--overwrite replace a non-empty output --verify" in merge


def test_config_is_defined_once() -> None:
    """Every command's `--config` comes from cli_options.add_config: the same flag, type and
    wording everywhere."""
    defined_elsewhere = []
    for path in [*ROOT.glob("workloads/**/*.py"), *ROOT.glob("infra/**/*.py")]:
        if path.name == "cli_options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
                and any(isinstance(a, ast.Constant) and a.value == "--config" for a in node.args)
            ):
                defined_elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert defined_elsewhere == []
    helps = {
        name: next(str(a.help) for a in parser._actions if "--config" in a.option_strings)
        for name, parser in PARSERS.items()
        if any("--config" in a.option_strings for a in parser._actions)
    }
    assert len(helps) >= 7
    assert all(h.startswith("run config, YAML or JSON (local or gs://)") for h in helps.values())


def test_the_exit_statuses_are_documented_in_the_operations_page() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    table = page[page.index("\n## Exit statuses\n") :]
    table = table[: table.index("\n\n", table.index("|"))]
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", table, re.M))
    statuses = {
        cli_options.EXIT_OK,
        cli_options.EXIT_FAILED,
        cli_options.EXIT_USAGE,
        guards.EXIT_NON_FINITE,
        cli_options.EXIT_CLOUD_REFUSED,
        cli_options.EXIT_INTERRUPTED,
    }
    assert {int(k) for k in rows} >= statuses
    assert len(statuses) == 6  # distinct
    assert "refused" in rows[str(cli_options.EXIT_CLOUD_REFUSED)]


def test_a_usage_error_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        ops.main(["status", "--no-such-flag"])
    assert exc.value.code == cli_options.EXIT_USAGE
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
