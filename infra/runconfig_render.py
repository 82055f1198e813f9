"""StackConfig -> workloads.runconfig.RunConfig: where every artefact lives in the buckets.

Bucket layout (one bucket per VM region; see StackConfig.training_bucket_name):
    models/<model>/                 base model (HF layout), staged to /dev/shm on the VMs
    data/codev-r1.jsonl             training data (default location)
    checkpoints/<run>/              the run dir: checkpoints/, metrics.jsonl, tensorboard/
    compile-cache/jax/              persistent JAX compilation cache (scratch: lifecycle-deleted)
    merged/<run>/                   merged HF shards (in the serving bucket when serving is on)
    compile-cache/vllm/             vLLM XLA cache of the serving host
    eval/<run>/, bench/<run>/       results (serving bucket)
"""

from __future__ import annotations

from infra import config as config_mod
from workloads import runconfig

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


def run_dir_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.training_bucket_name, "checkpoints", cfg.run_name)


def merged_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.serving_bucket_name, "merged", cfg.run_name)


def train_compile_cache_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.training_bucket_name, "compile-cache", "jax")


def serve_compile_cache_uri(cfg: config_mod.StackConfig) -> str:
    return gs(cfg.serving_bucket_name, "compile-cache", "vllm")


def render_run_config(cfg: config_mod.StackConfig) -> runconfig.RunConfig:
    """The run config the VMs read from /etc/gemma4/run.yaml.

    Raises:
        workloads.errors.UserError: the result does not pass the run-config schema.
    """
    t = cfg.training
    data: dict = {
        "run_name": cfg.run_name,
        "model": {
            "base": base_model_uri(cfg),
            "stage_dir": cfg.model.stage_dir,
            "dtype": "bfloat16",
        },
        "data": {
            "dataset": cfg.data.dataset or gs(cfg.training_bucket_name, "data", "codev-r1.jsonl"),
            "max_rows": cfg.data.max_rows,
            "max_seq_len": cfg.data.max_seq_len,
            "packing": cfg.data.packing,
            "seed": cfg.data.seed,
            "shuffle": cfg.data.shuffle,
        },
        "lora": {
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha,
            "dropout": cfg.lora.dropout,
            "targets": list(cfg.lora.targets),
        },
        "train": {
            "output_dir": run_dir_uri(cfg),
            "accelerator": t.accelerator,
            "micro_batch": t.micro_batch,
            "grad_accum": t.grad_accum,
            "max_steps": t.max_steps,
            "epochs": t.epochs,
            "learning_rate": t.learning_rate,
            "weight_decay": t.weight_decay,
            "warmup_steps": t.warmup_steps,
            "mesh": {"fsdp": t.mesh.fsdp, "tp": t.mesh.tp},
            "remat": t.remat,
            "attention": t.attention,
            "save_every": t.save_every,
            "keep_checkpoints": t.keep_checkpoints,
            "log_every": t.log_every,
            "compile_cache_dir": train_compile_cache_uri(cfg),
        },
    }
    if cfg.merge.enabled:
        data["merge"] = {"out": merged_uri(cfg), "shard_size": cfg.merge.shard_size}
    s = cfg.serving
    if s.enabled:
        data["serve"] = {
            "image": s.image,
            "model_dir": merged_uri(cfg),
            "served_model_name": s.served_model_name,
            "accelerator": s.accelerator,
            "tensor_parallel_size": s.tensor_parallel_size,
            "max_model_len": s.max_model_len,
            "port": s.port,
            "compile_cache_gcs": serve_compile_cache_uri(cfg),
        }
        if s.bench.enabled:
            data["bench"] = {
                "num_prompts": s.bench.num_prompts,
                "results_dir": gs(cfg.serving_bucket_name, "bench", cfg.run_name),
            }
        if s.eval.enabled:
            data["eval"] = {
                "problems_dir": VERILOG_EVAL_PROBLEMS,
                "results_dir": gs(cfg.serving_bucket_name, "eval", cfg.run_name),
                "endpoint": f"http://127.0.0.1:{s.port}/v1",
                "n": s.eval.n,
                "temperature": s.eval.temperature,
                "top_p": s.eval.top_p,
                "max_tokens": s.eval.max_tokens,
            }
    return runconfig.parse(data, source="rendered run config")


def render_run_config_yaml(cfg: config_mod.StackConfig) -> str:
    """The YAML text of `render_run_config(cfg)`."""
    return render_run_config(cfg).to_yaml()
