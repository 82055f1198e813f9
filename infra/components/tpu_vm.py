"""A Cloud TPU VM slice (infra/resources/tpu_node.py's TpuNode) with its startup script,
service account and tags, placed in the first zone of its list with capacity."""

from __future__ import annotations

import dataclasses
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra.components import service_account as sa_mod
from infra.resources import tpu_node
from infra.tpu import placement as tpu_placement
from infra.tpu import record as record_mod


@dataclasses.dataclass(frozen=True)
class RecordArgs:
    """Where the node's create request is recorded for recovery (infra/tpu/record.py)."""

    bucket: pulumi.Input[str]
    """The training bucket's name (runconfig_render.recovery_record_uri's)."""
    role: str
    run_dir: str | None
    """The training run's directory (None for the serving VM)."""
    boot_reports: str | None
    """Where the startup script reports a failed boot (runconfig_render.boot_reports_uri)."""


@dataclasses.dataclass(frozen=True)
class TpuVmArgs:
    """Arguments of TpuVm."""

    project: str
    """Project id."""
    zones: tuple[str, ...]
    """Zones to place the slice in, tried in order."""
    node_name: str
    """TPU node name (also what preflight looks up)."""
    accelerator_type: str
    """Accelerator type, e.g. v5p-8."""
    runtime_version: str
    """TPU software version (from the catalog unless overridden)."""
    provisioning: str
    """spot, preemptible, on-demand or queued."""
    service_account_email: pulumi.Input[str]
    """E-mail of the VM service account (cloud-platform scope; IAM decides)."""
    network: str
    """VPC network name."""
    subnetwork: str | None
    """Subnetwork name, or None for the network's default."""
    tags: tuple[str, ...]
    """Network tags (the firewall rules target them)."""
    labels: dict[str, str]
    """Labels on the node."""
    startup_script: str
    """The rendered startup script (names and paths only, never a secret)."""
    ssh_keys: str | None
    """`user:ssh-ed25519 ...` lines for the ssh-keys metadata, or None."""
    description: str
    """What the node is for."""
    queue_spot: bool = True
    """provisioning queued: wait for spot (True) or on-demand capacity."""
    queue_valid_for_hours: float = 24.0
    """provisioning queued: how long the request waits in one zone."""
    record: RecordArgs | None = None
    """Record the create request in the bucket (what recovery recreates the node from)."""


def scheduling_for(provisioning: str) -> dict[str, bool] | None:
    """The node's scheduling config: spot, preemptible, or none (on-demand; and queued, whose
    queued resource says spot or on-demand itself)."""
    if provisioning == "spot":
        return {"spot": True}
    if provisioning == "preemptible":
        return {"preemptible": True}
    if provisioning in ("on-demand", "queued"):
        return None
    raise ValueError(f"provisioning {provisioning!r}: spot, preemptible, on-demand or queued")


def queue_for(args: TpuVmArgs) -> dict[str, Any] | None:
    if args.provisioning != "queued":
        return None
    return {"spot": args.queue_spot, "valid_for_s": round(args.queue_valid_for_hours * 3600)}


class TpuVm(pulumi.ComponentResource):
    """One TPU VM slice. Spot and preemptible slices cannot be stopped, only deleted."""

    node: tpu_node.TpuNode
    zone: pulumi.Output[str]
    placement: pulumi.Output[dict[str, Any]]
    external_ips: pulumi.Output[list[str]]
    internal_ips: pulumi.Output[list[str]]

    def __init__(self, name: str, args: TpuVmArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemma4-tpu:infra:TpuVm", name, None, opts)
        metadata = {"startup-script": args.startup_script, "enable-oslogin": "FALSE"}
        if args.ssh_keys:
            metadata["ssh-keys"] = args.ssh_keys
        network: dict[str, Any] = {
            "network": args.network,
            "enable_external_ips": True,
            "can_ip_forward": False,
        }
        if args.subnetwork:
            network["subnetwork"] = args.subnetwork
        props: dict[str, Any] = {
            "project": args.project,
            "node_id": args.node_name,
            "zones": list(args.zones),
            "queue": queue_for(args),
            "accelerator_type": args.accelerator_type,
            "runtime_version": args.runtime_version,
            "description": args.description,
            "scheduling_config": scheduling_for(args.provisioning),
            "service_account": {
                "email": args.service_account_email,
                "scope": [sa_mod.CLOUD_PLATFORM_SCOPE],
            },
            "network_config": network,
            "tags": list(args.tags),
            "labels": args.labels,
            "metadata": metadata,
        }
        self.node = tpu_node.TpuNode(
            f"{name}-node",
            props,
            # A replacement (`pulumi up --replace`, which never asks the provider's diff) must
            # delete the old node before creating its successor under the same name; the diff
            # says the same for every replacement.
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),
        )
        self.record_uri: pulumi.Output[str] | None = None
        if args.record is not None:
            self.record_uri = self._declare_record(name, args.node_name, props, args.record)
        self.zone = self.node.zone
        # Where it runs and how it got there (exported as <role>Placement).
        self.placement = pulumi.Output.all(
            self.node.zone, self.node.queued_resource, self.node.refusals
        ).apply(lambda v: {"zone": v[0], "queuedResource": v[1], "refusedZones": v[2] or []})
        self.external_ips = self.node.network_endpoints.apply(tpu_placement.external_ips)
        self.internal_ips = self.node.network_endpoints.apply(tpu_placement.internal_ips)
        self.register_outputs(
            {
                "name": args.node_name,
                "zone": self.zone,
                "external_ips": self.external_ips,
                "internal_ips": self.internal_ips,
            }
        )

    def _declare_record(
        self, name: str, node_id: str, props: dict[str, Any], record: RecordArgs
    ) -> pulumi.Output[str]:
        """The node's create request as a JSON object in the training bucket; its gs:// URI.

        Why the program declares it rather than the provider writing it: it holds exactly the
        TpuNode's inputs (one dict feeds both), `pulumi preview` shows when it changes, the
        provider needs no storage client or bucket of its own, and `pulumi destroy` deletes it
        with the node, so nothing can recreate a destroyed stack's TPU from a stale record.
        """
        content = pulumi.Output.from_input(props).apply(
            lambda resolved: record_mod.dumps(
                record_mod.to_record(
                    resolved,
                    role=record.role,
                    run_dir=record.run_dir,
                    boot_reports=record.boot_reports,
                    node_keys=tpu_node.NODE_KEYS,
                )
            )
        )
        object_name = f"recovery/{node_id}.json"  # runconfig_render.recovery_record_uri
        self.record = gcp.storage.BucketObject(
            f"{name}-request",
            bucket=record.bucket,
            name=object_name,
            content=content,
            content_type="application/json",
            opts=pulumi.ResourceOptions(parent=self),
        )
        return pulumi.Output.concat("gs://", record.bucket, "/", object_name)
