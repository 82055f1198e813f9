"""Stacks made by earlier versions can still be destroyed and refreshed.

Pulumi stores each dynamic provider in the state with dill, by reference to its module, and
hands Delete and Read the provider pickled in the OLD state. tests/fixtures/pickled_providers/
holds the providers as four versions pickled them (0fc82a2: before the SSH deployment's rename;
d228f76: before infra/ was laid out by concern; 678bbda: before its folders were layered; 32d218c:
the custom role id's provider added), made by make_fixture.py there. Every one must load in
today's tree and run Delete and Read; and every provider of today's tree must be in a fixture, so
that moving one fails here until its new path is recorded and the old one keeps a shim.
"""

from __future__ import annotations

import base64
import json
import pathlib
from typing import Any

import dill
import pytest

from infra.resources import role_id, ssh_deployment, tpu_node
from infra.vm import workloads_wheel
from tests.fixtures.pickled_providers import make_fixture
from tests.fixtures.sshd import Worker
from tests.infra.conftest import provider_props
from tests.infra.resources.test_tpu_node import PROPS
from tests.infra.tpu.test_placement import FakeTpu

FIXTURES = pathlib.Path(__file__).parents[2] / "fixtures" / "pickled_providers"
PICKLES = {
    (path.stem, name): text
    for path in sorted(FIXTURES.glob("*.json"))
    for name, text in json.loads(path.read_text())["providers"].items()
}
CURRENT = {
    tpu_node.TpuNodeProvider: "TPU node",
    ssh_deployment.SshDeploymentProvider: "SSH deployment",
    role_id.CustomRoleIdProvider: "custom role id",
}


def load(text: str) -> Any:
    return dill.loads(base64.b64decode(text))


def test_the_fixtures_cover_the_pre_relayout_paths() -> None:
    names = {name for _commit, name in PICKLES}
    assert {
        "infra.deployment.WorkloadDeploymentProvider",
        "infra.components.tpu_node.TpuNodeProvider",
        "infra.ssh_deployment.SshDeploymentProvider",
        "infra.resources.tpu_node.TpuNodeProvider",
        "infra.resources.ssh_deployment.SshDeploymentProvider",
    } <= names


@pytest.mark.parametrize(("commit", "name"), sorted(PICKLES))
def test_every_provider_ever_pickled_loads_as_todays_class(commit: str, name: str) -> None:
    provider = load(PICKLES[commit, name])
    assert type(provider) in CURRENT, f"{commit}: {name} loads as {type(provider)}"


def test_every_provider_of_todays_tree_is_in_a_fixture() -> None:
    """Moving or renaming a provider class changes the path Pulumi pickles. Record the new path
    (make_fixture.py) and keep an importable shim at the old one, which the fixtures above
    prove still loads."""
    recorded = {name for _commit, name in PICKLES}
    missing = sorted(set(make_fixture.providers()) - recorded)
    assert not missing, (
        f"providers not in tests/fixtures/pickled_providers: {missing}; run make_fixture.py "
        "and keep a shim at each old path"
    )


@pytest.mark.parametrize(
    ("commit", "name"), sorted(k for k in PICKLES if k[1].endswith("TpuNodeProvider"))
)
def test_an_old_tpu_node_provider_reads_and_deletes(
    commit: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeTpu()
    monkeypatch.setattr(tpu_node, "new_api", lambda: api)
    created = tpu_node.TpuNodeProvider().create(dict(PROPS))
    outs = created.outs or {}
    old = load(PICKLES[commit, name])
    assert (old.read(created.id, outs).outs or {})["state"] == "READY"
    old.delete(created.id, outs)
    assert api.nodes == {}
    assert old.read(created.id, outs).id == ""


@pytest.mark.sshd
@pytest.mark.parametrize(
    ("commit", "name"), sorted(k for k in PICKLES if "Deployment" in k[1].rsplit(".", 1)[1])
)
def test_an_old_deployment_provider_stops_the_job_on_delete(
    commit: str, name: str, worker: Worker, wheel: workloads_wheel.Wheel
) -> None:
    """`pulumi destroy` of a stack deployed by an earlier version: its pickled provider stops
    and removes the units on a real worker (sshd), as today's does."""
    props = provider_props(str(worker.root), wheel, worker.access, [worker.host])
    created = ssh_deployment.SshDeploymentProvider().create(props)
    assert (worker.root / "etc/systemd/system/gemma4-train.service").exists()
    old = load(PICKLES[commit, name])
    assert old.read(created.id, created.outs or {}).id == created.id
    old.delete(created.id, created.outs or {})
    assert not list((worker.root / "etc/systemd/system").iterdir())


@pytest.mark.parametrize(
    ("commit", "name"), sorted(k for k in PICKLES if k[1].endswith("CustomRoleIdProvider"))
)
def test_an_old_custom_role_id_provider_keeps_its_id_and_deletes(commit: str, name: str) -> None:
    """A custom role's id stored by an earlier version: a new draw of the suffix is no change,
    and its delete (nothing in the cloud) runs."""
    outs = {"project": "p", "base": "gemma4SelfService_gemma4_dev", "suffix": "0123abcd"}
    old = load(PICKLES[commit, name])
    assert not old.diff(
        "gemma4SelfService_gemma4_dev_0123abcd", outs, outs | {"suffix": "f0"}
    ).changes
    old.delete("gemma4SelfService_gemma4_dev_0123abcd", outs)
