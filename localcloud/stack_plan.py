"""What the Pulumi program declares for a stack's VMs, learned by running it under Pulumi mocks.

The rehearsal boots VMs from the program's own declarations, not from a hand-written copy: it
runs `infra.program.run()` under the recording mocks (localcloud/pulumi_mocks.py) with the
stack's file plus the rehearsal's overlay (the tiny model and data, a local SSH key, short
training), and keeps, per VM, the node's metadata (startup-script, ssh-keys, ...) and the
deployment's inputs (the props `pulumi up`'s SshDeployment provider receives).
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
from typing import Any

from infra.config import model as config_mod
from infra.config import stack_config
from localcloud import pulumi_mocks

DEPLOYMENT = "pulumi-python:dynamic/gemma4:SshDeployment"
ADDRESS_PREFIX = "127.0.2."
"""The mock cloud's external addresses: each VM's sshd listens on one of these loopback ones."""

# The rehearsal's overlay on the stack file: by config only (the program has no rehearsal branch).
OVERLAY: dict[str, Any] = {
    "project": "localcloud-rehearsal",
    "model": {"name": "gemma-4-tiny", "downloadFromHub": False},
    "data": {"maxRows": 160, "maxSeqLen": 256, "packing": True},
    "training": {
        "maxSteps": 12,
        "warmupSteps": 2,
        "saveEvery": 4,
        "keepCheckpoints": 2,
        "microBatch": 1,
        "gradAccum": 2,
        "remat": "none",
        # The tiny model needs no room in /dev/shm besides itself.
        "shmWorkingSetGb": 0.5,
        # The VM deletes itself once trained and merged (the gcloud stand-in takes the request).
        "releaseWhenDone": True,
    },
    # The tiny model's context is 4,096 tokens.
    "serving": {"maxModelLen": 1024},
}


# The serving VM at the tiny model's size (a 4,096-token context): 2,048-token requests, a
# 256-token eval sample, and a one-point benchmark sweep of 4 requests of 128 + 32 tokens.
SERVING: dict[str, Any] = {
    "maxModelLen": 2048,
    "shmWorkingSetGb": 0.5,
    "eval": {"maxTokens": 256, "n": 1},
    "bench": {"numPrompts": 4, "shapes": [[128, 32]], "requestRates": [4]},
}


@dataclasses.dataclass
class VmPlan:
    """One VM as the program declares it.

    Attributes:
        role: train or serve; node_id: the TPU node's name; zone: its first zone.
        accelerator: the accelerator type (how many workers); metadata: the node's metadata.
        deployment: the SshDeployment's inputs (None: the program deploys nothing to it).
    """

    role: str
    node_id: str
    zone: str
    accelerator: str
    metadata: dict[str, str]
    deployment: dict[str, Any] | None
    service_account: str = ""
    """The email of the account the VM runs as."""
    props: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The TpuNode resource's inputs, as `pulumi up` hands them to its provider (empty for the
    controller's Compute Engine instance)."""


@dataclasses.dataclass
class StackPlan:
    """The stack's VMs and buckets, and the config they were declared from."""

    stack: str
    config: dict[str, Any]
    vms: dict[str, VmPlan]
    buckets: list[str]
    objects: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """gs:// URI -> the bytes of every bucket object the program declares (the recovery records,
    the boot release, the controller's source): `pulumi up` uploads them, the rehearsal too."""
    iam: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    """(type token, inputs) of every resource the program declared: the local IAM reads its
    roles and bindings from them (localcloud/iam.py)."""

    def stack_config(self) -> config_mod.StackConfig:
        """The config the program ran with, parsed as the program parses it: what the
        renderers (infra/config/runconfig_render.py) take to say where things live."""
        return stack_config.parse_stack_config(self.config, validate=False)


def merged(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with `overlay`'s keys set (sections merged, not replaced)."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def rehearsal_config(
    stack: str, public_key: str, private_key_file: pathlib.Path, serving: bool
) -> dict[str, Any]:
    """The stack file's `gemma4-tpu:*` mapping with the rehearsal's overlay."""
    mapping = stack_config.read_stack_file(pulumi_mocks.ROOT / f"Pulumi.{stack}.yaml")
    overlay = merged(
        OVERLAY,
        {
            "ssh": {"publicKey": public_key, "privateKeyFile": str(private_key_file)},
            "serving": {"enabled": serving, **(SERVING if serving else {})},
        },
    )
    return merged(mapping, overlay)


INSTANCE = "gcp:compute/instance:Instance"
BUCKET_OBJECT = "gcp:storage/bucketObject:BucketObject"


def _objects(declared: list[pulumi_mocks.Registered]) -> dict[str, bytes]:
    """gs:// URI -> bytes of each declared bucket object: its `content` (a secret under the
    mocks: the wrapped value) or its `source` file."""
    found = {}
    for obj in declared:
        inputs = obj.inputs
        uri = f"gs://{inputs['bucket']}/{inputs['name']}"
        content = inputs.get("content")
        if isinstance(content, dict):
            content = content.get("value")
        if content is not None:
            found[uri] = str(content).encode()
        elif getattr(inputs.get("source"), "path", None):
            found[uri] = pathlib.Path(inputs["source"].path).read_bytes()
    return found


def plan(stack: str, config: dict[str, Any], secrets: dict[str, str] | None = None) -> StackPlan:
    """Runs the program under mocks with `config` and reads each VM's declarations (the TPU
    nodes by role, the recovery controller's Compute Engine instance as `controller`).

    Args:
        secrets: secret config keys (recoverySshKey, ...) -> value.

    Raises:
        pulumi.RunError: the program refused the config (its message names the key).
    """
    recording = pulumi_mocks.run_program(stack, config, ip_prefix=ADDRESS_PREFIX, secrets=secrets)
    deployments = {
        r.inputs.get("vm"): dict(r.inputs) for r in recording.resources if r.type == DEPLOYMENT
    }
    vms: dict[str, VmPlan] = {}
    for node in recording.of_type(pulumi_mocks.TPU_NODE):
        inputs = node.inputs
        role = node.name.removesuffix("-node")
        vms[role] = VmPlan(
            role=role,
            node_id=inputs["node_id"],
            zone=inputs["zones"][0],
            accelerator=inputs["accelerator_type"],
            metadata={k: str(v) for k, v in (inputs.get("metadata") or {}).items()},
            deployment=deployments.get(inputs["node_id"]),
            service_account=str((inputs.get("service_account") or {}).get("email") or ""),
            props={k: v for k, v in inputs.items() if not k.startswith("__")},
        )
    for instance in recording.of_type(INSTANCE):
        inputs = instance.inputs
        vms["controller"] = VmPlan(
            role="controller",
            node_id=inputs["name"],
            zone=inputs["zone"],
            accelerator="",
            metadata={k: str(v) for k, v in (inputs.get("metadata") or {}).items()},
            deployment=None,
            service_account=str((inputs.get("serviceAccount") or {}).get("email") or ""),
        )
    buckets = [
        r.inputs["name"] for r in recording.resources if r.type == "gcp:storage/bucket:Bucket"
    ]
    return StackPlan(
        stack=stack,
        config=config,
        vms=vms,
        buckets=buckets,
        objects=_objects(recording.of_type(BUCKET_OBJECT)),
        iam=[(r.type, dict(r.inputs)) for r in recording.resources],
    )
