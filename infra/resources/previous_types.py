"""Pulumi type names this project registered before, kept as aliases so that renaming a type
never makes an existing stack delete and recreate the resource (the engine matches the old URN,
and the children of a renamed component inherit the alias)."""

from __future__ import annotations

import pulumi


def renamed_from(old_type: str, opts: pulumi.ResourceOptions | None) -> pulumi.ResourceOptions:
    """`opts` plus an alias to the type the resource registered under before (same name, same
    parent), for a resource whose type token was renamed."""
    alias = pulumi.ResourceOptions(aliases=[pulumi.Alias(type_=old_type)])
    return pulumi.ResourceOptions.merge(opts, alias)
