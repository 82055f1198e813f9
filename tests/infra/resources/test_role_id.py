"""Custom role ids that survive their own deletion (infra/resources/role_id.py).

GCP refuses a deleted custom role's id for 37 days. The program's runs are recorded under
Pulumi's mocks and replayed against a small stand-in of the engine's state: a CustomRoleId the
state already holds goes through the provider's diff (no change: the stored outputs stay, as in
Pulumi's "same" step), a new one through its create, and one the program no longer declares
leaves the state (deleted). Sequences: a re-run keeps the id; destroy then up, and
releaseWhenDone off then on, give a new id.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from infra.ops import release_record
from infra.resources import role_id as role_id_mod
from tests.fixtures import pulumi_mocks

TOKEN = "hf_TEST_SECRET_3f9a1c7e5b2d4068a1b2c3d4e5f60718"
CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"
PROJECT_IAM = "gcp:projects/iAMMember:IAMMember"
PROVIDER = role_id_mod.CustomRoleIdProvider()
State = dict[str, dict[str, Any]]


def up(state: State, rec: pulumi_mocks.Recording) -> State:
    """The CustomRoleId state after `pulumi up` of the recorded program on `state`."""
    after: State = {}
    for r in rec.of_type(role_id_mod.TYPE):
        news = {k: v for k, v in r.inputs.items() if k != "__provider"}
        old = state.get(r.urn)
        if old is not None and not PROVIDER.diff("id", old, news).changes:
            after[r.urn] = old
        else:
            after[r.urn] = dict(PROVIDER.create(news).outs or {})
    return after


def ids(state: State) -> list[str]:
    return sorted(role_id_mod.role_id(o["base"], o["suffix"]) for o in state.values())


def run(monkeypatch: pytest.MonkeyPatch, *, release: bool) -> pulumi_mocks.Recording:
    monkeypatch.setattr(release_record.storage, "exists", lambda _uri: False)
    mapping = pulumi_mocks.with_key(
        pulumi_mocks.stack_file_config("dev"), "training.releaseWhenDone", release
    )
    return pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN)


def test_the_role_is_named_after_the_suffix_of_its_creation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = run(monkeypatch, release=True)
    (rid,) = rec.of_type(role_id_mod.TYPE)
    assert rid.inputs["base"] == "gemma4SelfService_gemma4_dev"
    assert re.fullmatch(r"[0-9a-f]{8}", rid.inputs["suffix"])
    role = rec.one(CUSTOM_ROLE).inputs
    assert role["roleId"] == f"gemma4SelfService_gemma4_dev_{rid.inputs['suffix']}"
    member = next(r for r in rec.of_type(PROJECT_IAM) if "/roles/" in r.inputs["role"])
    assert member.inputs["role"] == f"projects/{role['project']}/roles/{role['roleId']}"


def test_a_re_run_keeps_the_id_and_destroy_then_up_gets_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = up({}, run(monkeypatch, release=True))
    again = up(first, run(monkeypatch, release=True))
    assert ids(again) == ids(first)  # the new run's draw is not a change
    after_destroy = up({}, run(monkeypatch, release=True))  # destroy empties the state
    assert len(ids(after_destroy)) == 1 and ids(after_destroy) != ids(first)
    assert ids(after_destroy)[0].startswith("gemma4SelfService_gemma4_dev_")


def test_turning_release_when_done_off_and_on_gets_a_new_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on = up({}, run(monkeypatch, release=True))
    off = up(on, run(monkeypatch, release=False))
    assert off == {}  # the role and its id go; GCP keeps the deleted id for 37 days
    on_again = up(off, run(monkeypatch, release=True))
    assert len(ids(on_again)) == 1 and ids(on_again) != ids(on)


def test_the_provider_replaces_only_for_a_new_base_or_project() -> None:
    olds = {"project": "p", "base": "gemma4SelfService_x", "suffix": "0123abcd"}
    created = PROVIDER.create(olds)
    assert created.id == "gemma4SelfService_x_0123abcd" and created.outs == olds
    redraw = PROVIDER.diff("id", olds, {**olds, "suffix": "ffff0000"})
    assert not redraw.changes and not redraw.replaces
    for key, value in (("base", "gemma4SelfService_y"), ("project", "q")):
        diff = PROVIDER.diff("id", olds, {**olds, key: value})
        assert diff.changes and diff.replaces == [key]
    PROVIDER.delete("gemma4SelfService_x_0123abcd", olds)  # nothing to do in the cloud


def test_a_role_id_gcp_would_refuse_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"custom role id 'x{60}_0123abcd': must be 3-64"):
        role_id_mod.role_id("x" * 60, "0123abcd")
    # The longest base the program makes (namePrefix has at most 20 characters) fits.
    assert role_id_mod.role_id("gemma4SelfService_" + "a" * 20, role_id_mod.draw_suffix())
