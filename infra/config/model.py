"""The stack configuration: one typed, frozen model read from the `gemma4-tpu:*` stack config keys.

Each section is the workloads' own settings model (workloads/contract/settings.py: the same fields,
defaults and constraints the VM's run config has) plus what only the cloud side needs (zones,
provisioning, enabled flags). Keys are camelCase, as Pulumi writes them (`pulumi config set
--path training.maxSteps 30`); that is the only difference. Unknown keys are errors.

This module is the model only: the rules are in infra/config/validation.py (which imports it), and
reading a stack's config through both is infra/config/stack_config.py. Over 400 lines because every
section of the stack file is here, each key with its description (docs/config.md is generated
from them).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic.alias_generators import to_camel

from infra.errors import InfraError
from workloads.contract import catalog, settings

PROJECT = "gemma4-tpu"
"""The Pulumi project name, also the config namespace (`gemma4-tpu:training`)."""

HF_TOKEN_KEY = "hfToken"  # noqa: S105 - the name of a config key, not a password
"""The secret config key of the Hugging Face token; never part of StackConfig."""
RECOVERY_SSH_KEY = "recoverySshKey"
"""Secret config key the recovery controller read while it ran `pulumi up`; no longer read (it
holds no secret now), still accepted so that a stack file that sets it loads."""
RECOVERY_PASSPHRASE_KEY = "recoveryPassphrase"  # noqa: S105 - a key name
"""Secret config key the recovery controller read while it ran `pulumi up`; no longer read."""
SECRET_KEYS = (HF_TOKEN_KEY, RECOVERY_SSH_KEY, RECOVERY_PASSPHRASE_KEY)
"""The secret config keys: read by the program as Pulumi secrets, never part of StackConfig."""

PLACEHOLDER_PROJECT = "your-gcp-project"
"""The project id the checked-in stack files carry; valid in form, refused by preflight."""

ProvisioningModel = Literal["spot", "preemptible", "on-demand", "queued"]
QueuedCapacity = Literal["spot", "on-demand"]


class ConfigError(InfraError):
    """The stack config is invalid; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class _Section(settings.Settings):
    # camelCase keys, as Pulumi writes them: the only difference from the workloads' settings.
    model_config = pydantic.ConfigDict(alias_generator=to_camel)


def _field(default: Any = ..., *, description: str, **kwargs: Any) -> Any:
    if "default_factory" in kwargs:
        return pydantic.Field(description=description, **kwargs)
    return pydantic.Field(default, description=description, **kwargs)


class SshStackSection(_Section):
    """Who may SSH into the TPU VMs, as whom, with which key."""

    user: str = _field(
        "gemma4", description="Linux user the deployment logs in as (ssh-keys metadata)."
    )
    public_key: str | None = _field(
        None,
        description="OpenSSH public key line for `user`; null = read `<privateKeyFile>.pub` at "
        "`pulumi up` time.",
    )
    private_key_file: str | None = _field(
        "~/.ssh/id_ed25519",
        description="Private key the deployment and the SSH commands use, read from the stack "
        "file of the machine running each up, destroy or ops command (`~` = that machine's home; "
        "never stored in the state); null = the keys of a running ssh-agent (then publicKey "
        "must be set).",
    )
    source_ranges: tuple[str, ...] = _field(
        (),
        description="CIDR ranges allowed to reach port 22 (your address, e.g. 198.51.100.7/32). "
        "0.0.0.0/0 is refused unless allowFromAnywhere is true.",
    )
    allow_from_anywhere: bool = _field(
        False, description="Explicitly allow 0.0.0.0/0 in sourceRanges (not recommended)."
    )


class StorageStackSection(_Section):
    """The GCS buckets: one per region that runs a TPU VM (a TPU must read an in-region bucket)."""

    location: str | None = _field(
        None, description="Region of the training bucket; null = the training zone's region."
    )
    serving_location: str | None = _field(
        None,
        description="Region of the serving bucket; null = the serving zone's region. When it "
        "equals the training region, one bucket serves both VMs.",
    )
    bucket_name: str | None = _field(
        None, description="Training bucket name; null = `<project>-<namePrefix>-<region>`."
    )
    serving_bucket_name: str | None = _field(
        None, description="Serving bucket name; null = `<project>-<namePrefix>-<region>`."
    )
    versioning: bool = _field(True, description="Object versioning (protects checkpoints).")
    # Upper bounds: a century; the storage API takes these as 32-bit ages.
    noncurrent_version_days: int = _field(
        30, ge=1, le=36_500, description="Days a replaced or deleted object version is kept."
    )
    scratch_days: int = _field(
        14,
        ge=1,
        le=36_500,
        description="Days objects under scratch prefixes (compile-cache/, tmp/) live.",
    )
    keep_on_destroy: bool = _field(
        True,
        description="`pulumi destroy` leaves the buckets and their data (checkpoints, merged "
        "weights) in place (retainOnDelete). A later `up` needs importExisting: true.",
    )
    protect: bool = _field(
        False, description="Pulumi-protect the buckets: `destroy` fails until unprotected."
    )
    force_destroy: bool = _field(
        False, description="Let a destroy delete non-empty buckets (everything in them is lost)."
    )
    import_existing: bool = _field(
        False, description="Adopt buckets kept by an earlier destroy instead of creating them."
    )


class ModelStackSection(_Section):
    """The base model."""

    name: str = _field(
        "gemma-4-31b", description="Catalog name of the model (workloads/contract/catalog.py)."
    )
    hf_id: str | None = _field(None, description="Hugging Face repository; null = the catalog's.")
    download_from_hub: bool = _field(
        True,
        description="If the bucket has no copy yet, the training VM downloads the model from the "
        "hub into the bucket (needs the hfToken secret).",
    )
    stage_dir: str = _field(
        "/dev/shm/models/base",
        description="Where the training VMs stage the weights; must be under /dev/shm (the boot "
        "disk has no room).",
    )


class DataStackSection(_Section, settings.DataSettings):
    """The training data (CodeV-R1 style JSONL: `prompt`, `response`)."""

    dataset: str | None = _field(
        None, description="JSONL path (gs://); null = gs://<training bucket>/data/codev-r1.jsonl."
    )


class LoraStackSection(_Section, settings.LoraSettings):
    """The LoRA adapters."""


class MeshStackSection(_Section, settings.MeshSettings):
    """The training device mesh."""


class QueueStackSection(_Section):
    """How a queued resource (`provisioning: queued`) asks for its capacity."""

    capacity: QueuedCapacity = _field(
        "spot",
        description="What the queued request waits for: spot (preemptible, cheaper) or on-demand "
        "capacity.",
    )
    # The queue gives up after this long in one zone, then the next fallback zone is asked.
    valid_for_hours: float = _field(
        24.0,
        gt=0,
        le=720,
        description="How long the request waits for capacity in one zone before the next zone of "
        "zoneFallbacks is asked (`pulumi up` waits with it).",
    )


class SliceStackSection(_Section):
    """What both TPU VMs share: where the slice runs and how its capacity is obtained."""

    accelerator: str = _field(description="TPU type of the slice.")
    zone: str = _field(description="Zone of the slice; its region holds the VM's bucket.")
    zone_fallbacks: tuple[str, ...] = _field(
        (),
        description="Zones to try, in order, when `zone` has no capacity or quota: `pulumi up` "
        "creates the node in the first that has it and keeps it there (output <role>Zone). "
        "The bucket stays in `zone`'s region.",
    )
    runtime_version: str | None = _field(
        None, description="TPU software version; null = the catalog's for the generation."
    )
    provisioning: ProvisioningModel = _field(
        "spot",
        description="spot, preemptible or on-demand capacity, or queued (a queued resource that "
        "waits for capacity; see queue).",
    )
    queue: QueueStackSection = _field(
        default_factory=QueueStackSection, description="The queued request (provisioning: queued)."
    )

    @property
    def zones(self) -> tuple[str, ...]:
        """The zones to try, in order, each once."""
        return tuple(dict.fromkeys((self.zone, *self.zone_fallbacks)))


class TrainingStackSection(SliceStackSection, settings.TrainingSettings):
    """The training TPU VM and the optimisation run."""

    accelerator: str = _field("v5p-8", description="TPU type of the training slice.")
    zone: str = _field(
        "us-central1-a", description="Zone of the training slice; its region holds the bucket."
    )
    node_name: str | None = _field(None, description="TPU node name; null = `<namePrefix>-train`.")
    mesh: MeshStackSection = _field(default_factory=MeshStackSection, description="Device mesh.")
    release_when_done: bool = _field(
        False,
        description="Delete the training TPU once training and the merge succeeded (the VM does "
        "it, recorded as released.json in the run directory; `pulumi up` then leaves the node "
        "out until runName changes).",
    )
    # At most 10 TB: more RAM than any TPU host has (validation compares with the host's).
    shm_working_set_gb: float = _field(
        32.0,
        ge=0,
        le=10_000,
        description="/dev/shm the host needs besides model weights (GB): data, scratch.",
    )


class MergeStackSection(_Section, settings.MergeSettings):
    """The LoRA merge (runs on the training VM after training)."""

    enabled: bool = _field(True, description="Merge the adapters into HF safetensors shards.")


class EvalStackSection(_Section, settings.EvalSettings):
    """verilog-eval pass@k against the served model (serving VM)."""

    enabled: bool = _field(True, description="Run the evaluation once serving is up.")


class BenchStackSection(_Section, settings.BenchSettings):
    """The `vllm bench serve` sweep (serving VM)."""

    enabled: bool = _field(True, description="Run the benchmark sweep once serving is up.")


class ServingStackSection(SliceStackSection, settings.ServingSettings):
    """The optional serving TPU VM (vLLM on v6e)."""

    enabled: bool = _field(False, description="Create the serving VM and serve the merged model.")
    accelerator: str = _field("v6e-8", description="TPU type of the serving slice.")
    zone: str = _field(
        "asia-northeast1-b",
        description="Zone of the serving slice; its region holds the serving bucket.",
    )
    provisioning: ProvisioningModel = _field(
        "spot",
        description="spot (no run-time limit; the default), preemptible (the older model, "
        "stopped after 24 h at most), on-demand, or queued (a queued resource that waits for "
        "capacity; see queue).",
    )
    node_name: str | None = _field(None, description="TPU node name; null = `<namePrefix>-serve`.")
    stop_after_hours: float | None = _field(
        None,
        gt=0,
        le=8760,
        description="Stop the serving TPU this many hours after each boot (a stopped node is not "
        "billed; `gcloud compute tpus tpu-vm start` brings it back); null = no limit. Only an "
        "on-demand node can be stopped (provisioning on-demand, or queued with queue.capacity "
        "on-demand): a spot or preemptible one can only be deleted.",
    )
    min_concurrent_sequences: int = _field(
        1, ge=1, description="Full-length sequences the KV cache must hold (HBM check)."
    )
    api_source_ranges: tuple[str, ...] = _field(
        (), description="CIDR ranges allowed to reach the API port; empty = SSH tunnel only."
    )
    shm_working_set_gb: float = _field(
        32.0,
        ge=0,
        le=10_000,
        description="/dev/shm the host needs besides weights (GB): compile cache.",
    )
    eval: EvalStackSection = _field(default_factory=EvalStackSection, description="Evaluation.")
    bench: BenchStackSection = _field(
        default_factory=BenchStackSection, description="Benchmark sweep."
    )


class RecoveryStackSection(_Section):
    """The recovery controller: an always-on small VM that recreates a preempted training TPU
    with the project's own `infra.ops recover --watch`, so no laptop has to stay awake."""

    enabled: bool = _field(
        False,
        description="Declare the controller (it recreates the node through the Cloud TPU API "
        "from the request `pulumi up` records in the training bucket; no secret, no state "
        "access).",
    )
    backend_url: str | None = _field(
        None,
        description="No longer read: the controller does not run Pulumi (accepted so that a "
        "stack file that sets it loads).",
    )
    zone: str | None = _field(None, description="Zone of the controller; null = training.zone.")
    machine_type: Literal["e2-micro", "e2-small", "e2-medium"] = _field(
        "e2-small",
        description="Machine type of the controller. Its one process (the watch, with the Cloud "
        "TPU client and gcsfs) fits any of them; e2-micro (1 GB) is the cheapest.",
    )
    interval_seconds: int = _field(
        120, ge=30, le=3600, description="How often the controller checks the training TPU."
    )


class StackConfig(_Section):
    """Everything one stack declares; read from the `gemma4-tpu:*` keys of Pulumi.<stack>.yaml."""

    project: str = _field(description="Google Cloud project id (set your own).")
    name_prefix: str = _field(
        "gemma4", description="Prefix of every cloud resource name (lower case, <= 20 chars)."
    )
    run_name: str = _field(
        "codev-lora", description="Run name: directory of checkpoints and results."
    )
    labels: dict[str, str] = _field(default_factory=dict, description="Extra labels on resources.")
    network: str = _field("default", description="VPC network of the TPU VMs.")
    subnetwork: str | None = _field(None, description="Subnetwork; null = the network's default.")
    enable_apis: bool = _field(
        True, description="Enable the TPU, Compute, Storage, IAM and Secret Manager APIs."
    )
    ssh: SshStackSection = _field(default_factory=SshStackSection, description="SSH access.")
    storage: StorageStackSection = _field(
        default_factory=StorageStackSection, description="GCS buckets."
    )
    model: ModelStackSection = _field(default_factory=ModelStackSection, description="Base model.")
    data: DataStackSection = _field(default_factory=DataStackSection, description="Training data.")
    lora: LoraStackSection = _field(default_factory=LoraStackSection, description="LoRA adapters.")
    training: TrainingStackSection = _field(
        default_factory=TrainingStackSection, description="Training."
    )
    merge: MergeStackSection = _field(default_factory=MergeStackSection, description="LoRA merge.")
    serving: ServingStackSection = _field(
        default_factory=ServingStackSection, description="Serving VM."
    )
    recovery: RecoveryStackSection = _field(
        default_factory=RecoveryStackSection, description="Recovery controller."
    )

    # Derived names and places (pure; validation checks that they are valid for GCP).

    @property
    def model_spec(self) -> catalog.ModelSpec | None:
        """The catalog's shapes of model.name; None for an unknown name (rule_model says so)."""
        return catalog.MODELS.get(self.model.name)

    @property
    def training_region(self) -> str:
        return catalog.zone_region(self.training.zone)

    @property
    def serving_region(self) -> str:
        return catalog.zone_region(self.serving.zone)

    @property
    def training_node_name(self) -> str:
        return self.training.node_name or f"{self.name_prefix}-train"

    @property
    def serving_node_name(self) -> str:
        return self.serving.node_name or f"{self.name_prefix}-serve"

    @property
    def training_bucket_location(self) -> str:
        return (self.storage.location or self.training_region).lower()

    @property
    def serving_bucket_location(self) -> str:
        return (self.storage.serving_location or self.serving_region).lower()

    @property
    def shared_bucket(self) -> bool:
        """True when the serving VM uses the training bucket (same region, or serving off)."""
        return (
            not self.serving.enabled
            or self.serving_bucket_location == self.training_bucket_location
        )

    @property
    def training_bucket_name(self) -> str:
        return self.storage.bucket_name or self._default_bucket_name(self.training_bucket_location)

    @property
    def serving_bucket_name(self) -> str:
        if self.shared_bucket:
            return self.training_bucket_name
        return self.storage.serving_bucket_name or self._default_bucket_name(
            self.serving_bucket_location
        )

    def _default_bucket_name(self, location: str) -> str:
        return f"{self.project}-{self.name_prefix}-{location}"

    @property
    def recovery_zone(self) -> str:
        return self.recovery.zone or self.training.zone

    @property
    def service_account_id(self) -> str:
        return f"{self.name_prefix}-tpu-vm"

    @property
    def hf_secret_id(self) -> str:
        return f"{self.name_prefix}-hf-token"

    @property
    def ssh_tag(self) -> str:
        return f"{self.name_prefix}-ssh"

    @property
    def api_tag(self) -> str:
        return f"{self.name_prefix}-api"

    @property
    def hf_repo(self) -> str:
        return self.model.hf_id or catalog.model(self.model.name).hf_id
