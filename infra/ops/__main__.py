"""`python -m infra.ops`: the operator commands (infra/ops/cli.py)."""

import sys

from infra.ops.cli import main

sys.exit(main())
