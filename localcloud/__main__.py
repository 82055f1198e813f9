"""`python -m localcloud rehearse ...` (the only command)."""

from __future__ import annotations

import sys

from localcloud import rehearse

if __name__ == "__main__":
    if sys.argv[1:2] != ["rehearse"]:
        print(
            "usage: python -m localcloud rehearse [--stack STACK] [--workdir DIR] "
            "[--weights-seconds S]",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(rehearse.main(sys.argv[2:]))
