"""An ingress firewall rule: given TCP ports, from given ranges, to VMs with given tags."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pulumi
import pulumi_gcp as gcp


@dataclasses.dataclass(frozen=True)
class FirewallArgs:
    """Arguments of IngressRule."""

    project: str
    """Project id of the network."""
    network: str
    """VPC network name."""
    rule_name: str
    """Firewall rule name (GCP name rules)."""
    ports: tuple[str, ...]
    """TCP ports allowed, e.g. ("22",)."""
    source_ranges: tuple[str, ...]
    """CIDR ranges allowed (validated: never 0.0.0.0/0 unless explicitly allowed)."""
    target_tags: tuple[str, ...]
    """Network tags of the VMs the rule applies to."""
    description: str
    """What the rule is for."""
    extra_sources: pulumi.Input[Sequence[str]] | None = None
    """Ranges known only once other resources exist (the recovery controller's address)."""


class IngressRule(pulumi.ComponentResource):
    """Allows TCP ports from the configured ranges to the tagged VMs, nothing else."""

    firewall: gcp.compute.Firewall

    def __init__(self, name: str, args: FirewallArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemma4-tpu:infra:IngressRule", name, None, opts)
        if not args.source_ranges or not args.target_tags:
            raise ValueError("an ingress rule needs source ranges and target tags")
        self.firewall = gcp.compute.Firewall(
            f"{name}-rule",
            project=args.project,
            name=args.rule_name,
            network=args.network,
            direction="INGRESS",
            allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=list(args.ports))],
            source_ranges=(
                list(args.source_ranges)
                if args.extra_sources is None
                else pulumi.Output.from_input(args.extra_sources).apply(
                    lambda extra: [*args.source_ranges, *extra]
                )
            ),
            target_tags=list(args.target_tags),
            description=args.description,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"name": self.firewall.name})
