"""`python -m infra.preflight`: the read-only checks before `pulumi up` and the deviceless
compile check (infra/ops/preflight.py)."""

import sys

from infra.ops.preflight import main

if __name__ == "__main__":
    sys.exit(main())
