"""Every error the Pulumi program and the operator commands raise on purpose, under one root.

`InfraError` is what the operator CLI (`python -m infra.ops`) catches and prints as one line (no
traceback unless asked for); the program turns a ConfigError into Pulumi's one-error preview.
The classes live at the bottom of infra so that they never decide which folder imports which:
a folder raises its own subclass, defined here or in its own module, without importing a sibling.
"""

from __future__ import annotations


class InfraError(Exception):
    """A problem a person can act on, described in one line (the file or key, the bad value,
    what is allowed)."""


class OpsError(InfraError):
    """A problem the operator can fix; printed as one line."""


class CloudRefused(OpsError):
    """Google Cloud answered a request with an error (permission, quota, a refused call): exit
    status 4, so that a script tells it from a usage error (2)."""


class Released(OpsError):
    """The training VM gave its node back when its run finished (training.releaseWhenDone)."""


class WheelBuildError(InfraError):
    """The checkout cannot be built into a wheel; the message names the file or key."""
