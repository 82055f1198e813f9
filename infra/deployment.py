"""Oldest home of the SSH deployment's dynamic provider (until 97f9c62, when it was renamed).

Stacks created then pickled it as `infra.deployment.WorkloadDeploymentProvider` (Pulumi stores a
dynamic provider by reference to its module and hands Delete and Read the one from the old
state). The class is the same; only its names changed (tests/infra/resources/
test_pickled_providers.py).
"""

from __future__ import annotations

from infra.resources.ssh_deployment import SshDeploymentProvider

WorkloadDeploymentProvider = SshDeploymentProvider

__all__ = ["WorkloadDeploymentProvider"]
