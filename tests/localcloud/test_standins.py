"""The local cloud's plan and docker stand-in: the program under mocks declares what the VMs boot
from, and `docker run` becomes the CPU build's server with the same engine arguments."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import yaml

from localcloud import stack_plan
from workloads.contract import runconfig
from workloads.serve import argv as argv_lib

DOCKER = pathlib.Path(__file__).resolve().parents[2] / "localcloud" / "guest" / "docker"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyForTestsOnly000000000000000000 rehearsal"


def rehearsal_plan() -> stack_plan.StackPlan:
    config = stack_plan.rehearsal_config("dev", KEY, pathlib.Path("/tmp/key"), serving=True)
    return stack_plan.plan("dev", config)


def test_the_plan_is_the_programs_declaration_with_the_tiny_model():
    plan = rehearsal_plan()
    assert set(plan.vms) == {"train", "serve"}
    train = plan.vms["train"]
    assert train.metadata["startup-script"].startswith("#!/bin/bash")
    assert KEY in train.metadata["ssh-keys"]
    run_config = yaml.safe_load(train.deployment["run_config_yaml"])
    assert run_config["model"]["base"].endswith("/models/gemma-4-tiny")
    assert plan.vms["serve"].deployment["hosts"] != train.deployment["hosts"]


def test_docker_run_becomes_the_cpu_builds_server(tmp_path):
    serve = runconfig.parse(
        yaml.safe_load(rehearsal_plan().vms["serve"].deployment["run_config_yaml"]),
        source="plan",
    ).serve
    source = argv_lib.model_source(serve)
    docker_argv = argv_lib.serve_argv(serve, source, docker=str(DOCKER))
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT"; env > "$OUT.env"\n')
    fake.chmod(0o755)
    env = {
        **os.environ,
        "LOCALCLOUD_VLLM_PYTHON": str(fake),
        "LOCALCLOUD_DOCKER_STATE": str(tmp_path / "state"),
        "OUT": str(tmp_path / "argv"),
    }
    subprocess.run([sys.executable, *docker_argv], env=env, check=True, capture_output=True)

    args = (tmp_path / "argv").read_text().splitlines()
    assert args[:3] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert args[3] == source.serve_path
    assert args[args.index("--tensor-parallel-size") + 1] == "1"  # one CPU for the 8 chips
    assert "--max-model-len" in args and "2048" in args
    assert "HF_HUB_OFFLINE=1" in (tmp_path / "argv.env").read_text()
    assert (tmp_path / "state" / f"{serve.container_name}.pid").exists()


def test_docker_image_inspect_answers_and_unknown_commands_are_refused():
    assert subprocess.run([sys.executable, str(DOCKER), "image", "inspect", "x"]).returncode == 0
    proc = subprocess.run(
        [sys.executable, str(DOCKER), "network", "ls"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "not implemented" in proc.stderr
