"""The Pulumi program under mocks: the resources it declares for the dev and prod stacks.

Every assertion runs in plain Python on what the mock monitor recorded after the Pulumi runtime
finished (never inside `apply`), and `CHECKED` counts the checks that ran so that a silently
skipped block would fail `test_all_checks_ran`.
"""

from __future__ import annotations

import collections
import json

import pulumi
import pytest

from infra.components import boot_release
from infra.components import bucket as bucket_mod
from infra.components import service_account as sa_mod
from infra.config import model as config
from infra.config import stack_config
from infra.vm import roles, startup
from tests.fixtures import pulumi_mocks
from workloads.contract import catalog

TOKEN = "hf_TEST_SECRET_3f9a1c7e5b2d4068a1b2c3d4e5f60718"

TPU = pulumi_mocks.TPU_NODE
BUCKET = "gcp:storage/bucket:Bucket"
BUCKET_IAM = "gcp:storage/bucketIAMMember:BucketIAMMember"
ACCOUNT = "gcp:serviceaccount/account:Account"
PROJECT_IAM = "gcp:projects/iAMMember:IAMMember"
SECRET = "gcp:secretmanager/secret:Secret"
SECRET_VERSION = "gcp:secretmanager/secretVersion:SecretVersion"
SECRET_IAM = "gcp:secretmanager/secretIamMember:SecretIamMember"
FIREWALL = "gcp:compute/firewall:Firewall"
SERVICE = "gcp:projects/service:Service"

DEPLOYMENT = "pulumi-python:dynamic/gemma4:SshDeployment"

RECORD = "gcp:storage/bucketObject:BucketObject"
EXPECTED_COUNTS = {
    "dev": {
        TPU: 1,
        BUCKET: 1,
        BUCKET_IAM: 2,
        ACCOUNT: 1,
        PROJECT_IAM: 2,
        SECRET: 1,
        SECRET_VERSION: 1,
        SECRET_IAM: 1,
        FIREWALL: 1,
        SERVICE: 5,
        DEPLOYMENT: 1,
        # The training node's create request (infra/tpu/record.py) and the release it
        # installs at boot (infra/components/boot_release.py), for recovery.
        RECORD: 2,
    },
    "prod": {
        TPU: 2,
        BUCKET: 2,
        BUCKET_IAM: 4,
        ACCOUNT: 1,
        PROJECT_IAM: 2,
        SECRET: 1,
        SECRET_VERSION: 1,
        SECRET_IAM: 1,
        FIREWALL: 1,
        SERVICE: 5,
        DEPLOYMENT: 2,
        RECORD: 3,
    },
}

CHECKED: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", params=["dev", "prod"])
def run(request):
    stack = request.param
    mapping = pulumi_mocks.stack_file_config(stack)
    recording = pulumi_mocks.run_program(stack, mapping, hf_token=TOKEN)
    cfg = stack_config.parse_stack_config(mapping)
    return stack, cfg, recording


def test_resource_types_and_counts(run):
    stack, _, rec = run
    counts = collections.Counter(r.type for r in rec.resources if r.custom)
    assert dict(counts) == EXPECTED_COUNTS[stack]
    components = collections.Counter(r.type for r in rec.resources if not r.custom)
    assert components["gemma4-tpu:infra:TpuVm"] == EXPECTED_COUNTS[stack][TPU]
    CHECKED["counts"] += 1


def test_every_cloud_resource_is_the_child_of_a_component(run):
    _, cfg, rec = run
    for r in rec.resources:
        if r.custom:
            assert "$gemma4-tpu:infra:" in r.parent, (r.type, r.parent)
        if "project" in r.inputs:
            assert r.inputs["project"] == cfg.project, r.name
    CHECKED["parents"] += 1


def test_tpu_vms(run):
    stack, cfg, rec = run
    account = rec.one(ACCOUNT)
    email = f"{account.inputs['accountId']}@{cfg.project}.iam.gserviceaccount.com"
    train = rec.one(TPU, "train-node")
    expected = {
        "train-node": (
            "v5p-8",
            "v2-alpha-tpuv5",
            "us-central1-a",
            {"spot": True},
            cfg.training_node_name,
        ),
    }
    if stack == "prod":
        expected["serve-node"] = (
            "v6e-8",
            "v2-alpha-tpuv6e",
            "asia-northeast1-b",
            {"spot": True},
            cfg.serving_node_name,
        )
    assert {r.name for r in rec.of_type(TPU)} == set(expected)
    for name, (acc, runtime, zone, scheduling, node_name) in expected.items():
        vm = rec.one(TPU, name)
        i = vm.inputs
        assert (i["accelerator_type"], i["runtime_version"], i["zones"][0], i["node_id"]) == (
            acc,
            runtime,
            zone,
            node_name,
        )
        assert i["project"] == cfg.project and i.get("queue") is None
        assert i["scheduling_config"] == scheduling
        assert i["service_account"] == {
            "email": email,
            "scope": ["https://www.googleapis.com/auth/cloud-platform"],
        }
        assert i["network_config"]["enable_external_ips"] is True
        assert i["metadata"]["startup-script"].startswith("#!/bin/bash\n")
        assert i["metadata"]["ssh-keys"] == f"gemma4:{pulumi_mocks.FAKE_PUBLIC_KEY}"
        assert cfg.ssh_tag in i["tags"]
        assert i["labels"]["app"] == "gemma4-tpu" and i["labels"]["stack"] == stack
    assert train.inputs["metadata"]["startup-script"] == startup.render_train(
        cfg,
        roles.TRAIN,
        has_hf_secret=True,
        release=boot_release.startup_context(cfg, cfg.training_node_name),
    )
    if stack == "prod":
        serve = rec.one(TPU, "serve-node")
        assert serve.inputs["metadata"]["startup-script"] == startup.render_serve(cfg, roles.SERVE)
        # The serving slice is placed in the first of its zone and fallbacks with capacity.
        assert serve.inputs["zones"] == [cfg.serving.zone, *cfg.serving.zone_fallbacks]
        assert cfg.api_tag in serve.inputs["tags"]
    CHECKED["tpu"] += 1


def test_ssh_firewall(run):
    _, cfg, rec = run
    rule = rec.one(FIREWALL).inputs
    assert rule["direction"] == "INGRESS"
    assert rule["sourceRanges"] == list(cfg.ssh.source_ranges)
    assert "0.0.0.0/0" not in rule["sourceRanges"]
    assert rule["targetTags"] == [cfg.ssh_tag]
    assert rule["allows"] == [{"protocol": "tcp", "ports": ["22"]}]
    # The rule applies to every VM (their tags carry its target tag), and to nothing untagged.
    for vm in rec.of_type(TPU):
        assert set(rule["targetTags"]) <= set(vm.inputs["tags"])
    CHECKED["firewall"] += 1


def test_buckets(run):
    stack, cfg, rec = run
    buckets = {r.inputs["name"]: r for r in rec.of_type(BUCKET)}
    expected = {cfg.training_bucket_name: "US-CENTRAL1"}
    if stack == "prod":
        expected[cfg.serving_bucket_name] = "ASIA-NORTHEAST1"
    assert {name: b.inputs["location"] for name, b in buckets.items()} == expected
    for b in buckets.values():
        i = b.inputs
        assert i["uniformBucketLevelAccess"] is True
        assert i["publicAccessPrevention"] == "enforced"
        assert i["versioning"] == {"enabled": True}
        assert i["forceDestroy"] is False
        assert b.retain_on_delete is True  # storage.keepOnDestroy: destroy keeps the data
        assert b.protect is False
        rules = {json.dumps(r, sort_keys=True) for r in i["lifecycleRules"]}
        scratch = {
            "action": {"type": "Delete"},
            "condition": {
                "age": float(cfg.storage.scratch_days),
                "matchesPrefixes": ["compile-cache/", "tmp/"],
            },
        }
        noncurrent = {
            "action": {"type": "Delete"},
            "condition": {"daysSinceNoncurrentTime": 30.0, "withState": "ARCHIVED"},
        }
        assert json.dumps(scratch, sort_keys=True) in rules
        assert json.dumps(noncurrent, sort_keys=True) in rules
    CHECKED["buckets"] += 1


def test_iam_is_least_privilege(run):
    _, cfg, rec = run
    account = rec.one(ACCOUNT).inputs
    member = f"serviceAccount:{account['accountId']}@{cfg.project}.iam.gserviceaccount.com"
    grants = rec.of_type(BUCKET_IAM) + rec.of_type(PROJECT_IAM) + rec.of_type(SECRET_IAM)
    assert grants
    for grant in grants:
        assert grant.inputs["member"] == member
        assert grant.inputs["role"] not in {"roles/editor", "roles/owner", "roles/storage.admin"}
    for grant in rec.of_type(PROJECT_IAM):
        assert not grant.inputs["role"].lower().endswith("admin"), grant.inputs["role"]
    assert {g.inputs["role"] for g in rec.of_type(PROJECT_IAM)} == set(sa_mod.PROJECT_ROLES)
    bucket_grants = collections.defaultdict(set)
    for g in rec.of_type(BUCKET_IAM):
        bucket_grants[g.inputs["bucket"]].add(g.inputs["role"])
    expected_buckets = {cfg.training_bucket_name, cfg.serving_bucket_name}
    assert dict(bucket_grants) == {b: set(bucket_mod.OBJECT_ROLES) for b in expected_buckets}
    (secret_grant,) = rec.of_type(SECRET_IAM)
    assert secret_grant.inputs["role"] == "roles/secretmanager.secretAccessor"
    assert secret_grant.inputs["secretId"] == cfg.hf_secret_id
    # No other kind of IAM resource exists (no project-wide binding or policy).
    assert not [
        r
        for r in rec.resources
        if "iam" in r.type.lower() and r.type not in {BUCKET_IAM, PROJECT_IAM, SECRET_IAM}
    ]
    CHECKED["iam"] += 1


def test_stack_outputs(run):
    stack, cfg, rec = run
    out = rec.outputs
    assert out["trainWorkerIps"] == [
        ip for ip in out["trainWorkerIps"] if ip.startswith("198.51.100.")
    ]
    assert len(out["trainWorkerIps"]) == 1
    assert out["trainSshCommands"] == [
        f"ssh -i ~/.ssh/id_ed25519 gemma4@{out['trainWorkerIps'][0]}"
    ]
    assert out["bucketUrls"]["training"] == f"gs://{cfg.training_bucket_name}"
    assert out["checkpointDir"].startswith(
        f"gs://{cfg.training_bucket_name}/checkpoints/{cfg.run_name}/"
    )
    assert out["tensorboardDir"].endswith("/tensorboard")
    if stack == "prod":
        assert out["servingEndpoint"] == f"http://{out['serveWorkerIps'][0]}:8000/v1"
        assert out["estimatedHourlyUsd"]["total"] == pytest.approx(16.80 + 21.52)
        assert out["bucketUrls"]["serving"] == f"gs://{cfg.serving_bucket_name}"
    else:
        assert "servingEndpoint" not in out
        assert out["estimatedHourlyUsd"]["total"] == pytest.approx(16.80)
    # The engine got the same outputs (what `pulumi stack output` shows).
    assert set(rec.raw_stack_outputs) == set(out)
    CHECKED["outputs"] += 1


def test_the_token_appears_only_as_the_secret_version_payload(run):
    _, _, rec = run
    carriers = []

    def walk(value, path, inside_secret):
        if isinstance(value, dict):
            secret = (
                value.get(pulumi.runtime.rpc._special_sig_key)
                == pulumi.runtime.rpc._special_secret_sig
            )
            for key, item in value.items():
                walk(item, f"{path}.{key}", inside_secret or secret)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", inside_secret)
        elif isinstance(value, str) and TOKEN in value:
            carriers.append((path, inside_secret))

    for r in rec.resources:
        walk(r.raw_inputs, f"{r.type}::{r.name}", False)
    assert carriers == [(f"{SECRET_VERSION}::hf-token-version.secretData.value", True)]
    assert TOKEN not in json.dumps(rec.raw_stack_outputs)
    assert TOKEN not in json.dumps(rec.outputs, default=str)
    assert TOKEN not in rec.program_result.run_config.to_yaml()
    CHECKED["secret"] += 1


def test_all_checks_ran(request):
    # Runs after the parametrized tests above (pytest keeps file order): every check block ran
    # to its end once per stack. A check skipped by an apply that never resolved shows up here.
    checks = [i for i in request.session.items if i.module is request.module and "[" in i.name]
    if len(checks) != 2 * 8:
        pytest.skip("only a selection of the stack checks was collected")
    assert {i.name.split("[")[0] for i in checks} == {
        "test_resource_types_and_counts",
        "test_every_cloud_resource_is_the_child_of_a_component",
        "test_tpu_vms",
        "test_ssh_firewall",
        "test_buckets",
        "test_iam_is_least_privilege",
        "test_stack_outputs",
        "test_the_token_appears_only_as_the_secret_version_payload",
    }
    expected = {"counts", "parents", "tpu", "firewall", "buckets", "iam", "outputs", "secret"}
    assert set(CHECKED) == expected
    assert set(CHECKED.values()) == {2}


def test_checks_see_wrong_expectations():
    # The recorded inputs are real data: a wrong expectation fails (it is not swallowed).
    rec = pulumi_mocks.run_program("dev", pulumi_mocks.stack_file_config("dev"), hf_token=TOKEN)
    vm = rec.one(TPU)
    with pytest.raises(AssertionError):
        assert vm.inputs["runtime_version"] == "tpu-ubuntu2204-base"


def test_invalid_config_fails_before_any_resource():
    mapping = pulumi_mocks.stack_file_config("prod")
    mapping["serving"] = {**mapping["serving"], "runtimeVersion": "tpu-ubuntu2204-base"}
    mapping["ssh"] = {**mapping["ssh"], "sourceRanges": ["0.0.0.0/0"]}
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN, recording=recording)
    message = str(info.value)
    assert "invalid (2 problem(s)); nothing was created" in message
    assert "serving.runtimeVersion: 'tpu-ubuntu2204-base': fails on v6e" in message
    assert "ssh.sourceRanges[0]: '0.0.0.0/0': open to the whole internet" in message
    assert recording.resources == []


def test_a_serving_image_without_gemma4_fails_before_any_resource():
    mapping = pulumi_mocks.stack_file_config("prod")
    mapping["serving"] = {**mapping["serving"], "image": "vllm/vllm-tpu:v0.18.0"}
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN, recording=recording)
    message = str(info.value)
    assert "invalid (1 problem(s)); nothing was created" in message
    line = next(x.strip() for x in message.splitlines() if "serving.image" in x)
    assert line.startswith(
        "serving.image: 'vllm/vllm-tpu:v0.18.0': v0.18.0 is too old for Gemma 4; it needs "
        f"vllm/vllm-tpu:v0.20.0 or a later release (default {catalog.VLLM_TPU_IMAGE})"
    )
    assert "Traceback" not in message
    assert recording.resources == []


def test_a_digest_pinned_serving_image_reaches_the_run_config_and_the_default_is_the_catalogs():
    assert stack_config.parse_stack_config(
        pulumi_mocks.stack_file_config("prod")
    ).serving.image == (catalog.VLLM_TPU_IMAGE)
    digest = "vllm/vllm-tpu@sha256:" + "ab" * 32
    mapping = pulumi_mocks.stack_file_config("prod")
    mapping["serving"] = {**mapping["serving"], "image": digest}
    rec = pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN)
    assert rec.program_result.run_config.serve.image == digest
    assert (
        f"readonly VLLM_IMAGE={digest}"
        in rec.one(TPU, "serve-node").inputs["metadata"]["startup-script"]
    )


def test_without_token_no_secret_and_no_hub_download():
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["model"] = {"downloadFromHub": False}
    rec = pulumi_mocks.run_program("dev", mapping)
    assert not rec.of_type(SECRET) and not rec.of_type(SECRET_IAM)
    script = rec.one(TPU).inputs["metadata"]["startup-script"]
    assert "readonly DOWNLOAD_FROM_HUB=false" in script
    assert "readonly HF_SECRET=''" in script


def test_a_bench_shape_beyond_the_context_fails_before_any_resource():
    # `pulumi preview`'s path: the stack's own sweep shape is named, not the context it exceeds.
    mapping = pulumi_mocks.stack_file_config("prod")
    mapping["serving"] = {**mapping["serving"], "bench": {"shapes": [[16000, 512]]}}
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN, recording=recording)
    message = str(info.value)
    assert "invalid (1 problem(s)); nothing was created" in message
    line = next(x.strip() for x in message.splitlines() if "serving.bench" in x)
    assert line == (
        "serving.bench.shapes[0]: [16000, 512]: input + output = 16512 tokens, beyond "
        "serving.maxModelLen 16384; shorten it, raise serving.maxModelLen to 16512 or set "
        "serving.bench.enabled false"
    )
    assert "Traceback" not in message
    assert recording.resources == []


def test_missing_public_key_is_a_config_error(tmp_path):
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["ssh"] = {"sourceRanges": ["198.51.100.7/32"], "privateKeyFile": str(tmp_path / "none")}
    with pytest.raises(
        pulumi.RunError, match=r"ssh.publicKey: not set: and .*none.pub does not exist"
    ):
        pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN)
    (tmp_path / "id.pub").write_text(pulumi_mocks.FAKE_PUBLIC_KEY + "\n")
    mapping["ssh"]["privateKeyFile"] = str(tmp_path / "id")
    rec = pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN)
    assert rec.one(TPU).inputs["metadata"]["ssh-keys"] == f"gemma4:{pulumi_mocks.FAKE_PUBLIC_KEY}"


def test_ssh_agent_identity_when_no_key_file_is_configured():
    # ssh.privateKeyFile: null = the keys of ssh-agent: no `-i` anywhere, no key path deployed.
    mapping = pulumi_mocks.stack_file_config("prod")
    mapping["ssh"] = {**mapping["ssh"], "privateKeyFile": None}
    rec = pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN)
    out = rec.outputs
    assert out["trainSshCommands"] == [f"ssh gemma4@{out['trainWorkerIps'][0]}"]
    ip = out["serveWorkerIps"][0]
    assert out["servingTunnelCommand"] == f"ssh -N -L 8000:127.0.0.1:8000 gemma4@{ip}"
    for dep in rec.of_type("pulumi-python:dynamic/gemma4:SshDeployment"):
        assert (
            "ssh_key_path" not in dep.inputs
        )  # each machine finds its own (infra.resources.ssh_access)
    assert rec.one(TPU, "train-node").inputs["metadata"]["ssh-keys"] == (
        f"gemma4:{pulumi_mocks.FAKE_PUBLIC_KEY}"
    )


def test_keep_and_protect_follow_the_config():
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["storage"] = {"keepOnDestroy": False, "protect": True, "importExisting": True}
    rec = pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN)
    bucket = rec.one(BUCKET)
    assert (bucket.retain_on_delete, bucket.protect) == (False, True)
    assert bucket.import_id == f"{config.PLACEHOLDER_PROJECT}/{bucket.inputs['name']}"


def test_api_firewall_when_ranges_are_given():
    mapping = pulumi_mocks.stack_file_config("prod")
    mapping["serving"] = {**mapping["serving"], "apiSourceRanges": ["198.51.100.0/28"]}
    rec = pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN)
    rules = {r.inputs["name"]: r.inputs for r in rec.of_type(FIREWALL)}
    api = rules["gemma4-prod-allow-api"]
    assert api["allows"] == [{"protocol": "tcp", "ports": ["8000"]}]
    assert api["sourceRanges"] == ["198.51.100.0/28"]
    assert api["targetTags"] == ["gemma4-prod-api"]
    assert "gemma4-prod-api" not in rec.one(TPU, "train-node").inputs["tags"]


def test_the_service_account_refuses_broad_project_roles():
    # Not parametrized: test_all_checks_ran counts this module's parametrized items.
    pulumi.runtime.set_mocks(pulumi_mocks.RecordingMocks(), project="gemma4-tpu", stack="dev")
    assert sa_mod.forbidden_project_roles(sa_mod.PROJECT_ROLES) == []
    for role in ("roles/editor", "roles/owner", "roles/storage.admin", "roles/secretmanager.admin"):
        assert sa_mod.forbidden_project_roles((*sa_mod.PROJECT_ROLES, role)) == [role]
        args = sa_mod.ServiceAccountArgs(
            project="my-project-1",
            account_id="gemma4-tpu-vm",
            display_name="test",
            project_roles=(*sa_mod.PROJECT_ROLES, role),
        )
        with pytest.raises(ValueError, match=rf"project_roles: \['{role}'\]: never granted"):
            sa_mod.VmServiceAccount("vm-sa", args)


CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"


def _release_stack(monkeypatch, record: dict | None):
    """The dev stack with training.releaseWhenDone, and the run's release record (None: the run
    has not released its node yet) as the bucket would answer."""
    from infra.ops import release_record

    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["training"] = {**mapping["training"], "releaseWhenDone": True}
    seen = []

    def exists(uri: str) -> bool:
        seen.append(uri)
        return record is not None

    monkeypatch.setattr(release_record.storage, "exists", exists)
    monkeypatch.setattr(release_record.storage, "read_text", lambda uri: json.dumps(record))
    return pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN), seen


def test_release_when_done_grants_only_self_deletion_and_tells_the_vm(monkeypatch):
    rec, seen = _release_stack(monkeypatch, None)
    bucket = rec.one(BUCKET).inputs["name"]
    run_name = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev")).run_name
    assert seen == [f"gs://{bucket}/checkpoints/{run_name}/released.json"]
    role = rec.one(CUSTOM_ROLE)
    assert sorted(role.inputs["permissions"]) == [
        "tpu.nodes.delete",
        "tpu.nodes.get",
        "tpu.operations.get",
    ]
    member = next(
        r for r in rec.of_type(PROJECT_IAM) if "roles/gemma4SelfService_" in r.inputs["role"]
    )
    assert member.inputs["member"].startswith("serviceAccount:")
    assert len(rec.of_type(TPU)) == 1
    run_yaml = rec.one(DEPLOYMENT).inputs["run_config_yaml"]
    assert "release:" in run_yaml and "released.json" in run_yaml
    assert "gemma4-release.service" in rec.one(DEPLOYMENT).inputs["units"]


def test_a_released_run_leaves_its_training_node_out(monkeypatch):
    record = {"run_name": "codev-smoke", "node": "gemma4-dev-train", "released_at": "2026-11-25"}
    rec, _ = _release_stack(monkeypatch, record)
    assert rec.of_type(TPU) == [] and rec.of_type(DEPLOYMENT) == []
    assert rec.of_type(CUSTOM_ROLE) == []  # nothing left to delete
    assert rec.outputs["trainReleased"]["released_at"] == "2026-11-25"
    assert "trainWorkerIps" not in rec.outputs and rec.outputs["deployments"] == {}
    assert len(rec.of_type(BUCKET)) == 1  # the data stays


def test_a_serving_time_limit_grants_only_self_stop(monkeypatch):
    mapping = pulumi_mocks.stack_file_config("prod")
    # Only an on-demand node can be stopped (a spot or preemptible one is deleted instead).
    mapping["serving"] = {**mapping["serving"], "stopAfterHours": 8, "provisioning": "on-demand"}
    rec = pulumi_mocks.run_program("prod", mapping, hf_token=TOKEN)
    assert sorted(rec.one(CUSTOM_ROLE).inputs["permissions"]) == [
        "tpu.nodes.get",
        "tpu.nodes.stop",
        "tpu.operations.get",
    ]
    serve = next(d for d in rec.of_type(DEPLOYMENT) if "serve" in d.name)
    assert "gemma4-serve-stop.timer" in serve.inputs["units"]
    assert "OnBootSec=28800s" in serve.inputs["units"]["gemma4-serve-stop.timer"]
    # Each VM's run config leaves the other's sections out (no redeploy for the other's change).
    train = next(d for d in rec.of_type(DEPLOYMENT) if "train" in d.name)
    assert "\nstop: null\n" in train.inputs["run_config_yaml"]
    assert "\nstop:\n" in serve.inputs["run_config_yaml"]
    # Without a limit (the checked-in prod stack) there is no role at all.
    plain = pulumi_mocks.run_program("prod", pulumi_mocks.stack_file_config("prod"), hf_token=TOKEN)
    assert plain.of_type(CUSTOM_ROLE) == []


def test_a_queued_stack_with_fallback_zones_reports_where_the_node_was_placed():
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["training"] = {
        **mapping["training"],
        "provisioning": "queued",
        "queue": {"capacity": "on-demand", "validForHours": 6},
        "zoneFallbacks": ["us-east5-a", "europe-west4-b"],
    }
    cfg = stack_config.parse_stack_config(mapping)
    rec = pulumi_mocks.run_program(
        "dev", mapping, hf_token=TOKEN, placed_in={cfg.training_node_name: "us-east5-a"}
    )
    node = rec.one(TPU, "train-node").inputs
    assert node["zones"] == ["us-central1-a", "us-east5-a", "europe-west4-b"]
    assert node["queue"] == {"spot": False, "valid_for_s": 6 * 3600}
    # The queued resource says on-demand or spot; the node itself carries no scheduling.
    assert node.get("scheduling_config") is None
    # The zone it got, not the first one asked for, is what the outputs and ops read.
    assert rec.outputs["trainZone"] == "us-east5-a"
    assert rec.outputs["trainPlacement"] == {
        "zone": "us-east5-a",
        "queuedResource": None,
        "refusedZones": [],
    }
    assert rec.outputs["deployments"]["train"]["zone"] == "us-east5-a"
    # Where infra.ops status/cost look for the stack's TPUs the state does not hold.
    assert rec.outputs["tpuScope"] == {
        "project": cfg.project,
        "zones": ["us-central1-a", "us-east5-a", "europe-west4-b"],
        "labels": {"app": "gemma4-tpu", "stack": "dev"},
    }
    # The bucket stays in the first zone's region.
    assert rec.one(BUCKET).inputs["location"] == "US-CENTRAL1"
