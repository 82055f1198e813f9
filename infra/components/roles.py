"""The TPU VMs a stack declares, one row per role: everything that differs between them.

The program (infra/program.py) declares a VM, its self-service grant and its deployment for every
row whose `declared` holds, in the order of ROLES; nothing else in infra spells a role's name
out. A third role is one more VmRole row here, plus what only it can say: its systemd units
(infra/vm/units.py plans them per role name) and its startup template (templates/startup/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from infra.components import boot_release
from infra.components import service_account as sa_mod
from infra.config import model as config_mod
from infra.vm import startup, units

# Run-config sections that only the serving VM reads. The training VM's copy leaves them out,
# so that a serving change (port, maxModelLen, eval or bench settings) keeps the training
# deployment's run-config hash and does not stop and restart a running training job.
SERVE_ONLY_SECTIONS = ("serve", "eval", "bench", "stop")


@dataclasses.dataclass(frozen=True)
class VmRole:
    """One TPU VM of the stack, as a row of functions of the validated stack config."""

    name: units.Role
    """Short name: resource names (`<name>`, `<name>-deploy`), the `role` label, the units'
    role, `python -m infra.ops --vm <name>`, the `<name>WorkerIps` style outputs."""
    noun: str
    """What the slice does, in descriptions ("a gemma4-tpu <noun> slice")."""
    section: Callable[[config_mod.StackConfig], config_mod.SliceStackSection]
    """The stack-config section that sizes and places it (accelerator, zones, provisioning)."""
    node_name: Callable[[config_mod.StackConfig], str]
    declared: Callable[[config_mod.StackConfig, bool], bool]
    """(config, the run released its training node) -> whether the stack has this VM now."""
    tags: Callable[[config_mod.StackConfig], tuple[str, ...]]
    """Network tags: which firewall rules reach it."""
    startup_script: Callable[[config_mod.StackConfig, bool], str]
    """(config, the stack stores a Hugging Face token) -> the rendered startup script."""
    self_service: Callable[[config_mod.StackConfig], tuple[str, ...]]
    """Permissions the VM needs on its own node (giving it back, stopping it)."""
    leaves_out: tuple[str, ...]
    """Run-config sections its copy of the run config leaves out (a change there does not
    redeploy it)."""


def _train_permissions(cfg: config_mod.StackConfig) -> tuple[str, ...]:
    # The training VM deletes its own node when the run is done (workloads release).
    return tuple(sa_mod.RELEASE_PERMISSIONS) if cfg.training.release_when_done else ()


def _serve_permissions(cfg: config_mod.StackConfig) -> tuple[str, ...]:
    # The serving VM stops its own node after its time limit.
    return tuple(sa_mod.STOP_PERMISSIONS) if cfg.serving.stop_after_hours is not None else ()


ROLES: tuple[VmRole, ...] = (
    VmRole(
        name="train",
        noun="training",
        section=lambda cfg: cfg.training,
        node_name=lambda cfg: cfg.training_node_name,
        declared=lambda _cfg, released: not released,
        tags=lambda cfg: (cfg.ssh_tag,),
        startup_script=lambda cfg, hf: startup.render_train(
            cfg,
            has_hf_secret=hf,
            release=boot_release.startup_context(cfg, cfg.training_node_name),
        ),
        self_service=_train_permissions,
        leaves_out=SERVE_ONLY_SECTIONS,
    ),
    VmRole(
        name="serve",
        noun="serving",
        section=lambda cfg: cfg.serving,
        node_name=lambda cfg: cfg.serving_node_name,
        declared=lambda cfg, _released: cfg.serving.enabled,
        tags=lambda cfg: (cfg.ssh_tag, cfg.api_tag),
        startup_script=lambda cfg, _hf: startup.render_serve(cfg),
        self_service=_serve_permissions,
        leaves_out=("release",),
    ),
)


def role(name: str) -> VmRole:
    """The row of role `name`.

    Raises:
        KeyError: no such role.
    """
    for row in ROLES:
        if row.name == name:
            return row
    raise KeyError(f"no VM role {name!r}; roles: {[r.name for r in ROLES]}")
