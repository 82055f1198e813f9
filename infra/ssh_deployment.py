"""Old home of the SSH deployment's dynamic provider (until the relayout of 7fa5135).

Pulumi stores a dynamic provider in the stack's state with dill, by reference to its module, and
hands Delete and Read the provider from the OLD state: stacks created before the relayout name
`infra.ssh_deployment.SshDeploymentProvider`. Kept so that they can still be destroyed and
refreshed (tests/infra/resources/test_pickled_providers.py).
"""

from __future__ import annotations

from infra.resources.ssh_deployment import SshDeploymentProvider

__all__ = ["SshDeploymentProvider"]
