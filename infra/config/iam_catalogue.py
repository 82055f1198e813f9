"""Google's IAM permission names for the services the program touches, and what each Cloud TPU
REST method the project calls needs.

Why a catalogue: IAM refuses a custom role that names a permission it does not know (`Error 400:
Permission tpu.queuedResources.create is not valid`), and Pulumi's mocks accept any string, so a
made-up name used to pass every test and fail the first real `pulumi up`. The program's tests
compare every permission it grants with this list (tests/infra/config/test_iam_catalogue.py),
the local Cloud TPU API authorizes its calls with TPU_METHOD_PERMISSIONS, and
`python -m infra.preflight` asks the user's own project for the custom roles' permissions.

Sources, read 2026-11-28:
- Cloud TPU: https://cloud.google.com/iam/docs/roles-permissions/tpu (roles/tpu.admin = `tpu.*`)
  and the Cloud TPU v2 REST reference
  (https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.queuedResources,
  `.nodes`, `.operations`, `.acceleratorTypes`, `.runtimeVersions`): each method's
  "Authorization requires the following IAM permission".
- The others: https://cloud.google.com/iam/docs/roles-permissions/<service> for storage,
  logging, monitoring, iam, secretmanager, cloudkms, compute, resourcemanager, serviceusage.

Completeness, honestly: `tpu.*` is the whole of Cloud TPU's list. For every other service this
is the part of Google's list the program can meet (the permissions of the predefined roles it
grants, and of the resources it declares), not the service's full list: compute alone has
hundreds. A permission missing here is either misspelt or new to the program; check it against
the source above before adding it.

Pure data and small functions: no Pulumi import, so that the rehearsal, the components and the ops
commands can all import it (the bottom layer of infra, like the rest of infra.config).
"""

from __future__ import annotations

from collections.abc import Iterable

SOURCE_DATE = "2026-11-28"

# Cloud TPU: every permission of roles/tpu.admin (`tpu.*`). There is no tpu.queuedResources.*:
# the queued-resource methods are authorized by tpu.nodes.* (TPU_METHOD_PERMISSIONS).
TPU_PERMISSIONS = frozenset(
    {
        "tpu.acceleratortypes.get",
        "tpu.acceleratortypes.list",
        "tpu.locations.get",
        "tpu.locations.list",
        "tpu.nodes.create",
        "tpu.nodes.createTagBinding",
        "tpu.nodes.delete",
        "tpu.nodes.deleteTagBinding",
        "tpu.nodes.get",
        "tpu.nodes.list",
        "tpu.nodes.listEffectiveTags",
        "tpu.nodes.listTagBindings",
        "tpu.nodes.performMaintenance",
        "tpu.nodes.reimage",
        "tpu.nodes.reset",
        "tpu.nodes.simulateMaintenanceEvent",
        "tpu.nodes.start",
        "tpu.nodes.stop",
        "tpu.nodes.update",
        "tpu.operations.get",
        "tpu.operations.list",
        "tpu.runtimeversions.get",
        "tpu.runtimeversions.list",
        "tpu.tensorflowversions.get",
        "tpu.tensorflowversions.list",
    }
)

# The other services: the permissions the program's grants and resources can meet (see the
# module docstring: a subset of each service's list).
_OTHER_PERMISSIONS = frozenset(
    {
        # Cloud Storage: the buckets it declares, and the object roles it grants on them.
        "storage.buckets.create",
        "storage.buckets.delete",
        "storage.buckets.get",
        "storage.buckets.getIamPolicy",
        "storage.buckets.list",
        "storage.buckets.setIamPolicy",
        "storage.buckets.update",
        "storage.managedFolders.create",
        "storage.managedFolders.delete",
        "storage.managedFolders.get",
        "storage.managedFolders.getIamPolicy",
        "storage.managedFolders.list",
        "storage.managedFolders.setIamPolicy",
        "storage.multipartUploads.abort",
        "storage.multipartUploads.create",
        "storage.multipartUploads.list",
        "storage.multipartUploads.listParts",
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.getIamPolicy",
        "storage.objects.list",
        "storage.objects.overrideUnlockedRetention",
        "storage.objects.restore",
        "storage.objects.setIamPolicy",
        "storage.objects.setRetention",
        "storage.objects.update",
        # Cloud Logging and Cloud Monitoring: what the VMs' and the controller's agents write.
        "logging.logEntries.create",
        "logging.logEntries.route",
        "monitoring.metricDescriptors.create",
        "monitoring.metricDescriptors.get",
        "monitoring.metricDescriptors.list",
        "monitoring.monitoredResourceDescriptors.get",
        "monitoring.monitoredResourceDescriptors.list",
        "monitoring.timeSeries.create",
        # IAM: service accounts, their policies, and the custom roles the program declares.
        "iam.roles.create",
        "iam.roles.delete",
        "iam.roles.get",
        "iam.roles.list",
        "iam.roles.undelete",
        "iam.roles.update",
        "iam.serviceAccounts.actAs",
        "iam.serviceAccounts.create",
        "iam.serviceAccounts.delete",
        "iam.serviceAccounts.get",
        "iam.serviceAccounts.getIamPolicy",
        "iam.serviceAccounts.list",
        "iam.serviceAccounts.setIamPolicy",
        "iam.serviceAccounts.update",
        # Secret Manager: the stack's secrets and their accessors.
        "secretmanager.secrets.create",
        "secretmanager.secrets.delete",
        "secretmanager.secrets.get",
        "secretmanager.secrets.getIamPolicy",
        "secretmanager.secrets.list",
        "secretmanager.secrets.setIamPolicy",
        "secretmanager.secrets.update",
        "secretmanager.versions.access",
        "secretmanager.versions.add",
        "secretmanager.versions.destroy",
        "secretmanager.versions.disable",
        "secretmanager.versions.enable",
        "secretmanager.versions.get",
        "secretmanager.versions.list",
        # Cloud KMS: the gcpkms:// secrets provider's key, used by the recovery controller.
        "cloudkms.cryptoKeyVersions.useToDecrypt",
        "cloudkms.cryptoKeyVersions.useToEncrypt",
        "cloudkms.cryptoKeys.get",
        "cloudkms.cryptoKeys.getIamPolicy",
        "cloudkms.cryptoKeys.setIamPolicy",
        "cloudkms.locations.get",
        "cloudkms.locations.list",
        # Compute Engine: the recovery controller's VM and address, the firewall rules.
        "compute.addresses.create",
        "compute.addresses.delete",
        "compute.addresses.get",
        "compute.addresses.use",
        "compute.disks.create",
        "compute.firewalls.create",
        "compute.firewalls.delete",
        "compute.firewalls.get",
        "compute.firewalls.update",
        "compute.images.useReadOnly",
        "compute.instances.create",
        "compute.instances.delete",
        "compute.instances.get",
        "compute.instances.setLabels",
        "compute.instances.setMetadata",
        "compute.instances.setServiceAccount",
        "compute.instances.setTags",
        "compute.instances.start",
        "compute.instances.stop",
        "compute.networks.get",
        "compute.networks.updatePolicy",
        "compute.subnetworks.use",
        "compute.subnetworks.useExternalIp",
        "compute.zones.get",
        # Resource Manager, Organization Policy and Service Usage: the project itself, its
        # bindings and the APIs the program enables.
        "orgpolicy.policy.get",
        "resourcemanager.projects.get",
        "resourcemanager.projects.getIamPolicy",
        "resourcemanager.projects.list",
        "resourcemanager.projects.setIamPolicy",
        "serviceusage.services.disable",
        "serviceusage.services.enable",
        "serviceusage.services.get",
        "serviceusage.services.list",
        "serviceusage.services.use",
    }
)

PERMISSIONS: frozenset[str] = TPU_PERMISSIONS | _OTHER_PERMISSIONS
"""Google's permission names the program may grant: all of Cloud TPU's, and the part of the other
services' lists the program can meet (module docstring)."""

# Each predefined role the program grants, with its permissions as Google's role reference lists
# them (sources above). Where a role also holds permissions of services the program never
# touches, those are left out: these are the permissions that matter here, not the full role.
PREDEFINED_ROLES: dict[str, frozenset[str]] = {
    "roles/logging.logWriter": frozenset({"logging.logEntries.create", "logging.logEntries.route"}),
    "roles/monitoring.metricWriter": frozenset(
        {
            "monitoring.metricDescriptors.create",
            "monitoring.metricDescriptors.get",
            "monitoring.metricDescriptors.list",
            "monitoring.monitoredResourceDescriptors.get",
            "monitoring.monitoredResourceDescriptors.list",
            "monitoring.timeSeries.create",
        }
    ),
    "roles/iam.serviceAccountUser": frozenset(
        {
            "iam.serviceAccounts.actAs",
            "iam.serviceAccounts.get",
            "iam.serviceAccounts.list",
            "resourcemanager.projects.get",
            "resourcemanager.projects.list",
        }
    ),
    "roles/storage.objectAdmin": frozenset(
        {
            "orgpolicy.policy.get",
            "resourcemanager.projects.get",
            "resourcemanager.projects.list",
            "storage.managedFolders.create",
            "storage.managedFolders.delete",
            "storage.managedFolders.get",
            "storage.managedFolders.getIamPolicy",
            "storage.managedFolders.list",
            "storage.managedFolders.setIamPolicy",
            "storage.multipartUploads.abort",
            "storage.multipartUploads.create",
            "storage.multipartUploads.list",
            "storage.multipartUploads.listParts",
            "storage.objects.create",
            "storage.objects.delete",
            "storage.objects.get",
            "storage.objects.getIamPolicy",
            "storage.objects.list",
            "storage.objects.overrideUnlockedRetention",
            "storage.objects.restore",
            "storage.objects.setIamPolicy",
            "storage.objects.setRetention",
            "storage.objects.update",
        }
    ),
    "roles/storage.objectUser": frozenset(
        {
            "orgpolicy.policy.get",
            "resourcemanager.projects.get",
            "resourcemanager.projects.list",
            "storage.managedFolders.create",
            "storage.managedFolders.delete",
            "storage.managedFolders.get",
            "storage.managedFolders.list",
            "storage.multipartUploads.abort",
            "storage.multipartUploads.create",
            "storage.multipartUploads.list",
            "storage.multipartUploads.listParts",
            "storage.objects.create",
            "storage.objects.delete",
            "storage.objects.get",
            "storage.objects.list",
            "storage.objects.restore",
            "storage.objects.update",
        }
    ),
    "roles/storage.objectViewer": frozenset(
        {
            "resourcemanager.projects.get",
            "resourcemanager.projects.list",
            "storage.managedFolders.get",
            "storage.managedFolders.list",
            "storage.objects.get",
            "storage.objects.list",
        }
    ),
    "roles/storage.legacyBucketReader": frozenset({"storage.buckets.get", "storage.objects.list"}),
    "roles/secretmanager.secretAccessor": frozenset(
        {
            "resourcemanager.projects.get",
            "resourcemanager.projects.list",
            "secretmanager.versions.access",
        }
    ),
    "roles/cloudkms.cryptoKeyEncrypterDecrypter": frozenset(
        {
            "cloudkms.cryptoKeyVersions.useToDecrypt",
            "cloudkms.cryptoKeyVersions.useToEncrypt",
            "cloudkms.locations.get",
            "cloudkms.locations.list",
            "resourcemanager.projects.get",
        }
    ),
}

# Every Cloud TPU v2 REST method the project calls (placement, the TpuNode provider, ops status,
# cost, recover, leftovers, preflight, the VMs' release and stop), with the permissions it needs
# on the project (Cloud TPU has no per-node IAM), as the REST reference lists them.
TPU_METHOD_PERMISSIONS: dict[str, tuple[str, ...]] = {
    "projects.locations.get": ("tpu.locations.get",),
    "projects.locations.list": ("tpu.locations.list",),
    "projects.locations.acceleratorTypes.get": ("tpu.acceleratortypes.get",),
    "projects.locations.acceleratorTypes.list": ("tpu.acceleratortypes.list",),
    "projects.locations.runtimeVersions.get": ("tpu.runtimeversions.get",),
    "projects.locations.runtimeVersions.list": ("tpu.runtimeversions.list",),
    "projects.locations.nodes.create": ("tpu.nodes.create",),
    "projects.locations.nodes.get": ("tpu.nodes.get",),
    "projects.locations.nodes.getGuestAttributes": ("tpu.nodes.get",),
    "projects.locations.nodes.list": ("tpu.nodes.list",),
    "projects.locations.nodes.delete": ("tpu.nodes.delete",),
    "projects.locations.nodes.patch": ("tpu.nodes.update",),
    "projects.locations.nodes.start": ("tpu.nodes.start",),
    "projects.locations.nodes.stop": ("tpu.nodes.stop",),
    "projects.locations.queuedResources.create": ("tpu.nodes.create",),
    "projects.locations.queuedResources.get": ("tpu.nodes.get",),
    "projects.locations.queuedResources.list": ("tpu.nodes.list",),
    "projects.locations.queuedResources.delete": ("tpu.nodes.delete",),
    "projects.locations.queuedResources.reset": ("tpu.nodes.reset",),
    "projects.locations.operations.get": ("tpu.operations.get",),
    "projects.locations.operations.list": ("tpu.operations.list",),
}

# What a create additionally needs on the service account its node runs as (when the request
# names one): attaching an account to a resource is acting as it.
TPU_METHOD_SERVICE_ACCOUNT_PERMISSIONS: dict[str, tuple[str, ...]] = {
    "projects.locations.nodes.create": ("iam.serviceAccounts.actAs",),
    "projects.locations.queuedResources.create": ("iam.serviceAccounts.actAs",),
}

# google.cloud.tpu_v2.TpuClient's methods the project calls -> the REST method each sends.
TPU_CLIENT_METHODS: dict[str, str] = {
    "get_location": "projects.locations.get",
    "list_locations": "projects.locations.list",
    "get_accelerator_type": "projects.locations.acceleratorTypes.get",
    "list_accelerator_types": "projects.locations.acceleratorTypes.list",
    "get_runtime_version": "projects.locations.runtimeVersions.get",
    "list_runtime_versions": "projects.locations.runtimeVersions.list",
    "create_node": "projects.locations.nodes.create",
    "get_node": "projects.locations.nodes.get",
    "get_guest_attributes": "projects.locations.nodes.getGuestAttributes",
    "list_nodes": "projects.locations.nodes.list",
    "delete_node": "projects.locations.nodes.delete",
    "update_node": "projects.locations.nodes.patch",
    "start_node": "projects.locations.nodes.start",
    "stop_node": "projects.locations.nodes.stop",
    "create_queued_resource": "projects.locations.queuedResources.create",
    "get_queued_resource": "projects.locations.queuedResources.get",
    "list_queued_resources": "projects.locations.queuedResources.list",
    "delete_queued_resource": "projects.locations.queuedResources.delete",
    "reset_queued_resource": "projects.locations.queuedResources.reset",
    "get_operation": "projects.locations.operations.get",
    "list_operations": "projects.locations.operations.list",
}


def unknown(permissions: Iterable[str]) -> list[str]:
    """The permissions of `permissions` that are not in PERMISSIONS, sorted, each once."""
    return sorted(set(permissions) - PERMISSIONS)


def tpu_method_permissions(method: str, *, with_service_account: bool = False) -> tuple[str, ...]:
    """What the Cloud TPU REST `method` (e.g. projects.locations.nodes.create) needs: on the
    project, plus on the node's service account when `with_service_account`.

    Raises:
        KeyError: a method the catalogue does not list (one line naming the known ones).
    """
    if method not in TPU_METHOD_PERMISSIONS:
        raise KeyError(
            f"Cloud TPU method {method!r}: not in the catalogue; known: "
            + ", ".join(sorted(TPU_METHOD_PERMISSIONS))
        )
    extra = TPU_METHOD_SERVICE_ACCOUNT_PERMISSIONS.get(method, ()) if with_service_account else ()
    return TPU_METHOD_PERMISSIONS[method] + extra


def permissions_of(*methods: str) -> tuple[str, ...]:
    """The project permissions the Cloud TPU REST `methods` need together, sorted, each once
    (what a custom role for a component that calls them holds)."""
    return tuple(sorted({p for m in methods for p in tpu_method_permissions(m)}))


def role_permissions(role: str) -> frozenset[str]:
    """The permissions of the predefined `role` (roles/...) as PREDEFINED_ROLES lists them.

    Raises:
        KeyError: a predefined role the catalogue does not list.
    """
    if role not in PREDEFINED_ROLES:
        raise KeyError(
            f"role {role!r}: not in the catalogue's predefined roles; known: "
            + ", ".join(sorted(PREDEFINED_ROLES))
        )
    return PREDEFINED_ROLES[role]
