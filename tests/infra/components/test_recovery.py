"""The recovery controller: what the stack declares for it under Pulumi mocks (identity, grants,
secrets, source, VM, firewall), the one-line errors of its config, its source archive, and the
service wrapper its startup script writes, run with fake gcloud and python."""

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
from infra.vm import source_archive, templating
from tests.fixtures import pulumi_mocks

TOKEN = "hf_TEST_SECRET_3f9a1c7e5b2d4068a1b2c3d4e5f60718"
SSH_KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\nTESTKEYb3BlbnNzaC1rZXktdjE\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)
PASSPHRASE = "correct-horse-battery-staple-7f3a"
BACKEND = "gs://acme-pulumi-state/gemma4"


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
        "backend_url": "gs://acme-pulumi-state",
        "training_bucket": "acme-gemma4-dev-us-central1",
        "vm_service_account": "projects/acme/serviceAccounts/vm@acme.iam.gserviceaccount.com",
        "ssh_key": "unused",
        "ssh_key_file": "~/.ssh/id_ed25519",
        "passphrase": "unused",
        "kms_key": None,
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


def _mapping(**recovery: object) -> dict:
    mapping = pulumi_mocks.stack_file_config("dev")
    mapping["recovery"] = {"enabled": True, "backendUrl": BACKEND, **recovery}
    return mapping


def _run(mapping: dict, secrets: dict[str, str] | None = None) -> pulumi_mocks.Recording:
    if secrets is None:
        secrets = {"recoverySshKey": SSH_KEY, "recoveryPassphrase": PASSPHRASE}
    return pulumi_mocks.run_program("dev", mapping, hf_token=TOKEN, secrets=secrets)


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
    address = rec.one(ADDRESS).inputs
    assert vm["networkInterfaces"][0]["accessConfigs"][0]["natIp"].startswith("198.51.100.")
    assert address["region"] == "us-central1" and address["addressType"] == "EXTERNAL"
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
        "tpu.nodes.update",
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
    assert bucket_grants == {
        ("acme-pulumi-state", "roles/storage.objectAdmin"),
        (cfg.training_bucket_name, "roles/storage.objectViewer"),
    }
    # Its two secrets, readable by it alone; nothing else of the stack's is shared with it.
    secrets = {r.inputs["secretId"] for r in rec.of_type(SECRET)}
    assert {
        f"{cfg.name_prefix}-recover-ssh-key",
        f"{cfg.name_prefix}-recover-passphrase",
    } <= secrets
    accessors = {
        r.inputs["secretId"]: r.inputs["member"]
        for r in rec.of_type(SECRET_IAM)
        if "-recover-" in r.inputs["secretId"]
    }
    assert set(accessors.values()) == {recover_member}
    assert all(
        r.inputs["member"] != recover_member
        for r in rec.of_type(SECRET_IAM)
        if "hf-token" in r.inputs["secretId"]
    )


def test_secrets_stay_out_of_metadata_and_outputs(rec) -> None:
    script = rec.one(INSTANCE).inputs["metadata"]["startup-script"]
    everything = json.dumps(
        [
            r.raw_inputs
            for r in rec.resources
            if r.type != "gcp:secretmanager/secretVersion:SecretVersion"
        ]
    )
    for secret in ("TESTKEYb3BlbnNzaC1rZXktdjE", PASSPHRASE, TOKEN):
        assert secret not in script
        assert secret not in json.dumps(rec.outputs)
        assert secret not in everything
    assert f"BACKEND_URL={BACKEND}" in script
    assert "recover --watch --yes" in script


def test_the_ssh_rule_lets_the_controller_redeploy(rec) -> None:
    cfg = stack_config.parse_stack_config(_mapping())
    ip = rec.one(ADDRESS)
    ranges = rec.one(FIREWALL).inputs["sourceRanges"]
    assert ranges[: len(cfg.ssh.source_ranges)] == list(cfg.ssh.source_ranges)
    assert len(ranges) == len(cfg.ssh.source_ranges) + 1 and ranges[-1].endswith("/32")
    assert ip.inputs["name"] == f"{cfg.name_prefix}-recover-ip"


def test_the_outputs_say_where_it_runs_and_what_it_costs(rec) -> None:
    out = rec.outputs["recoveryController"]
    assert out["vm"].endswith("-recover") and out["address"].startswith("198.51.100.")
    assert out["estimatedMonthlyUsd"] == {
        "machine": 12.26,
        "disk": 0.4,
        "address": 3.65,
        "secrets": 0.12,
        "total": 16.43,
    }
    assert out["logsCommand"].endswith("-- journalctl -u gemma4-recover -f")


def test_the_source_it_runs_is_this_checkout(rec, tmp_path: pathlib.Path) -> None:
    obj = rec.one(OBJECT).inputs
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
    obj = recording.one(OBJECT).inputs
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
    """The controller's `up` rebuilds the archive with its own zlib; it only reads the bucket, so
    a different hash would be an upload refused with a 403."""
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


def test_the_controllers_rebuild_from_its_unpacked_copy_is_the_same_archive(
    tmp_path: pathlib.Path,
) -> None:
    """What the controller's `up` does: unpack the uploaded archive (as its service does, under
    its own umask) and build the archive again from that copy."""
    uploaded = source_archive.write_archive("dev", tmp_path / "laptop")
    src = tmp_path / "src"
    subprocess.run(["tar", "-xf", str(uploaded), "-C", str(src.mkdir() or src)], check=True)
    rebuilt = source_archive.write_archive("dev", tmp_path / "controller", src)
    assert rebuilt.name == uploaded.name
    assert rebuilt.read_bytes() == uploaded.read_bytes()


@pytest.mark.parametrize(
    ("mapping", "secrets", "expected"),
    [
        (
            _mapping(),
            {},
            "recoverySshKey: not set: recovery.enabled needs the private key of ssh.privateKeyFile",
        ),
        (
            _mapping(backendUrl="s3://state"),
            None,
            "recovery.backendUrl: 's3://state': the stack's state must be in a GCS bucket",
        ),
        (
            _mapping(backendUrl=None),
            None,
            "recovery.backendUrl: None: the stack's state must be in a GCS bucket",
        ),
        (
            {**_mapping(), "ssh": {**_mapping()["ssh"], "privateKeyFile": "/keys/id"}},
            None,
            "ssh.privateKeyFile: '/keys/id': recovery.enabled needs a key file under ~/",
        ),
        (
            {**_mapping(), "ssh": {**_mapping()["ssh"], "publicKey": None}},
            None,
            "ssh.publicKey: None: recovery.enabled needs it set",
        ),
        (
            _mapping(zone="central"),
            None,
            "recovery.zone: 'central': a zone such as us-central1-a, or unset",
        ),
        (
            _mapping(),
            {"recoverySshKey": SSH_KEY},
            "recoveryPassphrase: not set: the stack's secrets use a passphrase, which the "
            "controller needs",
        ),
    ],
    ids=[
        "no-key",
        "not-gcs",
        "no-backend",
        "key-outside-home",
        "no-public-key",
        "bad-zone",
        "no-passphrase",
    ],
)
def test_a_controller_that_cannot_work_is_refused_with_one_line(mapping, secrets, expected) -> None:
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        pulumi_mocks.run_program(
            "dev",
            mapping,
            hf_token=TOKEN,
            secrets={"recoverySshKey": SSH_KEY} if secrets is None else secrets,
            recording=recording,
        )
    assert any(line.strip().startswith(expected) for line in str(info.value).splitlines())
    assert recording.resources == []


KMS_KEY = "projects/acme/locations/global/keyRings/pulumi/cryptoKeys/gemma4-dev"
KMS_IAM = "gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember"


def test_a_stack_whose_secrets_use_a_kms_key_grants_that_key_and_needs_no_passphrase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stack_config, "secrets_provider", lambda _stack: f"gcpkms://{KMS_KEY}")
    rec = _run(_mapping(), secrets={"recoverySshKey": SSH_KEY})
    cfg = stack_config.parse_stack_config(_mapping())
    (grant,) = rec.of_type(KMS_IAM)
    assert grant.inputs == {
        "cryptoKeyId": KMS_KEY,
        "role": "roles/cloudkms.cryptoKeyEncrypterDecrypter",
        "member": f"serviceAccount:{cfg.name_prefix}-recover@{cfg.project}.iam.gserviceaccount.com",
    }
    secret_ids = sorted(r.inputs["secretId"] for r in rec.of_type(SECRET))
    assert not any(i.endswith("-recover-passphrase") for i in secret_ids)
    script = rec.one(INSTANCE).inputs["metadata"]["startup-script"]
    assert "readonly PASSPHRASE_SECRET=''" in script
    # One secret version fewer in the estimate.
    cost = rec.outputs["recoveryController"]["estimatedMonthlyUsd"]
    assert cost["secrets"] == 0.06 and cost["total"] == 16.37


def test_a_secrets_provider_the_controller_cannot_reach_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = "awskms://alias/pulumi?region=us-east-1"
    monkeypatch.setattr(stack_config, "secrets_provider", lambda _stack: provider)
    recording = pulumi_mocks.Recording()
    with pytest.raises(pulumi.RunError) as info:
        secrets = {"recoverySshKey": SSH_KEY, "recoveryPassphrase": "x"}
        pulumi_mocks.run_program(
            "dev", _mapping(), hf_token=TOKEN, recording=recording, secrets=secrets
        )
    problems = str(info.value).splitlines()[1:]
    assert [p.strip() for p in problems] == [
        f"recovery.enabled: the stack's secrets provider {provider!r} is out of the controller's "
        "reach: it works with a passphrase or a gcpkms:// key "
        "(`pulumi stack change-secrets-provider`)"
    ]
    assert recording.resources == []


def test_the_secrets_provider_is_read_from_the_stack_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "Pulumi.kms.yaml").write_text(
        f"secretsprovider: gcpkms://{KMS_KEY}\nencryptedkey: CiQA\nconfig: {{}}\n"
    )
    (tmp_path / "Pulumi.pass.yaml").write_text("encryptionsalt: v1:abc\nconfig: {}\n")
    assert stack_config.secrets_provider("kms", tmp_path) == f"gcpkms://{KMS_KEY}"
    assert stack_config.secrets_provider("pass", tmp_path) == "passphrase"
    assert stack_config.secrets_provider("missing", tmp_path) == "passphrase"


# ---------------------------------------------------------------------------------------------
# The service wrapper the startup script writes, run as the service would run it


FAKE_GCLOUD = """#!/bin/sh
echo "gcloud $*" >>"$CALLS"
case "$1 $2" in
  "storage cp") cp "$ARCHIVE" "$5" ;;
  "secrets versions")
    case "$5" in
      *ssh-key) cat "$KEY" ;;
      *passphrase) printf '%s' "$PASSPHRASE" ;;
    esac ;;
esac
"""
FAKE_PYTHON = """#!/bin/sh
echo "python $*" >>"$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "infra.ops" ]; then
  echo "PULUMI_BACKEND_URL=$PULUMI_BACKEND_URL" >>"$CALLS"
  echo "PULUMI_CONFIG_PASSPHRASE=$PULUMI_CONFIG_PASSPHRASE" >>"$CALLS"
  echo "cwd=$(pwd)" >>"$CALLS"
fi
"""


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_the_service_wrapper_installs_the_source_reads_its_secrets_and_runs_recover(
    tmp_path: pathlib.Path,
) -> None:
    args = controller_args(backend_url=BACKEND)
    script = recovery_mod.render_startup(
        args,
        "gs://acme-gemma4-dev-us-central1/recovery/source-dev.tar.gz",
        "k-ssh-key",
        "k-passphrase",
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

    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
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
        "KEY": str(key),
        "PASSPHRASE": PASSPHRASE,
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
        "-c src/constraints.txt -e src[infra]",
    ]
    assert lines[-4] == (
        "python -m infra.ops --stack dev recover --watch --yes --interval 90 --until-new-source "
        f"gs://acme-gemma4-dev-us-central1/recovery/source-dev.tar.gz {app}/source.tar.gz"
    )
    assert lines[-3] == f"PULUMI_BACKEND_URL={BACKEND}"
    assert lines[-2] == f"PULUMI_CONFIG_PASSPHRASE={PASSPHRASE}"
    assert lines[-1] == f"cwd={app}/src"
    # The source is installed with the program's virtualenv where Pulumi.yaml says it is.
    assert (app / "src" / "Pulumi.dev.yaml").is_file()
    assert (app / "src" / ".venv").resolve() == (app / "venv").resolve()
    # The key is where the program looks for it, private, with its public half.
    placed = home / ".ssh" / "id_ed25519"
    assert placed.read_text() == key.read_text() and oct(placed.stat().st_mode & 0o777) == "0o600"
    assert (home / ".ssh" / "id_ed25519.pub").read_text().split()[:2] == (
        pathlib.Path(f"{key}.pub").read_text().split()[:2]
    )
    assert PASSPHRASE not in run.stdout + run.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_startup_script_passes_shellcheck(rec, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "recover.sh"
    path.write_text(rec.one(INSTANCE).inputs["metadata"]["startup-script"])
    subprocess.run(["bash", "-n", str(path)], check=True)
    lint = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


FAKE_CURL = """#!/bin/sh
# curl -fsSL -o FILE URL: serves URL's file name from $RELEASES; records what was asked.
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out=$2; shift 2 ;;
    -*) shift ;;
    *) url=$1; shift ;;
  esac
done
echo "$url" >>"$CALLS"
cp "$RELEASES/${url##*/}" "$out"
"""


def _pulumi_release(releases: pathlib.Path, version: str, listed_hash: str | None) -> str:
    """A release dir as get.pulumi.com lays it out: the tarball (a fake `pulumi` that prints its
    version) and the checksums file; `listed_hash` None = the tarball's true SHA-256, "" = no
    line for the tarball."""
    import hashlib
    import io

    tarball = f"pulumi-v{version}-linux-x64.tar.gz"
    script = f"#!/bin/sh\necho v{version}\n".encode()
    with tarfile.open(releases / tarball, "w:gz") as tar:
        info = tarfile.TarInfo("pulumi/pulumi")
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))
    digest = (
        hashlib.sha256((releases / tarball).read_bytes()).hexdigest()
        if listed_hash is None
        else listed_hash
    )
    line = f"{digest}  {tarball}\n" if digest else ""
    (releases / f"pulumi-{version}-checksums.txt").write_text(
        f"{'0' * 64}  pulumi-v{version}-darwin-arm64.tar.gz\n{line}"
    )
    return tarball


@pytest.mark.parametrize("listed", ["true", "tampered", "missing"])
def test_the_pulumi_cli_is_installed_only_when_its_sha256_is_the_published_one(
    tmp_path: pathlib.Path, listed: str
) -> None:
    version = "3.999.0"
    releases, opt, bin_dir = (tmp_path / d for d in ("releases", "opt", "bin"))
    for d in (releases, opt, bin_dir):
        d.mkdir()
    tarball = _pulumi_release(
        releases, version, {"true": None, "tampered": "ab" * 32, "missing": ""}[listed]
    )
    tampered = listed != "true"
    (bin_dir / "curl").write_text(FAKE_CURL)
    (bin_dir / "curl").chmod(0o755)
    script = (
        templating.render(
            "startup/recover.sh.j2",
            project="acme",
            stack="dev",
            backend_url=BACKEND,
            source_uri="gs://b/recovery/source-dev.tar.gz",
            pulumi_version=version,
            swap_mb=recovery_mod.SWAP_MB,
            ssh_key_secret="s",
            ssh_key_file="/k",
            passphrase_secret="",
            interval_s=60,
        )
        .replace("/opt/pulumi", str(opt / "pulumi"))
        .replace('\nmain "$@"\n', "\nensure_pulumi\n")
    )
    (tmp_path / "startup.sh").write_text(script)
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "RELEASES": str(releases),
        "CALLS": str(calls),
    }
    run = subprocess.run(
        ["bash", str(tmp_path / "startup.sh")], env=env, capture_output=True, text=True
    )
    # The tarball and Pulumi's checksums file of the same release, from get.pulumi.com.
    assert calls.read_text().splitlines() == [
        f"https://get.pulumi.com/releases/sdk/{tarball}",
        f"https://get.pulumi.com/releases/sdk/pulumi-{version}-checksums.txt",
    ]
    if tampered:
        assert run.returncode != 0
        assert not (opt / "pulumi").exists()
        logged = [line for line in run.stdout.splitlines() if "gemma4-recover:" in line]
        assert len(logged) == 1 and logged[0].endswith(
            f"pulumi {version}: {tarball} does not match Pulumi's published SHA-256 "
            f"(https://get.pulumi.com/releases/sdk/pulumi-{version}-checksums.txt); not installed"
        )
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert (opt / "pulumi" / "pulumi").is_file()
        assert f"pulumi v{version} installed (SHA-256 verified)" in run.stdout
