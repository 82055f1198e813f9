"""The settings a user chooses, defined once: the stack config and the run config both use them.

A stack config section (infra/config/model.py) is one of these models plus what only the cloud side
needs (zones, provisioning, enabled flags), read with camelCase keys at the Pulumi edge. The run
config a VM reads (workloads/contract/runconfig.py) is one of these models plus where things live
(gs:// paths, ports on the host), and infra renders it as a projection of the stack config
(`values_of`), not a field-by-field copy. So a constraint such as "lora.rank > 0" lives here and
holds on both sides with the same one-line message.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

import pydantic

from workloads.contract import catalog

# The six modules the paper's recipe adapts; `k_einsum` (the global layers' K=V projection) is
# an optional seventh.
DEFAULT_LORA_TARGETS = (
    "q_einsum",
    "kv_einsum",
    "attn_vec_einsum",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ALL_LORA_TARGETS = (*DEFAULT_LORA_TARGETS, "k_einsum")


def _remat_from_bool(value: Any) -> Any:
    """true/false (the older boolean key) mean "full"/"none"."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value


AttentionPath = Literal["kernel", "dense"]
"""How packed rows reach attention on a TPU: "kernel" = JAX's splash attention kernel with segment
ids (workloads.train.packed_attention); "dense" = tunix's dense [rows, L, L] mask. Off TPU the
dense path is always used."""

RematPolicy = Annotated[Literal["full", "dots", "none"], pydantic.BeforeValidator(_remat_from_bool)]
"""What the backward pass keeps of each decoder layer's forward pass: "full" remat keeps only
the layer's input and recomputes the layer (least HBM, one extra forward); "dots" keeps the
outputs of the weight matmuls and recomputes the rest (attention scores, norms, activation
functions); "none" keeps everything (no recompute, most HBM). true/false mean full/none."""

_BYTE_SIZE = pydantic.TypeAdapter(pydantic.ByteSize)


def parse_size(text: str | int) -> int:
    """`"5GB"` -> 5_000_000_000, `"512MiB"` -> 536_870_912; ints pass through (pydantic's
    ByteSize: decimal and binary units, case-insensitive).

    Raises:
        ValueError: on anything else, naming the value and the accepted form.
    """
    if isinstance(text, int):
        return text
    try:
        return int(_BYTE_SIZE.validate_python(str(text)))
    except pydantic.ValidationError:
        raise ValueError(
            f"size {text!r} is not a number with an optional unit (B, KB, MB, GB, MiB, GiB)"
        ) from None


class Settings(pydantic.BaseModel):
    """Base of every settings model: unknown keys are errors, values are frozen, and no key takes
    an empty string or a non-finite number (each would only fail hours later on the VM)."""

    model_config = pydantic.ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, str_min_length=1
    )


def values_of(section: pydantic.BaseModel, settings: type[Settings]) -> dict[str, Any]:
    """The values of `section` that belong to `settings` (one of its bases), by field name: the
    projection from a stack config section onto the run config's."""
    return section.model_dump(include=set(settings.model_fields))


class DataSettings(Settings):
    """Which samples train, in which order, in rows of which length."""

    max_rows: int | None = pydantic.Field(
        10_000, ge=1, description="Read only the first N rows (the paper: 10,000); null = all."
    )
    max_seq_len: int = pydantic.Field(
        3072,
        description="Tokens per row, a positive multiple of 128; longer samples are DROPPED, "
        "never truncated.",
    )
    packing: bool = pydantic.Field(
        True,
        description="Pack several samples per row (block-diagonal attention); false = one "
        "sample per row, padded (the paper's recipe, ~70% padding).",
    )
    seed: int = pydantic.Field(0, ge=0, description="Seed of the deterministic sample order.")
    shuffle: bool = pydantic.Field(
        True, description="Shuffle the sample order (deterministic from seed)."
    )

    @pydantic.field_validator("max_seq_len")
    @classmethod
    def _whole_tiles(cls, value: int) -> int:
        """Allowed: a positive multiple of 128."""
        # The TPU kernels and XLA's layouts tile the sequence in blocks of 128.
        if value <= 0 or value % 128:
            raise ValueError("a positive multiple of 128 (e.g. 3072)")
        return value


class LoraSettings(Settings):
    """The LoRA adapters (Qwix)."""

    rank: int = pydantic.Field(64, description="LoRA rank r (positive).")
    alpha: float = pydantic.Field(
        64.0, description="LoRA alpha (positive); the delta is scaled by alpha/rank."
    )
    dropout: float = pydantic.Field(0.05, description="Dropout on the LoRA input, in [0, 1).")
    targets: tuple[str, ...] = pydantic.Field(
        DEFAULT_LORA_TARGETS,
        description="Tunix modules to adapt: " + ", ".join(ALL_LORA_TARGETS) + ".",
    )

    @pydantic.field_validator("rank")
    @classmethod
    def _positive_rank(cls, value: int) -> int:
        """Allowed: a positive integer."""
        if value <= 0:
            raise ValueError("a positive integer (the paper: 64)")
        return value

    @pydantic.field_validator("alpha")
    @classmethod
    def _positive_alpha(cls, value: float) -> float:
        """Allowed: a positive number."""
        if value <= 0:
            raise ValueError("a positive number (the paper: 64)")
        return value

    @pydantic.field_validator("dropout")
    @classmethod
    def _dropout_probability(cls, value: float) -> float:
        """Allowed: in [0, 1)."""
        if not 0 <= value < 1:
            raise ValueError("in [0, 1)")
        return value

    @pydantic.field_validator("targets")
    @classmethod
    def _known_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Allowed: a non-empty subset of the modules listed."""
        if not value or any(t not in ALL_LORA_TARGETS for t in value):
            raise ValueError("one or more of " + ", ".join(ALL_LORA_TARGETS))
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class MeshSettings(Settings):
    """The training device mesh; fsdp * tp must equal the slice's device count."""

    fsdp: int = pydantic.Field(1, ge=1, description="Data/parameter-sharding axis size.")
    tp: int = pydantic.Field(
        4, ge=1, description="Tensor-parallel axis size; must divide query, KV and global KV heads."
    )


class TrainingSettings(Settings):
    """Optimisation, memory policy, checkpointing and logging of the LoRA fine-tune."""

    micro_batch: int = pydantic.Field(1, ge=1, description="Rows per forward pass (global).")
    grad_accum: int = pydantic.Field(8, ge=1, description="Micro-batches per optimizer step.")
    max_steps: int | None = pydantic.Field(
        None, ge=1, description="Optimizer steps; null = `epochs` passes over the data."
    )
    epochs: int = pydantic.Field(1, ge=1, description="Passes over the data when maxSteps is null.")
    # Upper bounds: a step of more than 1 (or decay of more than all of a weight) only diverges.
    learning_rate: float = pydantic.Field(1e-4, gt=0, le=1, description="Peak AdamW learning rate.")
    weight_decay: float = pydantic.Field(0.001, ge=0, le=1, description="AdamW weight decay.")
    warmup_steps: int = pydantic.Field(
        100, ge=0, description="Linear warm-up steps, then cosine to 0."
    )
    mesh: MeshSettings = pydantic.Field(default_factory=MeshSettings, description="Device mesh.")
    remat: RematPolicy = pydantic.Field(
        "full",
        description="What the backward pass recomputes of each decoder layer: full (least "
        "HBM), dots (keeps weight-matmul outputs), none (fastest, most HBM); true/false = "
        "full/none. `python -m infra.preflight --compile` shows what fits.",
    )
    attention: AttentionPath = pydantic.Field(
        "kernel",
        description="How packed rows reach attention on the TPU: kernel (JAX's splash attention "
        "with segment ids: no [rows, L, L] mask or scores in HBM) or dense (tunix's mask path, "
        "for comparison).",
    )
    save_every: int = pydantic.Field(100, ge=1, description="Checkpoint every N optimizer steps.")
    keep_checkpoints: int = pydantic.Field(
        3, ge=1, description="Checkpoints kept (oldest deleted)."
    )
    log_every: int = pydantic.Field(1, ge=1, description="Log metrics every N optimizer steps.")


class MergeSettings(Settings):
    """The LoRA merge into Hugging Face safetensors shards."""

    shard_size: str = pydantic.Field("5GB", description="Largest shard file, e.g. 5GB or 512MiB.")

    @pydantic.field_validator("shard_size")
    @classmethod
    def _valid_size(cls, value: str) -> str:
        """Allowed: a size such as 5GB or 512MiB."""
        try:
            if parse_size(value) > 0:
                return value
        except ValueError:
            pass
        raise ValueError("a size such as 5GB or 512MiB")


KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
"""What vLLM stores the KV cache in: auto = the model's dtype; the fp8 kinds take one byte per value
(fp8 = fp8_e4m3), which tpu-inference maps to JAX's float8 types on TPU."""

# Bytes per cached value of each KV cache dtype (auto and bfloat16: Gemma 4 serves in bf16).
KV_CACHE_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


WeightQuantization = Literal["off", "fp8"]
"""How the served weights are stored: off = the merged model's bf16; fp8 = tpu-inference
quantizes every module's weights and activations to float8_e4m3fn at load with a Qwix rule
(`--additional-config`), as Google's daily v6e-8 benchmark of Gemma 4 31B does. int8 is not
offered: tpu-inference lists INT8 W8A8 for v5/v6 only as a pre-quantized compressed-tensors
checkpoint, marked untested, not as an on-load Qwix rule."""

ServingProfile = Literal["paper", "throughput"]

WeightsFrom = Literal["staged", "bucket"]
"""Where vLLM reads the merged weights on the serving VM: staged = copied from gs:// into
/dev/shm first, each file's checksum verified against merge_metadata.json; bucket = streamed
from gs:// by vLLM's Run:ai Model Streamer (`--load-format runai_streamer`), no copy and no host
checksum (the merge's own verify stands). Staged is the default: no measurement compares the two
for this model, and only staging checks what it loads (docs/architecture.md, "Serving")."""

# vLLM's load format that streams safetensors from object storage (gs://, s3://).
RUNAI_STREAMER = "runai_streamer"

# fp8 on load: every module (module_path ".*"), weights and activations, float8_e4m3fn: the rule
# of tpu-inference's daily Gemma 4 31B benchmark (.buildkite/benchmark/cases/daily/).
QWIX_FP8_RULES = {
    "quantization": {
        "qwix": {
            "rules": [
                {
                    "module_path": ".*",
                    "weight_qtype": "float8_e4m3fn",
                    "act_qtype": "float8_e4m3fn",
                }
            ]
        }
    }
}

# Bytes per stored weight of each quantization (embeddings are counted at bf16 either way:
# workloads' sizing does not assume the rule reaches them).
WEIGHT_QUANTIZATION_BYTES = {"off": 2, "fp8": 1}

SERVING_PROFILES: dict[str, dict[str, Any]] = {
    # The paper's configuration: one server over the 8 chips, bf16 weights and KV cache, the
    # engine's own scheduling choices.
    "paper": {
        "tensor_parallel_size": 8,
        "data_parallel_size": 1,
        "weight_quantization": "off",
        "kv_cache_dtype": "auto",
        "batched_attention_kernel": False,
        "async_scheduling": None,
        "block_size": None,
    },
    # Google's daily v6e-8 benchmark of Gemma 4 31B (tpu-inference, Gemma4-31B-*.json): two
    # replicas of TP 4, fp8 weights+activations (Qwix) and KV cache, the batched ragged paged
    # attention kernel, async scheduling.
    "throughput": {
        "tensor_parallel_size": 4,
        "data_parallel_size": 2,
        "weight_quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "batched_attention_kernel": True,
        "async_scheduling": True,
        "block_size": None,
    },
}
"""The values each serving profile gives the keys it names; a key the config sets overrides."""

# The environment variable tpu-inference reads to use the batched ragged paged attention kernel
# (tpu_inference/envs.py, default off).
BATCHED_ATTENTION_ENV = "USE_BATCHED_RPA_KERNEL"
# vLLM's wait for its engine processes to start (vllm/envs.py, default 600 s); compiling the 31B
# model's programs on a cold cache can take longer.
ENGINE_READY_TIMEOUT_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"
# The most of each chip's HBM vLLM may be given: the rest holds the compiled programs, which
# load outside vLLM's budget. 0.98 is the highest value a tpu-inference maintainer verified for
# Gemma 4 31B on v6e (issue 2333, TP 4, 16K context); tpu-inference's CI runs 31B at 0.90 after
# the torchax path's programs (~6 GiB on tpu7x) failed to load at 0.95.
MAX_HBM_UTILIZATION = 0.98


class ServingSettings(Settings):
    """vLLM serving of the merged model."""

    image: str = pydantic.Field(
        catalog.VLLM_TPU_IMAGE, description="vLLM TPU container image (pinned tag or digest)."
    )
    served_model_name: str = pydantic.Field(
        "gemma-4-31b-verilog", description="Model name in /v1/models."
    )
    profile: ServingProfile = pydantic.Field(
        "paper",
        description="Named serving configuration that gives the keys it sets their values (a key "
        "set here overrides it): paper = 1 replica of TP 8, bf16 weights and KV cache; "
        "throughput = Google's v6e-8 benchmark: 2 replicas of TP 4, fp8 weights (Qwix) and KV "
        "cache, batched attention kernel, async scheduling.",
    )
    tensor_parallel_size: int = pydantic.Field(
        8,
        ge=1,
        description="vLLM tensor parallelism: chips per replica (default from profile: paper 8, "
        "throughput 4).",
    )
    data_parallel_size: int = pydantic.Field(
        1,
        ge=1,
        description="Replicas of the model on the VM (--data-parallel-size); replicas x "
        "tensorParallelSize must equal the chips (default from profile: paper 1, throughput 2).",
    )
    weight_quantization: WeightQuantization = pydantic.Field(
        "off",
        description="Weights as served: off = bf16; fp8 = float8_e4m3fn weights and activations "
        "quantized at load by tpu-inference's Qwix rule (--additional-config), half the weight "
        "HBM, no faster matmuls on v6e (its matrix unit has no fp8) (default from profile: paper "
        "off, throughput fp8).",
    )
    batched_attention_kernel: bool = pydantic.Field(
        False,
        description="Use tpu-inference's batched ragged paged attention kernel "
        "(USE_BATCHED_RPA_KERNEL=1) (default from profile: paper false, throughput true).",
    )
    async_scheduling: bool | None = pydantic.Field(
        None,
        description="vLLM async scheduling (--async-scheduling / --no-async-scheduling); null = "
        "the engine decides (default from profile: paper null, throughput true).",
    )
    block_size: int | None = pydantic.Field(
        None,
        description="Tokens per KV cache block (--block-size), a positive multiple of 16; null = "
        "the engine's default (default from profile: null in both).",
    )
    engine_ready_timeout_s: int = pydantic.Field(
        1800,
        ge=60,
        description="Seconds vLLM waits for its engine processes to start "
        "(VLLM_ENGINE_READY_TIMEOUT_S; vLLM's default 600 can be shorter than a cold compile).",
    )
    max_model_len: int = pydantic.Field(
        16384, ge=1, description="Longest request, prompt + output."
    )
    port: int = pydantic.Field(
        8000, ge=1, le=65535, description="HTTP port of the OpenAI-compatible API."
    )
    # The engine's batching and memory knobs (vLLM flags of the same names; defaults: README,
    # "Serving knobs").
    kv_cache_dtype: KvCacheDtype = pydantic.Field(
        "auto",
        description="KV cache dtype (--kv-cache-dtype): auto = the model's bf16; fp8 (= fp8_e4m3) "
        "or fp8_e5m2 halve the bytes per cached token, so twice the tokens fit.",
    )
    max_num_seqs: int = pydantic.Field(
        256, ge=1, description="Most sequences the engine runs at once (--max-num-seqs)."
    )
    max_num_batched_tokens: int = pydantic.Field(
        4096,
        ge=1,
        description="Most tokens one engine step processes, prompt chunks and decodes together "
        "(--max-num-batched-tokens); at least maxNumSeqs.",
    )
    hbm_utilization: float = pydantic.Field(
        0.9,
        gt=0,
        description="Fraction of each chip's HBM vLLM may use for weights, activations and KV "
        "cache (--gpu-memory-utilization), at most 0.98: the rest holds the compiled programs.",
    )
    weights_from: WeightsFrom = pydantic.Field(
        "staged",
        description="Where vLLM reads the merged weights: staged = copied from gs:// into "
        "/dev/shm first, checksums verified against merge_metadata.json; bucket = streamed "
        "straight from gs:// (--load-format runai_streamer), no copy and no checksum on the host "
        "(the merge's own verify stands); needs the merged model in gs://.",
    )

    @pydantic.model_validator(mode="wrap")
    @classmethod
    def _profile_values(cls, data: Any, handler: pydantic.ModelWrapValidatorHandler[Any]) -> Any:
        """The profile's values for the keys the input does not set (by name or alias); they do
        not count as set (model_fields_set keeps meaning "the user wrote it")."""
        if not isinstance(data, dict):
            return handler(data)
        profile_field = cls.model_fields["profile"]
        profile = data.get(profile_field.alias or "profile", data.get("profile", "paper"))
        values = SERVING_PROFILES.get(profile) if isinstance(profile, str) else None
        if values is None:
            return handler(data)  # the profile field's own check names the allowed profiles
        filled = dict(data)
        added = set()
        for name, value in values.items():
            alias = cls.model_fields[name].alias or name
            if name not in data and alias not in data:
                filled[alias] = value
                added.add(name)
        model = handler(filled)
        model.model_fields_set.difference_update(added)
        return model

    @pydantic.field_validator("hbm_utilization")
    @classmethod
    def _room_for_programs(cls, value: float) -> float:
        """Allowed: above 0 and at most MAX_HBM_UTILIZATION."""
        if value > MAX_HBM_UTILIZATION:
            raise ValueError(
                f"above {MAX_HBM_UTILIZATION}: the rest of each chip's HBM holds the compiled "
                "programs, which load outside vLLM's share; use 0.9 (tpu-inference's CI value "
                f"for Gemma 4 31B) up to {MAX_HBM_UTILIZATION}"
            )
        return value

    @pydantic.field_validator("block_size")
    @classmethod
    def _whole_blocks(cls, value: int | None) -> int | None:
        """Allowed: null or a positive multiple of 16."""
        # vLLM's attention backends page the KV cache in multiples of 16 tokens.
        if value is not None and (value <= 0 or value % 16):
            raise ValueError("null (the engine's default) or a positive multiple of 16 (e.g. 256)")
        return value

    @pydantic.field_validator("max_num_batched_tokens")
    @classmethod
    def _batch_holds_the_sequences(cls, value: int, info: pydantic.ValidationInfo) -> int:
        """Allowed: at least max_num_seqs (vLLM refuses to start otherwise: every running
        sequence needs one token of each step)."""
        seqs = info.data.get("max_num_seqs")
        if seqs is not None and value < seqs:
            raise ValueError(
                f"below max_num_seqs {seqs}: vLLM needs one token per running sequence in each "
                "step; raise it or lower max_num_seqs"
            )
        return value

    @pydantic.field_validator("image")
    @classmethod
    def _pinned_image(cls, value: str) -> str:
        """Allowed: a well-formed, pinned image reference (a tag other than latest, or a digest)."""
        problem = catalog.image_reference_problem(value)
        if problem:
            raise ValueError(problem)
        return value


# The serving settings that change the served model's numbers (what the eval records, so that a
# score is read next to the numerics it was served with).
NUMERICS_KEYS = (
    "profile",
    "weight_quantization",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "data_parallel_size",
)


def serving_numerics(serve: ServingSettings) -> dict[str, Any]:
    """The profile and the serving settings that change numerics, as the eval records them.

    Args:
        serve: the run config's serve section (or any ServingSettings).

    Returns:
        {key: value} for NUMERICS_KEYS.
    """
    return {key: getattr(serve, key) for key in NUMERICS_KEYS}


def quantizes(numerics: dict[str, Any] | None) -> bool:
    """Whether recorded numerics store weights or the KV cache below bf16."""
    if not numerics:
        return False
    return (
        numerics.get("weight_quantization", "off") != "off"
        or KV_CACHE_DTYPE_BYTES.get(numerics.get("kv_cache_dtype", "auto"), 2) < 2
    )


def served_with(numerics: dict[str, Any] | None) -> str:
    """`profile throughput (weights fp8, KV cache fp8, 2 x TP 4)`, or that it is not known.

    Args:
        numerics: the summary's `serving` record (settings.serving_numerics), or None.

    Returns:
        The phrase.
    """
    if not numerics:
        return "serving settings not recorded (eval ran without a run config)"
    weights = numerics.get("weight_quantization", "off")
    kv = numerics.get("kv_cache_dtype", "auto")
    replicas = numerics.get("data_parallel_size", "?")
    tp = numerics.get("tensor_parallel_size", "?")
    return (
        f"profile {numerics.get('profile', '?')} (weights {'bf16' if weights == 'off' else weights}"
        f", KV cache {'bf16' if kv in ('auto', 'bfloat16') else kv}, {replicas} x TP {tp})"
    )


class EvalSettings(Settings):
    """verilog-eval spec-to-rtl pass@k sampling."""

    n: int = pydantic.Field(5, ge=1, description="Samples per problem.")
    temperature: float = pydantic.Field(0.8, ge=0, description="Sampling temperature.")
    top_p: float = pydantic.Field(0.95, gt=0, le=1, description="Nucleus sampling.")
    max_tokens: int = pydantic.Field(1024, ge=1, description="Max new tokens per sample.")


class BenchSettings(Settings):
    """The `vllm bench serve` sweep."""

    num_prompts: int = pydantic.Field(200, ge=1, description="Prompts per sweep point.")
    shapes: tuple[tuple[int, int], ...] = pydantic.Field(
        ((512, 256), (1024, 512), (4096, 512), (8192, 512), (15360, 512)),
        description="(input_len, output_len) pairs, the sweep's request shapes (default: the "
        "paper's); the longest input + output must fit serving.maxModelLen.",
    )
    # inf is vLLM's "all at once" (a burst); nan is refused by the check below.
    request_rates: tuple[Annotated[float, pydantic.AllowInfNan(True)], ...] = pydantic.Field(
        (1, 2, 4, 8, 16, 32, 64, float("inf")), description="Requests per second; inf = burst."
    )

    @pydantic.field_validator("shapes")
    @classmethod
    def _positive_shapes(cls, value: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        bad = [shape for shape in value if min(shape) <= 0]
        if bad or not value:
            raise ValueError(
                f"shapes must be non-empty (input_len, output_len) pairs > 0; bad: {bad}"
            )
        return value

    @pydantic.field_validator("request_rates")
    @classmethod
    def _positive_rates(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        bad = [rate for rate in value if not rate > 0]
        if bad or not value:
            raise ValueError(f"request_rates must be non-empty and > 0 (inf = burst); bad: {bad}")
        return value


# ---------------------------------------------------------------------------------------------
# One line per problem, for the stack config and the run config alike


def _key_of(field_name: str, field: Any) -> str:
    return str(field.alias or field_name)


def _model_at(
    root: type[pydantic.BaseModel], loc: tuple[Any, ...]
) -> type[pydantic.BaseModel] | None:
    """The model that owns the key at `loc` (keys as the user wrote them: aliases or names)."""
    model = root
    for part in loc[:-1]:
        match = next(
            (f for n, f in model.model_fields.items() if part in (n, f.alias)),
            None,
        )
        annotation = getattr(match, "annotation", None)
        # `Section | None` fields (optional run-config sections) are followed into the section.
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        found = [c for c in candidates if isinstance(c, type) and issubclass(c, pydantic.BaseModel)]
        if not found:
            return None
        model = found[0]
    return model


def problem_lines(errors: list[Any], root: type[pydantic.BaseModel]) -> list[str]:
    """One line per problem of `ValidationError.errors()` against `root`:
    `key: bad value: what is allowed` (an unknown key gets the closest known one and the list)."""
    lines = []
    for problem in errors:
        loc = tuple(problem["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        model = _model_at(root, loc) if loc else None
        if problem["type"] == "extra_forbidden":
            allowed = sorted(_key_of(n, f) for n, f in model.model_fields.items()) if model else []
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"{key}: unknown key{hint}: allowed keys here are {', '.join(allowed)}")
        elif problem["type"] == "missing":
            field = (
                next((f for n, f in model.model_fields.items() if loc[-1] in (n, f.alias)), None)
                if model
                else None
            )
            lines.append(f"{key}: missing: required; {(field.description or '') if field else ''}")
        else:
            # A validator's own sentence comes without pydantic's "Value error, " prefix.
            message = str(problem["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {problem.get('input')!r}: {message}")
    return lines
