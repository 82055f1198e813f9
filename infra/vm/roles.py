"""The TPU VM roles: what each VM of a stack is for, one VmRole object per role, and ROLES.

A role owns everything infra asks of a VM because of what it is for: the stack-config section
that sizes and places it, its node name, when the stack has it, its network tags, the
permissions it needs on its own node, its startup script, its systemd units, the run-config
sections its copy leaves out, the names of its stack outputs, and the operator traits that
`python -m infra.ops` and the program read (it has training metrics, a serving port, it is given
back when its run is done, the recovery controller recreates it). Nothing else in infra/ names a
role: code asks a trait or `role(name)` (tests/infra/test_role_names.py keeps it so). A third
role is one more VmRole subclass and its instance in ROLES (docs/architecture.md, "Adding a VM
role").

The table lives in infra/vm/, the lowest floor that needs it: a role's units and startup script
are rendered on this floor (units.py, startup.py); components, ops, preflight and the program
read it from above. The config-dependent parts are methods, each a few lines that name the
stack-config field or the renderer they read.
"""

from __future__ import annotations

import abc
from typing import Any

from infra.config import iam_catalogue
from infra.config import model as config_mod
from infra.vm import startup, units
from infra.vm.layout import RemoteLayout
from workloads.contract import runconfig

# What a VM needs to give its own node back: the training VM deletes it when its run is done
# (training.releaseWhenDone), the serving VM stops it after its time limit
# (serving.stopAfterHours). The program grants them in one custom role with only what the stack
# asks for, on the project (Cloud TPU has no per-node IAM), and not at all when neither is asked.
# The REST methods `gcloud compute tpus tpu-vm delete|stop` sends (it reads the node first and
# may poll the operation), and the permissions the catalogue says they need.
RELEASE_PERMISSIONS = iam_catalogue.permissions_of(
    "projects.locations.nodes.get",
    "projects.locations.nodes.delete",
    "projects.locations.operations.get",
)
STOP_PERMISSIONS = iam_catalogue.permissions_of(
    "projects.locations.nodes.get",
    "projects.locations.nodes.stop",
    "projects.locations.operations.get",
)

# Run-config sections (workloads/contract/runconfig.py) that only the serving VM reads. The
# training VM's copy leaves them out, so that a serving change (port, maxModelLen, eval or bench
# settings) keeps the training deployment's run-config hash and does not stop and restart a
# running training job.
SERVE_ONLY_SECTIONS = ("serve", "eval", "bench", "stop")


class VmRole(abc.ABC):
    """One TPU VM of a stack: its identity, its operator traits, and what it is made of."""

    name: str
    """Short name, what users see: resource names (`<name>`, `<name>-deploy`), the `role`
    label, the deployments output's key, `python -m infra.ops --vm <name>`, its stack outputs
    (`output`) and its startup template (templates/startup/<name>.sh.j2)."""
    noun: str
    """What the slice does, in descriptions ("a gemma4-tpu <noun> slice") and messages ("the
    <noun> VM")."""
    leaves_out: tuple[str, ...]
    """Run-config sections its copy of the run config leaves out (a change there does not
    redeploy it)."""
    absent_hint: str = ""
    """Why a stack may not have this VM, added to the error of `infra.ops --vm <name>`."""

    # The operator traits: what infra.ops and the program ask of a role instead of its name.
    has_training_metrics: bool = False
    """It runs the training: `status` shows the last step and loss, and its recovery record
    names the run directory (`recover` judges from it whether the run finished or progresses)."""
    has_serving_port: bool = False
    """It serves the API: `tunnel` forwards its port by default; the servingEndpoint and
    servingTunnelCommand outputs point at it."""
    releasable: bool = False
    """It can give its node back when its run is done: then the stack declares no VM for it,
    exports `<name>Released` (and keeps `<name>Node`, `<name>Zone`), and infra.ops reports the
    VM released instead of missing, and leaves it out of `cost`."""
    recovered_by_controller: bool = False
    """The recovery controller recreates it when preempted (`recover --watch`): `status` names
    the controller, and its deployment's bundle is also the boot release a recreated node
    installs (infra/components/boot_release.py)."""

    @abc.abstractmethod
    def section(self, cfg: config_mod.StackConfig) -> config_mod.SliceStackSection:
        """The stack-config section that sizes and places it (accelerator, zones,
        provisioning)."""

    @abc.abstractmethod
    def node_name(self, cfg: config_mod.StackConfig) -> str:
        """Its TPU node's name."""

    @abc.abstractmethod
    def declared(self, cfg: config_mod.StackConfig, released: bool) -> bool:
        """Whether the stack has this VM now (`released`: the run gave its training node
        back)."""

    @abc.abstractmethod
    def tags(self, cfg: config_mod.StackConfig) -> tuple[str, ...]:
        """Network tags: which firewall rules reach it."""

    @abc.abstractmethod
    def self_service(self, cfg: config_mod.StackConfig) -> tuple[str, ...]:
        """Permissions the VM needs on its own node (giving it back, stopping it)."""

    @abc.abstractmethod
    def plan_units(self, run_config: runconfig.RunConfig, layout: RemoteLayout) -> units.UnitPlan:
        """Its systemd units (infra/vm/units.py): text, which to enable, which to start."""

    @abc.abstractmethod
    def startup_script(
        self,
        cfg: config_mod.StackConfig,
        *,
        has_hf_secret: bool,
        release: dict[str, Any] | None = None,
    ) -> str:
        """Its rendered startup script (infra/vm/startup.py). `has_hf_secret`: the stack stores
        a Hugging Face token; `release`: the boot release's template variables, for a role the
        controller recovers (boot_release.startup_context); None restores nothing at boot."""

    def output(self, what: str) -> str:
        """The name of one of its stack outputs, `<name><What>`: output("WorkerIps") is
        trainWorkerIps. Users' scripts read them: never renamed."""
        return f"{self.name}{what}"

    def __repr__(self) -> str:
        return f"<VmRole {self.name}>"


class TrainRole(VmRole):
    """The training VM: trains, merges, and gives its node back when the run is done."""

    name = "train"
    noun = "training"
    leaves_out = SERVE_ONLY_SECTIONS
    has_training_metrics = True
    releasable = True
    recovered_by_controller = True

    def section(self, cfg: config_mod.StackConfig) -> config_mod.SliceStackSection:
        return cfg.training

    def node_name(self, cfg: config_mod.StackConfig) -> str:
        return cfg.training_node_name

    def declared(self, cfg: config_mod.StackConfig, released: bool) -> bool:
        return not released

    def tags(self, cfg: config_mod.StackConfig) -> tuple[str, ...]:
        return (cfg.ssh_tag,)

    def self_service(self, cfg: config_mod.StackConfig) -> tuple[str, ...]:
        # It deletes its own node when the run is done (workloads release).
        return tuple(RELEASE_PERMISSIONS) if cfg.training.release_when_done else ()

    def plan_units(self, run_config: runconfig.RunConfig, layout: RemoteLayout) -> units.UnitPlan:
        return units.plan_train_units(run_config, layout)

    def startup_script(
        self,
        cfg: config_mod.StackConfig,
        *,
        has_hf_secret: bool,
        release: dict[str, Any] | None = None,
    ) -> str:
        return startup.render_train(cfg, self, has_hf_secret=has_hf_secret, release=release)


class ServeRole(VmRole):
    """The serving VM: serves the merged model, evaluates and benchmarks it, and may stop
    itself after a time limit."""

    name = "serve"
    noun = "serving"
    leaves_out = ("release",)
    absent_hint = "the serving VM exists only with serving.enabled: true"
    has_serving_port = True

    def section(self, cfg: config_mod.StackConfig) -> config_mod.SliceStackSection:
        return cfg.serving

    def node_name(self, cfg: config_mod.StackConfig) -> str:
        return cfg.serving_node_name

    def declared(self, cfg: config_mod.StackConfig, released: bool) -> bool:
        return cfg.serving.enabled

    def tags(self, cfg: config_mod.StackConfig) -> tuple[str, ...]:
        return (cfg.ssh_tag, cfg.api_tag)

    def self_service(self, cfg: config_mod.StackConfig) -> tuple[str, ...]:
        # It stops its own node after its time limit.
        return tuple(STOP_PERMISSIONS) if cfg.serving.stop_after_hours is not None else ()

    def plan_units(self, run_config: runconfig.RunConfig, layout: RemoteLayout) -> units.UnitPlan:
        return units.plan_serve_units(run_config, layout)

    def startup_script(
        self,
        cfg: config_mod.StackConfig,
        *,
        has_hf_secret: bool,
        release: dict[str, Any] | None = None,
    ) -> str:
        # The serving VM never reads the token, and restores no release at boot.
        return startup.render_serve(cfg, self)


TRAIN = TrainRole()
SERVE = ServeRole()
ROLES: tuple[VmRole, ...] = (TRAIN, SERVE)
"""Every role, in the order the program declares their VMs and infra.ops lists them."""


def names() -> tuple[str, ...]:
    """The roles' names, in the order of ROLES (the choices of `infra.ops --vm`)."""
    return tuple(r.name for r in ROLES)


def find(name: str) -> VmRole | None:
    """The role called `name`; None when there is none (a name read from a stack's outputs)."""
    return next((r for r in ROLES if r.name == name), None)


def role(name: str) -> VmRole:
    """The role called `name`.

    Raises:
        KeyError: no such role.
    """
    found = find(name)
    if found is None:
        raise KeyError(f"no VM role {name!r}; roles: {list(names())}")
    return found
