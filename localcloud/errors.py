"""The local cloud's errors, under one root: `LocalCloudError`, itself an InfraError
(infra/errors.py), so that a caller catching every error the project raises on purpose catches
these too, and `python -m localcloud` prints each as one line (localcloud/__main__.py).

The local Cloud TPU API's `ApiError` (localcloud/tpu_api.py) is not one of them: it is the body
of an HTTP error answer, raised and caught inside the server's request handler; its callers see
the answer, as the real client sees Google's.
"""

from __future__ import annotations

from infra.errors import InfraError


class LocalCloudError(InfraError):
    """A problem of the local cloud, in one line (which machine, stage or tool, and why)."""


class CannotBoot(LocalCloudError):
    """This machine cannot build or boot containers (one line says why)."""


class MachineError(LocalCloudError):
    """A container did not come up, or a command in it failed (one line says which)."""


class RehearsalError(LocalCloudError):
    """A stage of the rehearsal failed: one line naming it and where to look."""
