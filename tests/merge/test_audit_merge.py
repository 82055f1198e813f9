"""Merge properties the other tests leave implicit: memory stays flat whatever the model size,
the progress bar counts bytes and tensors, and only the LoRA factors are restored (the base model
is never loaded as a model, and nothing lands on an accelerator)."""

from __future__ import annotations

import json
import pathlib
import tracemalloc

import numpy as np
import safetensors.numpy

from tests.merge.test_stream import some_deltas, write_base
from workloads.merge import mapping, stream
from workloads.merge import safetensors_io as st

ROWS, COLS, RANK = 512, 2048, 8  # 4 MiB float32 tensors
PER_FILE = 4  # tensors per base file
SHARD_TENSORS = 8  # tensors per output shard


def big_base(root: pathlib.Path, layers: int) -> dict[str, mapping.Delta]:
    """A base of `layers` x (up_proj target + down-like copy), 4 tensors per file; returns the
    deltas of the targets."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    names = []
    for i in range(layers):
        names += [
            f"model.language_model.layers.{i}.mlp.up_proj.weight",
            f"model.vision_tower.encoder.layers.{i}.fc.weight",
        ]
    weight_map = {}
    for f in range(0, len(names), PER_FILE):
        file = f"model-{f // PER_FILE + 1:05d}.safetensors"
        part = {
            n: rng.standard_normal((ROWS, COLS), dtype=np.float32) for n in names[f : f + PER_FILE]
        }
        safetensors.numpy.save_file(part, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        del part
    (root / st.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text('{"model_type": "gemma4"}')
    return {
        n: mapping.Delta(
            n,
            rng.standard_normal((ROWS, RANK), dtype=np.float32),
            rng.standard_normal((RANK, COLS), dtype=np.float32),
            f"layers.{n.split('.')[3]}.up_proj",
        )
        for n in names
        if "up_proj" in n
    }


def traced_peak(
    base: pathlib.Path, out: pathlib.Path, deltas, workers: int = 1, shard_tensors=SHARD_TENSORS
) -> int:
    """Peak bytes allocated by Python and numpy during the streaming pass (deltas excluded), in
    all its threads."""
    layout = st.read_layout(str(base))
    tracemalloc.start()
    try:
        stats = stream.stream_merge(
            layout,
            deltas,
            str(out),
            shard_size=shard_tensors * ROWS * COLS * 4 + 65536,  # + room for the header
            overwrite=False,
            metadata={"step": 1},
            progress=False,
            workers=workers,
        )
        assert stats.workers == workers
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_is_a_few_blocks_whatever_the_model_size(tmp_path):
    tensor = ROWS * COLS * 4
    small = traced_peak(tmp_path / "b4", tmp_path / "o4", big_base(tmp_path / "b4", 4))
    large = traced_peak(tmp_path / "b16", tmp_path / "o16", big_base(tmp_path / "b16", 16))
    # 8 tensors (32 MiB) vs 32 tensors (128 MiB): the same peak, a few tensor-sized buffers
    # (read block, float32 block, the writer's two), less than one output shard (8 tensors).
    assert large < small + tensor // 4, (small, large)
    assert large < 5 * tensor, (large, 5 * tensor)
    files = sorted((tmp_path / "o16").glob("*.safetensors"))
    assert len(files) == 4 and len(safetensors.numpy.load_file(str(files[0]))) == SHARD_TENSORS


def test_progress_bar_counts_bytes_and_tensors_on_stderr(tmp_path, capsys):
    tensors = write_base(tmp_path / "base")
    stream.stream_merge(
        st.read_layout(str(tmp_path / "base")),
        some_deltas(),
        str(tmp_path / "out"),
        shard_size=3000,
        overwrite=False,
        metadata={"step": 1},
        progress=True,
    )
    err = capsys.readouterr().err
    assert "merge" in err and "100%" in err
    assert f"{len(tensors)}/{len(tensors)} tensors" in err
    total = st.read_layout(str(tmp_path / "base")).total_bytes
    assert f"{total / 1024:.2f}k" in err or f"{total / 1024:.1f}k" in err, err


def test_only_the_lora_factors_are_restored_onto_the_host(lora_run, tmp_path, monkeypatch):
    from tunix.models.gemma4 import params_safetensors

    from workloads import merge
    from workloads.checkpoint import lora_restore
    from workloads.model import gemma4

    def forbidden(*args, **kwargs):
        raise AssertionError("the merge must not load the base as a model")

    monkeypatch.setattr(gemma4, "load_model", forbidden)
    monkeypatch.setattr(params_safetensors, "create_model_from_safe_tensors", forbidden)
    restored = []
    real = lora_restore.restore_lora_params

    def spy(checkpoint, step):
        params = real(checkpoint, step)
        restored.append(params)
        return params

    monkeypatch.setattr(lora_restore, "restore_lora_params", spy)
    result = merge.merge_lora(
        str(lora_run.base), str(lora_run.run), str(tmp_path / "out"), progress=False
    )
    (params,) = restored
    assert all(type(v) is np.ndarray for v in params.values())  # host numpy, not jax.Array
    assert all(k.endswith(("_lora_a", "_lora_b")) for k in params)
    lora_bytes = sum(v.nbytes for v in params.values())
    assert lora_bytes < result.tensor_bytes / 5  # the factors, not the model


def test_benchmark_checkpoint_has_real_31b_shapes_that_the_mapping_accepts():
    """The merge benchmark's synthetic layers (a global k_eq_v layer and a sliding one at the
    real 31B sizes) and LoRA factors map one to one onto each other: every target gets a delta
    of its tensor's exact shape, the global layer's K lands on k_proj and it has no v_proj."""
    from benchmarks import merge_throughput as bench
    from workloads.contract import catalog, runconfig

    spec = catalog.model("gemma-4-31b")
    for layer, glob in ((5, True), (4, False)):
        shapes = bench.layer_shapes(spec, layer, glob)
        factors = {
            name: np.zeros(shape, np.float32)
            for name, shape in bench.lora_shapes(spec, layer, glob, 64).items()
        }
        deltas = mapping.build_deltas(
            factors, rank=64, alpha=64.0, targets=runconfig.ALL_LORA_TARGETS
        )
        assert {n: d.shape for n, d in deltas.items()} == {
            n: s for n, s in shapes.items() if n.endswith("_proj.weight")
        }
        v_proj = f"{mapping.HF_TEXT_PREFIX}layers.{layer}.self_attn.v_proj.weight"
        assert (v_proj in shapes) == (not glob)
    q = shapes[f"{mapping.HF_TEXT_PREFIX}layers.4.self_attn.q_proj.weight"]
    assert q == (spec.num_heads * spec.head_dim, spec.embed_dim) == (8192, 5376)


def test_each_thread_holds_a_few_blocks_whatever_the_model_size(tmp_path):
    tensor = ROWS * COLS * 4
    small = traced_peak(
        tmp_path / "o4", tmp_path / "m4", big_base(tmp_path / "o4", 4), 2, SHARD_TENSORS // 2
    )
    large = traced_peak(
        tmp_path / "o16", tmp_path / "m16", big_base(tmp_path / "o16", 16), 2, SHARD_TENSORS // 2
    )
    # 2 shards of 16 MiB (one per thread) vs 8 (four per thread): the same peak, each thread a
    # few tensor-sized buffers (read block, float32 block, the writer's two) whatever it writes.
    assert large < small + tensor // 2, (small, large)
    assert large < 10 * tensor, (large, 10 * tensor)
