"""The rendered startup scripts: golden files, `bash -n`, shellcheck, quoting, no secrets.

UPDATE_GOLDEN=1 rewrites tests/golden/startup/*.sh on purpose; a mismatch prints a unified diff.
"""

from __future__ import annotations

import difflib
import os
import pathlib
import shutil
import subprocess

import jinja2
import pytest

from infra.components import boot_release
from infra.config import stack_config
from infra.vm import roles, startup, templating
from tests.fixtures import pulumi_mocks

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "golden" / "startup"


def _scripts() -> dict[str, str]:
    scripts = {}
    for stack in ("dev", "prod"):
        cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config(stack))
        # As the program renders it: with the release it restores at boot.
        scripts[f"{stack}-train.sh"] = roles.TRAIN.startup_script(
            cfg,
            has_hf_secret=True,
            release=boot_release.startup_context(cfg, roles.TRAIN.node_name(cfg)),
        )
        if cfg.serving.enabled:
            scripts[f"{stack}-serve.sh"] = startup.render_serve(cfg, roles.SERVE)
    return scripts


SCRIPTS = _scripts()


def test_both_stacks_are_covered():
    assert set(SCRIPTS) == {"dev-train.sh", "prod-train.sh", "prod-serve.sh"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_matches_golden_file(name):
    path = GOLDEN / name
    rendered = SCRIPTS[name]
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered)
    assert path.exists(), f"{path} is missing: run with UPDATE_GOLDEN=1 to create it"
    expected = path.read_text()
    if rendered != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                rendered.splitlines(keepends=True),
                fromfile=f"golden/{name}",
                tofile=f"rendered/{name}",
            )
        )
        pytest.fail(f"{name} differs from its golden file (UPDATE_GOLDEN=1 rewrites it):\n{diff}")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_bash_syntax(name, tmp_path):
    path = tmp_path / name
    path.write_text(SCRIPTS[name])
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (.ci/setup installs it)"
)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_shellcheck(name, tmp_path):
    path = tmp_path / name
    path.write_text(SCRIPTS[name])
    result = subprocess.run(
        ["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_what_every_script_does(name):
    script = SCRIPTS[name]
    assert script.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in script
    assert "export TMPDIR=/dev/shm" in script
    assert 'rm -f "$READY_MARKER"' in script and "\n  finish\n" in script
    assert "readonly READY_MARKER=/run/gemma4/ready" in script
    assert "ppa:deadsnakes/ppa" in script and "readonly PYTHON=python3.11" in script
    assert "readonly VENV_DIR=/opt/gemma4/venv" in script
    assert "set -x" not in script  # would print the token
    if "train" in name:
        assert "'jax[tpu]==0.10.2'" in script
        assert "libtpu==0.0.42.1" in script and "--find-links" not in script
        assert "google-tunix==0.1.7" in script and "qwix==0.1.8" in script
        assert "gcloud secrets versions access latest" in script
        assert "JAX_COMPILATION_CACHE_DIR=gs://" in script
        assert 'gcloud storage rsync --recursive "$MODEL_URI" "$STAGE_DIR"' in script
    else:
        assert "/sys/kernel/mm/transparent_hugepage/enabled" in script
        assert "docker pull" in script and "readonly VLLM_IMAGE=vllm/vllm-tpu:" in script
        assert f"readonly VERILOG_EVAL_COMMIT={startup.VERILOG_EVAL_COMMIT}" in script
        assert "apt_install iverilog bubblewrap git" in script  # eval's sandbox
        assert "gcloud secrets" not in script  # the serving VM never needs the token


def test_no_token_looking_value_in_any_script():
    for script in SCRIPTS.values():
        assert (
            "hf_" not in script
        )  # Hugging Face tokens start with hf_; scripts only name the secret


def test_values_are_quoted_by_the_filter():
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    context = startup.train_context(cfg, roles.TRAIN, has_hf_secret=True)
    evil = "evil/repo'; touch /tmp/pwned #$(id)"
    context["hf_repo"] = evil
    script = templating.render("startup/train.sh.j2", **context)
    (line,) = [x for x in script.splitlines() if x.startswith("readonly HF_REPO=")]
    result = subprocess.run(
        ["bash", "-c", f'{line}\nprintf %s "$HF_REPO"'], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout == evil


def test_missing_variable_is_an_error():
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    context = startup.train_context(cfg, roles.TRAIN, has_hf_secret=True)
    del context["model_uri"]
    with pytest.raises(jinja2.UndefinedError):
        templating.render("startup/train.sh.j2", **context)
