"""Old home of the TPU node's dynamic provider (until the relayout of 7fa5135).

Pulumi stores a dynamic provider in the stack's state with dill, by reference to its module, and
hands Delete and Read the provider from the OLD state: stacks created before the relayout name
`infra.components.tpu_node.TpuNodeProvider`. Without this module they could not be destroyed or
refreshed. Nothing else imports it (tests/infra/resources/test_pickled_providers.py loads
the pickles of earlier versions).
"""

from __future__ import annotations

from infra.resources.tpu_node import TpuNodeProvider

__all__ = ["TpuNodeProvider"]
