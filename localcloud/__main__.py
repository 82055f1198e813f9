"""`python -m localcloud rehearse ...` (the only command).

An error the project raises on purpose (InfraError: the local cloud's LocalCloudError,
localcloud/errors.py, and infra's own) that reaches here is one line on stderr, `error: ...`,
and a non-zero exit status, as `python -m infra.ops` prints its own: 2 when this machine cannot
boot containers (as the rehearsal's own check says), 1 otherwise. WORKLOADS_TRACEBACK=1 prints
the traceback too.
"""

from __future__ import annotations

import os
import sys
import traceback

from infra.errors import InfraError
from localcloud import rehearse
from localcloud.errors import CannotBoot
from workloads.common import cli_options

USAGE = "usage: python -m localcloud rehearse [--stack STACK] [--workdir DIR] [--weights-seconds S]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["rehearse"]:
        print(USAGE, file=sys.stderr)
        return cli_options.EXIT_USAGE
    try:
        return rehearse.main(argv[1:])
    except InfraError as exc:  # every error localcloud and infra raise on purpose
        if os.environ.get("WORKLOADS_TRACEBACK") == "1":
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return rehearse.EXIT_CANNOT_BOOT if isinstance(exc, CannotBoot) else cli_options.EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
