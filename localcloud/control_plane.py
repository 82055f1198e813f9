"""The rehearsal's control plane: the local Cloud TPU API with the program's IAM, and the VMs its
nodes boot as.

`pulumi up` creates a TPU node through the TpuNode provider (infra/resources/tpu_node.py), whose
placement calls Cloud TPU with the real client; here the same provider code runs (the Pulumi
engine is the stand-in: this module calls the provider's create, read, diff and delete as the
engine would) and the client reaches localcloud/tpu_api.py by gcloud's endpoint setting, as the
operator's identity from a key file (Application Default Credentials). A node the API creates
boots as a container VM of the local cloud from the node's own metadata and service account
(`VmHooks`); a preemption, a stop or a delete through the API kills it. The VMs' own TPU calls
(the training VM's release) go to the same API as their service account, checked against the
grants the program declared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import threading
from collections.abc import Callable
from typing import Any

from infra.resources import tpu_node
from infra.tpu import api as tpu_api
from infra.tpu import placement as tpu_placement
from localcloud import cloud_vm, stack_plan
from localcloud import iam as iam_mod
from localcloud import tpu_api as local_tpu
from workloads.common import processes

OPERATOR = "rehearsal-operator"
# gcloud's endpoint setting and Application Default Credentials: what the rehearsal's process
# points at the local API (restored when it ends).
CREDENTIALS_ENV = "GOOGLE_APPLICATION_CREDENTIALS"

NewVm = Callable[[stack_plan.VmPlan, str, str], cloud_vm.CloudVm]
Halted = Callable[[cloud_vm.CloudVm], None]


class VmHooks:
    """What becomes of a node's workers here: one container VM per node (the rehearsed slices
    have one worker), made by `new_vm(plan, service_account, token)` and booted without waiting
    for its boot to end (as a create returns before the startup script does). `iam` is the
    API's: it issues the token of the node's service account."""

    def __init__(
        self,
        plans: dict[str, stack_plan.VmPlan],
        new_vm: NewVm,
        halted: Halted,
        iam: iam_mod.Iam,
    ) -> None:
        self.plans = {plan.node_id: plan for plan in plans.values()}
        self.new_vm = new_vm
        self.halted = halted
        self.iam = iam
        self.vms: dict[str, cloud_vm.CloudVm] = {}  # node name -> its (last) VM
        self._lock = threading.Lock()

    def boot(self, node: dict[str, Any]) -> list[str]:
        name = str(node["name"])
        node_id, zone = name.rsplit("/", 1)[-1], name.split("/locations/")[1].split("/")[0]
        plan = dataclasses.replace(
            self.plans[node_id],
            zone=zone,
            metadata={k: str(v) for k, v in (node.get("metadata") or {}).items()},
        )
        account = str((node.get("serviceAccount") or {}).get("email") or "")
        token = self.iam.issue_token(f"serviceAccount:{account}") if account else ""
        vm = self.new_vm(plan, account, token)
        vm.boot(wait=False)
        with self._lock:
            self.vms[name] = vm
        return [vm.address]

    def halt(self, node: dict[str, Any], why: str) -> None:
        with self._lock:
            vm = self.vms.get(str(node["name"]))
        if vm is not None and vm.machine.running():
            self.halted(vm)


@dataclasses.dataclass
class Placed:
    """A node `pulumi up` created: its id (resource name) and the provider's outputs."""

    id: str
    outs: dict[str, Any]

    @property
    def address(self) -> str:
        return tpu_placement.external_ips(self.outs.get("network_endpoints"))[0]


class ControlPlane:
    """The local Cloud TPU API for one rehearsal, with the program's grants in force and this
    process's client pointed at it (`close` restores the environment); its nodes boot as the
    VMs `new_vm` makes and stop through `halted` (VmHooks)."""

    def __init__(
        self, plan: stack_plan.StackPlan, workdir: pathlib.Path, new_vm: NewVm, halted: Halted
    ) -> None:
        self.plan = plan
        project = str(plan.config["project"])
        # One IAM, made first: the API checks every call against it, and the hooks issue the
        # tokens of the nodes' service accounts from it.
        iam = iam_mod.Iam(iam_mod.from_resources(plan.iam))
        self.hooks = VmHooks(plan.vms, new_vm, halted, iam)
        self.api = local_tpu.TpuApiServer(project, self.hooks, iam=iam)
        email = f"{OPERATOR}@{project}.iam.gserviceaccount.com"
        self.api.iam.owner(f"serviceAccount:{email}")  # the person running `pulumi up`
        key = workdir / "operator-key.json"
        key.write_text(
            json.dumps(self.api.iam.new_key_file(email, project, self.api.url + "/token"))
        )
        key.chmod(0o600)
        self._undo = contextlib.ExitStack()
        self._undo.enter_context(
            processes.environment({tpu_api.ENDPOINT_ENV: self.api.url, CREDENTIALS_ENV: str(key)})
        )
        self.provider = tpu_node.TpuNodeProvider()
        self.placed: dict[str, Placed] = {}  # role -> its node now

    def up(self, role: str) -> Placed:
        """The TpuNode provider's create of `role`'s node, as `pulumi up` calls it."""
        created = self.provider.create(dict(self.plan.vms[role].props))
        self.placed[role] = Placed(created.id, dict(created.outs or {}))
        return self.placed[role]

    def destroy(self, role: str) -> None:
        """The provider's delete of `role`'s node (`pulumi destroy`), if it still exists."""
        placed = self.placed.pop(role, None)
        if placed is not None and self.api.state(placed.id) is not None:
            self.provider.delete(placed.id, placed.outs)

    def calls(self) -> tuple[int, int]:
        """(calls answered, calls refused) so far."""
        codes = [code for *_, code in self.api.calls]
        return len(codes), sum(1 for code in codes if code >= 400)

    def close(self) -> None:
        self.api.stop()
        self._undo.close()
