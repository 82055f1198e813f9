"""A secret in Secret Manager (the Hugging Face token; the recovery controller's SSH key and
passphrase), readable only by the members named."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pulumi
import pulumi_gcp as gcp

from infra.resources.previous_types import renamed_from


@dataclasses.dataclass(frozen=True)
class SecretArgs:
    """Arguments of StoredSecret."""

    project: str
    """Project id of the secret."""
    secret_id: str
    """Secret id; the VMs read `projects/<project>/secrets/<secret_id>/versions/latest`."""
    secret_data: pulumi.Input[str]
    """The value: a Pulumi secret output (config.require_secret), never a plain string."""
    accessors: Sequence[pulumi.Input[str]]
    """IAM members granted roles/secretmanager.secretAccessor on this secret only."""
    labels: dict[str, str]
    """Labels on the secret."""


class StoredSecret(pulumi.ComponentResource):
    """A secret with one version (the value) and an accessor grant per member."""

    secret: gcp.secretmanager.Secret
    version: gcp.secretmanager.SecretVersion
    secret_id: pulumi.Output[str]

    def __init__(self, name: str, args: SecretArgs, opts: pulumi.ResourceOptions | None = None):
        # Registered as HfTokenSecret when it only held the token; the alias keeps every stack's
        # three secrets in place.
        opts = renamed_from("gemma4-tpu:infra:HfTokenSecret", opts)
        super().__init__("gemma4-tpu:infra:StoredSecret", name, None, opts)
        self.secret = gcp.secretmanager.Secret(
            f"{name}-secret",
            project=args.project,
            secret_id=args.secret_id,
            replication=gcp.secretmanager.SecretReplicationArgs(
                auto=gcp.secretmanager.SecretReplicationAutoArgs()
            ),
            labels=args.labels,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.version = gcp.secretmanager.SecretVersion(
            f"{name}-version",
            secret=self.secret.id,
            secret_data=pulumi.Output.secret(args.secret_data),
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["secretData"]),
        )
        self.grants = [
            gcp.secretmanager.SecretIamMember(
                f"{name}-accessor-{i}",
                project=args.project,
                secret_id=self.secret.secret_id,
                role="roles/secretmanager.secretAccessor",
                member=member,
                opts=pulumi.ResourceOptions(parent=self),
            )
            for i, member in enumerate(args.accessors)
        ]
        self.secret_id = self.secret.secret_id
        self.register_outputs({"secret_id": self.secret_id})
