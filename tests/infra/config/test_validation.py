"""The validation rules: a table of invalid configs, each expecting its own message."""

from __future__ import annotations

import copy
import typing

import pytest
from pydantic.alias_generators import to_snake

from infra.config import model as config
from infra.config import runconfig_render, sizing, stack_config, validation
from tests.fixtures import pulumi_mocks
from workloads.contract import catalog


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


DEV = pulumi_mocks.stack_file_config("dev")
PROD = pulumi_mocks.stack_file_config("prod")
SERVING = {"serving": {"enabled": True}}

# (id, base, override, has_hf_token, the problem line must start with this)
CASES = [
    (
        "unknown-accelerator",
        DEV,
        {"training": {"accelerator": "v5p-7"}},
        True,
        "training.accelerator: 'v5p-7': known accelerator types are v5p-8, v5p-16, v5p-32, v6e-8",
    ),
    (
        "ubuntu-base-on-v6e",
        PROD,
        {"serving": {"runtimeVersion": "tpu-ubuntu2204-base"}},
        True,
        "serving.runtimeVersion: 'tpu-ubuntu2204-base': fails on v6e with "
        '"Failed to get global TPU topology"; use v2-alpha-tpuv6e',
    ),
    (
        "runtime-of-other-generation",
        DEV,
        {"training": {"runtimeVersion": "v2-alpha-tpuv6e"}},
        True,
        "training.runtimeVersion: 'v2-alpha-tpuv6e': v5p runs v2-alpha-tpuv5",
    ),
    (
        "zone-without-accelerator",
        DEV,
        {"training": {"zone": "europe-west1-b"}},
        True,
        "training.zone: 'europe-west1-b': v5p-8 is offered in us-central1-a, us-east5-a",
    ),
    (
        "fallback-zone-without-v6e",
        PROD,
        {"serving": {"zoneFallbacks": ["us-central1-a"]}},
        True,
        "serving.zoneFallbacks[0]: 'us-central1-a': v6e-8 is offered in asia-northeast1-b",
    ),
    (
        "training-fallback-zone-without-v5p",
        DEV,
        {"training": {"zoneFallbacks": ["us-east5-a", "asia-northeast1-b"]}},
        True,
        "training.zoneFallbacks[1]: 'asia-northeast1-b': v5p-8 is offered in us-central1-a",
    ),
    (
        "queue-window-too-long",
        DEV,
        {"training": {"provisioning": "queued", "queue": {"validForHours": 1000}}},
        True,
        "training.queue.validForHours: 1000: Input should be less than or equal to 720",
    ),
    (
        "zone-repeating-the-primary",
        DEV,
        {"training": {"zoneFallbacks": ["us-east5-a", "us-central1-a"]}},
        True,
        "training.zoneFallbacks[1]: 'us-central1-a': already listed as training.zone; list each "
        "zone once",
    ),
    (
        "fallback-zone-twice",
        PROD,
        {"serving": {"zoneFallbacks": ["asia-northeast1-b"]}},
        True,
        "serving.zoneFallbacks[0]: 'asia-northeast1-b': already listed as serving.zone",
    ),
    (
        "queue-settings-without-a-queue",
        DEV,
        {"training": {"queue": {"validForHours": 6}}},
        True,
        "training.queue: set, but training.provisioning is 'spot': the queue settings apply only "
        "to provisioning: queued; remove training.queue or set training.provisioning: queued",
    ),
    (
        "stop-a-spot-serving-node-by-default",
        DEV,
        {"serving": {"enabled": True, "stopAfterHours": 8}},
        True,
        "serving.stopAfterHours: 8: a spot TPU (serving.provisioning: spot, the default) cannot "
        "be stopped, only deleted; set serving.provisioning: on-demand (or queued with "
        "serving.queue.capacity: on-demand), or remove serving.stopAfterHours",
    ),
    (
        "stop-a-preemptible-serving-node",
        PROD,
        {"serving": {"provisioning": "preemptible", "stopAfterHours": 1.5}},
        True,
        "serving.stopAfterHours: 1.5: a preemptible TPU (serving.provisioning: preemptible) "
        "cannot be stopped",
    ),
    (
        "stop-a-queued-spot-serving-node",
        PROD,
        {"serving": {"provisioning": "queued", "stopAfterHours": 8}},
        True,
        "serving.stopAfterHours: 8: a queued spot TPU (serving.provisioning: queued) cannot be "
        "stopped",
    ),
    (
        "vllm-hbm-names-the-key-set",
        PROD,
        {"serving": {"minConcurrentSequences": 64}},
        True,
        "serving.minConcurrentSequences: 64, serving.maxModelLen: 16384, "
        "serving.profile: 'paper', serving.tensorParallelSize: 8, serving.hbmUtilization: 0.9, "
        "serving.kvCacheDtype: 'auto', serving.weightQuantization: 'off': estimated HBM per chip",
    ),
    (
        # Too small a share of HBM: every key that feeds the estimate and its budget is named,
        # the one the stack set first.
        "vllm-hbm-utilization-too-small",
        PROD,
        {"serving": {"hbmUtilization": 0.3}},
        True,
        "serving.hbmUtilization: 0.3, serving.maxModelLen: 16384, serving.profile: 'paper', "
        "serving.minConcurrentSequences: 1, serving.tensorParallelSize: 8, "
        "serving.kvCacheDtype: 'auto', serving.weightQuantization: 'off': estimated HBM per chip "
        "12.0 GB (the 62.5 GB of model.name 'gemma-4-31b' / TP at weightQuantization 'off' + KV "
        "cache for 1 x 16384 tokens per replica) exceeds 30% of the 32.0 GB of v6e-8; raise "
        "tensorParallelSize or hbmUtilization, or lower maxModelLen, minConcurrentSequences, or "
        "set weightQuantization fp8 or kvCacheDtype fp8 (serving.profile: throughput sets both)",
    ),
    (
        "duplicate-lora-target",
        DEV,
        {"lora": {"targets": ["q_einsum", "kv_einsum", "q_einsum"]}},
        True,
        "lora.targets[2]: 'q_einsum': already listed as lora.targets[0]; list each once",
    ),
    (
        "duplicate-ssh-range",
        DEV,
        {"ssh": {"sourceRanges": ["198.51.100.7/32", "198.51.100.7/32"]}},
        True,
        "ssh.sourceRanges[1]: '198.51.100.7/32': already listed as ssh.sourceRanges[0]; list "
        "each once",
    ),
    (
        "duplicate-api-range",
        PROD,
        {"serving": {"apiSourceRanges": ["203.0.113.0/24", "203.0.113.0/24"]}},
        True,
        "serving.apiSourceRanges[1]: '203.0.113.0/24': already listed as "
        "serving.apiSourceRanges[0]; list each once",
    ),
    (
        "queue-capacity-typo",
        DEV,
        {"training": {"queue": {"capacity": "preemptible"}}},
        True,
        "training.queue.capacity: 'preemptible': Input should be 'spot' or 'on-demand'",
    ),
    (
        "mesh-not-device-count",
        DEV,
        {"training": {"mesh": {"fsdp": 2, "tp": 4}}},
        True,
        "training.mesh: fsdp=2 x tp=4 = 8: must equal the 4 JAX devices of v5p-8",
    ),
    (
        "tp-not-dividing-heads",
        DEV,
        {"training": {"accelerator": "v5p-16", "microBatch": 2, "mesh": {"fsdp": 1, "tp": 8}}},
        True,
        "training.mesh.tp: 8: must divide the query, KV and global KV heads (32, 16, 4) of "
        "gemma-4-31b; allowed: 1, 2, 4",
    ),
    (
        "vllm-tp-beyond-slice",
        PROD,
        {"serving": {"tensorParallelSize": 16}},
        True,
        "serving.tensorParallelSize: 16: between 1 and the 8 chips of v6e-8",
    ),
    (
        "vllm-tp-not-dividing-heads",
        PROD,
        {"serving": {"tensorParallelSize": 3}},
        True,
        "serving.tensorParallelSize: 3: must divide the 32 query heads",
    ),
    (
        "vllm-hbm",
        PROD,
        {"serving": {"tensorParallelSize": 2}},
        True,
        "serving.tensorParallelSize: 2, serving.maxModelLen: 16384, serving.profile: 'paper', "
        "serving.minConcurrentSequences: 1, serving.hbmUtilization: 0.9, "
        "serving.kvCacheDtype: 'auto', serving.weightQuantization: 'off': estimated HBM per chip",
    ),
    (
        "vllm-replicas-times-tp-not-the-chips",
        PROD,
        {"serving": {"tensorParallelSize": 4}},
        True,
        "serving.dataParallelSize: 1, serving.tensorParallelSize: 4: replicas x TP = 4 must "
        "equal the 8 chips of v6e-8 (e.g. 1 x 8, 2 x 4; serving.profile: paper)",
    ),
    (
        # The throughput profile's fp8 halves the weights, but a bf16 override at TP 4 with 64
        # full-length sequences per replica cannot fit: every key involved is named.
        "vllm-throughput-profile-with-bf16-weights-and-kv-overflows",
        PROD,
        {
            "serving": {
                "profile": "throughput",
                "weightQuantization": "off",
                "kvCacheDtype": "auto",
                "minConcurrentSequences": 64,
            }
        },
        True,
        "serving.minConcurrentSequences: 64, serving.maxModelLen: 16384, "
        "serving.kvCacheDtype: 'auto', serving.weightQuantization: 'off', "
        "serving.profile: 'throughput', serving.tensorParallelSize: 4, "
        "serving.hbmUtilization: 0.9: estimated HBM per chip",
    ),
    (
        "vllm-unknown-profile",
        PROD,
        {"serving": {"profile": "fast"}},
        True,
        "serving.profile: 'fast': Input should be 'paper' or 'throughput'",
    ),
    (
        "weights-on-boot-disk",
        DEV,
        {"model": {"stageDir": "/opt/models"}},
        True,
        "model.stageDir: '/opt/models': must be under /dev/shm (RAM-backed): "
        "the weights are 62.5 GB; the boot disk has 12.0 GB free",
    ),
    (
        "shm-too-small",
        DEV,
        {"training": {"shmWorkingSetGb": 300}},
        True,
        "training.shmWorkingSetGb: 300.0: weights 62.5 GB x2 (base + merged) + working set "
        "= 425.0 GB exceed the 336.0 GB /dev/shm can grow to on a v5p-8 host (75% of its "
        "448.0 GB of RAM)",
    ),
    (
        "training-hbm",
        DEV,
        {"data": {"maxSeqLen": 32768}, "training": {"microBatch": 4}},
        True,
        "training.microBatch: 4: estimated HBM per device",
    ),
    (
        "batch-vs-data-parallel",
        DEV,
        {"training": {"microBatch": 3, "mesh": {"fsdp": 2, "tp": 2}}},
        True,
        "training.microBatch: 3: must be a multiple of the data-parallel size (mesh.fsdp = 2)",
    ),
    (
        "batch-vs-hosts",
        DEV,
        {"training": {"accelerator": "v5p-16", "microBatch": 1, "mesh": {"fsdp": 2, "tp": 4}}},
        True,
        "training.microBatch: 1: must be a multiple of the 2 hosts of v5p-16",
    ),
    (
        "seq-len-not-multiple",
        DEV,
        {"data": {"maxSeqLen": 3000}},
        True,
        "data.maxSeqLen: 3000: a positive multiple of 128",
    ),
    (
        "seq-len-zero",
        DEV,
        {"data": {"maxSeqLen": 0}},
        True,
        "data.maxSeqLen: 0: a positive multiple of 128",
    ),
    ("rank-zero", DEV, {"lora": {"rank": 0}}, True, "lora.rank: 0: a positive integer"),
    ("alpha-negative", DEV, {"lora": {"alpha": -1}}, True, "lora.alpha: -1: a positive number"),
    (
        "unknown-lora-target",
        DEV,
        {"lora": {"targets": ["q_proj"]}},
        True,
        "lora.targets: ['q_proj']: one or more of q_einsum",
    ),
    (
        "bucket-in-other-region",
        DEV,
        {"storage": {"location": "us-east1"}},
        True,
        "storage.location: 'us-east1': must be the training zone's region 'us-central1'",
    ),
    (
        "serving-bucket-in-other-region",
        PROD,
        {"storage": {"servingLocation": "us-central1"}},
        True,
        "storage.servingLocation: 'us-central1': must be the serving zone's region "
        "'asia-northeast1'",
    ),
    (
        "ssh-from-anywhere",
        DEV,
        {"ssh": {"sourceRanges": ["0.0.0.0/0"]}},
        True,
        "ssh.sourceRanges[0]: '0.0.0.0/0': open to the whole internet",
    ),
    (
        "api-from-anywhere-v6",
        PROD,
        {"serving": {"apiSourceRanges": ["::/0"]}},
        True,
        "serving.apiSourceRanges[0]: '::/0': open to the whole internet",
    ),
    (
        "ssh-no-ranges",
        DEV,
        {"ssh": {"sourceRanges": []}},
        True,
        "ssh.sourceRanges: []: at least one CIDR range",
    ),
    (
        "ssh-bad-cidr",
        DEV,
        {"ssh": {"sourceRanges": ["10.0.0.300/32"]}},
        True,
        "ssh.sourceRanges[0]: '10.0.0.300/32': a CIDR range such as 198.51.100.7/32",
    ),
    (
        "bad-public-key",
        DEV,
        {"ssh": {"publicKey": "not a key"}},
        True,
        "ssh.publicKey: 'not a key': an OpenSSH public key line",
    ),
    (
        "ssh-agent-without-public-key",
        DEV,
        {"ssh": {"privateKeyFile": None, "publicKey": None}},
        True,
        "ssh.publicKey: not set: required when ssh.privateKeyFile is null (ssh-agent)",
    ),
    (
        "project-id",
        DEV,
        {"project": "My_Project"},
        True,
        "project: 'My_Project': a GCP project id is 6-30 characters",
    ),
    ("name-prefix", DEV, {"namePrefix": "Gemma"}, True, "namePrefix: 'Gemma': 1-20 characters"),
    (
        "bucket-name",
        DEV,
        {"storage": {"bucketName": "goog-bucket"}},
        True,
        "storage.bucketName: 'goog-bucket': a bucket name is 3-63 characters",
    ),
    (
        "derived-bucket-name-too-long",
        PROD,
        {"project": "abcdefghijklmnopqrstuvwxyz1234", "namePrefix": "abcdefghijklmnopqrst"},
        True,
        "storage.servingBucketName: 'abcdefghijklmnopqrstuvwxyz1234-abcdefghijklmnopqrst-asia-"
        "northeast1': a bucket name is 3-63 characters",
    ),
    (
        "node-name",
        DEV,
        {"training": {"nodeName": "Train_VM"}},
        True,
        "training.nodeName: 'Train_VM': a TPU node name is 1-63 characters",
    ),
    ("label", DEV, {"labels": {"Team": "ml"}}, True, "labels.Team: 'Team': a label key is"),
    (
        "unknown-model",
        DEV,
        {"model": {"name": "gemma-3-27b"}},
        True,
        "model.name: 'gemma-3-27b': known models are gemma-4-31b",
    ),
    (
        "serving-without-merge",
        DEV,
        {**SERVING, "merge": {"enabled": False}},
        True,
        "merge.enabled: false: must be true when serving.enabled is true",
    ),
    (
        "merge-shard-size",
        DEV,
        {"merge": {"shardSize": "huge"}},
        True,
        "merge.shardSize: 'huge': a size such as 5GB or 512MiB",
    ),
    (
        "serving-image-before-gemma4",
        PROD,
        {"serving": {"image": "vllm/vllm-tpu:v0.18.0"}},
        True,
        "serving.image: 'vllm/vllm-tpu:v0.18.0': v0.18.0 is too old for Gemma 4; it needs "
        "vllm/vllm-tpu:v0.20.0 or a later release",
    ),
    (
        "serving-image-old-default",
        PROD,
        {"serving": {"image": "docker.io/vllm/vllm-tpu:v0.11.1"}},
        True,
        "serving.image: 'docker.io/vllm/vllm-tpu:v0.11.1': v0.11.1 is too old for Gemma 4",
    ),
    (
        "serving-image-nightly-before-gemma4",
        PROD,
        {"serving": {"image": "vllm/vllm-tpu:nightly-20260316-e778980-57a314d"}},
        True,
        "serving.image: 'vllm/vllm-tpu:nightly-20260316-e778980-57a314d': nightly-20260316-e778980"
        "-57a314d is too old for Gemma 4",
    ),
    ("no-hf-token", DEV, {}, False, "hfToken: not set: model.downloadFromHub is true"),
    (
        "provisioning-typo",
        DEV,
        {"training": {"provisioning": "spott"}},
        True,
        "training.provisioning: 'spott': Input should be 'spot', 'preemptible', 'on-demand' or "
        "'queued'",
    ),
    (
        "key-typo",
        DEV,
        {"training": {"maxStep": 3}},
        True,
        "training.maxStep: unknown key (did you mean maxSteps?): allowed keys here are accelerator",
    ),
    # Non-finite numbers: every float key of the schema refuses them (the model's config).
    (
        "infinite-learning-rate",
        DEV,
        {"training": {"learningRate": float("inf")}},
        True,
        "training.learningRate: inf: Input should be a finite number",
    ),
    (
        "nan-dropout",
        DEV,
        {"lora": {"dropout": float("nan")}},
        True,
        "lora.dropout: nan: Input should be a finite number",
    ),
    # Empty strings: no key takes one.
    ("empty-network", DEV, {"network": ""}, True, "network: '': String should have at least 1"),
    (
        "empty-served-model-name",
        PROD,
        {"serving": {"servedModelName": ""}},
        True,
        "serving.servedModelName: '': String should have at least 1 character",
    ),
    # Cross-section: what the serving VM's own eval and bench send vs what vLLM is started with.
    (
        "serving-port-is-ssh",
        PROD,
        {"serving": {"port": 22}},
        True,
        "serving.port: 22: is SSH's port on the TPU VM",
    ),
    (
        "context-shorter-than-the-benchmark",
        PROD,
        {"serving": {"maxModelLen": 8192}},
        True,
        "serving.maxModelLen: 8192: the benchmark sweep sends requests of up to 15872 tokens",
    ),
    (
        "benchmark-shape-listed-twice",
        PROD,
        {"serving": {"bench": {"shapes": [[512, 256], [512, 256]]}}},
        True,
        "serving.bench.shapes[1]: (512, 256): already listed as serving.bench.shapes[0]",
    ),
    (
        "benchmark-shape-not-positive",
        PROD,
        {"serving": {"bench": {"shapes": [[0, 256]]}}},
        True,
        "serving.bench.shapes: ",
    ),
    (
        "dataset-on-the-laptop",
        DEV,
        {"data": {"dataset": "/home/me/codev_r1.jsonl"}},
        True,
        "data.dataset: '/home/me/codev_r1.jsonl': the TPU VM reads its data from GCS only",
    ),
    (
        "dataset-malformed-url",
        DEV,
        {"data": {"dataset": "gs://My Bucket/data.jsonl"}},
        True,
        "data.dataset: 'gs://My Bucket/data.jsonl': not a gs://BUCKET/OBJECT URL of a file",
    ),
    (
        "dataset-bucket-only",
        DEV,
        {"data": {"dataset": "gs://my-bucket/"}},
        True,
        "data.dataset: 'gs://my-bucket/': not a gs://BUCKET/OBJECT URL of a file",
    ),
    (
        "eval-output-fills-the-context",
        PROD,
        {"serving": {"maxModelLen": 16384, "eval": {"maxTokens": 16384}}},
        True,
        "serving.eval.maxTokens: 16384: leaves no room for the prompt in serving.maxModelLen",
    ),
    (
        "network-name-with-spaces",
        DEV,
        {"network": "my network"},
        True,
        "network: 'my network': a VPC network name",
    ),
    (
        "network-json-text",
        DEV,
        {"network": '{"nested": 1}'},
        True,
        "network: '{\"nested\": 1}': a VPC network name",
    ),
    (
        "subnetwork-upper-case",
        DEV,
        {"subnetwork": "Sub_A"},
        True,
        "subnetwork: 'Sub_A': a subnetwork name",
    ),
    (
        "hf-id-without-owner",
        DEV,
        {"model": {"hfId": "gemma-4-31B-it"}},
        True,
        "model.hfId: 'gemma-4-31B-it': a Hugging Face repository id, owner/name",
    ),
    (
        "served-name-shell-metacharacters",
        PROD,
        {"serving": {"servedModelName": "gemma; rm -rf ~"}},
        True,
        "serving.servedModelName: 'gemma; rm -rf ~': 1-128 letters",
    ),
    (
        "image-blank",
        PROD,
        {"serving": {"image": " "}},
        True,
        "serving.image: ' ': not a container image reference",
    ),
    (
        "image-upper-case-repository",
        PROD,
        {"serving": {"image": "VLLM/vllm-tpu:v0.21.0"}},
        True,
        "serving.image: 'VLLM/vllm-tpu:v0.21.0': not a container image reference",
    ),
    (
        "image-truncated-digest",
        PROD,
        {"serving": {"image": "vllm/vllm-tpu@sha256:abc"}},
        True,
        "serving.image: 'vllm/vllm-tpu@sha256:abc': not a container image reference",
    ),
    (
        "image-unpinned",
        PROD,
        {"serving": {"image": "vllm/vllm-tpu:latest"}},
        True,
        "serving.image: 'vllm/vllm-tpu:latest': not pinned",
    ),
    (
        "negative-seed",
        DEV,
        {"data": {"seed": -1}},
        True,
        "data.seed: -1: Input should be greater than or equal to 0",
    ),
    (
        "serving-context-beyond-the-model",
        PROD,
        {"serving": {"maxModelLen": 300_032}},
        True,
        "serving.maxModelLen: 300032: longer than gemma-4-31b's 262,144-token context",
    ),
    (
        "training-rows-beyond-the-model",
        DEV,
        {"data": {"maxSeqLen": 262_272}},
        True,
        "data.maxSeqLen: 262272: longer than gemma-4-31b's 262,144-token context",
    ),
    (
        "shm-working-set-beyond-any-host",
        DEV,
        {"training": {"shmWorkingSetGb": 1e308}},
        True,
        "training.shmWorkingSetGb: 1e+308: Input should be less than or equal to 10000",
    ),
    (
        "learning-rate-above-one",
        DEV,
        {"training": {"learningRate": 5}},
        True,
        "training.learningRate: 5: Input should be less than or equal to 1",
    ),
    (
        "scratch-kept-for-ever",
        DEV,
        {"storage": {"scratchDays": 100_000}},
        True,
        "storage.scratchDays: 100000: Input should be less than or equal to 36500",
    ),
]


def test_the_table_is_large_and_ids_are_unique():
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("base", "override", "has_token", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_config_names_key_value_and_what_is_allowed(base, override, has_token, expected):
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config(_merge(base, override), has_hf_token=has_token)
    matching = [p for p in info.value.problems if p.startswith(expected)]
    assert len(matching) == 1, f"expected one line starting {expected!r}, got {info.value.problems}"
    # One line each, always `key: value: allowed`.
    for problem in info.value.problems:
        assert "\n" not in problem
        assert problem.count(": ") >= 2, problem


def test_a_shorter_benchmark_sweep_fits_a_shorter_context():
    # The sweep's shapes are the stack's: a short one fits a short maxModelLen (a small model).
    cfg = stack_config.parse_stack_config(
        _merge(PROD, {"serving": {"maxModelLen": 8192, "bench": {"shapes": [[1024, 512]]}}}),
        has_hf_token=True,
    )
    assert cfg.serving.bench.shapes == ((1024, 512),)


def test_valid_variants_pass():
    # v5p-16 with a mesh over its 8 devices and a micro-batch that splits over hosts and fsdp.
    cfg = stack_config.parse_stack_config(
        _merge(
            DEV,
            {"training": {"accelerator": "v5p-16", "microBatch": 2, "mesh": {"fsdp": 2, "tp": 4}}},
        ),
        has_hf_token=True,
    )
    assert cfg.training.accelerator == "v5p-16"
    # 0.0.0.0/0 only when explicitly allowed.
    stack_config.parse_stack_config(
        _merge(DEV, {"ssh": {"sourceRanges": ["0.0.0.0/0"], "allowFromAnywhere": True}}),
        has_hf_token=True,
    )
    # Serving in the training region shares the one bucket.
    cfg = stack_config.parse_stack_config(
        _merge(PROD, {"serving": {"zone": "us-central1-b", "zoneFallbacks": []}}), has_hf_token=True
    )
    assert cfg.shared_bucket and cfg.serving_bucket_name == cfg.training_bucket_name
    # Data in any readable bucket.
    stack_config.parse_stack_config(
        _merge(DEV, {"data": {"dataset": "gs://my-data_1.example/codev/r1.jsonl"}}),
        has_hf_token=True,
    )
    # No token needed when the bucket already holds the model.
    stack_config.parse_stack_config(
        _merge(DEV, {"model": {"downloadFromHub": False}}), has_hf_token=False
    )
    # A shared VPC by path, a subnetwork by URL, an org's model fork, a served name with a slash,
    # an image in another registry with a port, a digest-pinned image.
    stack_config.parse_stack_config(
        _merge(
            PROD,
            {
                "network": "projects/host-project-1/global/networks/shared-vpc",
                "subnetwork": "https://www.googleapis.com/compute/v1/projects/host-project-1/"
                "regions/us-central1/subnetworks/tpu-subnet",
                "model": {"hfId": "acme-ai/gemma-4-31B-it.v2"},
                "serving": {"servedModelName": "acme/gemma-4-31b-verilog_v1"},
            },
        ),
        has_hf_token=True,
    )
    # Queued capacity with fallbacks in the training region and beyond it.
    cfg = stack_config.parse_stack_config(
        _merge(
            DEV,
            {
                "training": {
                    "provisioning": "queued",
                    "queue": {"capacity": "on-demand", "validForHours": 6},
                    "zoneFallbacks": ["us-east5-a"],
                }
            },
        ),
        has_hf_token=True,
    )
    assert cfg.training.zones == ("us-central1-a", "us-east5-a")
    # A serving node that can be stopped: on-demand, directly or through a queue.
    for serving in (
        {"provisioning": "on-demand", "stopAfterHours": 8},
        {"provisioning": "queued", "queue": {"capacity": "on-demand"}, "stopAfterHours": 8},
    ):
        stack_config.parse_stack_config(_merge(PROD, {"serving": serving}), has_hf_token=True)
    # Greedy evaluation: one sample per problem scores pass@1 (the eval leaves pass@5 out).
    cfg = stack_config.parse_stack_config(
        _merge(PROD, {"serving": {"eval": {"n": 1, "temperature": 0}}}), has_hf_token=True
    )
    assert (cfg.serving.eval.n, cfg.serving.eval.temperature) == (1, 0)
    # Distinct list values pass, and a repeat of the zone across sections is no repeat.
    stack_config.parse_stack_config(
        _merge(DEV, {"lora": {"targets": ["q_einsum", "kv_einsum"]}}), has_hf_token=True
    )
    for image in (
        "registry.example.com:5000/ml/vllm-tpu:2026-11-01",
        "us-docker.pkg.dev/acme/ml/vllm-tpu@sha256:" + "0a" * 32,
    ):
        stack_config.parse_stack_config(
            _merge(PROD, {"serving": {"image": image}}), has_hf_token=True
        )


def test_a_fallback_zone_outside_the_buckets_region_is_a_warning_not_an_error():
    cfg = stack_config.parse_stack_config(
        _merge(
            PROD,
            {
                "training": {"zoneFallbacks": ["us-east5-a"]},
                "serving": {"zoneFallbacks": ["us-east5-b"]},
            },
        ),
        has_hf_token=True,
    )
    assert validation.cross_region_fallbacks(cfg) == [
        "training.zoneFallbacks[0]: 'us-east5-a' is in us-east5, the bucket in us-central1: a VM "
        "placed there reads its data across regions (slower, billed egress)",
        "serving.zoneFallbacks[0]: 'us-east5-b' is in us-east5, the bucket in asia-northeast1: a "
        "VM placed there reads its data across regions (slower, billed egress)",
    ]
    # A fallback in the bucket's own region needs no warning.
    same_region = stack_config.parse_stack_config(
        _merge(PROD, {"serving": {"zone": "us-east5-a", "zoneFallbacks": ["us-east5-b"]}}),
        has_hf_token=True,
    )
    assert validation.cross_region_fallbacks(same_region) == []


@pytest.mark.parametrize(
    "image",
    [
        catalog.VLLM_TPU_IMAGE,  # the default
        "vllm/vllm-tpu:v0.20.0",  # the floor
        "vllm/vllm-tpu:v1.2.3",
        "vllm/vllm-tpu:nightly-20260428-99e0d15-fd74c90",
        "vllm/vllm-tpu:gemma4",  # no version in the tag: nothing to check
        "vllm/vllm-tpu@sha256:" + "0" * 64,  # a digest cannot be judged by name
        "us-docker.pkg.dev/my-project/vllm/vllm-tpu:v0.11.1",  # the user's own build
    ],
)
def test_serving_images_that_may_serve_gemma4_pass(image):
    cfg = stack_config.parse_stack_config(
        _merge(PROD, {"serving": {"image": image}}), has_hf_token=True
    )
    assert cfg.serving.image == image


def test_the_default_serving_image_is_the_catalogs_and_clears_the_floor():
    cfg = stack_config.parse_stack_config(PROD, has_hf_token=True)
    assert cfg.serving.image == catalog.VLLM_TPU_IMAGE
    assert catalog.vllm_tpu_image_problem(catalog.VLLM_TPU_IMAGE) is None
    for old in ("vllm/vllm-tpu:v0.19.0", "vllm/vllm-tpu:0.10.0", "vllm/vllm-tpu:v0.18.0@sha256:ab"):
        assert "too old for Gemma 4" in (catalog.vllm_tpu_image_problem(old) or ""), old


def test_the_image_floor_applies_only_when_serving_is_on():
    stack_config.parse_stack_config(
        _merge(DEV, {"serving": {"enabled": False, "image": "vllm/vllm-tpu:v0.11.1"}}),
        has_hf_token=True,
    )


def test_estimates_for_the_papers_setup():
    prod = stack_config.parse_stack_config(PROD)
    v5p = catalog.accelerator("v5p-8")
    v6e = catalog.accelerator("v6e-8")
    train = sizing.training_hbm_bytes(prod)
    # The paper trained this on v5p-8: the estimate must fit, with the base weights split over tp=4.
    assert catalog.MODELS["gemma-4-31b"].weight_bytes / 4 < train < v5p.hbm_bytes_per_chip
    serve = sizing.serving_hbm_bytes(prod)
    assert serve < v6e.hbm_bytes_per_chip * 0.9
    # vLLM replicates the 4 global KV heads over TP 8: one head per chip, not half a head.
    model = catalog.MODELS["gemma-4-31b"]
    per_token = sizing.serving_kv_bytes_per_token_per_chip(model, 8)
    assert per_token == (50 * 2 * 2 * 256 + 10 * 2 * 1 * 512) * 2
    # LoRA parameters of the paper's targets at rank 64: ~0.46 B.
    count = sizing.lora_param_count(model, 64, config.LoraStackSection().targets)
    assert 0.4e9 < count < 0.5e9


# ---------------------------------------------------------------------------------------------
# The serving engine's knobs: one line each at preview, naming the key, the value, what is allowed


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"kvCacheDtype": "fp16"},
            "serving.kvCacheDtype: 'fp16': Input should be 'auto', 'bfloat16', 'fp8'",
        ),
        ({"maxNumSeqs": 0}, "serving.maxNumSeqs: 0: Input should be greater than or equal to 1"),
        (
            {"maxNumSeqs": 512, "maxNumBatchedTokens": 256},
            "serving.maxNumBatchedTokens: 256: below max_num_seqs 512",
        ),
        ({"hbmUtilization": 1.5}, "serving.hbmUtilization: 1.5: above 0.98: the rest of"),
        (
            {"minConcurrentSequences": 300, "maxNumSeqs": 256},
            "serving.minConcurrentSequences: 300: above serving.maxNumSeqs 256",
        ),
    ],
)
def test_serving_knobs_are_checked_at_preview(override, expected):
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config(
            _merge(PROD, {"serving": {"enabled": True, **override}}), has_hf_token=True
        )
    matching = [p for p in info.value.problems if p.startswith(expected)]
    assert len(matching) == 1, f"expected one line starting {expected!r}, got {info.value.problems}"
    assert all("\n" not in problem for problem in info.value.problems)


def test_an_fp8_kv_cache_halves_the_kv_part_of_the_hbm_estimate():
    bf16 = stack_config.parse_stack_config(_merge(PROD, {"serving": {"minConcurrentSequences": 4}}))
    fp8 = stack_config.parse_stack_config(
        _merge(PROD, {"serving": {"minConcurrentSequences": 4, "kvCacheDtype": "fp8"}})
    )
    weights_and_reserve = (
        sizing.serving_hbm_bytes(bf16)
        - sizing.serving_kv_bytes_per_token_per_chip(catalog.MODELS["gemma-4-31b"], 8)
        * bf16.serving.max_model_len
        * 4
    )
    kv_bf16 = sizing.serving_hbm_bytes(bf16) - weights_and_reserve
    assert sizing.serving_hbm_bytes(fp8) - weights_and_reserve == kv_bf16 // 2
    assert fp8.serving.kv_cache_dtype == "fp8"


def test_every_list_valued_key_is_checked_for_repeats():
    """A list key added to the schema must be given a repeat check (rule_list_repeats, or
    rule_zone_lists for the zone fallbacks)."""
    from infra.config import reference

    lists = {
        key.path for key in reference.iter_keys() if typing.get_origin(key.base) in (tuple, list)
    }
    checked = set(validation.READS["rule_list_repeats"]) | set(validation.READS["rule_zone_lists"])
    assert lists and lists <= checked, sorted(lists - checked)


# ---------------------------------------------------------------------------------------------
# The serving keys and the recovery controller's: bad input is exactly one line naming the key,
# the bad value and what is allowed; good input passes

ONE_LINE = [
    (
        "unknown-profile",
        {"serving": {"profile": "fast"}},
        "serving.profile: 'fast': Input should be 'paper' or 'throughput'",
    ),
    (
        "profile-with-replicas-over-the-chips",
        {"serving": {"profile": "paper", "dataParallelSize": 2}},
        "serving.dataParallelSize: 2, serving.tensorParallelSize: 8: replicas x TP = 16 must "
        "equal the 8 chips of v6e-8 (e.g. 1 x 8, 2 x 4; serving.profile: paper)",
    ),
    (
        "throughput-profile-with-tp-over-its-replicas",
        {"serving": {"profile": "throughput", "tensorParallelSize": 8}},
        "serving.dataParallelSize: 2, serving.tensorParallelSize: 8: replicas x TP = 16 must "
        "equal the 8 chips of v6e-8 (e.g. 1 x 8, 2 x 4; serving.profile: throughput)",
    ),
    (
        "tp-beyond-the-chips",
        {"serving": {"tensorParallelSize": 16}},
        "serving.tensorParallelSize: 16: between 1 and the 8 chips of v6e-8",
    ),
    (
        "quantization-the-engine-does-not-offer",
        {"serving": {"weightQuantization": "int8"}},
        "serving.weightQuantization: 'int8': Input should be 'off' or 'fp8'",
    ),
    (
        "kv-dtype-the-engine-does-not-offer",
        {"serving": {"kvCacheDtype": "fp16"}},
        "serving.kvCacheDtype: 'fp16': Input should be 'auto', 'bfloat16', 'fp8', 'fp8_e4m3' or "
        "'fp8_e5m2'",
    ),
    (
        "unknown-weights-source",
        {"serving": {"weightsFrom": "local"}},
        "serving.weightsFrom: 'local': Input should be 'staged' or 'bucket'",
    ),
    (
        "bench-shape-beyond-the-context",
        {"serving": {"bench": {"shapes": [[1024, 512], [16000, 512]]}}},
        "serving.bench.shapes[1]: [16000, 512]: input + output = 16512 tokens, beyond "
        "serving.maxModelLen 16384; shorten it, raise serving.maxModelLen to 16512 or set "
        "serving.bench.enabled false",
    ),
    (
        "context-below-the-default-bench-shapes",
        {"serving": {"maxModelLen": 4096}},
        "serving.maxModelLen: 4096: the benchmark sweep sends requests of up to 15872 tokens "
        "(input + output); raise it to 15872, shorten serving.bench.shapes or set "
        "serving.bench.enabled false",
    ),
    (
        "recovery-interval-too-short",
        {"recovery": {"enabled": True, "intervalSeconds": 10}},
        "recovery.intervalSeconds: 10: Input should be greater than or equal to 30",
    ),
    (
        "recovery-zone-a-region",
        {"recovery": {"enabled": True, "zone": "us-central1"}},
        "recovery.zone: 'us-central1': a zone such as us-central1-a, or unset",
    ),
    (
        "recovery-machine-type",
        {"recovery": {"enabled": True, "machineType": "n1-standard-1"}},
        "recovery.machineType: 'n1-standard-1': Input should be 'e2-micro', 'e2-small' or "
        "'e2-medium'",
    ),
    (
        "recovery-limit-that-is-a-flag",
        {"recovery": {"enabled": True, "maxAttempts": 3}},
        "recovery.maxAttempts: unknown key: allowed keys here are backendUrl, enabled, "
        "intervalSeconds, machineType, zone",
    ),
]


@pytest.mark.parametrize(
    ("override", "expected"), [c[1:] for c in ONE_LINE], ids=[c[0] for c in ONE_LINE]
)
def test_a_bad_serving_or_recovery_key_is_exactly_one_line(override, expected):
    with pytest.raises(config.ConfigError) as info:
        stack_config.parse_stack_config(_merge(PROD, override), has_hf_token=True)
    assert info.value.problems == [expected]


@pytest.mark.parametrize(
    "override",
    [
        {"serving": {"profile": "throughput"}},
        {"serving": {"profile": "throughput", "tensorParallelSize": 8, "dataParallelSize": 1}},
        {"serving": {"profile": "throughput", "weightQuantization": "off"}},
        {"serving": {"profile": "paper", "tensorParallelSize": 4, "dataParallelSize": 2}},
        {"serving": {"weightQuantization": "fp8", "kvCacheDtype": "fp8_e5m2"}},
        {"serving": {"weightsFrom": "bucket"}},
        {"serving": {"maxModelLen": 1536, "bench": {"shapes": [[1024, 512]]}}},
        {"serving": {"maxModelLen": 4096, "bench": {"enabled": False}}},
        {
            "recovery": {
                "enabled": True,
                "intervalSeconds": 30,
                "zone": "us-central1-b",
                "machineType": "e2-micro",
            }
        },
    ],
    ids=lambda override: ",".join(f"{k}={v}" for k, v in next(iter(override.values())).items()),
)
def test_a_good_serving_or_recovery_key_passes(override):
    cfg = stack_config.parse_stack_config(_merge(PROD, override), has_hf_token=True)
    serve = runconfig_render.render_run_config(cfg).serve
    assert serve is not None
    # The profile gives what the stack leaves unset; a key the stack sets wins.
    for key, value in override.get("serving", {}).items():
        if key != "bench":
            assert getattr(serve, to_snake(key)) == value, key
    # weightsFrom bucket streams the merged model from where the merge wrote it: always gs://.
    assert serve.model_dir.startswith("gs://")
