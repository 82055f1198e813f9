"""Pulumi dynamic resources (the TPU node, the SSH deployment) and what their providers share."""
