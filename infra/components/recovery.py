"""The recovery controller: a small always-on VM that recovers a preempted training TPU.

Why a VM: `python -m infra.ops recover --watch` on the user's machine stops when the laptop
sleeps, and a preempted spot run then waits for a human. The controller runs that same command
(the project's own recover loop, infra/ops/recover.py, from the source the last `pulumi up`
uploaded): it recreates the node through the Cloud TPU API from the create request `pulumi up`
recorded in the training bucket, and the new VM restores its release from the bucket at boot.
No Pulumi runs there: no CLI, no state, no passphrase, no SSH key. A small Compute Engine VM
is the simplest thing that holds a long-running watch (a Cloud Run job would need its own
container image and a scheduler).

Least privilege: its own service account with a custom role holding only the Cloud TPU
permissions a recreation needs (project-wide: Cloud TPU has no per-node IAM), the right to
attach the VMs' service account to the new node, read access on the training bucket (the
recorded request, the run's progress, the VMs' boot reports, its own source), and log writing.
It holds no secret and writes nothing in any bucket; what it remembers between its own
restarts (how many new nodes failed) is a file on its disk.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pulumi
import pulumi_gcp as gcp

from infra.components import service_account as sa_mod
from infra.config import iam_catalogue
from infra.vm import source_archive, templating
from workloads.contract import catalog

# The Cloud TPU REST methods a recovery calls (infra/ops/recover.py through
# infra/tpu/placement.py): it reads the node in each zone and its queued resources, deletes a
# lost or failed node and its queued resource, creates the node directly or through a queued
# resource, and waits on each long-running operation. It never updates a node in place.
RECOVER_METHODS = (
    "projects.locations.nodes.create",
    "projects.locations.nodes.delete",
    "projects.locations.nodes.get",
    "projects.locations.queuedResources.create",
    "projects.locations.queuedResources.delete",
    "projects.locations.queuedResources.get",
    "projects.locations.queuedResources.list",
    "projects.locations.operations.get",
)
# What those methods need on the project, nothing else of Cloud TPU. Cloud TPU has no
# tpu.queuedResources.* permissions (a role naming one is refused): the queued-resource methods
# are authorized by tpu.nodes.*. Attaching the VMs' account to the new node (actAs) is granted
# on that account alone (roles/iam.serviceAccountUser below), not here.
RECOVER_PERMISSIONS = iam_catalogue.permissions_of(*RECOVER_METHODS)
IMAGE = "debian-cloud/debian-12"
DISK_GB = 10
# The service user's home on the controller, where its journal lives.
RUN_HOME = "/var/lib/gemma4-recover"


@dataclasses.dataclass(frozen=True)
class RecoveryArgs:
    """Arguments of RecoveryController."""

    project: str
    stack: str
    prefix: str
    """The stack's namePrefix (resource names)."""
    zone: str
    machine_type: str
    network: str
    subnetwork: str | None
    training_bucket: pulumi.Input[str]
    """Name of the training bucket (the source archive and the recorded request are there; the
    run is read there)."""
    record_uri: str
    """The training VM's recorded create request (runconfig_render.recovery_record_uri)."""
    vm_service_account: pulumi.Input[str]
    """The TPU VMs' service account id (projects/.../serviceAccounts/...): the controller may
    attach it to the node it creates."""
    interval_s: int
    labels: dict[str, str]
    source_dir: pathlib.Path = source_archive.ROOT
    archive_dir: pathlib.Path = source_archive.ROOT / ".recovery"


def monthly_usd(machine_type: str) -> dict[str, float]:
    """The controller's estimated monthly cost from the catalog's list prices (no secrets)."""
    parts = catalog.controller_monthly_usd(machine_type, DISK_GB, 0)
    return {**parts, "total": round(sum(parts.values()), 2)}


def source_object_name(stack: str) -> str:
    """The training bucket's object that holds the controller's source (a tar.gz of stored
    blocks: infra/vm/source_archive.py says why)."""
    return f"recovery/source-{stack}.tar.gz"


def render_startup(args: RecoveryArgs, source_uri: str) -> str:
    return templating.render(
        "startup/recover.sh.j2",
        project=args.project,
        stack=args.stack,
        source_uri=source_uri,
        record_uri=args.record_uri,
        interval_s=args.interval_s,
    )


class RecoveryController(pulumi.ComponentResource):
    """The controller VM, its identity and grants, and the source it runs.

    Attributes:
        outputs: what the stack exports as `recoveryController`.
    """

    def __init__(self, name: str, args: RecoveryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemma4-tpu:infra:RecoveryController", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.account = gcp.serviceaccount.Account(
            f"{name}-account",
            project=args.project,
            account_id=f"{args.prefix}-recover",
            display_name=f"gemma4-tpu recovery controller ({args.stack})",
            description="Recreates a preempted training TPU (python -m infra.ops recover).",
            opts=child,
        )
        self.grants: list[pulumi.Resource] = self._declare_grants(name, args, child)
        source_uri = self._declare_source(name, args, child)
        self._declare_vm(name, args, source_uri)
        self.outputs = {
            "vm": self.instance.name,
            "zone": args.zone,
            "serviceAccount": self.account.email,
            "watches": args.record_uri,
            "logsCommand": f"gcloud compute ssh {args.prefix}-recover --zone {args.zone} "
            "-- journalctl -u gemma4-recover -f",
            "estimatedMonthlyUsd": monthly_usd(args.machine_type),
        }
        self.register_outputs({"vm": self.instance.name})

    def _declare_grants(
        self, name: str, args: RecoveryArgs, child: pulumi.ResourceOptions
    ) -> list[pulumi.Resource]:
        """The least-privilege grants of the module docstring (TPU, logs, act-as the VMs'
        account, read on the training bucket)."""
        member = self.account.member
        return [
            sa_mod.custom_role_grant(
                f"{name}-tpu",
                args.project,
                member,
                role_id=f"gemma4Recover_{args.prefix}",
                title=f"gemma4-tpu recovery ({args.prefix})",
                description="Recreates the stack's TPU nodes (directly or queued).",
                permissions=RECOVER_PERMISSIONS,
                opts=child,
            ),
            gcp.projects.IAMMember(
                f"{name}-logs",
                project=args.project,
                role="roles/logging.logWriter",
                member=member,
                opts=child,
            ),
            gcp.serviceaccount.IAMMember(
                f"{name}-act-as-vm",
                service_account_id=args.vm_service_account,
                role="roles/iam.serviceAccountUser",
                member=member,
                opts=child,
            ),
            gcp.storage.BucketIAMMember(
                f"{name}-run",
                bucket=args.training_bucket,
                role="roles/storage.objectViewer",
                member=member,
                opts=child,
            ),
        ]

    def _declare_source(
        self, name: str, args: RecoveryArgs, child: pulumi.ResourceOptions
    ) -> pulumi.Output[str]:
        """The source archive the controller runs, in the training bucket; returns its gs:// URI."""
        archive = source_archive.write_archive(args.stack, args.archive_dir, args.source_dir)
        object_name = source_object_name(args.stack)
        self.source = gcp.storage.BucketObject(
            f"{name}-source",
            bucket=args.training_bucket,
            name=object_name,
            source=pulumi.FileAsset(str(archive)),
            content_type="application/gzip",
            opts=child,
        )
        return pulumi.Output.concat("gs://", args.training_bucket, "/", object_name)

    def _declare_vm(self, name: str, args: RecoveryArgs, source_uri: pulumi.Output[str]) -> None:
        """The VM, which starts watching at boot."""
        script = source_uri.apply(lambda uri: render_startup(args, uri))
        network = gcp.compute.InstanceNetworkInterfaceArgs(
            network=args.network,
            subnetwork=args.subnetwork,
            # An ephemeral external address: its way to PyPI and Google's APIs. Nothing lets it
            # in anywhere (it logs in to no worker), so it needs no fixed one.
            access_configs=[gcp.compute.InstanceNetworkInterfaceAccessConfigArgs()],
        )
        self.instance = gcp.compute.Instance(
            f"{name}-vm",
            project=args.project,
            name=f"{args.prefix}-recover",
            zone=args.zone,
            machine_type=args.machine_type,
            boot_disk=gcp.compute.InstanceBootDiskArgs(
                initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                    image=IMAGE, size=DISK_GB, type="pd-standard"
                )
            ),
            network_interfaces=[network],
            service_account=gcp.compute.InstanceServiceAccountArgs(
                email=self.account.email, scopes=[sa_mod.CLOUD_PLATFORM_SCOPE]
            ),
            metadata={"startup-script": script, "enable-oslogin": "TRUE"},
            tags=[f"{args.prefix}-recover"],
            labels={**args.labels, "role": "recover"},
            allow_stopping_for_update=True,
            description="gemma4-tpu recovery controller: recreates a preempted training TPU.",
            # It starts watching at boot: every grant and the source must exist by then.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*self.grants, self.source]),
        )
