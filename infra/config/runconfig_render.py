"""StackConfig -> workloads.contract.runconfig.RunConfig: where every artefact lives in the buckets.

Bucket layout (one bucket per VM region; see StackConfig.training_bucket_name):
    models/<model>/                 base model (HF layout), staged to /dev/shm on the VMs
    models/<model>.complete         written last by the hub download's upload (the copy is whole)
    venv/train-<digest>.tar.gz      the training venv for one lock digest, + .sha256 written last
    data/codev-r1.jsonl             training data (default location)
    checkpoints/<run>/              the run dir: checkpoints/, metrics.jsonl, tensorboard/
    compile-cache/jax/              persistent JAX compilation cache (scratch: lifecycle-deleted)
    merged/<run>/                   merged HF shards (in the serving bucket when serving is on)
    compile-cache/vllm/             vLLM XLA cache of the serving host
    eval/<run>/, bench/<run>/       results (serving bucket)
"""

from __future__ import annotations

from infra.config import model as config_mod
from workloads.contract import runconfig, settings
from workloads.contract.settings import values_of

VERILOG_EVAL_DIR = "/opt/verilog-eval"
VERILOG_EVAL_PROBLEMS = f"{VERILOG_EVAL_DIR}/dataset_spec-to-rtl"
SCRATCH_PREFIXES = ("compile-cache/", "tmp/")


def gs(bucket: str, *parts: str) -> str:
    return runconfig.join(f"gs://{bucket}", *parts)


def base_model_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.training_bucket_name, "models", cfg.model.name)


def base_model_marker_uri(cfg: config_mod.StackConfig) -> str:
    """Written after the hub download finished uploading (the model is complete in the bucket)."""
    return base_model_uri(cfg) + ".complete"


def venv_archive_uri(cfg: config_mod.StackConfig, digest: str) -> str:
    """The training VM's venv packed by the first VM that installed it, keyed by the digest of
    the pins and the lock: another pin is another archive."""
    return gs(cfg.training_bucket_name, "venv", f"train-{digest}.tar.gz")


def recovery_record_uri(cfg: config_mod.StackConfig, node: str) -> str:
    """The node's recorded create request (infra/tpu/record.py), what recovery recreates it
    from: in the training bucket, which recovery reads for the run's progress anyway."""
    return gs(cfg.training_bucket_name, "recovery", f"{node}.json")


def release_archive_uri(cfg: config_mod.StackConfig, node: str) -> str:
    """The release `pulumi up` pushes for the node (infra/components/boot_release.py): what its
    startup script installs at boot when nothing is deployed there yet (a recreated node)."""
    return gs(cfg.training_bucket_name, "recovery", f"{node}-release.tar.gz")


def boot_reports_uri(cfg: config_mod.StackConfig, node: str) -> str:
    """Where the node's workers report a failed boot (`<host>.failed`, one line each): recovery
    reads it there without SSH and replaces a node whose boot failed."""
    return gs(cfg.training_bucket_name, "recovery", f"{node}-boot")


def run_dir_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.training_bucket_name, "checkpoints", cfg.run_name)


def merged_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.serving_bucket_name, "merged", cfg.run_name)


def release_marker_uri(cfg: config_mod.StackConfig) -> str:
    """Written by `workloads release` when the training VM gave itself back (see program.py)."""
    return runconfig.join(run_dir_uri(cfg), runconfig.RELEASE_MARKER_FILE)


def train_compile_cache_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.training_bucket_name, "compile-cache", "jax")


def serve_compile_cache_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.serving_bucket_name, "compile-cache", "vllm")


def render_run_config(cfg: config_mod.StackConfig) -> runconfig.RunConfig:
    """The run config the VMs read from /etc/gemma4/run.yaml.

    Raises:
        workloads.common.errors.UserError: the result does not pass the run-config schema.
    """
    # The user's settings pass through as they are (a projection onto the shared settings
    # models); what is added here is where things live.
    data: dict = {
        "run_name": cfg.run_name,
        "model": {
            "base": base_model_uri(cfg),
            "stage_dir": cfg.model.stage_dir,
            "dtype": "bfloat16",
        },
        "data": {
            **values_of(cfg.data, settings.DataSettings),
            "dataset": cfg.data.dataset or gs(cfg.training_bucket_name, "data", "codev-r1.jsonl"),
        },
        "lora": values_of(cfg.lora, settings.LoraSettings),
        "train": {
            **values_of(cfg.training, settings.TrainingSettings),
            "output_dir": run_dir_uri(cfg),
            "accelerator": cfg.training.accelerator,
            "compile_cache_dir": train_compile_cache_uri(cfg),
        },
    }
    if cfg.training.release_when_done:
        data["release"] = {
            "project": cfg.project,
            "zone": cfg.training.zone,
            "node": cfg.training_node_name,
            "marker": release_marker_uri(cfg),
        }
    if cfg.serving.enabled and cfg.serving.stop_after_hours is not None:
        data["stop"] = {
            "project": cfg.project,
            "zone": cfg.serving.zone,
            "node": cfg.serving_node_name,
            "after_hours": cfg.serving.stop_after_hours,
        }
    if cfg.merge.enabled:
        data["merge"] = {**values_of(cfg.merge, settings.MergeSettings), "out": merged_uri(cfg)}
    s = cfg.serving
    if s.enabled:
        data["serve"] = {
            **values_of(s, settings.ServingSettings),
            "model_dir": merged_uri(cfg),
            "accelerator": s.accelerator,
            "compile_cache_gcs": serve_compile_cache_uri(cfg),
        }
        if s.bench.enabled:
            data["bench"] = {
                **values_of(s.bench, settings.BenchSettings),
                "results_dir": gs(cfg.serving_bucket_name, "bench", cfg.run_name),
            }
        if s.eval.enabled:
            data["eval"] = {
                **values_of(s.eval, settings.EvalSettings),
                "problems_dir": VERILOG_EVAL_PROBLEMS,
                "results_dir": gs(cfg.serving_bucket_name, "eval", cfg.run_name),
                "endpoint": f"http://127.0.0.1:{s.port}/v1",
            }
    return runconfig.parse(data, source="rendered run config")


def render_run_config_yaml(cfg: config_mod.StackConfig) -> str:
    """The YAML text of `render_run_config(cfg)`."""
    return render_run_config(cfg).to_yaml()
