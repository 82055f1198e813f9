"""The rules a stack config must pass before any resource is declared (each from a catalog fact).

Every rule reads the catalog (workloads/contract/catalog.py) and returns problem lines of the form
`key: bad value: what is allowed`; `check` runs them all so that the user sees every problem at
once. The memory estimates the rules compare against the catalog are in infra/config/sizing.py.

One function per concern, all run on every config.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterable

from infra.config import model as config_mod
from infra.config.sizing import (
    serving_hbm_bytes,
    serving_shm_bytes,
    training_hbm_bytes,
    training_shm_bytes,
)
from workloads.contract import catalog

StackConfig = config_mod.StackConfig
Rule = Callable[[StackConfig], list[str]]
AnyRule = Callable[..., list[str]]

# The stack-config keys each rule reads, as users type them (a section stands for every key
# under it), by rule name. docs/config.md's "Checked by" column is made from this table, and
# tests/infra/config/test_validation_reads.py runs every rule on recording configs to prove that no
# rule reads a key it does not declare.
READS: dict[str, tuple[str, ...]] = {}


def reads(*keys: str) -> Callable[[AnyRule], AnyRule]:
    """Declares the keys the decorated rule reads (see READS)."""

    def declare(rule: AnyRule) -> AnyRule:
        READS[rule.__name__] = keys
        return rule

    return declare


GB = catalog.GB

# GCP naming rules (documented limits of each resource type).
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_PREFIX_RE = re.compile(r"^[a-z]([-a-z0-9]{0,18}[a-z0-9])?$")
_NODE_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$")
_RUN_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
_LINUX_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_SSH_KEY_TYPE_RE = re.compile(
    r"^(ssh-(ed25519|rsa|dss)|ecdsa-sha2-nistp(256|384|521)|sk-[a-z0-9@.-]+)$"
)
# A VPC network or subnetwork: its name, or its path/URL in another project (shared VPC).
_NETWORK_RE = re.compile(
    r"^((https://www\.googleapis\.com/compute/v1/)?projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/"
    r"global/networks/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
)
_SUBNETWORK_RE = re.compile(
    r"^((https://www\.googleapis\.com/compute/v1/)?projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/"
    r"regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
)
# Hugging Face repository ids: owner/name, letters, digits, '.', '_', '-' (at most 96 each).
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# The served model name: what clients send as "model" and vLLM's --served-model-name (no spaces,
# nothing a shell or URL would read specially).
_SERVED_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_ANYWHERE = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))


def _fmt_gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def _accelerator(name: str) -> catalog.Accelerator | None:
    return catalog.ACCELERATORS.get(name)


# ---------------------------------------------------------------------------------------------
# Names


@reads(
    "labels",
    "namePrefix",
    "project",
    "runName",
    "serving.enabled",
    "serving.nodeName",
    "serving.zone",
    "ssh.user",
    "storage.bucketName",
    "storage.location",
    "storage.servingBucketName",
    "storage.servingLocation",
    "training.nodeName",
    "training.zone",
)
def rule_names(cfg: StackConfig) -> list[str]:
    """Names valid for GCP: project id, prefix, node names, bucket names, run name, labels."""
    problems = []
    if not _PROJECT_RE.match(cfg.project):
        problems.append(
            f"project: {cfg.project!r}: a GCP project id is 6-30 characters: lower-case letters, "
            "digits and dashes, starting with a letter, not ending with a dash"
        )
    if not _PREFIX_RE.match(cfg.name_prefix):
        problems.append(
            f"namePrefix: {cfg.name_prefix!r}: 1-20 characters: lower-case letters, digits and "
            "dashes, starting with a letter, not ending with a dash"
        )
    if not _RUN_RE.match(cfg.run_name):
        problems.append(
            f"runName: {cfg.run_name!r}: 1-63 characters: lower-case letters, digits and dashes, "
            "starting with a letter"
        )
    nodes = [("training.nodeName", cfg.training_node_name)]
    if cfg.serving.enabled:
        nodes.append(("serving.nodeName", cfg.serving_node_name))
    for key, name in nodes:
        if not _NODE_RE.match(name):
            problems.append(
                f"{key}: {name!r}: a TPU node name is 1-63 characters: lower-case letters, digits "
                "and dashes, starting with a letter, not ending with a dash"
            )
    if cfg.serving.enabled and cfg.training_node_name == cfg.serving_node_name:
        problems.append(
            f"serving.nodeName: {cfg.serving_node_name!r}: must differ from the training node name"
        )
    buckets = [("storage.bucketName", cfg.training_bucket_name)]
    if not cfg.shared_bucket:
        buckets.append(("storage.servingBucketName", cfg.serving_bucket_name))
    for key, name in buckets:
        if not _BUCKET_RE.match(name) or name.startswith("goog") or "google" in name:
            problems.append(
                f"{key}: {name!r}: a bucket name is 3-63 characters: lower-case letters, digits, "
                "dashes and underscores, starting and ending with a letter or digit, without "
                "'goog' prefix or 'google' (the default is <project>-<namePrefix>-<region>: "
                "set a shorter one)"
            )
    if not cfg.shared_bucket and cfg.training_bucket_name == cfg.serving_bucket_name:
        problems.append(
            f"storage.servingBucketName: {cfg.serving_bucket_name!r}: the serving bucket is in "
            "another region and needs its own name"
        )
    for key, value in cfg.labels.items():
        if not _LABEL_KEY_RE.match(key):
            problems.append(
                f"labels.{key}: {key!r}: a label key is 1-63 characters: lower-case letters, "
                "digits, _ and -, starting with a letter"
            )
        if not _LABEL_VALUE_RE.match(value):
            problems.append(
                f"labels.{key}: {value!r}: a label value is 0-63 characters: lower-case letters, "
                "digits, _ and -"
            )
    if not _LINUX_USER_RE.match(cfg.ssh.user):
        problems.append(
            f"ssh.user: {cfg.ssh.user!r}: a Linux user name: lower-case letters, digits, _ and -"
        )
    return problems


@reads("model.hfId", "network", "serving.servedModelName", "subnetwork")
def rule_references(cfg: StackConfig) -> list[str]:
    """Names of things outside the stack that it refers to: the VPC network and subnetwork, the
    Hugging Face repository, and the model name clients ask vLLM for."""
    problems = []
    if not _NETWORK_RE.match(cfg.network):
        problems.append(
            f"network: {cfg.network!r}: a VPC network name (lower-case letters, digits and "
            "dashes, starting with a letter, at most 63) or projects/<id>/global/networks/<name>"
        )
    if cfg.subnetwork is not None and not _SUBNETWORK_RE.match(cfg.subnetwork):
        problems.append(
            f"subnetwork: {cfg.subnetwork!r}: a subnetwork name (lower-case letters, digits and "
            "dashes, starting with a letter) or projects/<id>/regions/<region>/subnetworks/<name>"
        )
    if cfg.model.hf_id is not None and not _HF_REPO_RE.match(cfg.model.hf_id):
        problems.append(
            f"model.hfId: {cfg.model.hf_id!r}: a Hugging Face repository id, owner/name "
            "(letters, digits, '.', '_' and '-'), e.g. google/gemma-4-31B-it"
        )
    if not _SERVED_NAME_RE.match(cfg.serving.served_model_name):
        problems.append(
            f"serving.servedModelName: {cfg.serving.served_model_name!r}: 1-128 letters, digits, "
            "'.', '_', '-' and '/', starting with a letter or digit (clients send it as the model)"
        )
    return problems


# ---------------------------------------------------------------------------------------------
# Accelerators, runtimes, zones, regions


def _slice_problems(
    section: str, accelerator: str, runtime: str | None, zone: str, fallbacks: Iterable[str]
) -> list[str]:
    acc = _accelerator(accelerator)
    if acc is None:
        return [
            f"{section}.accelerator: {accelerator!r}: known accelerator types are "
            f"{', '.join(catalog.ACCELERATORS)}"
        ]
    problems = []
    if runtime is not None:
        reason = catalog.KNOWN_BAD_RUNTIMES.get((acc.generation, runtime))
        allowed = ", ".join(catalog.RUNTIME_VERSIONS[acc.generation])
        if reason:
            problems.append(f"{section}.runtimeVersion: {runtime!r}: {reason}; use {allowed}")
        elif runtime not in catalog.RUNTIME_VERSIONS[acc.generation]:
            problems.append(
                f"{section}.runtimeVersion: {runtime!r}: {acc.generation} runs {allowed} "
                "(or leave it unset)"
            )
    for key, z in [(f"{section}.zone", zone)] + [
        (f"{section}.zoneFallbacks[{i}]", z) for i, z in enumerate(fallbacks)
    ]:
        if z not in acc.zones:
            problems.append(f"{key}: {z!r}: {acc.name} is offered in {', '.join(acc.zones)}")
    return problems


@reads(
    "serving.accelerator",
    "serving.enabled",
    "serving.runtimeVersion",
    "serving.zone",
    "serving.zoneFallbacks",
    "training.accelerator",
    "training.runtimeVersion",
    "training.zone",
    "training.zoneFallbacks",
)
def rule_slices(cfg: StackConfig) -> list[str]:
    """Accelerator known; runtime matches the generation; zone (and fallbacks) offer the type."""
    problems = _slice_problems(
        "training",
        cfg.training.accelerator,
        cfg.training.runtime_version,
        cfg.training.zone,
        cfg.training.zone_fallbacks,
    )
    if cfg.serving.enabled:
        problems += _slice_problems(
            "serving",
            cfg.serving.accelerator,
            cfg.serving.runtime_version,
            cfg.serving.zone,
            cfg.serving.zone_fallbacks,
        )
    return problems


def _zone_repeats(section: str, zone: str, fallbacks: Iterable[str]) -> list[str]:
    seen = {zone: f"{section}.zone"}
    problems = []
    for i, fallback in enumerate(fallbacks):
        key = f"{section}.zoneFallbacks[{i}]"
        if fallback in seen:
            problems.append(
                f"{key}: {fallback!r}: already listed as {seen[fallback]}; list each zone once"
            )
        else:
            seen[fallback] = key
    return problems


@reads(
    "serving.enabled",
    "serving.zone",
    "serving.zoneFallbacks",
    "training.zone",
    "training.zoneFallbacks",
)
def rule_zone_lists(cfg: StackConfig) -> list[str]:
    """Each zone once per slice: zone first, then zoneFallbacks (a repeat would be tried once and
    the list silently shortened)."""
    problems = _zone_repeats("training", cfg.training.zone, cfg.training.zone_fallbacks)
    if cfg.serving.enabled:
        problems += _zone_repeats("serving", cfg.serving.zone, cfg.serving.zone_fallbacks)
    return problems


def _queue_unused(section: str, provisioning: str, fields_set: Iterable[str]) -> list[str]:
    if "queue" not in fields_set or provisioning == "queued":
        return []
    return [
        f"{section}.queue: set, but {section}.provisioning is {provisioning!r}: the queue "
        f"settings apply only to provisioning: queued; remove {section}.queue or set "
        f"{section}.provisioning: queued"
    ]


def _repeats(key: str, values: Iterable[object]) -> list[str]:
    """One line per value listed again in the list at `key` (by its first repeat's index)."""
    seen: dict[object, int] = {}
    problems = []
    for i, value in enumerate(values):
        if value in seen:
            problems.append(
                f"{key}[{i}]: {value!r}: already listed as {key}[{seen[value]}]; list each once"
            )
        else:
            seen[value] = i
    return problems


@reads(
    "lora.targets",
    "serving.apiSourceRanges",
    "serving.bench.requestRates",
    "serving.bench.shapes",
    "serving.enabled",
    "ssh.sourceRanges",
)
def rule_list_repeats(cfg: StackConfig) -> list[str]:
    """Each value of a list-valued key once: a repeat is a typo that the list's consumer would
    silently collapse (a LoRA target adapted once, a firewall range allowed once). The zone
    lists have their own rule (rule_zone_lists: a fallback may also repeat the zone)."""
    problems = _repeats("lora.targets", cfg.lora.targets)
    problems += _repeats("ssh.sourceRanges", cfg.ssh.source_ranges)
    if cfg.serving.enabled:
        problems += _repeats("serving.apiSourceRanges", cfg.serving.api_source_ranges)
        # A sweep point listed twice is measured twice and tabled once.
        problems += _repeats("serving.bench.shapes", cfg.serving.bench.shapes)
        problems += _repeats("serving.bench.requestRates", cfg.serving.bench.request_rates)
    return problems


# The queue sections are read for presence (a queue set without provisioning: queued).
@reads(
    "serving.enabled",
    "serving.provisioning",
    "serving.queue",
    "serving.stopAfterHours",
    "training.provisioning",
    "training.queue",
)
def rule_provisioning(cfg: StackConfig) -> list[str]:
    """Settings that only one capacity model uses are refused with another: the queue settings
    need provisioning: queued; serving.stopAfterHours needs a node that can be stopped. Google's
    Cloud TPU docs: a Spot VM (the current form of the older preemptible TPUs, without their
    24-hour limit) cannot be restarted, only deleted and created again; a preemptible TPU is
    likewise preempted or deleted, never stopped. Only on-demand capacity (direct, or through a
    queued resource, whose ACTIVE node is managed like any other) can be stopped and started."""
    problems = _queue_unused("training", cfg.training.provisioning, cfg.training.model_fields_set)
    if not cfg.serving.enabled:
        return problems
    provisioning = cfg.serving.provisioning
    problems += _queue_unused("serving", provisioning, cfg.serving.model_fields_set)
    hours = cfg.serving.stop_after_hours
    kind: str = provisioning
    if kind == "queued":
        kind = "on-demand" if cfg.serving.queue.capacity == "on-demand" else "queued spot"
    if hours is not None and kind != "on-demand":
        default = "" if "provisioning" in cfg.serving.model_fields_set else ", the default"
        problems.append(
            f"serving.stopAfterHours: {hours:g}: a {kind} TPU (serving.provisioning: "
            f"{provisioning}{default}) cannot be stopped, only deleted; set serving.provisioning: "
            "on-demand (or queued with serving.queue.capacity: on-demand), or remove "
            "serving.stopAfterHours"
        )
    return problems


def cross_region_fallbacks(cfg: StackConfig) -> list[str]:
    """Warnings, not errors: a fallback zone outside the bucket's region works, but a VM placed
    there reads its data across regions (slower, and the transfer is billed)."""
    warnings = []
    sections: list[tuple[str, config_mod.SliceStackSection, str]] = [
        ("training", cfg.training, cfg.training_bucket_location)
    ]
    if cfg.serving.enabled:
        sections.append(("serving", cfg.serving, cfg.serving_bucket_location))
    for name, section, bucket_region in sections:
        for i, zone in enumerate(section.zone_fallbacks):
            region = catalog.zone_region(zone)
            if region != bucket_region:
                warnings.append(
                    f"{name}.zoneFallbacks[{i}]: {zone!r} is in {region}, the bucket in "
                    f"{bucket_region}: a VM placed there reads its data across regions (slower, "
                    "billed egress)"
                )
    return warnings


@reads(
    "serving.enabled",
    "serving.zone",
    "storage.location",
    "storage.servingLocation",
    "training.zone",
)
def rule_bucket_regions(cfg: StackConfig) -> list[str]:
    """A TPU VM reads its bucket in its own region (cross-region reads are slow and billed)."""
    problems = []
    if cfg.storage.location and cfg.storage.location.lower() != cfg.training_region:
        problems.append(
            f"storage.location: {cfg.storage.location!r}: must be the training zone's region "
            f"{cfg.training_region!r} (the TPU reads its bucket in-region), or unset"
        )
    if (
        cfg.serving.enabled
        and cfg.storage.serving_location
        and cfg.storage.serving_location.lower() != cfg.serving_region
    ):
        problems.append(
            f"storage.servingLocation: {cfg.storage.serving_location!r}: must be the serving "
            f"zone's region {cfg.serving_region!r} (the TPU reads its bucket in-region), or unset"
        )
    return problems


# ---------------------------------------------------------------------------------------------
# Model, mesh, batch


@reads("data.maxSeqLen", "model.name", "serving.maxModelLen")
def rule_model(cfg: StackConfig) -> list[str]:
    """A known model, and sequences no longer than its context window."""
    model = cfg.model_spec
    if model is None:
        return [f"model.name: {cfg.model.name!r}: known models are {', '.join(catalog.MODELS)}"]
    problems = []
    for key, length in (
        ("data.maxSeqLen", cfg.data.max_seq_len),
        ("serving.maxModelLen", cfg.serving.max_model_len),
    ):
        if length > model.max_context:
            problems.append(
                f"{key}: {length}: longer than {model.name}'s {model.max_context:,}-token context"
            )
    return problems


@reads("model.name", "training.accelerator", "training.mesh.fsdp", "training.mesh.tp")
def rule_mesh(cfg: StackConfig) -> list[str]:
    """fsdp * tp == JAX devices of the slice; tp divides every sharded head count."""
    problems = []
    acc = _accelerator(cfg.training.accelerator)
    mesh = cfg.training.mesh
    if acc is not None and mesh.fsdp * mesh.tp != acc.jax_devices:
        problems.append(
            f"training.mesh: fsdp={mesh.fsdp} x tp={mesh.tp} = {mesh.fsdp * mesh.tp}: must equal "
            f"the {acc.jax_devices} JAX devices of {acc.name}"
        )
    model = cfg.model_spec
    if model is not None:
        bad = [h for h in model.head_counts if h % mesh.tp]
        if bad:
            allowed = [
                d
                for d in range(1, model.num_heads + 1)
                if all(h % d == 0 for h in model.head_counts)
            ]
            problems.append(
                f"training.mesh.tp: {mesh.tp}: must divide the query, KV and global KV heads "
                f"{model.head_counts} of {model.name}; allowed: {', '.join(map(str, allowed))}"
            )
    return problems


@reads("training.accelerator", "training.mesh.fsdp", "training.microBatch")
def rule_batch(cfg: StackConfig) -> list[str]:
    """The global micro-batch splits evenly over the data-parallel axis and over the hosts."""
    problems = []
    t = cfg.training
    if t.micro_batch % t.mesh.fsdp:
        problems.append(
            f"training.microBatch: {t.micro_batch}: must be a multiple of the data-parallel size "
            f"(mesh.fsdp = {t.mesh.fsdp})"
        )
    acc = _accelerator(t.accelerator)
    if acc is not None and t.micro_batch % acc.hosts:
        problems.append(
            f"training.microBatch: {t.micro_batch}: must be a multiple of the {acc.hosts} hosts "
            f"of {acc.name} (every host feeds its own rows)"
        )
    return problems


@reads("merge.enabled", "serving.enabled")
def rule_merge(cfg: StackConfig) -> list[str]:
    problems = []
    if cfg.serving.enabled and not cfg.merge.enabled:
        problems.append(
            "merge.enabled: false: must be true when serving.enabled is true (the serving VM "
            "serves the merged model)"
        )
    return problems


@reads(
    "model.name",
    "serving.accelerator",
    "serving.dataParallelSize",
    "serving.enabled",
    "serving.profile",
    "serving.tensorParallelSize",
)
def rule_serving_tp(cfg: StackConfig) -> list[str]:
    """vLLM's replicas x TP use exactly the slice's chips, and TP fits the heads (vLLM
    replicates KV heads, so TP must divide the query heads and either divide or be a multiple of
    each KV head count)."""
    if not cfg.serving.enabled:
        return []
    acc = _accelerator(cfg.serving.accelerator)
    model = cfg.model_spec
    tp = cfg.serving.tensor_parallel_size
    dp = cfg.serving.data_parallel_size
    problems = []
    if tp < 1 or (acc is not None and tp > acc.chips):
        chips = acc.chips if acc else "?"
        problems.append(
            f"serving.tensorParallelSize: {tp}: between 1 and the {chips} chips of "
            f"{cfg.serving.accelerator}"
        )
    elif acc is not None and tp * dp != acc.chips:
        problems.append(
            f"serving.dataParallelSize: {dp}, serving.tensorParallelSize: {tp}: replicas x TP = "
            f"{tp * dp} must equal the {acc.chips} chips of {cfg.serving.accelerator} (e.g. 1 x "
            f"{acc.chips}, 2 x {acc.chips // 2}; serving.profile: {cfg.serving.profile})"
        )
    if model is not None and tp >= 1 and (acc is None or tp <= acc.chips):
        kv_ok = all(kv % tp == 0 or tp % kv == 0 for kv in model.head_counts[1:])
        if model.num_heads % tp or not kv_ok:
            problems.append(
                f"serving.tensorParallelSize: {tp}: must divide the {model.num_heads} query heads "
                f"and divide or be a multiple of the KV heads {model.head_counts[1:]} "
                "(e.g. 1, 2, 4, 8)"
            )
    return problems


@reads("serving.enabled", "serving.image")
def rule_serving_image(cfg: StackConfig) -> list[str]:
    """The serving image can load Gemma 4: official release tags at or above the catalog's
    floor, nightlies from the day the model landed; digests and other repositories pass
    unjudged. (That it is a well-formed, pinned reference is the schema's check.)"""
    if not cfg.serving.enabled:
        return []
    problem = catalog.vllm_tpu_image_problem(cfg.serving.image)
    return [f"serving.image: {cfg.serving.image!r}: {problem}"] if problem else []


# ---------------------------------------------------------------------------------------------
# Memory: /dev/shm and HBM


def _shm_room(acc: catalog.Accelerator) -> str:
    return (
        f"{_fmt_gb(acc.shm_limit_bytes)} /dev/shm can grow to on a {acc.name} host "
        f"({catalog.SHM_MAX_FRACTION:.0%} of its {_fmt_gb(acc.host_ram_bytes)} of RAM)"
    )


@reads(
    "data.maxSeqLen",
    "lora.rank",
    "lora.targets",
    "merge.enabled",
    "model.name",
    "model.stageDir",
    "serving.accelerator",
    "serving.enabled",
    "serving.hbmUtilization",
    "serving.kvCacheDtype",
    "serving.maxModelLen",
    "serving.minConcurrentSequences",
    "serving.profile",
    "serving.shmWorkingSetGb",
    "serving.tensorParallelSize",
    "serving.weightQuantization",
    "training.accelerator",
    "training.attention",
    "training.mesh.fsdp",
    "training.mesh.tp",
    "training.microBatch",
    "training.remat",
    "training.shmWorkingSetGb",
)
def rule_memory(cfg: StackConfig) -> list[str]:
    """Weights + working set fit /dev/shm (never the boot disk); HBM fits per chip."""
    problems: list[str] = []
    model = cfg.model_spec
    if model is None:
        return problems
    stage = cfg.model.stage_dir.rstrip("/")
    if not (stage == "/dev/shm" or stage.startswith("/dev/shm/")):
        acc = _accelerator(cfg.training.accelerator)
        free = f"; the boot disk has {_fmt_gb(acc.boot_disk_free_bytes)} free" if acc else ""
        problems.append(
            f"model.stageDir: {cfg.model.stage_dir!r}: must be under /dev/shm (RAM-backed): the "
            f"weights are {_fmt_gb(model.weight_bytes)}{free}"
        )
    train_acc = _accelerator(cfg.training.accelerator)
    if train_acc is not None:
        need = training_shm_bytes(cfg)
        if need > train_acc.shm_limit_bytes:
            problems.append(
                f"training.shmWorkingSetGb: {cfg.training.shm_working_set_gb}: weights "
                f"{_fmt_gb(model.weight_bytes)}{' x2 (base + merged)' if cfg.merge.enabled else ''}"
                f" + working set = {_fmt_gb(need)} exceed the {_shm_room(train_acc)}"
            )
        need = training_hbm_bytes(cfg)
        if need > train_acc.hbm_bytes_per_chip:
            problems.append(
                f"training.microBatch: {cfg.training.micro_batch}: estimated HBM per device "
                f"{_fmt_gb(need)} (maxSeqLen {cfg.data.max_seq_len}, mesh fsdp="
                f"{cfg.training.mesh.fsdp} tp={cfg.training.mesh.tp}, lora.rank {cfg.lora.rank}) "
                f"exceeds the {_fmt_gb(train_acc.hbm_bytes_per_chip)} of {train_acc.name}; lower "
                "microBatch or maxSeqLen, or use more devices"
            )
    serve_acc = _accelerator(cfg.serving.accelerator)
    if cfg.serving.enabled and serve_acc is not None:
        need = serving_shm_bytes(cfg)
        if need > serve_acc.shm_limit_bytes:
            problems.append(
                f"serving.shmWorkingSetGb: {cfg.serving.shm_working_set_gb}: merged weights + "
                f"working set = {_fmt_gb(need)} exceed the {_shm_room(serve_acc)}"
            )
        need = serving_hbm_bytes(cfg)
        budget = serve_acc.hbm_bytes_per_chip * cfg.serving.hbm_utilization
        if need > budget:
            problems.append(
                f"{_serving_hbm_keys(cfg)}: estimated HBM per chip {_fmt_gb(need)} (the "
                f"{_fmt_gb(model.weight_bytes)} of model.name {cfg.model.name!r} / TP at "
                f"weightQuantization {cfg.serving.weight_quantization!r} + KV cache for "
                f"{cfg.serving.min_concurrent_sequences} x {cfg.serving.max_model_len} "
                f"tokens per replica) exceeds {cfg.serving.hbm_utilization:.0%} of the "
                f"{_fmt_gb(serve_acc.hbm_bytes_per_chip)} of {serve_acc.name}; raise "
                "tensorParallelSize or hbmUtilization, or lower maxModelLen, "
                "minConcurrentSequences, or set weightQuantization fp8 or kvCacheDtype fp8 "
                "(serving.profile: throughput sets both)"
            )
    return problems


# The serving keys the HBM estimate and its budget read, in the order the message names them.
_SERVING_HBM_KEYS = (
    ("min_concurrent_sequences", "minConcurrentSequences"),
    ("tensor_parallel_size", "tensorParallelSize"),
    ("hbm_utilization", "hbmUtilization"),
    ("max_model_len", "maxModelLen"),
    ("kv_cache_dtype", "kvCacheDtype"),
    ("weight_quantization", "weightQuantization"),
    ("profile", "profile"),
)


def _serving_hbm_keys(cfg: StackConfig) -> str:
    """Every serving key whose value makes the HBM estimate exceed its budget, with its value:
    any of them can make it fit. The keys the stack sets come first (a stack that raised the
    concurrent sequences reads that key first, not a TP it kept), then the defaults it relies on.
    """
    fields_set = cfg.serving.model_fields_set
    ordered = sorted(_SERVING_HBM_KEYS, key=lambda k: k[0] not in fields_set)
    return ", ".join(f"serving.{key}: {getattr(cfg.serving, attr)!r}" for attr, key in ordered)


# ---------------------------------------------------------------------------------------------
# Network and secrets


def _range_problems(key: str, ranges: Iterable[str], allow_anywhere: bool) -> list[str]:
    problems = []
    for i, text in enumerate(ranges):
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            problems.append(f"{key}[{i}]: {text!r}: a CIDR range such as 198.51.100.7/32")
            continue
        if net in _ANYWHERE and not allow_anywhere:
            problems.append(
                f"{key}[{i}]: {text!r}: open to the whole internet; use your own range (e.g. "
                "198.51.100.7/32) or set ssh.allowFromAnywhere: true"
            )
    return problems


@reads(
    "serving.apiSourceRanges",
    "serving.enabled",
    "ssh.allowFromAnywhere",
    "ssh.privateKeyFile",
    "ssh.publicKey",
    "ssh.sourceRanges",
)
def rule_network(cfg: StackConfig) -> list[str]:
    """SSH limited to configured ranges, never 0.0.0.0/0 unless explicitly allowed."""
    problems = []
    if not cfg.ssh.source_ranges:
        problems.append(
            "ssh.sourceRanges: []: at least one CIDR range (your address, e.g. 198.51.100.7/32); "
            "the deployment connects over SSH"
        )
    problems += _range_problems(
        "ssh.sourceRanges", cfg.ssh.source_ranges, cfg.ssh.allow_from_anywhere
    )
    problems += _key_file_problems(cfg.ssh.private_key_file)
    key = cfg.ssh.public_key
    if key is None and cfg.ssh.private_key_file is None:
        problems.append(
            "ssh.publicKey: not set: required when ssh.privateKeyFile is null (ssh-agent): the "
            "OpenSSH public key line of the agent's key, e.g. 'ssh-ed25519 AAAA... you@host'"
        )
    if key is not None:
        parts = key.split()
        if len(parts) < 2 or not _SSH_KEY_TYPE_RE.match(parts[0]):
            shown = key if len(key) <= 40 else key[:37] + "..."
            problems.append(
                f"ssh.publicKey: {shown!r}: an OpenSSH public key line such as "
                "'ssh-ed25519 AAAA... you@host' (or unset to read <privateKeyFile>.pub)"
            )
    if cfg.serving.enabled:
        problems += _range_problems(
            "serving.apiSourceRanges", cfg.serving.api_source_ranges, cfg.ssh.allow_from_anywhere
        )
    return problems


@reads("model.downloadFromHub")
def rule_hf_token(cfg: StackConfig, has_hf_token: bool | None) -> list[str]:
    if has_hf_token is False and cfg.model.download_from_hub:
        return [
            f"{config_mod.HF_TOKEN_KEY}: not set: model.downloadFromHub is true; set it with "
            f"`pulumi config set --secret {config_mod.HF_TOKEN_KEY} hf_...` or set "
            "model.downloadFromHub: false once the bucket holds the model"
        ]
    return []


SSH_PORT = 22
# gs://bucket/object: a bucket name is 3-63 of [a-z0-9-_.], starting and ending alphanumeric.
_GS_URL = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]/[^\s]+[^/\s]$")


@reads("data.dataset", "storage.bucketName", "storage.location", "training.zone")
def rule_dataset(cfg: StackConfig) -> list[str]:
    """The training VM reads its data from GCS: a path on this machine, or a malformed URL,
    would fail only on the VM, after the model is staged."""
    dataset = cfg.data.dataset
    if dataset is None or _GS_URL.match(dataset):
        return []
    where = f"gs://{cfg.training_bucket_name}/data/codev-r1.jsonl"
    if not dataset.startswith("gs://"):
        return [
            f"data.dataset: {dataset!r}: the TPU VM reads its data from GCS only: upload it "
            f"(gcloud storage cp FILE {where}) and give its gs:// URL, or leave the key unset "
            "for that default"
        ]
    return [f"data.dataset: {dataset!r}: not a gs://BUCKET/OBJECT URL of a file (e.g. {where})"]


@reads(
    "serving.bench.enabled",
    "serving.bench.shapes",
    "serving.enabled",
    "serving.eval.enabled",
    "serving.eval.maxTokens",
    "serving.maxModelLen",
    "serving.port",
)
def rule_serving_requests(cfg: StackConfig) -> list[str]:
    """What the serving VM's own eval and benchmark will send fits what vLLM is started with,
    and the API port is not SSH's."""
    if not cfg.serving.enabled:
        return []
    serving = cfg.serving
    problems = []
    if serving.port == SSH_PORT:
        problems.append(
            f"serving.port: {serving.port}: is SSH's port on the TPU VM; use another (default 8000)"
        )
    # Any n >= 1 is fine: the eval reports pass@k for the k <= n of its list (pass@1 at least).
    eval_section = cfg.serving.eval
    if eval_section.enabled and eval_section.max_tokens >= serving.max_model_len:
        problems.append(
            f"serving.eval.maxTokens: {eval_section.max_tokens}: leaves no room for the prompt "
            f"in serving.maxModelLen {serving.max_model_len}"
        )
    if not serving.bench.enabled:
        return problems
    if "shapes" in serving.bench.model_fields_set:
        # The stack's own shapes: name each one that does not fit, as the user wrote it.
        for index, (inp, out) in enumerate(serving.bench.shapes):
            if inp + out > serving.max_model_len:
                problems.append(
                    f"serving.bench.shapes[{index}]: [{inp}, {out}]: input + output = "
                    f"{inp + out} tokens, beyond serving.maxModelLen {serving.max_model_len}; "
                    f"shorten it, raise serving.maxModelLen to {inp + out} or set "
                    "serving.bench.enabled false"
                )
        return problems
    longest = max(i + o for i, o in serving.bench.shapes)
    if longest > serving.max_model_len:
        problems.append(
            f"serving.maxModelLen: {serving.max_model_len}: the benchmark sweep sends requests "
            f"of up to {longest} tokens (input + output); raise it to {longest}, shorten "
            "serving.bench.shapes or set serving.bench.enabled false"
        )
    return problems


def key_file_problems(path: str | None) -> list[str]:
    """ssh.privateKeyFile's problems as rule_network reports them (the operator commands read
    the key file from this machine's stack file without the other rules).

    Args:
        path: the ssh.privateKeyFile value, None for ssh-agent.

    Returns:
        One line per problem (empty when the path can be opened).
    """
    return _key_file_problems(path)


def _key_file_problems(path: str | None) -> list[str]:
    """A key file path the OS can open: no control characters, and `~name/` only for a real user."""
    if path is None:
        return []
    allowed = "a file path: absolute, relative to the stack's directory, or ~/..."
    if not path.strip() or any(ord(ch) < 32 or ord(ch) == 127 for ch in path):
        return [f"ssh.privateKeyFile: {path!r}: {allowed} (no control characters)"]
    if path.startswith("~") and os.path.expanduser(path).startswith("~"):
        user = path[1:].split("/", 1)[0]
        return [f"ssh.privateKeyFile: {path!r}: no user {user!r} on this machine; {allowed}"]
    return []


@reads("recovery.enabled", "recovery.zone")
def rule_recovery(cfg: StackConfig) -> list[str]:
    """The controller's zone, when set, is a zone name. It needs nothing else of the stack: it
    recreates the node from the request `pulumi up` records (no state backend, key or secret)."""
    rec = cfg.recovery
    if not rec.enabled:
        return []
    if rec.zone is not None and not re.fullmatch(r"[a-z]+-[a-z]+[0-9]+-[a-z]", rec.zone):
        return [f"recovery.zone: {rec.zone!r}: a zone such as us-central1-a, or unset"]
    return []


# ---------------------------------------------------------------------------------------------
# The serving engine's batching knobs (each knob's own range is checked by its field)


@reads("serving.enabled", "serving.maxNumSeqs", "serving.minConcurrentSequences")
def rule_serving_batching(cfg: StackConfig) -> list[str]:
    """The engine may run as many sequences at once as the HBM check sized the KV cache for."""
    serving = cfg.serving
    if not serving.enabled or serving.min_concurrent_sequences <= serving.max_num_seqs:
        return []
    return [
        f"serving.minConcurrentSequences: {serving.min_concurrent_sequences}: above "
        f"serving.maxNumSeqs {serving.max_num_seqs}, the most sequences vLLM runs at once; raise "
        "maxNumSeqs or lower minConcurrentSequences"
    ]


RULES: tuple[Rule, ...] = (
    rule_names,
    rule_references,
    rule_slices,
    rule_zone_lists,
    rule_list_repeats,
    rule_provisioning,
    rule_bucket_regions,
    rule_model,
    rule_mesh,
    rule_batch,
    rule_merge,
    rule_serving_tp,
    rule_serving_image,
    rule_serving_requests,
    rule_dataset,
    rule_memory,
    rule_network,
    rule_recovery,
    rule_serving_batching,
)


def check(cfg: StackConfig, *, has_hf_token: bool | None = None) -> list[str]:
    """Runs every rule; returns all problems (empty = valid)."""
    problems: list[str] = []
    for rule in RULES:
        problems += rule(cfg)
    problems += rule_hf_token(cfg, has_hf_token)
    return problems
