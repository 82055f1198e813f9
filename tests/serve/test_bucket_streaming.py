"""serving.weightsFrom bucket, rehearsed (slow: it starts real vLLM): vLLM's CPU build streams the
merged model from gs:// on the project's GCS protocol server with `--load-format runai_streamer`,
started by the product's own serve path (`workloads.serve.command.serving`, the process launcher,
the argv of `workloads.serve.argv`), and decodes token for token what the training code's model
loaded from a local directory decodes.

The Run:ai model streamer reads gs:// in two halves, each with its own way to an emulator:
- its Python half (runai_model_streamer_gcs: the listing of the safetensors, and the pull of the
  config and tokenizer files vLLM does before it starts) is google-cloud-storage, which follows
  STORAGE_EMULATOR_HOST (the gcs_server fixture sets it for gcsfs already); it builds its client
  with google.auth.default() unless RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS is true, and a
  machine without Application Default Credentials then fails with DefaultCredentialsError;
- its C++ half (libstreamergcs.so, google-cloud-cpp storage), which streams the tensors, follows
  CLOUD_STORAGE_EMULATOR_ENDPOINT, google-cloud-cpp's emulator override. Without it the listing
  succeeds and the streaming waits on storage.googleapis.com.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import pathlib
import urllib.parse

import pytest

from tests.serve.engine import needs_engine
from workloads.cli import demo_serving
from workloads.common import storage
from workloads.contract import runconfig, settings
from workloads.serve import argv, parity
from workloads.serve import command as serve_command

# The streamer's switches to the emulator, on top of the fixture's STORAGE_EMULATOR_HOST.
CPP_EMULATOR_ENV = "CLOUD_STORAGE_EMULATOR_ENDPOINT"
ANONYMOUS_ENV = "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS"
# vLLM's own line when the runai_streamer loader reads the weights (vllm/model_executor/
# model_loader/weight_utils.py's progress bar).
STREAMER_LOG_LINE = "Loading safetensors using Runai Model Streamer"


def _jax_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """The training code's greedy decode of the model in `model_dir` (float32, CPU)."""
    from workloads.merge import verify
    from workloads.model import gemma4

    mesh = verify.single_device_mesh()
    model = gemma4.load_model(model_dir, mesh=mesh, dtype="float32")
    return parity.greedy(model, mesh, prompts, parity.NEW_TOKENS)


def _tokenize(base_url: str, model: str, text: str) -> list[int]:
    """The server's token ids of `text` (vLLM's POST /tokenize, with its default special tokens)."""
    parts = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/tokenize",
            json.dumps({"model": model, "prompt": text}),
            {"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    assert response.status == 200, body[:500]
    return list(json.loads(body)["tokens"])


@pytest.mark.slow
@needs_engine
def test_vllm_streams_the_merged_model_from_the_bucket(
    gcs_server, gcs_bucket: str, tiny_model_dir, tmp_path: pathlib.Path, monkeypatch
) -> None:
    model_dir = str(tiny_model_dir)
    url = f"{gcs_bucket}/merged/run1"
    fs, root = storage.filesystem(url)
    for path in sorted(pathlib.Path(model_dir).iterdir()):
        fs.put_file(str(path), f"{root.rstrip('/')}/{path.name}")
    monkeypatch.setenv(CPP_EMULATOR_ENV, gcs_server.url)
    monkeypatch.setenv(ANONYMOUS_ENV, "true")
    # vLLM pulls the config and tokenizer files into <VLLM_ASSETS_CACHE>/model_streamer/<hash>.
    monkeypatch.setenv("VLLM_ASSETS_CACHE", str(tmp_path / "vllm-assets"))

    # The demo's serve section (float32, eager, the text model), one replica (the second engine
    # process of --data-parallel-size 2 only costs start-up time here), weights from the bucket.
    sections = demo_serving.serving_sections(
        tmp_path, demo_serving.engine_python(), demo_serving.free_port()
    )
    serve = runconfig.ServingRunSection(
        **{
            **sections["serve"],
            "model_dir": url,
            "weights_from": "bucket",
            "data_parallel_size": 1,
        }
    )
    source = argv.model_source(serve)
    assert (source.kind, source.serve_path) == ("bucket", url)
    command = serve_command.launch_argv(serve, source)
    assert command[command.index("--model") + 1] == url
    assert command[command.index("--load-format") + 1] == settings.RUNAI_STREAMER

    prompts = parity.prompt_ids(model_dir)
    log_path = tmp_path / "vllm.log"
    # The reference decodes while vLLM starts (both mostly wait on one core each).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(_jax_greedy, model_dir, prompts)
        with log_path.open("w") as log, serve_command.serving(serve, echo=log):
            base_url = argv.local_url(serve)
            served = parity.served_greedy(base_url, serve.served_model_name, prompts)
            # The tokenizer vLLM pulled from the bucket is the model's own.
            for text, ids in zip(parity.PROMPTS, prompts, strict=True):
                assert _tokenize(base_url, serve.served_model_name, text) == ids
        expected = reference.result()

    log_text = log_path.read_text(errors="replace")
    assert STREAMER_LOG_LINE in log_text, log_text[-3000:]
    assert served == expected
