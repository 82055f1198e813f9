"""The VM startup scripts: the pinned software stack and the template context of each role.

The scripts (templates/startup/<role>.sh.j2: train.sh.j2, serve.sh.j2) run at every boot and are
idempotent. They receive names and paths only: the Hugging Face token stays in Secret Manager and
is fetched by the training VM only when the bucket has no copy of the model yet. Each role's
`startup_script` (infra/vm/roles.py) names its renderer here and passes itself: the script
writes the role's name and boot-report path from it.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import re
import tomllib
from typing import Any, Protocol

from infra.config import model as config_mod
from infra.config import runconfig_render, sizing
from infra.vm import templating
from infra.vm.layout import WORKER
from workloads.common import stage_records
from workloads.contract import catalog, runconfig


class ScriptRole(Protocol):
    """What a script reads of its role (infra/vm/roles.py's VmRole, which renders its script with
    this module: a protocol here, so that neither imports the other's name in a circle)."""

    @property
    def name(self) -> str: ...

    def node_name(self, cfg: config_mod.StackConfig) -> str: ...


PYTHON = "python3.11"
# The worker paths the deploy steps use too (one definition, in infra/vm/layout.py).
VENV_DIR = WORKER.venv
READY_MARKER = WORKER.ready_marker
BOOT_FAILED_MARKER = WORKER.boot_failed_marker
BOOT_FAILED_NOTE = WORKER.boot_failed_note
ENV_FILE = WORKER.env_file
RUN_CONFIG_PATH = WORKER.config_path
LOG_FILE = WORKER.startup_log
STAGES_FILE = WORKER.stages_file
SCRIPT_COPY = WORKER.startup_script_copy
TMPDIR = "/dev/shm"
HF_HOME = "/dev/shm/huggingface"
# Files `hf download` fetches at once: more than a Gemma 4 31B checkpoint's shards, so all of
# them download in parallel (the client's default is 8).
HF_MAX_WORKERS = 16

CONSTRAINTS_FILE = pathlib.Path(__file__).resolve().parents[2] / "constraints.txt"
PYPROJECT_FILE = CONSTRAINTS_FILE.parent / "pyproject.toml"


def normalized_name(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): `Cloud_TPU.x` -> `cloud-tpu-x`."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def pinned_versions(path: pathlib.Path = CONSTRAINTS_FILE) -> dict[str, str]:
    """constraints.txt as {normalized name: exact version}: the versions CI installs and tests."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalized_name(name)] = version.strip()
    return pins


def pinned(requirement: str) -> str:
    """`jax[tpu]` -> `jax[tpu]==0.10.2`, the version from constraints.txt.

    Raises:
        KeyError: the package is not in constraints.txt (add it to pyproject and regenerate).
    """
    name = requirement.split("[", 1)[0]
    try:
        return f"{requirement}=={pinned_versions()[normalized_name(name)]}"
    except KeyError:
        raise KeyError(f"{name} is not pinned in {CONSTRAINTS_FILE.name}") from None


# What the training VM's venv needs, at the versions CI tests (constraints.txt), so every boot of
# every worker gets the same software; the `workloads` package itself is installed on top by the
# deployment. libtpu is the TPU compiler itself: the release the deviceless compile check uses,
# so what that check compiled is what the VM compiles. transformers renders the chat template
# with the tokenizer's own implementation (what vLLM uses); tqdm, psutil and google-crc32c (the
# shards' checksum) serve the merge.
TRAIN_PACKAGES = (
    "jax[tpu]",
    "libtpu",
    "flax",
    "qwix",
    "orbax-checkpoint",
    "optax",
    "numpy",
    "ml_dtypes",
    "safetensors",
    "tokenizers",
    "transformers",
    "huggingface_hub",
    "gcsfs",
    "google-crc32c",
    "tensorboardX",
    "tqdm",
    "psutil",
)
# The serving host runs vLLM in its container; its venv only drives serve/eval/bench/report
# (gs:// access, the shards' checksums, and the bench and report plots).
SERVE_PACKAGES = ("gcsfs", "google-crc32c", "matplotlib")
# The venv's own pip, which every deploy installs a release's wheel with (infra/remote/release.py):
# the lock's, not whichever one ensurepip of the image's Python bundles that day.
VENV_TOOLS = ("pip",)


@functools.cache
def core_packages(path: pathlib.Path = PYPROJECT_FILE) -> tuple[str, ...]:
    """The workloads wheel's own dependencies (pyproject's [project].dependencies, names only).

    Both VMs install them at boot from the lock, so the deployment's `pip install <wheel>` finds
    them present and adds nothing unpinned.
    """
    requirements = tomllib.loads(path.read_text())["project"]["dependencies"]
    return tuple(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in requirements)


@functools.cache
def no_deps(path: pathlib.Path = PYPROJECT_FILE) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the packages installed without their dependencies, what their imported modules need),
    names only, from pyproject's [tool.gemma4-tpu.no-deps] (it says why)."""
    table = tomllib.loads(path.read_text())["tool"]["gemma4-tpu"]["no-deps"]
    names = [
        tuple(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in table[key])
        for key in ("packages", "needs")
    ]
    return names[0], names[1]


def _pinned_all(packages: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(pinned(p) for p in packages))  # in order, each once


def train_requirements() -> tuple[str, ...]:
    # No --find-links to Google's libtpu release page: the pinned libtpu is on PyPI, and a page
    # the installer must reach is one more way a boot fails (uv stops on an unreachable link).
    needs = no_deps()[1]
    return _pinned_all((*TRAIN_PACKAGES, *needs, *core_packages(), *VENV_TOOLS))


def train_no_deps() -> tuple[str, ...]:
    """What the training VM installs with `pip install --no-deps` after train_requirements."""
    return _pinned_all(no_deps()[0])


def serve_requirements() -> tuple[str, ...]:
    return _pinned_all((*SERVE_PACKAGES, *core_packages(), *VENV_TOOLS))


def lock() -> tuple[str, ...]:
    """The whole of constraints.txt as `name==version` lines: what pip gets as `-c` on the VMs,
    as CI installs with `-c constraints.txt`. The top-level pins say what to install; the lock
    pins everything they pull in, so a VM runs the versions CI tested, not the day's newest.
    Constraints install nothing by themselves: the CPU-only test packages (torch, pytest, ...)
    in the lock stay off the VMs."""
    return tuple(f"{name}=={version}" for name, version in sorted(pinned_versions().items()))


VERILOG_EVAL_REPO = "https://github.com/NVlabs/verilog-eval.git"
VERILOG_EVAL_COMMIT = "65c87a832b6cb752c38490b397df372f6ddc1c89"

_SERVE_DEFAULTS = runconfig.ServingRunSection.model_fields


def _requirements_digest(
    requirements: tuple[str, ...], constraints: tuple[str, ...], without_deps: tuple[str, ...] = ()
) -> str:
    """Changes when a pin or the lock changes: the venv is installed again at the next boot."""
    text = "\n".join(requirements) + "\n--constraints--\n" + "\n".join(constraints)
    if without_deps:
        text += "\n--no-deps--\n" + "\n".join(without_deps)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _common(
    cfg: config_mod.StackConfig,
    role: ScriptRole,
    requirements: tuple[str, ...],
    shm: tuple[int, str],
    without_deps: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The variables of templates/startup/_common.sh.j2. `shm`: (the bytes of /dev/shm the role's
    working set needs, the stack-config key that sets them)."""
    shm_needed, shm_key = shm
    return {
        "shm_needed_bytes": shm_needed,
        "shm_key": shm_key,
        "shm_max_percent": round(catalog.SHM_MAX_FRACTION * 100),
        "stack_role": role.name,
        "project": cfg.project,
        "python": PYTHON,
        "venv_dir": VENV_DIR,
        "requirements": list(requirements),
        "constraints": list(lock()),
        "no_deps": list(without_deps),
        "requirements_digest": _requirements_digest(requirements, lock(), without_deps),
        # The installer of the venvs (uv, from the lock): the same pinned set as pip would
        # install, in about a third of pip's time (benchmarks/startup.py).
        "uv_requirement": pinned("uv"),
        "ready_marker": READY_MARKER,
        "boot_failed_marker": BOOT_FAILED_MARKER,
        "boot_failed_note": BOOT_FAILED_NOTE,
        "env_file": ENV_FILE,
        "log_file": LOG_FILE,
        "state_dir": WORKER.state_dir,
        "stages_file": STAGES_FILE,
        "script_copy": SCRIPT_COPY,
        "tmpdir": TMPDIR,
        # The serving venv is two small packages: pip is as fast as an archive there.
        "venv_archive_uri": "",
        "boot_report_uri": runconfig_render.boot_reports_uri(cfg, role.node_name(cfg)),
    }


# _release.sh.j2 without a release: nothing is restored at boot (the deploy installs the job).
NO_BOOT_RELEASE = dict.fromkeys(
    (
        "release_uri",
        "release_build",
        "release_verify",
        "release_import_check",
        "release_switch",
        "base_python",
        "releases_dir",
        "release_current",
        "config_link",
        "active_config",
        "unit_dir",
        "deployed_file",
    ),
    "",
)


def train_context(
    cfg: config_mod.StackConfig, role: ScriptRole, *, has_hf_secret: bool
) -> dict[str, Any]:
    """Variables of templates/startup/train.sh.j2 (`role`: the training VM's, roles.TRAIN)."""
    acc = catalog.accelerator(cfg.training.accelerator)
    requirements = train_requirements()
    env = [
        f"TMPDIR={TMPDIR}",
        f"HF_HOME={HF_HOME}",
        f"GEMMA4_ROLE={role.name}",
        f"{stage_records.STAGES_ENV}={STAGES_FILE}",
        f"GEMMA4_RUN_CONFIG={RUN_CONFIG_PATH}",
        f"GEMMA4_VENV={VENV_DIR}",
        f"GEMMA4_HOSTS={acc.hosts}",
        f"JAX_COMPILATION_CACHE_DIR={runconfig_render.train_compile_cache_uri(cfg)}",
    ]
    shm = (sizing.training_shm_bytes(cfg), "training.shmWorkingSetGb")
    common = _common(cfg, role, requirements, shm, train_no_deps())
    return {
        **common,
        **NO_BOOT_RELEASE,
        "venv_archive_uri": runconfig_render.venv_archive_uri(cfg, common["requirements_digest"]),
        "hf_max_workers": HF_MAX_WORKERS,
        "env_lines": env,
        "hosts": acc.hosts,
        "stage_dir": cfg.model.stage_dir.rstrip("/"),
        "model_uri": runconfig_render.base_model_uri(cfg),
        "model_marker_uri": runconfig_render.base_model_marker_uri(cfg),
        "hf_repo": cfg.hf_repo,
        "download_from_hub": cfg.model.download_from_hub and has_hf_secret,
        "hf_secret": cfg.hf_secret_id if has_hf_secret else "",
    }


def serve_context(cfg: config_mod.StackConfig, role: ScriptRole) -> dict[str, Any]:
    """Variables of templates/startup/serve.sh.j2 (`role`: the serving VM's, roles.SERVE)."""
    cache_dir = _SERVE_DEFAULTS["compile_cache_dir"].default
    shm = (sizing.serving_shm_bytes(cfg), "serving.shmWorkingSetGb")
    env = [
        f"TMPDIR={TMPDIR}",
        f"HF_HOME={HF_HOME}",
        f"GEMMA4_ROLE={role.name}",
        f"GEMMA4_RUN_CONFIG={RUN_CONFIG_PATH}",
        f"GEMMA4_VENV={VENV_DIR}",
        f"GEMMA4_VERILOG_EVAL={runconfig_render.VERILOG_EVAL_DIR}",
    ]
    return {
        **_common(cfg, role, serve_requirements(), shm),
        "env_lines": env,
        "vllm_image": cfg.serving.image,
        "merged_uri": runconfig_render.merged_uri(cfg),
        "merged_dir": _SERVE_DEFAULTS["local_dir"].default,
        "weights_from": cfg.serving.weights_from,
        "vllm_cache_dir": cache_dir,
        "vllm_cache_uri": runconfig_render.serve_compile_cache_uri(cfg),
        "verilog_eval_repo": VERILOG_EVAL_REPO,
        "verilog_eval_commit": VERILOG_EVAL_COMMIT,
        "verilog_eval_dir": runconfig_render.VERILOG_EVAL_DIR,
    }


def render_train(
    cfg: config_mod.StackConfig,
    role: ScriptRole,
    *,
    has_hf_secret: bool,
    release: dict[str, Any] | None = None,
) -> str:
    """The training VM's startup script. `release`: the variables of _release.sh.j2, what the
    program passes (infra/components/boot_release.startup_context: the deploy's scripts live
    above this layer); None restores nothing at boot."""
    context = train_context(cfg, role, has_hf_secret=has_hf_secret) | (release or {})
    return templating.render(template(role), **context)


def render_serve(cfg: config_mod.StackConfig, role: ScriptRole) -> str:
    """The serving VM's startup script."""
    return templating.render(template(role), **serve_context(cfg, role))


def template(role: ScriptRole) -> str:
    """A role's startup template, under templates/: startup/<role>.sh.j2."""
    return f"startup/{role.name}.sh.j2"
