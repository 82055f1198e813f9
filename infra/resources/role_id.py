"""A custom role's id that no deletion can block: `<base>_<suffix>`, the suffix drawn anew
each time the role comes into being and kept for as long as it lives.

Why: GCP keeps a deleted custom role for 7 days and then refuses its id for 30 more ("You can't
create a role_id (...) which has been marked for deletion"). A fixed id made `pulumi destroy`
then `pulumi up` with the same namePrefix fail for 37 days, and so did turning
training.releaseWhenDone or serving.stopAfterHours off and on again (which deletes the
self-service role and creates it again).

How: the program draws a fresh random suffix on every run and gives it to this resource; the
resource keeps the suffix of its own creation (its diff ignores later draws, so Pulumi keeps
the stored outputs) and is replaced only when the base or the project changes. A role that
disappears from the program (destroy, a toggle) takes its CustomRoleId with it, so the next
role of that base is a new resource with a new suffix. Why not Pulumi's auto-naming: role_id
has none; why not pulumi_random: it is not installed, and a new provider plugin is one more
download on every machine that runs `pulumi up`, including the recovery controller.

Under Pulumi's mocks the outputs echo the inputs, so a run's suffix is its own draw: two runs
(a destroy and an up) give two ids, which is what tests/infra/resources/test_role_id.py checks.

Pulumi pickles this provider by module path (infra/resources/): never move it without a shim
(tests/infra/resources/test_pickled_providers.py).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import pulumi
import pulumi.dynamic

from infra.resources import dynamic_values

# What GCP accepts as a custom role's id.
ROLE_ID = re.compile(r"[A-Za-z0-9_.]{3,64}")
SUFFIX_BYTES = 4  # 8 hex digits: two draws of one base meet once in ~4 billion


class CustomRoleIdInputs(dynamic_values.ProviderState):
    """The role's project, its id without the suffix, and this run's draw of the suffix."""

    project: str
    base: str
    suffix: str


def draw_suffix() -> str:
    """A fresh suffix: what a role created by this run is called after its base."""
    return secrets.token_hex(SUFFIX_BYTES)


def role_id(base: str, suffix: str) -> str:
    """`<base>_<suffix>`, checked against GCP's rule for custom role ids.

    Raises:
        ValueError: not a valid role id (one line naming it and the rule).
    """
    rid = f"{base}_{suffix}"
    if not ROLE_ID.fullmatch(rid):
        raise ValueError(
            f"custom role id {rid!r}: must be 3-64 characters of letters, digits, '_' and '.'"
        )
    return rid


class CustomRoleIdProvider(pulumi.dynamic.ResourceProvider):
    """create keeps the run's suffix; diff replaces only for a new base or project; delete has
    nothing to do (the role itself is deleted by its IAMCustomRole)."""

    serialize_as_secret_always = False

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        # A later run's draw of the suffix is never a change: the id stays the one created.
        replaces = [k for k in ("project", "base") if olds.get(k) != news.get(k)]
        return pulumi.dynamic.DiffResult(
            changes=bool(replaces),
            replaces=replaces,
            stables=[] if replaces else ["project", "base", "suffix"],
            delete_before_replace=False,
        )

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        inputs = CustomRoleIdInputs.model_validate(props)
        rid = role_id(inputs.base, inputs.suffix)
        return pulumi.dynamic.CreateResult(id_=rid, outs=inputs.props())

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        return None


MODULE, NAME = "gemma4", "CustomRoleId"
TYPE = f"pulumi-python:dynamic/{MODULE}:{NAME}"


class CustomRoleId(pulumi.dynamic.Resource, module=MODULE, name=NAME):
    """The id of one custom role: `id` is `<base>_<suffix>` from its creation on.

    Outputs:
        suffix: the suffix drawn when it was created.
    """

    base: pulumi.Output[str]
    suffix: pulumi.Output[str]
    role_id: pulumi.Output[str]

    def __init__(
        self,
        name: str,
        project: str,
        base: str,
        opts: pulumi.ResourceOptions | None = None,
        *,
        suffix: str | None = None,
    ) -> None:
        inputs = CustomRoleIdInputs(project=project, base=base, suffix=suffix or draw_suffix())
        role_id(base, inputs.suffix)  # a base too long for GCP fails here, at `pulumi preview`
        super().__init__(CustomRoleIdProvider(), name, inputs.props(), opts)
        # From the outputs: after its creation these hold the stored suffix, not this run's.
        self.role_id = pulumi.Output.all(self.base, self.suffix).apply(lambda p: role_id(*p))
