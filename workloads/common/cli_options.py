"""What every command line of the project shares: the help formatter that shows defaults, the one
`--config` option, the `--stack/-s` option, and the table of exit statuses.

The commands are `python -m workloads ...`, `python -m infra.ops ...` and
`python -m infra.preflight`; they build their parsers with `parser(...)` so that `--help` looks
the same everywhere.
"""

from __future__ import annotations

import argparse
from typing import Any

from workloads.common import storage

# The exit statuses of every command (the README's "Exit statuses" table lists them).
EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and found a problem: a preflight check, a failed unit
EXIT_USAGE = 2  # the user's input cannot be used: arguments, config, a file (argparse's own 2)
# 3 is training's stop on a non-finite loss (workloads.train.guards.EXIT_NON_FINITE)
EXIT_CLOUD_REFUSED = 4  # Google Cloud answered the request with an error (permission, quota)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

SHOWN_DEFAULT = "shown_default"


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: X)` to an option's help when it has a default worth saying.

    The default is the parser's own, or, for an option whose parser default is None because the
    run config fills it (flags win over the config), the one `config_default` attached. None,
    False (a switch) and a help that already mentions "default" (one that describes a computed
    default in words, such as "one per CPU core") get nothing appended.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        value = getattr(action, SHOWN_DEFAULT, action.default)
        if (
            value is None
            or value is False
            or value is argparse.SUPPRESS
            or not action.option_strings
            or "default" in text
        ):
            return text
        if isinstance(value, list | tuple):
            shown = ",".join(map(str, value))
        else:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"


def parser(prog: str, description: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """An ArgumentParser with the shared formatter."""
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=DefaultsFormatter, **kwargs
    )


def config_default(action: argparse.Action, value: Any) -> argparse.Action:
    """Makes the help show `value` as the default of an option that the run config fills when the
    flag is absent (its parser default stays None, which is how the command sees "not given")."""
    setattr(action, SHOWN_DEFAULT, value)
    return action


def add_config(parser: argparse.ArgumentParser, *, required: bool = False, uses: str = "") -> None:
    """The one `--config` option: a run config file, YAML or JSON, local or gs://.

    `uses` says what the command takes from it (appended to the help)."""
    parser.add_argument(
        "--config",
        required=required,
        type=storage.absolute,
        metavar="FILE",
        help="run config, YAML or JSON (local or gs://)" + (f"; {uses}" if uses else ""),
    )


def add_stack(parser: argparse.ArgumentParser, *, on_subcommand: bool = False) -> None:
    """`--stack/-s NAME`, accepted before and after the subcommand, as Pulumi's own CLI does.

    On the subcommands its default is SUPPRESS, so a value given before the subcommand is not
    overwritten by the subcommand's absent one.
    """
    parser.add_argument(
        "-s",
        "--stack",
        metavar="NAME",
        default=argparse.SUPPRESS if on_subcommand else None,
        help="Pulumi stack (default: the selected one)",
    )
