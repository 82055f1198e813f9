"""The run-config schema: defined once, written by infra onto the VM, read by every workload.

A run config is YAML or JSON. Every field is documented; unknown keys are errors (a typo must
never be silently ignored). Each workload reads its own section (`train`, `merge`, `serve`,
`bench`, `eval`) plus the shared `model`, `data` and `lora` ones.

Paths (the fields typed `ConfigPath` below) may be local or `gs://`. A relative local path is
relative to the current working directory of the command that reads the config: `load` resolves
it to an absolute path once, when it reads the file (`~` is expanded; gs:// and other URLs are
left as they are), exactly as the command line resolves its own path options
(`storage.absolute`), so every workload, Orbax included, sees absolute paths. `parse` leaves
paths as written: infra renders configs for another machine, where this machine's working
directory means nothing.
"""

from __future__ import annotations

import json
import pathlib
from typing import Annotated, Any, Literal

import pydantic
import yaml

from workloads.common import errors, storage
from workloads.contract import catalog, settings
from workloads.contract.settings import ALL_LORA_TARGETS, DEFAULT_LORA_TARGETS, parse_size

# The shared settings as the run config uses them unchanged.
LoraRunSection = settings.LoraSettings
MeshRunSection = settings.MeshSettings
__all__ = [
    "ALL_LORA_TARGETS",
    "DEFAULT_LORA_TARGETS",
    "LoraRunSection",
    "MeshRunSection",
    "parse_size",
]

# Validation context key: set by `load`, which resolves relative local paths (module docstring).
_RESOLVE_PATHS = "resolve_paths"


def _resolve_when_loading(value: str, info: pydantic.ValidationInfo) -> str:
    if info.context and info.context.get(_RESOLVE_PATHS):
        return storage.absolute(value)
    return value


# A local path or gs:// URL; relative local paths are resolved by `load` (module docstring).
ConfigPath = Annotated[str, pydantic.AfterValidator(_resolve_when_loading)]


_Section = settings.Settings


class ModelRunSection(_Section):
    """The base model."""

    base: ConfigPath = pydantic.Field(
        description="HF safetensors directory of the base model (config.json + *.safetensors + "
        "tokenizer files), local or gs://."
    )
    stage_dir: ConfigPath = pydantic.Field(
        "/dev/shm/models/base",
        description="Local directory a gs:// base is staged into once and reused (RAM-backed "
        "/dev/shm on TPU VMs: the boot disk has no room for 62.5 GB).",
    )
    dtype: Literal["bfloat16", "float32"] = pydantic.Field(
        "bfloat16", description="Parameter dtype for training (float32 for exact CPU tests)."
    )


class DataRunSection(settings.DataSettings):
    """The training data: CodeV-R1 style JSONL with `prompt` and `response` fields."""

    dataset: ConfigPath = pydantic.Field(
        description="JSONL file (local or gs://) with prompt/response rows."
    )


class TrainingRunSection(settings.TrainingSettings):
    """Optimisation, checkpointing and logging of the LoRA fine-tune."""

    output_dir: ConfigPath = pydantic.Field(
        description="Run directory (local or gs://): checkpoints/, metrics.jsonl, tensorboard/."
    )
    accelerator: str | None = pydantic.Field(
        None,
        description="TPU type this runs on (e.g. v5p-8; recorded for the cost report); "
        "null = not a catalog machine (a CPU, a GPU).",
    )
    max_grad_norm: float | None = pydantic.Field(
        None, gt=0, description="Global-norm gradient clipping; null = none (the paper's recipe)."
    )
    compile_cache_dir: ConfigPath | None = pydantic.Field(
        None, description="Persistent JAX compilation cache (local or gs://); null = off."
    )

    @property
    def checkpoint_dir(self) -> str:
        return join(self.output_dir, "checkpoints")

    @property
    def metrics_path(self) -> str:
        return join(self.output_dir, "metrics.jsonl")

    @property
    def tensorboard_dir(self) -> str:
        return join(self.output_dir, "tensorboard")


class MergeRunSection(settings.MergeSettings):
    """LoRA merge into Hugging Face safetensors shards."""

    out: ConfigPath = pydantic.Field(
        description="Output directory of the merged model (local or gs://)."
    )
    step: int | None = pydantic.Field(None, ge=0, description="Checkpoint step; null = latest.")


class ServingRunSection(settings.ServingSettings):
    """vLLM serving of the merged model on a TPU v6e host."""

    model_dir: str = pydantic.Field(
        description="Merged model directory to serve (local or gs://), or a Hugging Face hub id "
        "(hf://org/name, or a bare org/name that is no local directory). Left as written by "
        "`load` (a hub id is no path); `serve` resolves a relative local directory against the "
        "working directory, as `load` does the other paths."
    )
    local_dir: ConfigPath = pydantic.Field(
        "/dev/shm/models/merged", description="Where a gs:// model is staged on the host (RAM)."
    )
    accelerator: str | None = pydantic.Field(
        None, description="TPU type of the serving host (e.g. v6e-8), for the cost report."
    )
    # All interfaces on purpose: the firewall admits only the configured source ranges.
    host: str = pydantic.Field("0.0.0.0", description="Bind address (the firewall limits sources).")  # noqa: S104
    shm_size: str = pydantic.Field("16G", description="Docker --shm-size.")
    compile_cache_dir: ConfigPath = pydantic.Field(
        "/dev/shm/vllm-xla-cache", description="Host dir mounted as the XLA compilation cache."
    )
    compile_cache_gcs: str | None = pydantic.Field(
        None, description="gs:// prefix the compilation cache is synced to and restored from."
    )
    ready_timeout_s: int = pydantic.Field(1800, gt=0, description="Seconds to wait for readiness.")
    extra_args: tuple[str, ...] = pydantic.Field((), description="Extra `vllm serve` arguments.")
    container_name: str = pydantic.Field(
        "gemma4-vllm",
        pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$",
        description="Docker container name (`bench` runs `docker exec` in it).",
    )
    model_wait_timeout_s: int = pydantic.Field(
        21600,
        ge=0,
        description="Seconds to wait for the merged model's completion marker "
        "(model.safetensors.index.json + merge_metadata.json); 0 = do not wait.",
    )
    model_wait_poll_s: float = pydantic.Field(
        30, gt=0, description="Seconds between checks for the completion marker."
    )
    stage_workers: int = pydantic.Field(16, ge=1, description="Parallel downloads when staging.")
    ready_poll_s: float = pydantic.Field(5, gt=0, description="Seconds between readiness probes.")
    compile_cache_sync_s: int = pydantic.Field(
        600,
        gt=0,
        description="Seconds between uploads of the compile cache to compile_cache_gcs "
        "while serving (it is also uploaded at exit).",
    )
    stop_timeout_s: int = pydantic.Field(
        30, ge=0, description="Seconds `docker stop` gives vLLM after SIGTERM before SIGKILL."
    )
    launcher: Literal["docker", "process"] = pydantic.Field(
        "docker",
        description="How vLLM starts, from the same flags: docker = the TPU image in a container "
        "(the serving VM); process = engine_python runs the CPU build of the same vLLM release "
        "on this machine (the local rehearsal).",
    )
    engine_python: ConfigPath = pydantic.Field(
        ".venv-serve/bin/python",
        description="The serving venv's Python (vLLM's CPU build, installed by .ci/setup); "
        "launcher process only.",
    )
    cpu_kv_cache_gib: float = pydantic.Field(
        1,
        gt=0,
        description="KV cache of vLLM's CPU backend in GiB (VLLM_CPU_KVCACHE_SPACE); launcher "
        "process only.",
    )

    @pydantic.field_validator("model_dir")
    @classmethod
    def _bucket_needs_gs(cls, value: str, info: pydantic.ValidationInfo) -> str:
        """Allowed with weights_from bucket: a gs:// directory only (what vLLM's Run:ai streamer
        reads; a local directory or a hub id has no bucket to stream from). weights_from, a field
        of the base class, is validated before model_dir, so info.data has it."""
        if info.data.get("weights_from") == "bucket" and not value.startswith("gs://"):
            raise ValueError(
                "weights_from bucket streams the merged model from gs://, so model_dir must be "
                "a gs:// directory; use a gs:// model_dir or weights_from: staged"
            )
        return value

    @pydantic.field_validator("image")
    @classmethod
    def _loads_gemma4(cls, value: str) -> str:
        """Allowed: a vLLM TPU release that can load Gemma 4 (the stack checks the same only
        when serving is on: rule_serving_image)."""
        problem = catalog.vllm_tpu_image_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class BenchRunSection(settings.BenchSettings):
    """`vllm bench serve` sweep."""

    results_dir: ConfigPath = pydantic.Field(
        description="Where per-point JSON and the tables go (local or gs://)."
    )
    scratch_dir: ConfigPath = pydantic.Field(
        "/dev/shm/gemma4-bench",
        description="Host dir the container writes result files into; "
        "must be visible at the same path inside the serving container (under the /dev/shm mount).",
    )
    ready_timeout_s: int = pydantic.Field(
        1800, gt=0, description="Seconds to wait for the server to be ready before the sweep."
    )
    extra_args: tuple[str, ...] = pydantic.Field(
        (), description="Extra `vllm bench serve` arguments."
    )


class EvalRunSection(settings.EvalSettings):
    """verilog-eval spec-to-rtl pass@k against the served endpoint."""

    problems_dir: ConfigPath = pydantic.Field(
        description="verilog-eval dataset_spec-to-rtl dir (local or gs://)."
    )
    results_dir: ConfigPath = pydantic.Field(
        description="Where samples, verdicts and the summary go (local or gs://)."
    )
    endpoint: str = pydantic.Field(
        "http://127.0.0.1:8000/v1", description="OpenAI-compatible base URL."
    )
    concurrency: int = pydantic.Field(16, ge=1, description="Requests in flight.")
    sim_timeout_s: float = pydantic.Field(60, gt=0, description="Wall-clock limit per simulation.")
    ks: tuple[int, ...] = pydantic.Field(
        (1, 5), description="k values of pass@k; those > n are left out."
    )


class OwnNodeRunSection(_Section):
    """This VM's own TPU node, for a command that acts on it (release, stop)."""

    project: str = pydantic.Field(description="Project of this VM's TPU node.")
    zone: str = pydantic.Field(
        description="The stack's first zone for this node; the VM uses the zone it runs in "
        "(GEMMA4_ZONE, from the metadata server) when it knows it."
    )
    node: str = pydantic.Field(description="Name of this VM's TPU node.")


# The record's name in the run directory: the program renders `marker` from it and reads it back
# (infra/config/runconfig_render.py), so the name is the contract, not the command's own choice.
RELEASE_MARKER_FILE = "released.json"


class ReleaseRunSection(OwnNodeRunSection):
    """Giving the training TPU back once training (and the merge) succeeded."""

    marker: ConfigPath = pydantic.Field(
        description="Where the release is recorded (local or gs://): `pulumi up` reads it and "
        "does not create the node again for this run."
    )


class StopRunSection(OwnNodeRunSection):
    """Stopping the serving TPU after a time limit (the stack's serving.stopAfterHours)."""

    after_hours: float = pydantic.Field(
        gt=0, description="Hours after each boot of the VM at which the node is stopped."
    )


class RunConfig(_Section):
    """Everything one run needs; written by infra (infra/runconfig render) and read on the VM."""

    run_name: str = pydantic.Field(
        pattern=r"^[a-z][a-z0-9-]{0,62}$", description="Run name (lower case, digits, dashes)."
    )
    model: ModelRunSection = pydantic.Field(description="The base model.")
    data: DataRunSection = pydantic.Field(description="The training data.")
    lora: LoraRunSection = pydantic.Field(LoraRunSection(), description="LoRA adapters.")
    train: TrainingRunSection = pydantic.Field(description="Training.")
    merge: MergeRunSection | None = pydantic.Field(None, description="Merge; null = no merge.")
    serve: ServingRunSection | None = pydantic.Field(
        None, description="Serving; null = no serving."
    )
    bench: BenchRunSection | None = pydantic.Field(None, description="Benchmark; null = none.")
    eval: EvalRunSection | None = pydantic.Field(None, description="Evaluation; null = none.")
    release: ReleaseRunSection | None = pydantic.Field(
        None, description="Delete the training TPU when done; null = keep it."
    )
    stop: StopRunSection | None = pydantic.Field(
        None, description="Stop the serving TPU after a time limit; null = no limit."
    )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def join(base: str, *parts: str) -> str:
    """Joins path parts for local paths and gs:// URLs alike."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def format_validation_error(exc: pydantic.ValidationError, source: str) -> str:
    """One line per problem: `source: key.path: bad value: what is allowed`."""
    return "\n".join(
        f"{source}: {line}" for line in settings.problem_lines(exc.errors(), RunConfig)
    )


def parse(
    data: dict[str, Any], source: str = "run config", *, resolve_paths: bool = False
) -> RunConfig:
    """Validates a mapping into a RunConfig.

    Args:
        resolve_paths: make relative local paths absolute against the working directory (what
            `load` does); off by default, so paths stay as written (module docstring).

    Raises:
        errors.UserError: listing every problem, one line each.
    """
    if not isinstance(data, dict):
        raise errors.UserError(
            f"{source}: expected a mapping at the top level, got {type(data).__name__}"
        )
    try:
        return RunConfig.model_validate(data, context={_RESOLVE_PATHS: resolve_paths})
    except pydantic.ValidationError as exc:
        raise errors.UserError(format_validation_error(exc, source)) from None


def load(path: str | pathlib.Path) -> RunConfig:
    """Reads a YAML or JSON run config from a local path or gs://; relative local paths in it
    come back absolute, resolved against the current working directory (module docstring).

    Raises:
        errors.UserError: the file is missing, unparsable, or invalid.
    """
    text = storage.read_text(str(path))
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0]
        raise errors.UserError(
            f"{path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: {first}"
        ) from None
    return parse(data, source=str(path), resolve_paths=True)
