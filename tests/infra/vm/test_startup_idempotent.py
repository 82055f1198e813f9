"""The startup scripts' staging steps, run for real in bash against a fake `gcloud`.

The rendered scripts run at every boot: staging must skip what is complete, and a boot that
died half-way must be redone by the next one. Each test renders the real template (paths moved
into a temp dir), sources it without its `main` call and runs the staging function twice.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from infra.config import stack_config
from infra.vm import roles, startup, templating
from tests.fixtures import pulumi_mocks

# A stand-in for the Cloud SDK: gs://X is $FAKE_GCS/X; every call is logged to $FAKE_GCS/calls.
FAKE_GCLOUD = r"""#!/bin/bash
set -euo pipefail
printf '%s\n' "$*" >>"$FAKE_GCS/calls"
local_path() { printf '%s/%s' "$FAKE_GCS" "${1#gs://}"; }
verb="$1 $2"
shift 2
case "$verb" in
  "storage ls")
    # A bucket's own listing answers unless the test made it unreachable.
    case "$1" in
      gs://*/*) [ ! -e "$FAKE_GCS/unreachable" ] && [ -e "$(local_path "$1")" ] ;;
      *) [ ! -e "$FAKE_GCS/unreachable" ] ;;
    esac ;;
  "storage cp")
    if [ "$1" = --quiet ]; then shift; fi
    cp "$(local_path "$1")" "$2" ;;
  "storage rsync")
    if [ -e "$FAKE_GCS/fail-rsync" ]; then echo "network error" >&2; exit 1; fi
    args=()
    for a in "$@"; do case "$a" in --*) ;; *) args+=("$a") ;; esac; done
    mkdir -p "${args[1]}"
    cp -r "$(local_path "${args[0]}")/." "${args[1]}/" ;;
  *) echo "fake gcloud: unexpected $verb" >&2; exit 2 ;;
esac
"""


def _functions(script: str) -> str:
    """The script without its final `main "$@"` line: sourcing it defines the functions only."""
    lines = script.rstrip("\n").splitlines()
    assert lines[-1] == 'main "$@"', lines[-1]
    return "\n".join(lines[:-1]) + "\n"


def _run(tmp: pathlib.Path, script: str, call: str) -> tuple[int, str]:
    """Sources the script's functions and runs `call` under `set -e` (as `main` would)."""
    (tmp / "functions.sh").write_text(_functions(script))
    driver = (
        f"source {tmp / 'functions.sh'}\n"
        "sleep() { :; }\n"  # retry's backoff, not needed here
        "set +e\n"
        f"(set -e; {call})\n"
        'echo "rc=$?"\n'
    )
    env = {
        "PATH": f"{tmp / 'bin'}:/usr/bin:/bin",
        "FAKE_GCS": str(tmp / "gcs"),
        "HOME": str(tmp),
    }
    proc = subprocess.run(
        ["bash", "-c", driver], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    rc = int(proc.stdout.strip().splitlines()[-1].removeprefix("rc="))
    return rc, proc.stdout + proc.stderr


@pytest.fixture
def tmp(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "bin").mkdir()
    gcloud = tmp_path / "bin" / "gcloud"
    gcloud.write_text(FAKE_GCLOUD)
    gcloud.chmod(0o755)
    (tmp_path / "gcs").mkdir()
    return tmp_path


def _calls(tmp: pathlib.Path, verb: str) -> list[str]:
    path = tmp / "gcs" / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if line.startswith(verb)]


def test_training_staging_skips_a_complete_copy_and_redoes_an_interrupted_one(tmp):
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    context = startup.train_context(cfg, roles.TRAIN, has_hf_secret=True)
    stage = tmp / "shm" / "models" / "base"
    context |= {
        "stage_dir": str(stage),
        "model_uri": "gs://bucket/models/gemma-4-31b",
        "model_marker_uri": "gs://bucket/models/gemma-4-31b.complete",
        "tmpdir": str(tmp / "shm"),
    }
    script = templating.render("startup/train.sh.j2", **context)
    model = tmp / "gcs" / "bucket" / "models" / "gemma-4-31b"
    model.mkdir(parents=True)
    (model / "model-00001-of-00002.safetensors").write_text("weights 1")
    (model / "model-00002-of-00002.safetensors").write_text("weights 2")
    (tmp / "gcs" / "bucket" / "models" / "gemma-4-31b.complete").write_text("google/x\n")

    # A boot that dies during the copy leaves no completion marker ...
    (tmp / "gcs" / "fail-rsync").touch()
    rc, output = _run(tmp, script, "ensure_base_model 0")
    assert rc != 0, output
    assert not pathlib.Path(f"{stage}.staged").exists()
    assert len(_calls(tmp, "storage rsync")) == 3  # retried, then given up

    # ... so the next boot copies again, and completes.
    (tmp / "gcs" / "fail-rsync").unlink()
    rc, output = _run(tmp, script, "ensure_base_model 0")
    assert rc == 0, output
    assert sorted(p.name for p in stage.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert pathlib.Path(f"{stage}.staged").exists()
    assert len(_calls(tmp, "storage rsync")) == 5  # the small files, then everything

    # Every later boot: nothing is copied, not even a bucket listing.
    before = len(_calls(tmp, ""))
    rc, output = _run(tmp, script, "ensure_base_model 0")
    assert rc == 0, output
    assert "base model already staged" in output
    assert len(_calls(tmp, "")) == before


def _script_without_hub_download(tmp: pathlib.Path) -> str:
    """The dev training script with no hf token (no hub download), staging gs://bucket's model."""
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    context = startup.train_context(cfg, roles.TRAIN, has_hf_secret=False)
    context |= {
        "stage_dir": str(tmp / "shm" / "base"),
        "model_uri": "gs://bucket/models/gemma-4-31b",
        "model_marker_uri": "gs://bucket/models/gemma-4-31b.complete",
    }
    return templating.render("startup/train.sh.j2", **context)


def test_training_staging_without_a_model_and_without_hub_download_fails_clearly(tmp):
    script = _script_without_hub_download(tmp)
    rc, output = _run(tmp, script, "ensure_base_model 1")
    assert rc == 1
    assert "ERROR: no model at gs://bucket/models/gemma-4-31b" in output
    assert _calls(tmp, "storage rsync") == []


def test_serving_staging_skips_the_same_merged_model_and_restages_a_new_one(tmp):
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("prod"))
    context = startup.serve_context(cfg, roles.SERVE)
    merged_dir = tmp / "shm" / "merged"
    (tmp / "shm").mkdir()
    context |= {
        "merged_uri": "gs://serve/merged/run",
        "merged_dir": str(merged_dir),
        "tmpdir": str(tmp / "shm"),
    }
    script = templating.render("startup/serve.sh.j2", **context)
    index = "model.safetensors.index.json"

    # No merged model yet: nothing to do, and the boot goes on.
    rc, output = _run(tmp, script, "stage_merged_model")
    assert rc == 0 and "no merged model at gs://serve/merged/run yet" in output, output

    bucket = tmp / "gcs" / "serve" / "merged" / "run"
    bucket.mkdir(parents=True)
    (bucket / "model-00001-of-00001.safetensors").write_text("merged v1")
    (bucket / index).write_text('{"v": 1}')
    rc, output = _run(tmp, script, "stage_merged_model")
    assert rc == 0, output
    assert (merged_dir / index).read_text() == '{"v": 1}'
    assert len(_calls(tmp, "storage rsync")) == 1

    # Same index in the bucket: skipped (one small index download to compare).
    rc, output = _run(tmp, script, "stage_merged_model")
    assert rc == 0 and "merged model already staged" in output, output
    assert len(_calls(tmp, "storage rsync")) == 1

    # A new merge (another index): staged again, the index (completion marker) written last.
    (bucket / "model-00001-of-00001.safetensors").write_text("merged v2")
    (bucket / index).write_text('{"v": 2}')
    rc, output = _run(tmp, script, "stage_merged_model")
    assert rc == 0, output
    assert len(_calls(tmp, "storage rsync")) == 2
    assert (merged_dir / "model-00001-of-00001.safetensors").read_text() == "merged v2"
    assert (merged_dir / index).read_text() == '{"v": 2}'


def test_serving_weights_from_the_bucket_are_not_staged_and_the_stage_says_so(tmp):
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("prod"))
    context = startup.serve_context(cfg, roles.SERVE)
    merged_dir = tmp / "shm" / "merged"
    (tmp / "shm").mkdir()
    stages = tmp / "stages.jsonl"
    context |= {
        "merged_uri": "gs://serve/merged/run",
        "merged_dir": str(merged_dir),
        "tmpdir": str(tmp / "shm"),
        "stages_file": str(stages),
        "weights_from": "bucket",
    }
    script = templating.render("startup/serve.sh.j2", **context)
    bucket = tmp / "gcs" / "serve" / "merged" / "run"
    bucket.mkdir(parents=True)
    (bucket / "model.safetensors.index.json").write_text('{"v": 1}')

    rc, output = _run(tmp, script, "merged_model_weights")
    assert rc == 0, output
    assert "weights stream from gs://serve/merged/run" in output
    assert not merged_dir.exists() and not _calls(tmp, "storage")
    records = [json.loads(line) for line in stages.read_text().splitlines()]
    assert [(r["stage"], r["event"]) for r in records] == [
        ("weights", "start"),
        ("weights", "end"),
    ]
    assert records[-1]["note"] == (
        "streamed from gs://serve/merged/run by vLLM (serving.weightsFrom bucket), not staged"
    )

    # The default stages, as before.
    script = templating.render("startup/serve.sh.j2", **(context | {"weights_from": "staged"}))
    rc, output = _run(tmp, script, "merged_model_weights")
    assert rc == 0, output
    assert (merged_dir / "model.safetensors.index.json").read_text() == '{"v": 1}'


def test_an_unreachable_bucket_is_not_taken_for_a_missing_model(tmp):
    # Before: `gcloud storage ls` failing for a network outage read as "no model there", and the
    # boot stopped with "no model at ..." (or went to the hub), naming the wrong cause.
    script = _script_without_hub_download(tmp)
    (tmp / "gcs" / "unreachable").parent.mkdir(parents=True, exist_ok=True)
    (tmp / "gcs" / "unreachable").touch()
    rc, output = _run(tmp, script, "ensure_base_model 1")
    assert rc == 1
    assert "ERROR: cannot read gs://bucket (network, permissions or an outage)" in output
    assert "no model at" not in output
    assert len(_calls(tmp, "storage ls gs://bucket")) >= 3  # retried before giving up
