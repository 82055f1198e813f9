"""The recovery controller: what the stack declares for it under Pulumi mocks (identity, grants,
source, VM, the recorded request it recreates the node from), the one-line errors of its config,
its source archive, and the service wrapper its startup script writes, run with fake gcloud and
python."""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import tarfile
import zlib
from typing import Any

import pulumi
import pytest

from infra.components import recovery as recovery_mod
from infra.config import stack_config
from infra.vm import source_archive
from tests.fixtures import pulumi_mocks

TOKEN = "hf_TEST_SECRET_3f9a1c7e5b2d4068a1b2c3d4e5f60718"
SSH_KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\nTESTKEYb3BlbnNzaC1rZXktdjE\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)
PASSPHRASE = "correct-horse-battery-staple-7f3a"
BACKEND = "gs://acme-pulumi-state/gemma4"
RECORD = "gs://acme-gemma4-dev-us-central1/recovery/gemma4-dev-train.json"


def controller_args(**overrides: Any) -> recovery_mod.RecoveryArgs:
    """The recovery controller of an example dev stack (the rendered script's inputs)."""
    values: dict[str, Any] = {
        "project": "acme",
        "stack": "dev",
        "prefix": "gemma4-dev",
        "zone": "us-central1-a",
        "machine_type": "e2-micro",
        "network": "default",
        "subnetwork": None,
        "training_bucket": "acme-gemma4-dev-us-central1",
        "record_uri": RECORD,
        "vm_service_account": "projects/acme/serviceAccounts/vm@acme.iam.gserviceaccount.com",
        "interval_s": 90,
        "labels": {},
    }
    return recovery_mod.RecoveryArgs(**(values | overrides))


INSTANCE = "gcp:compute/instance:Instance"
ADDRESS = "gcp:compute/address:Address"
CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"
PROJECT_IAM = "gcp:projects/iAMMember:IAMMember"
SA_IAM = "gcp:serviceaccount/iAMMember:IAMMember"
BUCKET_IAM = "gcp:storage/bucketIAMMember:BucketIAMMember"
SECRET = "gcp:secretmanager/secret:Secret"
SECRET_IAM = "gcp:secretmanager/secretIamMember:SecretIamMember"
OBJECT = "gcp:storage/bucketObject:BucketObject"
FIREWALL = "gcp:compute/firewall:Firewall"
TPU_NODE = "pulumi-python:dynamic/gemma4:TpuNode"


def _mapping(**recovery: object) -> dict:
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["recovery"] = {"enabled": True, **recovery}
    return mapping


def _run(mapping: dict, secrets: dict[str, str] | None = None) -> pulumi_mocks.Recording:
    return pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN, secrets=secrets or {})


def _source(rec: pulumi_mocks.Recording) -> Any:
    return next(r for r in rec.of_type(OBJECT) if r.inputs["name"].startswith("recovery/source-"))


@pytest.fixture(scope="module")
def rec() -> pulumi_mocks.Recording:
    return _run(_mapping())


def test_the_controller_is_a_small_vm_with_its_own_identity(rec) -> None:
    cfg = stack_config.parse_stack_config(_mapping())
    vm = rec.one(INSTANCE).inputs
    # e2-small by default: a recovery's `pulumi up` (program, provider, watch, engine, plugin)
    # leaves an e2-micro's 1 GB little room.
    assert vm["machineType"] == "e2-small" and vm["zone"] == cfg.training.zone
    assert vm["name"] == f"{cfg.name_prefix}-recover"
    assert vm["bootDisk"]["initializeParams"]["image"] == "debian-cloud/debian-12"
    assert vm["serviceAccount"]["email"].startswith(f"{cfg.name_prefix}-recover@")
    # An ephemeral external address (PyPI, Google's APIs): nothing lets it in anywhere, so no
    # reserved address is declared.
    assert vm["networkInterfaces"][0]["accessConfigs"] == [{}]
    assert rec.of_type(ADDRESS) == []
    # It starts watching at boot: its grants and the source exist first.
    instance = rec.one(INSTANCE)
    assert instance.parent.endswith("RecoveryController::recover")


def test_it_holds_only_what_recreating_a_node_needs(rec) -> None:
    cfg = stack_config.parse_stack_config(_mapping())
    roles = [r for r in rec.of_type(CUSTOM_ROLE) if r.inputs["roleId"].startswith("gemma4Recover")]
    assert len(roles) == 1
    # Cloud TPU's own names: queued resources are authorized by tpu.nodes.* (there is no
    # tpu.queuedResources.*, and IAM refuses a role that names one).
    assert sorted(roles[0].inputs["permissions"]) == [
        "tpu.nodes.create",
        "tpu.nodes.delete",
        "tpu.nodes.get",
        "tpu.nodes.list",
        "tpu.operations.get",
    ]
    recover_member = (
        f"serviceAccount:{cfg.name_prefix}-recover@{cfg.project}.iam.gserviceaccount.com"
    )
    project_roles = sorted(
        r.inputs["role"] for r in rec.of_type(PROJECT_IAM) if r.inputs["member"] == recover_member
    )
    # The role's id carries the suffix of its creation (infra/resources/role_id.py).
    role_id = roles[0].inputs["roleId"]
    assert re.fullmatch(f"gemma4Recover_{cfg.name_prefix.replace('-', '_')}_[0-9a-f]{{8}}", role_id)
    assert project_roles == [f"projects/{cfg.project}/roles/{role_id}", "roles/logging.logWriter"]
    act_as = rec.one(SA_IAM).inputs
    assert act_as["role"] == "roles/iam.serviceAccountUser"
    assert act_as["serviceAccountId"].endswith(
        f"/{cfg.service_account_id}@{cfg.project}.iam.gserviceaccount.com"
    )
    bucket_grants = {
        (r.inputs["bucket"], r.inputs["role"])
        for r in rec.of_type(BUCKET_IAM)
        if r.inputs["member"] == recover_member
    }
    # Reads of the training bucket only: no state bucket, no write anywhere.
    assert bucket_grants == {(cfg.training_bucket_name, "roles/storage.objectViewer")}
    # No secret of its own, and none of the stack's is shared with it.
    assert not any("-recover-" in r.inputs["secretId"] for r in rec.of_type(SECRET))
    assert all(r.inputs["member"] != recover_member for r in rec.of_type(SECRET_IAM))


def test_secrets_stay_out_of_metadata_and_outputs(rec) -> None:
    script = rec.one(INSTANCE).inputs["metadata"]["startup-script"]
    everything = json.dumps(
        [
            r.raw_inputs
            for r in rec.resources
            if r.type != "gcp:secretmanager/secretVersion:SecretVersion"
        ]
    )
    assert TOKEN not in script + json.dumps(rec.outputs) + everything
    cfg = stack_config.parse_stack_config(_mapping())
    record = f"gs://{cfg.training_bucket_name}/recovery/{cfg.training_node_name}.json"
    assert f"readonly RECORD_URI={record}" in script
    assert "recover --vm train --watch --yes" in script and "--request" in script
    for gone in ("pulumi-v", "PULUMI_", "swapfile", "secrets versions access"):
        assert gone not in script, gone


def test_an_older_stack_files_backend_and_secrets_load_and_reach_nothing() -> None:
    """recovery.backendUrl and the recoverySshKey/recoveryPassphrase secrets are accepted (a stack
    file that sets them still loads) and declare nothing."""
    secrets = {"recoverySshKey": SSH_KEY, "recoveryPassphrase": PASSPHRASE}
    rec = _run(_mapping(backendUrl=BACKEND), secrets=secrets)
    everything = json.dumps([r.raw_inputs for r in rec.resources]) + json.dumps(rec.outputs)
    for secret in ("TESTKEYb3BlbnNzaC1rZXktdjE", PASSPHRASE, "acme-pulumi-state"):
        assert secret not in everything


def test_the_ssh_rule_is_the_configured_ranges_alone(rec) -> None:
    """The controller no longer deploys over SSH: its address is not let in."""
    cfg = stack_config.parse_stack_config(_mapping())
    assert rec.one(FIREWALL).inputs["sourceRanges"] == list(cfg.ssh.source_ranges)


def test_the_request_it_recreates_from_is_the_tpu_nodes_own_inputs(rec) -> None:
    """What `pulumi up` records in the training bucket is what the TpuNode creates its node
    with: the controller places exactly the node `pulumi up` would."""
    from infra.resources import tpu_node
    from infra.tpu import record as record_mod

    cfg = stack_config.parse_stack_config(_mapping())
    obj = next(r for r in rec.of_type(OBJECT) if r.inputs["name"].endswith("-train.json"))
    assert obj.inputs["bucket"] == cfg.training_bucket_name
    assert rec.outputs["trainRecoveryRecord"] == (
        f"gs://{cfg.training_bucket_name}/recovery/{cfg.training_node_name}.json"
    )
    # pulumi-gcp marks a BucketObject's content secret: the mocks see it wrapped.
    content = obj.inputs["content"]
    content = content["value"] if isinstance(content, dict) else content
    recorded = record_mod.from_record(json.loads(content), "test")
    node = next(r for r in rec.of_type(TPU_NODE) if r.inputs["node_id"] == cfg.training_node_name)
    inputs = tpu_node.TpuNodeInputs.model_validate(
        {k: v for k, v in node.inputs.items() if k != "__provider"}
    )
    assert recorded.request == inputs.request()
    assert recorded.role == "train" and recorded.run_dir and recorded.run_dir.startswith("gs://")
    assert recorded.boot_reports == (
        f"gs://{cfg.training_bucket_name}/recovery/{cfg.training_node_name}-boot"
    )
    script = recorded.request.node["metadata"]["startup-script"]
    assert f"readonly BOOT_REPORT_URI={recorded.boot_reports}" in script
    assert TOKEN not in content


def test_the_outputs_say_where_it_runs_and_what_it_costs(rec) -> None:
    out = rec.outputs["recoveryController"]
    assert out["vm"].endswith("-recover") and "address" not in out
    assert out["estimatedMonthlyUsd"] == {
        "machine": 12.26,
        "disk": 0.4,
        "address": 3.65,
        "secrets": 0.0,
        "total": 16.31,
    }
    assert out["watches"] == rec.outputs["trainRecoveryRecord"]
    assert out["logsCommand"].endswith("-- journalctl -u gemma4-recover -f")


def test_the_source_it_runs_is_this_checkout(rec, tmp_path: pathlib.Path) -> None:
    obj = _source(rec).inputs
    assert obj["name"] == "recovery/source-dev.tar.gz"
    archive = pathlib.Path(obj["source"].path)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "Pulumi.yaml" in names and "Pulumi.dev.yaml" in names and "pyproject.toml" in names
    assert "infra/program.py" in names and "workloads/contract/catalog.py" in names
    assert "Pulumi.prod.yaml" not in names
    assert not any(n.startswith((".venv", ".git/", ".whl")) or "__pycache__" in n for n in names)
    # Byte-for-byte the same when built again (the controller's own `up` changes nothing).
    again = source_archive.write_archive("dev", tmp_path)
    assert again.read_bytes() == archive.read_bytes()


def _asset_identity(recording: pulumi_mocks.Recording) -> tuple[str, str, str]:
    """What Pulumi compares of the uploaded source: the object's name and the SHA-256 of the
    FileAsset's bytes (the engine hashes the file), with the file's content-addressed name."""
    obj = _source(recording).inputs
    path = pathlib.Path(obj["source"].path)
    return obj["name"], path.name, hashlib.sha256(path.read_bytes()).hexdigest()


def _other_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another machine's compressor: a different level and macOS's OS byte (19) in every gzip
    header, and a zlib that deflates differently (as zlib-ng does)."""
    real_gzip, real_zlib = gzip.compress, zlib.compress

    def gzip_compress(data: bytes, compresslevel: int = 9, *, mtime: float | None = None) -> bytes:
        out = bytearray(real_gzip(data, compresslevel=1, mtime=mtime))
        out[9] = 19
        return bytes(out)

    monkeypatch.setattr(gzip, "compress", gzip_compress)
    monkeypatch.setattr(
        zlib, "compress", lambda data, level=-1, wbits=15: real_zlib(data, 1, wbits)
    )


def test_another_machines_compressor_leaves_what_pulumi_compares_unchanged(
    rec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two machines that run `pulumi up` (laptops with different zlibs) upload the same bytes:
    a different hash would upload the source again and restart the controller for nothing."""
    _other_zlib(monkeypatch)
    assert _asset_identity(_run(_mapping())) == _asset_identity(rec)


def _tiny_checkout(root: pathlib.Path, script_mode: int) -> None:
    for name in (*source_archive.ENTRIES[:5], "Pulumi.dev.yaml"):
        (root / name).write_text(f"{name}\n")
    for package in ("infra", "workloads", "templates"):
        (root / package).mkdir()
        (root / package / "x.py").write_text("x = 1\n")
    script = root / "templates" / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(script_mode)
    (root / "infra" / "x.py").chmod(script_mode)


def test_modes_come_from_the_content_not_from_the_checkouts_permission_bits(
    tmp_path: pathlib.Path,
) -> None:
    built = []
    for mode in (0o755, 0o600):
        root = tmp_path / oct(mode)
        root.mkdir()
        _tiny_checkout(root, mode)
        built.append(source_archive.write_archive("dev", tmp_path / f"out-{mode}", root))
    assert built[0].name == built[1].name
    assert built[0].read_bytes() == built[1].read_bytes()
    with tarfile.open(built[0]) as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
    assert modes["templates/run.sh"] == 0o755
    assert modes["infra/x.py"] == 0o644 and modes["Pulumi.yaml"] == 0o644


def test_a_controller_in_a_bad_zone_is_refused_with_one_line() -> None:
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        pulumi_mocks.run_program(
            "dev", _mapping(zone="central"), hf_token=TOKEN, recording=recording
        )
    expected = "recovery.zone: 'central': a zone such as us-central1-a, or unset"
    assert any(line.strip().startswith(expected) for line in str(info.value).splitlines())
    assert recording.resources == []


# ---------------------------------------------------------------------------------------------
# The service wrapper the startup script writes, run as the service would run it


FAKE_GCLOUD = """#!/bin/sh
echo "gcloud $*" >>"$CALLS"
case "$1 $2" in
  "storage cp") cp "$ARCHIVE" "$5" ;;
esac
"""
FAKE_PYTHON = """#!/bin/sh
echo "python $*" >>"$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "infra.ops" ]; then
  echo "env=$(env | grep -c -e PULUMI -e PASSPHRASE)" >>"$CALLS"
  echo "cwd=$(pwd)" >>"$CALLS"
fi
"""


def test_the_service_wrapper_installs_the_source_and_runs_recover_with_no_secret(
    tmp_path: pathlib.Path,
) -> None:
    args = controller_args()
    script = recovery_mod.render_startup(
        args, "gs://acme-gemma4-dev-us-central1/recovery/source-dev.tar.gz"
    )
    app, home, units, bin_dir = (tmp_path / d for d in ("app", "home", "units", "bin"))
    for d in (app, home, units, bin_dir):
        d.mkdir()
    # Only write the wrapper and the unit, into the test's directories.
    script = (
        script.replace("/opt/gemma4-recover", str(app))
        .replace("/var/lib/gemma4-recover", str(home))
        .replace("/etc/systemd/system", str(units))
        .replace('\nmain "$@"\n', "\nwrite_service\n")
    )
    (tmp_path / "startup.sh").write_text(script)
    subprocess.run(["bash", str(tmp_path / "startup.sh")], check=True)
    run_sh = app / "run.sh"
    subprocess.run(["bash", "-n", str(run_sh)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(run_sh)], check=True)
    unit = (units / "gemma4-recover.service").read_text()
    assert f"ExecStart={app}/run.sh" in unit and "Restart=always" in unit

    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    (app / "venv" / "bin").mkdir(parents=True)
    (app / "venv" / "bin" / "python").write_text(FAKE_PYTHON)
    (app / "venv" / "bin" / "python").chmod(0o755)
    # A whole venv (its pip too): run.sh makes a venv again only when pip is missing.
    (app / "venv" / "bin" / "pip").write_text(FAKE_PYTHON)
    (app / "venv" / "bin" / "pip").chmod(0o755)
    archive = source_archive.write_archive("dev", tmp_path / "archives")
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        "CALLS": str(calls),
        "ARCHIVE": str(archive),
    }
    run = subprocess.run(
        ["bash", str(run_sh)], env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    # run.sh puts its own PATH first: the fake gcloud must still be found there.
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("gcloud storage cp --quiet gs://acme-gemma4-dev-us-central1/")
    # pip and setuptools at the lock's versions first, then the project built with them: no
    # build tool is fetched at run time.
    installs = [line for line in lines if line.startswith("python -m pip install")]
    assert installs == [
        "python -m pip install -q --disable-pip-version-check -c src/constraints.txt "
        "pip setuptools",
        "python -m pip install -q --disable-pip-version-check --no-build-isolation "
        "-c src/constraints.txt -e src[recover]",
    ]
    assert lines[-3] == (
        f"python -m infra.ops recover --vm train --watch --yes --request {RECORD} --journal "
        f"{home}/journal-train.json --interval 90 --until-new-source "
        f"gs://acme-gemma4-dev-us-central1/recovery/source-dev.tar.gz {app}/source.tar.gz"
    )
    assert lines[-2] == "env=0"  # nothing of Pulumi, no passphrase
    assert lines[-1] == f"cwd={app}/src"
    assert (app / "src" / "infra" / "ops" / "recover.py").is_file()
    # Only the source comes from the bucket: no secret is read.
    assert [line.split()[1] for line in lines if line.startswith("gcloud")] == ["storage"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_startup_script_passes_shellcheck(rec, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "recover.sh"
    path.write_text(rec.one(INSTANCE).inputs["metadata"]["startup-script"])
    subprocess.run(["bash", "-n", str(path)], check=True)
    lint = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
