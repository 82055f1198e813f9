"""The VM startup scripts: the pinned software stack and the template context of each role.

The scripts (templates/startup/{train,serve}.sh.j2) run at every boot and are idempotent. They
receive names and paths only: the Hugging Face token stays in Secret Manager and is fetched by
the training VM only when the bucket has no copy of the model yet.
"""

from __future__ import annotations

import hashlib
from typing import Any

from infra import config as config_mod
from infra import runconfig_render, templating
from workloads import catalog, runconfig

PYTHON = "python3.11"
VENV_DIR = "/opt/gemma4/venv"
READY_MARKER = "/var/lib/gemma4/ready"
ENV_FILE = "/etc/gemma4/env"
RUN_CONFIG_PATH = "/etc/gemma4/run.yaml"
LOG_FILE = "/var/log/gemma4-startup.log"
TMPDIR = "/dev/shm"
HF_HOME = "/dev/shm/huggingface"
LIBTPU_FIND_LINKS = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"

# The JAX-TPU / Tunix / Qwix stack that works together (what CI installs), pinned exactly so
# that every boot of every worker gets the same software. The `workloads` package itself is
# installed on top by the deployment.
TRAIN_REQUIREMENTS: tuple[str, ...] = (
    f"--find-links {LIBTPU_FIND_LINKS}",
    "jax[tpu]==0.10.2",
    # The TPU compiler itself: the same release the deviceless compile check uses (pyproject's
    # `compile` extra), so what that check compiled is what the VM compiles.
    "libtpu==0.0.42.1",
    "flax==0.12.8",
    "google-tunix==0.1.7",
    "qwix==0.1.8",
    "orbax-checkpoint==0.12.8",
    "optax==0.2.8",
    "safetensors==0.7.0",
    "tokenizers==0.22.2",
    # The chat template is rendered with the tokenizer's own transformers implementation
    # (what vLLM uses); tunix would pull it in anyway, pinned here so every boot gets this one.
    "transformers==5.12.1",
    "huggingface_hub==1.33.0",
    "gcsfs==2026.10.1",
    "tensorboardX==2.6.5",
    # The merge (run on the training VM after training): progress bar and peak-RSS figure.
    "tqdm==4.70.1",
    "psutil==7.2.2",
)
# The serving host runs vLLM in its container; its venv only drives serve/eval/bench/report
# (gs:// access, and the bench and report plots).
SERVE_REQUIREMENTS: tuple[str, ...] = ("gcsfs==2026.10.1", "matplotlib==3.11.2")

VERILOG_EVAL_REPO = "https://github.com/NVlabs/verilog-eval.git"
VERILOG_EVAL_COMMIT = "65c87a832b6cb752c38490b397df372f6ddc1c89"

_SERVE_DEFAULTS = runconfig.ServeSection.model_fields


def _requirements_digest(requirements: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:16]


def _common(
    cfg: config_mod.StackConfig, role: str, requirements: tuple[str, ...]
) -> dict[str, Any]:
    return {
        "stack_role": role,
        "project": cfg.project,
        "python": PYTHON,
        "venv_dir": VENV_DIR,
        "requirements": list(requirements),
        "requirements_digest": _requirements_digest(requirements),
        "ready_marker": READY_MARKER,
        "env_file": ENV_FILE,
        "log_file": LOG_FILE,
        "tmpdir": TMPDIR,
    }


def train_context(cfg: config_mod.StackConfig, *, has_hf_secret: bool) -> dict[str, Any]:
    """Variables of templates/startup/train.sh.j2."""
    acc = catalog.accelerator(cfg.training.accelerator)
    env = [
        f"TMPDIR={TMPDIR}",
        f"HF_HOME={HF_HOME}",
        "GEMMA4_ROLE=train",
        f"GEMMA4_RUN_CONFIG={RUN_CONFIG_PATH}",
        f"GEMMA4_VENV={VENV_DIR}",
        f"GEMMA4_HOSTS={acc.hosts}",
        f"JAX_COMPILATION_CACHE_DIR={runconfig_render.train_compile_cache_uri(cfg)}",
    ]
    return {
        **_common(cfg, "train", TRAIN_REQUIREMENTS),
        "env_lines": env,
        "hosts": acc.hosts,
        "stage_dir": cfg.model.stage_dir.rstrip("/"),
        "model_uri": runconfig_render.base_model_uri(cfg),
        "model_marker_uri": runconfig_render.base_model_marker_uri(cfg),
        "hf_repo": cfg.hf_repo,
        "download_from_hub": cfg.model.download_from_hub and has_hf_secret,
        "hf_secret": cfg.hf_secret_id if has_hf_secret else "",
    }


def serve_context(cfg: config_mod.StackConfig) -> dict[str, Any]:
    """Variables of templates/startup/serve.sh.j2."""
    cache_dir = _SERVE_DEFAULTS["compile_cache_dir"].default
    env = [
        f"TMPDIR={TMPDIR}",
        f"HF_HOME={HF_HOME}",
        "GEMMA4_ROLE=serve",
        f"GEMMA4_RUN_CONFIG={RUN_CONFIG_PATH}",
        f"GEMMA4_VENV={VENV_DIR}",
        f"GEMMA4_VERILOG_EVAL={runconfig_render.VERILOG_EVAL_DIR}",
    ]
    return {
        **_common(cfg, "serve", SERVE_REQUIREMENTS),
        "env_lines": env,
        "vllm_image": cfg.serving.image,
        "merged_uri": runconfig_render.merged_uri(cfg),
        "merged_dir": _SERVE_DEFAULTS["local_dir"].default,
        "vllm_cache_dir": cache_dir,
        "vllm_cache_uri": runconfig_render.serve_compile_cache_uri(cfg),
        "verilog_eval_repo": VERILOG_EVAL_REPO,
        "verilog_eval_commit": VERILOG_EVAL_COMMIT,
        "verilog_eval_dir": runconfig_render.VERILOG_EVAL_DIR,
    }


def render_train(cfg: config_mod.StackConfig, *, has_hf_secret: bool) -> str:
    """The training VM's startup script."""
    return templating.render(
        "startup/train.sh.j2", **train_context(cfg, has_hf_secret=has_hf_secret)
    )


def render_serve(cfg: config_mod.StackConfig) -> str:
    """The serving VM's startup script."""
    return templating.render("startup/serve.sh.j2", **serve_context(cfg))
