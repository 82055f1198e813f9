"""`python -m infra.preflight`: the read-only checks before `pulumi up` and the deviceless
compile check (infra/preflight/checks.py)."""

import sys

from infra.preflight.checks import main

if __name__ == "__main__":
    sys.exit(main())
