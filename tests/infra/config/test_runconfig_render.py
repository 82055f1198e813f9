"""StackConfig -> RunConfig: the paths in the buckets and the values the workloads read."""

from __future__ import annotations

import yaml

from infra.config import runconfig_render, stack_config
from tests.fixtures import pulumi_mocks
from workloads.contract import runconfig


def _render(stack):
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config(stack))
    return cfg, runconfig_render.render_run_config(cfg)


def test_prod_run_config_is_the_papers_recipe_packed():
    cfg, rc = _render("prod")
    train_bucket = f"gs://{cfg.training_bucket_name}"
    serve_bucket = f"gs://{cfg.serving_bucket_name}"
    assert rc.run_name == "codev-r1"
    assert rc.model.base == f"{train_bucket}/models/gemma-4-31b"
    assert rc.model.stage_dir.startswith("/dev/shm/")
    assert rc.data.dataset == f"{train_bucket}/data/codev-r1.jsonl"
    assert (rc.data.max_rows, rc.data.max_seq_len, rc.data.packing) == (10_000, 3072, True)
    assert (rc.lora.rank, rc.lora.alpha, rc.lora.dropout) == (64, 64.0, 0.05)
    t = rc.train
    assert t.output_dir == f"{train_bucket}/checkpoints/codev-r1"
    assert t.checkpoint_dir == f"{train_bucket}/checkpoints/codev-r1/checkpoints"
    assert (t.max_steps, t.epochs, t.save_every, t.keep_checkpoints) == (None, 1, 100, 3)
    assert (t.micro_batch, t.grad_accum, t.mesh.fsdp, t.mesh.tp, t.remat) == (
        cfg.training.micro_batch,
        cfg.training.grad_accum,
        cfg.training.mesh.fsdp,
        cfg.training.mesh.tp,
        cfg.training.remat,
    )
    assert t.compile_cache_dir == f"{train_bucket}/compile-cache/jax"
    # The merged model goes to the serving VM's in-region bucket; serving reads it from there.
    assert rc.merge.out == f"{serve_bucket}/merged/codev-r1"
    assert rc.serve.model_dir == rc.merge.out
    assert rc.serve.compile_cache_gcs == f"{serve_bucket}/compile-cache/vllm"
    assert (rc.serve.tensor_parallel_size, rc.serve.max_model_len) == (8, 16384)
    assert rc.eval.problems_dir == "/opt/verilog-eval/dataset_spec-to-rtl"
    assert rc.eval.results_dir == f"{serve_bucket}/eval/codev-r1"
    assert rc.bench.results_dir == f"{serve_bucket}/bench/codev-r1"


def test_dev_run_config_has_no_serving_sections():
    cfg, rc = _render("dev")
    assert rc.train.max_steps == 30
    assert rc.merge is not None and rc.merge.out.startswith(
        f"gs://{cfg.training_bucket_name}/merged/"
    )
    assert rc.serve is None and rc.eval is None and rc.bench is None


def test_yaml_round_trips_through_the_workloads_schema():
    for stack in ("dev", "prod"):
        cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config(stack))
        text = runconfig_render.render_run_config_yaml(cfg)
        assert runconfig.parse(yaml.safe_load(text)) == runconfig_render.render_run_config(cfg)
