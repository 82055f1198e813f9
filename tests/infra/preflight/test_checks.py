"""Preflight against a fake Cloud TPU client at the API boundary (the three read-only calls)."""

from __future__ import annotations

import copy

from google.api_core import exceptions
from google.cloud import tpu_v2

from infra.config import stack_config
from infra.preflight import checks as preflight
from tests.fixtures import pulumi_mocks

PROJECT = "my-project-1"


class FakeTpuClient:
    """Answers like tpu_v2.TpuClient: AcceleratorType / RuntimeVersion lists, a Node or NotFound."""

    def __init__(self, offered=None, runtimes=None, nodes=None, fail=None):
        self.offered = offered or {}
        self.runtimes = runtimes or {}
        self.nodes = nodes or {}
        self.fail = fail or set()
        self.calls = []

    def list_accelerator_types(self, *, parent):
        self.calls.append(("list_accelerator_types", parent))
        if "accelerators" in self.fail:
            raise exceptions.PermissionDenied("tpu.acceleratorTypes.list denied")
        zone = parent.rsplit("/", 1)[-1]
        return [
            tpu_v2.AcceleratorType(name=f"{parent}/acceleratorTypes/{t}", type_=t)
            for t in self.offered.get(zone, ())
        ]

    def list_runtime_versions(self, *, parent):
        self.calls.append(("list_runtime_versions", parent))
        zone = parent.rsplit("/", 1)[-1]
        return [
            tpu_v2.RuntimeVersion(name=f"{parent}/runtimeVersions/{v}", version=v)
            for v in self.runtimes.get(zone, ())
        ]

    def get_node(self, *, name):
        self.calls.append(("get_node", name))
        if name not in self.nodes:
            raise exceptions.NotFound(f"{name} not found")
        return tpu_v2.Node(name=name, state=self.nodes[name])


def _cfg(stack="prod", **overrides):
    mapping = copy.deepcopy(pulumi_mocks.stack_file_config(stack))
    mapping["project"] = PROJECT
    mapping["ssh"]["sourceRanges"] = ["192.168.10.0/24"]
    mapping.update(overrides)
    return stack_config.parse_stack_config(mapping)


def _healthy():
    return FakeTpuClient(
        offered={"us-central1-a": ["v5p-8", "v5p-16"], "asia-northeast1-b": ["v6e-8"]},
        runtimes={
            "us-central1-a": ["v2-alpha-tpuv5", "tpu-ubuntu2204-base"],
            "asia-northeast1-b": ["v2-alpha-tpuv6e"],
        },
    )


def test_all_good():
    client = _healthy()
    checks = preflight.run_preflight(_cfg(), lambda: client, has_hf_token=True)
    ok, report = preflight.verdict(checks)
    assert ok, report
    assert len(checks) == 6
    assert report.splitlines()[-1] == "preflight: OK (6 checks passed): `pulumi up` can go ahead"
    # Read-only calls only, against the configured zones and node names.
    assert (
        "get_node",
        f"projects/{PROJECT}/locations/us-central1-a/nodes/gemma4-prod-train",
    ) in client.calls
    assert (
        "list_accelerator_types",
        f"projects/{PROJECT}/locations/asia-northeast1-b",
    ) in client.calls
    assert {c[0] for c in client.calls} == {
        "list_accelerator_types",
        "list_runtime_versions",
        "get_node",
    }


def test_preempted_node_fails_with_what_to_do():
    client = _healthy()
    name = f"projects/{PROJECT}/locations/us-central1-a/nodes/gemma4-prod-train"
    client.nodes[name] = tpu_v2.Node.State.PREEMPTED
    ok, report = preflight.verdict(
        preflight.run_preflight(_cfg(), lambda: client, has_hf_token=True)
    )
    assert not ok
    assert "FAIL  training v5p-8 in us-central1-a: node gemma4-prod-train is PREEMPTED" in report
    assert "gcloud compute tpus tpu-vm delete gemma4-prod-train --zone us-central1-a" in report
    assert report.splitlines()[-1].startswith("preflight: FAILED (1 of 6 checks)")


def test_ready_node_is_fine():
    client = _healthy()
    client.nodes[f"projects/{PROJECT}/locations/us-central1-a/nodes/gemma4-prod-train"] = (
        tpu_v2.Node.State.READY
    )
    ok, report = preflight.verdict(
        preflight.run_preflight(_cfg(), lambda: client, has_hf_token=True)
    )
    assert ok and "node gemma4-prod-train exists (READY)" in report


def test_accelerator_missing_suggests_a_fallback_zone():
    client = _healthy()
    client.offered["asia-northeast1-b"] = []
    client.offered["us-east5-b"] = ["v6e-8"]
    ok, report = preflight.verdict(
        preflight.run_preflight(_cfg(), lambda: client, has_hf_token=True)
    )
    assert not ok
    assert (
        "FAIL  serving v6e-8 in asia-northeast1-b: accelerator type not offered in this zone; "
        "us-east5-b offers it: pulumi config set --path 'gemma4-tpu:serving.zone' us-east5-b"
    ) in report


def test_runtime_missing():
    client = _healthy()
    client.runtimes["asia-northeast1-b"] = ["tpu-ubuntu2204-base"]
    ok, report = preflight.verdict(
        preflight.run_preflight(_cfg(), lambda: client, has_hf_token=True)
    )
    assert not ok
    assert "runtime version v2-alpha-tpuv6e not offered in asia-northeast1-b" in report


def test_api_errors_are_failed_checks_not_tracebacks():
    client = _healthy()
    client.fail.add("accelerators")
    ok, report = preflight.verdict(
        preflight.run_preflight(_cfg("dev"), lambda: client, has_hf_token=True)
    )
    assert not ok
    assert "cannot list accelerator types: 403 tpu.acceleratorTypes.list denied" in report


def test_no_credentials_is_one_failed_check():
    def factory():
        raise RuntimeError("Your default credentials were not found")

    ok, report = preflight.verdict(preflight.run_preflight(_cfg("dev"), factory, has_hf_token=True))
    assert not ok and "cannot create the Cloud TPU client: Your default credentials" in report


def test_serving_off_checks_only_training():
    client = _healthy()
    checks = preflight.run_preflight(_cfg("dev"), lambda: client, has_hf_token=True)
    assert len(checks) == 3 and all(c.ok for c in checks)
    assert all("us-central1-a" in c[1] for c in client.calls)


def test_checked_in_stack_files_fail_on_placeholders(capsys):
    created = []
    status = preflight.main(["--stack", "prod"], client_factory=lambda: created.append(1))
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL  project: 'your-gcp-project' is the placeholder" in out
    assert "FAIL  ssh.sourceRanges: 203.0.113.0/24 is a documentation range" in out
    assert "FAIL  hfToken: not set" in out
    assert created == []  # no API call for a project that does not exist


def test_main_runs_the_checks(tmp_path, capsys):
    stack_file = tmp_path / "Pulumi.mine.yaml"
    stack_file.write_text(
        (pulumi_mocks.ROOT / "Pulumi.dev.yaml")
        .read_text()
        .replace("your-gcp-project", PROJECT)
        .replace("203.0.113.0/24", "192.168.10.0/24")
        + "  gemma4-tpu:hfToken:\n    secure: v1:abc\n"
    )
    status = preflight.main(["--stack", "mine", "--root", str(tmp_path)], client_factory=_healthy)
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.splitlines()[-1] == "preflight: OK (3 checks passed): `pulumi up` can go ahead"


def test_main_invalid_config(tmp_path, capsys):
    (tmp_path / "Pulumi.bad.yaml").write_text(
        "config:\n  gemma4-tpu:project: my-project-1\n  gemma4-tpu:lora:\n    rank: 0\n"
    )
    status = preflight.main(["--stack", "bad", "--root", str(tmp_path)], client_factory=_healthy)
    out = capsys.readouterr().out
    assert status == 2
    assert "FAIL  lora.rank: 0: a positive integer" in out
    assert "FAIL  ssh.sourceRanges: []" in out


def test_fake_matches_the_real_client_signatures():
    # The fake stands in at the API boundary: the real client has these methods and fields.
    for method in ("list_accelerator_types", "list_runtime_versions", "get_node"):
        assert callable(getattr(tpu_v2.TpuClient, method))
    assert "type_" in tpu_v2.AcceleratorType.meta.fields
    assert "version" in tpu_v2.RuntimeVersion.meta.fields
    assert tpu_v2.Node.State.PREEMPTED.name == "PREEMPTED"


def test_the_serving_line_shows_the_profiles_replicas_and_hbm_per_chip():
    paper = preflight.serving_summary(_cfg())
    assert paper is not None and paper.startswith(
        "serving: profile paper: 1 replica(s) x TP 8 on v6e-8, weights bf16, KV cache bf16; "
        "estimated HBM per chip 12.0 GB for 1 x 16384 tokens per replica, of 0.9 x 32.0 GB"
    )
    serving = pulumi_mocks.stack_file_config("prod")["serving"]
    fast = preflight.serving_summary(_cfg(serving={**serving, "profile": "throughput"}))
    assert fast is not None and fast.startswith(
        "serving: profile throughput: 2 replica(s) x TP 4 on v6e-8, weights fp8, KV cache fp8; "
        "estimated HBM per chip 12.2 GB"
    )
    assert preflight.serving_summary(_cfg(serving={**serving, "enabled": False})) is None
