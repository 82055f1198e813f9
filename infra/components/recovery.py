"""The recovery controller: a small always-on VM that recovers a preempted training TPU.

Why a VM: `python -m infra.ops recover --watch` on the user's machine stops when the laptop
sleeps, and a preempted spot run then waits for a human. The controller runs that same command
(the project's own recover loop, from the source the last `pulumi up` uploaded) against the same
gs:// Pulumi state, so a recovery is exactly the user's `pulumi up --replace`. A small
Compute Engine VM is the simplest thing that holds a long-running watch with a Pulumi CLI
(a Cloud Run job would need its own container image and a scheduler).

Least privilege: its own service account with a custom role holding only the Cloud TPU
permissions a node's create/replace needs (project-wide: Cloud TPU has no per-node IAM), the
right to attach the VMs' service account to the new node, object access on the state bucket,
read access on the training bucket, and access to its secrets (the SSH key the deployment uses,
and the stack's secrets passphrase when the stack uses one; a stack whose secrets provider is a
gcpkms:// key grants it the use of that one key instead). Its fixed external
address is added to the SSH firewall rule so its `pulumi up` can redeploy onto the new workers.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pulumi
import pulumi_gcp as gcp

from infra.components import secret as secret_mod
from infra.components import service_account as sa_mod
from infra.config import iam_catalogue
from infra.vm import source_archive, startup, templating
from workloads.contract import catalog

# The Cloud TPU REST methods a recovery calls: the controller's `pulumi up --replace` runs the
# TpuNode provider (infra/resources/tpu_node.py: placement reads the node and its queued
# resources, deletes them, creates the node directly or through a queued resource, updates its
# metadata in place, and waits on each long-running operation) and its watch reads the node.
RECOVER_METHODS = (
    "projects.locations.nodes.create",
    "projects.locations.nodes.delete",
    "projects.locations.nodes.get",
    "projects.locations.nodes.patch",
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
# The swap file the startup script makes: the peak of a recovery (program, provider, watch,
# Pulumi engine, pulumi-gcp plugin) must not meet the OOM killer (README, recovery controller).
SWAP_MB = 1024
# The service user's home on the controller: `~/` in ssh.privateKeyFile means this there.
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
    backend_url: str
    """The Pulumi state backend (gs://bucket[/path])."""
    training_bucket: pulumi.Input[str]
    """Name of the training bucket (the source archive goes there; the run is read there)."""
    vm_service_account: pulumi.Input[str]
    """The TPU VMs' service account id (projects/.../serviceAccounts/...): the controller may
    attach it to the node it creates."""
    ssh_key: pulumi.Input[str]
    """The deployment's SSH private key (a Pulumi secret)."""
    ssh_key_file: str
    """ssh.privateKeyFile (under ~/): where the program on the controller finds the key."""
    passphrase: pulumi.Input[str] | None
    """The stack's secrets passphrase (a Pulumi secret), or None for a KMS secrets provider."""
    kms_key: str | None
    """The gcpkms:// secrets provider's key (projects/.../cryptoKeys/...), or None."""
    interval_s: int
    labels: dict[str, str]
    source_dir: pathlib.Path = source_archive.ROOT
    archive_dir: pathlib.Path = source_archive.ROOT / ".recovery"


def state_bucket(backend_url: str) -> str:
    """gs://bucket/path -> bucket."""
    return backend_url.removeprefix("gs://").split("/", 1)[0]


def secret_id(prefix: str, suffix: str) -> str:
    """The Secret Manager id of one of the controller's secrets (declared and read by name)."""
    return f"{prefix}-recover-{suffix}"


def key_path_on_controller(ssh_key_file: str) -> str:
    """~/x -> /var/lib/gemma4-recover/x (the service user's home)."""
    if not ssh_key_file.startswith("~/"):
        raise ValueError(f"ssh.privateKeyFile {ssh_key_file!r}: must be under ~/")
    return f"{RUN_HOME}/{ssh_key_file[2:]}"


def monthly_usd(machine_type: str, secrets: int) -> dict[str, float]:
    """The controller's estimated monthly cost from the catalog's list prices."""
    parts = catalog.controller_monthly_usd(machine_type, DISK_GB, secrets)
    return {**parts, "total": round(sum(parts.values()), 2)}


def source_object_name(stack: str) -> str:
    """The training bucket's object that holds the controller's source (a tar.gz of stored
    blocks: infra/vm/source_archive.py says why)."""
    return f"recovery/source-{stack}.tar.gz"


def render_startup(
    args: RecoveryArgs, source_uri: str, ssh_key_secret: str, passphrase_secret: str
) -> str:
    return templating.render(
        "startup/recover.sh.j2",
        project=args.project,
        stack=args.stack,
        backend_url=args.backend_url,
        source_uri=source_uri,
        pulumi_version=startup.pinned_versions()["pulumi"],
        swap_mb=SWAP_MB,
        ssh_key_secret=ssh_key_secret,
        ssh_key_file=key_path_on_controller(args.ssh_key_file),
        passphrase_secret=passphrase_secret,
        interval_s=args.interval_s,
    )


class RecoveryController(pulumi.ComponentResource):
    """The controller VM, its identity and grants, its secrets and the source it runs.

    Attributes:
        address: its fixed external IP (allowed by the SSH firewall rule).
        outputs: what the stack exports as `recoveryController`.
    """

    address: pulumi.Output[str]

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
        passphrase_secret = self._declare_secrets(name, args, child)
        source_uri = self._declare_source(name, args, child)
        self._declare_vm(name, args, source_uri, has_passphrase=passphrase_secret is not None)
        self.outputs = {
            "vm": self.instance.name,
            "zone": args.zone,
            "address": self.address,
            "serviceAccount": self.account.email,
            "logsCommand": f"gcloud compute ssh {args.prefix}-recover --zone {args.zone} "
            "-- journalctl -u gemma4-recover -f",
            "estimatedMonthlyUsd": monthly_usd(
                args.machine_type, 1 if passphrase_secret is None else 2
            ),
        }
        self.register_outputs({"address": self.address})

    def _declare_grants(
        self, name: str, args: RecoveryArgs, child: pulumi.ResourceOptions
    ) -> list[pulumi.Resource]:
        """The least-privilege grants of the module docstring (TPU, logs, act-as the VMs'
        account, the state bucket, read on the training bucket)."""
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
                f"{name}-state",
                bucket=state_bucket(args.backend_url),
                role="roles/storage.objectAdmin",
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

    def _declare_secrets(
        self, name: str, args: RecoveryArgs, child: pulumi.ResourceOptions
    ) -> secret_mod.StoredSecret | None:
        """The SSH key and passphrase secrets (and the KMS key's grant); added to self.grants.
        Returns the passphrase secret, or None for a KMS secrets provider."""
        member = self.account.member

        def secret(suffix: str, data: pulumi.Input[str]) -> secret_mod.StoredSecret:
            return secret_mod.StoredSecret(
                f"{name}-{suffix}",
                secret_mod.SecretArgs(
                    project=args.project,
                    secret_id=secret_id(args.prefix, suffix),
                    secret_data=data,
                    accessors=[member],
                    labels=args.labels,
                ),
                opts=child,
            )

        ssh_secret = secret("ssh-key", args.ssh_key)
        passphrase_secret = (
            secret("passphrase", args.passphrase) if args.passphrase is not None else None
        )
        self.grants += [ssh_secret] + ([passphrase_secret] if passphrase_secret else [])
        if args.kms_key is not None:
            # Pulumi's gcpkms secrets manager unwraps the stack's data key with this key on every
            # operation; encrypt too, for the CLI's re-wrapping of that data key. This key only.
            self.grants.append(
                gcp.kms.CryptoKeyIAMMember(
                    f"{name}-kms",
                    crypto_key_id=args.kms_key,
                    role="roles/cloudkms.cryptoKeyEncrypterDecrypter",
                    member=member,
                    opts=child,
                )
            )
        return passphrase_secret

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

    def _declare_vm(
        self, name: str, args: RecoveryArgs, source_uri: pulumi.Output[str], *, has_passphrase: bool
    ) -> None:
        """Its fixed address and the VM, which starts watching at boot."""
        child = pulumi.ResourceOptions(parent=self)
        region = catalog.zone_region(args.zone)
        ip = gcp.compute.Address(
            f"{name}-ip",
            project=args.project,
            name=f"{args.prefix}-recover-ip",
            region=region,
            address_type="EXTERNAL",
            description="The recovery controller's address (allowed to SSH to the TPU VMs).",
            opts=child,
        )
        self.address = ip.address
        script = source_uri.apply(
            lambda uri: render_startup(
                args,
                uri,
                secret_id(args.prefix, "ssh-key"),
                secret_id(args.prefix, "passphrase") if has_passphrase else "",
            )
        )
        network = gcp.compute.InstanceNetworkInterfaceArgs(
            network=args.network,
            subnetwork=args.subnetwork,
            access_configs=[
                gcp.compute.InstanceNetworkInterfaceAccessConfigArgs(nat_ip=ip.address)
            ],
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
