"""The streaming writer on synthetic checkpoints: exact bf16 arithmetic, byte-identical copies
(a vision tower in mixed dtypes included), shard limits, gs://-style output (fsspec memory://),
atomic completion and refusals."""

import json
import os
import pathlib
import subprocess
import time

import fsspec
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from tests.fixtures.tmpfs import mount_tmpfs
from workloads.common import digest, errors, storage
from workloads.merge import mapping, parts, shard_worker, stream
from workloads.merge import safetensors_io as st

BF16 = ml_dtypes.bfloat16
Q = "model.language_model.layers.0.self_attn.q_proj.weight"
UP = "model.language_model.layers.0.mlp.up_proj.weight"


def synthetic_tensors():
    rng = np.random.default_rng(0)
    return {
        Q: rng.standard_normal((48, 32)).astype(BF16),
        UP: rng.standard_normal((40, 32)).astype(np.float32),
        "model.language_model.embed_tokens.weight": rng.standard_normal((100, 32)).astype(BF16),
        "model.language_model.layers.0.layer_scalar": np.ones((1,), BF16),
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight": rng.standard_normal(
            (17, 9)
        ).astype(BF16),
        "model.vision_tower.patch_embedder.position_embedding": rng.standard_normal((7, 3)).astype(
            np.float32
        ),
        "model.vision_tower.pooler.ids": np.arange(5, dtype=np.int64),
        "model.embed_vision.embedding_projection.weight": rng.standard_normal((3, 5)).astype(
            np.float16
        ),
    }


def write_base(root: pathlib.Path, tensors=None):
    tensors = tensors or synthetic_tensors()
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        safetensors.numpy.save_file(
            {k: tensors[k] for k in part}, str(root / file), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, file))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (root / "config.json").write_text('{"model_type": "gemma4"}')
    (root / "tokenizer.json").write_text("{}")
    return tensors


def some_deltas(scale=0.5):
    rng = np.random.default_rng(1)
    return {
        Q: mapping.Delta(
            Q,
            scale * rng.standard_normal((48, 2)).astype(np.float32),
            rng.standard_normal((2, 32)).astype(np.float32),
            "layers.0.q_einsum",
            row_block=8,  # several delta blocks per tensor
        ),
        UP: mapping.Delta(
            UP,
            scale * rng.standard_normal((40, 2)).astype(np.float32),
            rng.standard_normal((2, 32)).astype(np.float32),
            "layers.0.up_proj",
            row_block=8,
        ),
    }


def run(base, out, deltas=None, **kw):
    kw.setdefault("shard_size", 3000)
    kw.setdefault("overwrite", False)
    kw.setdefault("workers", 1)  # one job at a time; the tests of parallel jobs pass more
    return stream.stream_merge(
        st.read_layout(str(base)),
        some_deltas() if deltas is None else deltas,
        str(out),
        metadata={"step": 1},
        progress=False,
        **kw,
    )


def read_all(out):
    index = json.loads((pathlib.Path(out) / st.INDEX_FILE).read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(safetensors.numpy.load_file(str(pathlib.Path(out) / file)))
    return index, tensors


def test_targets_get_float32_sum_cast_back_and_the_rest_is_copied_bit_for_bit(tmp_path):
    base = write_base(tmp_path / "base")
    deltas = some_deltas()
    run(tmp_path / "base", tmp_path / "out", block_bytes=256)  # several row blocks per target
    index, merged = read_all(tmp_path / "out")
    assert set(merged) == set(base) == set(index["weight_map"])
    want_q = (base[Q].astype(np.float32) + deltas[Q].full()).astype(BF16)
    assert (
        merged[Q].dtype == BF16
        and merged[Q].view(np.uint16).tobytes() == want_q.view(np.uint16).tobytes()
    )
    np.testing.assert_array_equal(merged[UP], base[UP] + deltas[UP].full())
    for name in set(base) - {Q, UP}:
        assert merged[name].dtype == base[name].dtype
        assert merged[name].tobytes() == base[name].tobytes(), name
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "gemma4"}'
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_shards_respect_the_size_and_alignment_and_the_metadata_has_their_checksum(tmp_path):
    write_base(tmp_path / "base")
    stats = run(tmp_path / "base", tmp_path / "out", shard_size=3000)
    out = tmp_path / "out"
    meta = json.loads((out / stream.METADATA_FILE).read_text())
    assert meta["step"] == 1 and meta["merged_tensors"] == sorted([Q, UP])
    assert len(meta["files"]) >= 3 and meta["files"] == stats.shards
    for name, entry in meta["files"].items():
        path = out / name
        assert entry["bytes"] == path.stat().st_size
        # a tensor larger than the limit (embed_tokens, up_proj, q_proj) gets a file of its own
        assert path.stat().st_size <= 3000 or len(safe_open(str(path), "np").keys()) == 1
        assert st.file_digest(str(path), "crc32c") == (entry["crc32c"], entry["bytes"])
        for info in st.read_layout(str(out)).tensors.values():
            if info.file == name:
                assert info.start % info.itemsize == 0, info.name


def test_non_empty_output_is_refused_unless_overwrite(tmp_path):
    write_base(tmp_path / "base")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(errors.UserError, match="not empty; pass --overwrite"):
        run(tmp_path / "base", out)
    assert (out / "old.txt").exists()
    run(tmp_path / "base", out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / st.INDEX_FILE).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failure_mid_merge_leaves_no_output_and_no_temporary_files(tmp_path, monkeypatch):
    write_base(tmp_path / "base")
    real, calls = shard_worker.write_part, []

    def failing(part, *args):
        calls.append(part.shard)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(part, *args)

    monkeypatch.setattr(shard_worker, "write_part", failing)
    with pytest.raises(OSError, match="disk full"):
        run(tmp_path / "base", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_stale_temporary_directories_of_dead_merges_are_removed(tmp_path):
    import socket

    write_base(tmp_path / "base")
    stale = tmp_path / f".out.merge-tmp-{socket.gethostname()}-999999999"
    stale.mkdir()
    (stale / "model-00001-of-00009.safetensors").write_bytes(b"partial")
    run(tmp_path / "base", tmp_path / "out")
    assert not stale.exists() and (tmp_path / "out" / st.INDEX_FILE).exists()


def test_target_without_base_tensor_or_with_other_shape_is_named(tmp_path):
    write_base(tmp_path / "base")
    missing = "model.language_model.layers.0.self_attn.v_proj.weight"
    bad = {
        missing: mapping.Delta(
            missing,
            np.zeros((4, 1), np.float32),
            np.zeros((1, 32), np.float32),
            "layers.0.kv_einsum",
        )
    }
    with pytest.raises(
        errors.UserError, match=rf"LoRA target {missing} \(from layers.0.kv_einsum\) has no tensor"
    ):
        run(tmp_path / "base", tmp_path / "out", deltas=bad)
    wrong = {
        Q: mapping.Delta(
            Q, np.zeros((32, 1), np.float32), np.zeros((1, 48), np.float32), "layers.0.q_einsum"
        )
    }
    with pytest.raises(
        errors.UserError,
        match=rf"{Q}: base tensor has shape \[48, 32\] but the LoRA delta .* \[32, 48\]",
    ):
        run(tmp_path / "base", tmp_path / "out", deltas=wrong)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def memfs():
    fs = fsspec.filesystem("memory")
    yield fs
    fs.rm("/", recursive=True) if fs.exists("/") else None
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")


def upload_tree(fs, local: pathlib.Path, remote: str):
    for path in local.iterdir():
        fs.pipe_file(f"{remote}/{path.name}", path.read_bytes())


def test_remote_base_and_output_upload_the_index_last(tmp_path, memfs, monkeypatch):
    write_base(tmp_path / "base")
    upload_tree(memfs, tmp_path / "base", "/base")
    order = []
    upload, write = storage.upload_file, storage.write_text_atomic
    monkeypatch.setattr(
        storage,
        "upload_file",
        lambda src, dst: (order.append(dst.rsplit("/", 1)[-1]), upload(src, dst)),
    )
    monkeypatch.setattr(
        storage,
        "write_text_atomic",
        lambda dst, text: (order.append(dst.rsplit("/", 1)[-1]), write(dst, text)),
    )
    run("memory://base", "memory://out", staging_dir=str(tmp_path))
    assert order[-1] == st.INDEX_FILE and order[-2] == stream.METADATA_FILE
    assert sum(name.endswith(".safetensors") for name in order) >= 3
    local = tmp_path / "copy"
    local.mkdir()
    for name in storage.list_files("memory://out"):
        (local / name).write_bytes(memfs.cat_file(f"/out/{name}"))
    run(tmp_path / "base", tmp_path / "local-out")
    for name in os.listdir(tmp_path / "local-out"):  # same bytes as a local merge
        if name != stream.METADATA_FILE:
            assert (local / name).read_bytes() == (tmp_path / "local-out" / name).read_bytes(), name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("merge-staging-")] == []


def test_remote_output_is_refused_when_not_empty_and_overwrite_removes_stale_files(tmp_path, memfs):
    write_base(tmp_path / "base")
    memfs.pipe_file("/out/model-00001-of-00099.safetensors", b"old")
    memfs.pipe_file(f"/out/{st.INDEX_FILE}", b"{}")
    with pytest.raises(errors.UserError, match="not empty; pass --overwrite"):
        run(tmp_path / "base", "memory://out", staging_dir=str(tmp_path))
    run(tmp_path / "base", "memory://out", overwrite=True, staging_dir=str(tmp_path))
    names = storage.list_files("memory://out")
    assert "model-00001-of-00099.safetensors" not in names and st.INDEX_FILE in names
    assert json.loads(memfs.cat_file(f"/out/{st.INDEX_FILE}"))["weight_map"]


def test_a_write_error_in_the_writer_thread_reaches_the_caller(tmp_path, monkeypatch):
    write_base(tmp_path / "base")
    real = st.HashingWriter.__init__

    def init(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        handle = self._handle

        class Full:
            def write(self, data):
                raise OSError(28, "No space left on device")

            def __getattr__(self, name):
                return getattr(handle, name)

        self._handle = Full()

    monkeypatch.setattr(st.HashingWriter, "__init__", init)
    with pytest.raises(errors.UserError) as caught:
        run(tmp_path / "base", tmp_path / "out")
    # ENOSPC from the writer thread of a part: one line naming the output and its free space.
    message = str(caught.value)
    assert message.startswith(
        f"{tmp_path / 'out'}: disk full while writing the merged checkpoint ("
    )
    assert " free); the partial output was removed" in message and "\n" not in message
    assert caught.value.__suppress_context__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_a_real_full_disk_in_a_part_is_one_line(tmp_path, capsys):
    """The output on a 256 KiB tmpfs, the merge 1.6 MB, two workers writing parts (needs root to
    mount; skipped elsewhere): the write fails for real in a part's writer thread, the merge
    ends in one line naming the output and the free space it found, and the tmpfs is left
    empty."""
    tensors = synthetic_tensors()
    tensors["model.language_model.layers.0.mlp.down_proj.weight"] = np.ones((400, 1024), BF16)
    write_base(tmp_path / "base", tensors)
    small = tmp_path / "small"
    if not mount_tmpfs(small, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(errors.UserError) as caught:
            run(tmp_path / "base", small / "out", shard_size=1_000_000, workers=2)
        message = str(caught.value)
        assert message.startswith(
            f"{small / 'out'}: disk full while writing the merged checkpoint ("
        )
        # The free space measured before the partial output went: what the user found full.
        free = message.split("(", 1)[1].split(" free)", 1)[0]
        assert free.endswith(("bytes", "KiB")), message
        assert "\n" not in message
        assert list(small.iterdir()) == []  # the partial output was removed
        assert capsys.readouterr().err == ""  # no thread printed a traceback
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_full_staging_disk_of_a_remote_output_names_the_staging_directory(tmp_path, memfs):
    tensors = synthetic_tensors()
    tensors["model.language_model.layers.0.mlp.down_proj.weight"] = np.ones((400, 1024), BF16)
    write_base(tmp_path / "base", tensors)
    small = tmp_path / "small"
    if not mount_tmpfs(small, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(errors.UserError) as caught:
            run(tmp_path / "base", "memory://out", staging_dir=str(small), shard_size=1_000_000)
        message = str(caught.value)
        assert message.startswith(f"{small}: disk full while staging the merge (")
        assert "\n" not in message
        assert list(small.iterdir()) == []
        assert st.INDEX_FILE not in storage.list_files("memory://out")
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_parallel_threads_write_the_same_bytes_as_one_job_at_a_time(tmp_path):
    write_base(tmp_path / "base")
    one = run(tmp_path / "base", tmp_path / "one", workers=1)
    two = run(tmp_path / "base", tmp_path / "two", workers=2)
    assert (one.workers, two.workers) == (1, 2)
    assert two.cpu_seconds > 0
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(os.listdir(tmp_path / "two")) and len(one.shards) >= 3
    for name in names:  # the shards, their checksums in merge_metadata.json, the index
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_a_failing_job_among_parallel_ones_fails_the_merge_and_leaves_nothing(tmp_path):
    write_base(tmp_path / "base")
    layout = st.read_layout(str(tmp_path / "base"))
    damaged = layout.tensors[Q]  # the base file loses its tail after the headers were read
    os.truncate(tmp_path / "base" / damaged.file, damaged.start + 10)
    # Whichever worker reads past the cut first names the file and its tensor.
    with pytest.raises(errors.UserError, match=rf"{damaged.file}: truncated while reading model\."):
        stream.stream_merge(
            layout,
            some_deltas(),
            str(tmp_path / "out"),
            shard_size=3000,
            overwrite=False,
            metadata={"step": 1},
            progress=False,
            workers=2,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_a_realistic_target_is_bit_identical_to_a_whole_tensor_merge(tmp_path):
    """A 31B-like q_proj slice (rows not a multiple of the delta's blocks, rank 64) merged in
    parallel threads, in blocks of rows, equals the naive merge of the whole tensor at once."""
    rows, cols, rank = 2 * mapping.ROW_BLOCK + 52, 5376, 64
    rng = np.random.default_rng(3)
    weight = (0.02 * rng.standard_normal((rows, cols), dtype=np.float32)).astype(BF16)
    tensors = {**synthetic_tensors(), Q: weight}
    write_base(tmp_path / "base", tensors)
    delta = mapping.Delta(
        Q,
        (0.01 * rng.standard_normal((rows, rank), dtype=np.float32)),
        rng.standard_normal((rank, cols), dtype=np.float32) / 8,
        "layers.0.q_einsum",
    )
    stats = run(
        tmp_path / "base",
        tmp_path / "out",
        deltas={Q: delta},
        shard_size=weight.nbytes + 1024,  # q_proj in one shard, the rest in others
        workers=2,
        block_bytes=cols * 4 * mapping.ROW_BLOCK,  # one delta block per row block: 3 blocks
    )
    assert stats.workers == 2
    _, merged = read_all(tmp_path / "out")
    naive = (weight.astype(np.float32) + delta.full()).astype(BF16)
    assert merged[Q].tobytes() == naive.tobytes()
    assert np.mean(merged[Q] != weight) > 0.5  # the delta changed most weights


@pytest.mark.parametrize("workers", [1, 2])
def test_a_finished_shard_is_uploaded_while_the_next_one_is_written(
    tmp_path, memfs, monkeypatch, workers
):
    write_base(tmp_path / "base")
    staging = tmp_path / "staging"
    staging.mkdir()
    upload, overlapped = storage.upload_file, []

    def slow_upload(src, dst):
        name = pathlib.Path(src).name
        if name.endswith(".safetensors") and not overlapped:  # the first shard's upload
            deadline = time.monotonic() + 20
            others = []
            while not others and time.monotonic() < deadline:
                staged = next(staging.glob("merge-staging-*"))
                others = [p for p in staged.glob("*.safetensors") if p.name != name]
                time.sleep(0.01)
            overlapped.append(bool(others))
        return upload(src, dst)

    monkeypatch.setattr(storage, "upload_file", slow_upload)
    # One shard per tensor, so that there is a next shard for every worker.
    run(tmp_path / "base", "memory://out", staging_dir=str(staging), workers=workers, shard_size=1)
    assert overlapped == [True]
    local = tmp_path / "local"
    run(tmp_path / "base", local, shard_size=1)
    meta = json.loads(memfs.cat_file(f"/out/{stream.METADATA_FILE}"))
    assert meta["files"] == json.loads((local / stream.METADATA_FILE).read_text())["files"]


def _one_element_delta(name, rows, cols, value):
    """A delta that adds `value` to element [0, 0] only (left e0, right value * e0)."""
    left = np.zeros((rows, 1), np.float32)
    left[0, 0] = 1
    right = np.zeros((1, cols), np.float32)
    right[0, 0] = value
    return mapping.Delta(name, left, right, "layers.0.q_einsum", row_block=8)


@pytest.mark.parametrize(
    ("dtype", "top", "step", "finite"),
    [
        # bf16's largest is 0x7F7F = 3.3895e38; a float32 sum from 0x7F7F8000 (halfway to 0x7F80)
        # on rounds to Inf (ties to even), anything below stays finite.
        (BF16, np.uint32(0x7F7F0000).view(np.float32), np.float32(2.0**119), False),
        (BF16, np.uint32(0x7F7F0000).view(np.float32), np.float32(2.0**119) * 0.99, True),
        (np.float16, np.float32(65504), np.float32(16), False),  # 65520 rounds to Inf
        (np.float16, np.float32(65504), np.float32(15.9), True),
        (np.float32, np.finfo(np.float32).max, np.finfo(np.float32).max, False),  # f32 Inf
    ],
)
def test_a_sum_that_rounds_to_inf_in_the_tensor_dtype_is_refused(
    tmp_path, dtype, top, step, finite
):
    """The non-finite check works on the float32 sum before the cast: a sum finite in float32
    that the cast back would round to Inf is refused, one just below is written as naive does."""
    tensors = synthetic_tensors()
    weight = np.zeros((48, 32), np.float32)
    weight[0, 0] = top
    tensors[Q] = weight.astype(dtype)
    write_base(tmp_path / "base", tensors)
    deltas = {Q: _one_element_delta(Q, 48, 32, step)}
    if finite:
        run(tmp_path / "base", tmp_path / "out", deltas=deltas)
        _, merged = read_all(tmp_path / "out")
        naive = (weight + deltas[Q].full()).astype(dtype)
        assert np.isfinite(naive).all() and merged[Q].tobytes() == naive.tobytes()
    else:
        with np.errstate(over="ignore"):  # the premise: naive casting gives Inf
            assert not np.isfinite((weight + deltas[Q].full()).astype(dtype)).all()
        with pytest.raises(errors.UserError, match=r"rows 0-\d+ are not finite"):
            run(tmp_path / "base", tmp_path / "out", deltas=deltas)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_a_base_target_holding_nan_is_refused(tmp_path):
    tensors = synthetic_tensors()
    weight = np.asarray(tensors[Q]).copy()
    weight[30, 5] = np.nan
    tensors[Q] = weight
    write_base(tmp_path / "base", tensors)
    message = r"q_proj.weight: the merged values of rows 0-47 are not finite"
    with pytest.raises(errors.UserError, match=message):
        run(tmp_path / "base", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_every_blas_call_of_the_pass_runs_on_one_thread_and_the_setting_is_given_back(
    tmp_path, monkeypatch
):
    """The jobs' threads call numpy's BLAS themselves; the pass holds it at one thread for its
    whole length (a job's own pin, entered and left while another job computes, must not undo
    it), so a delta's bits never depend on a BLAS thread count; the caller's setting returns."""
    import threading

    from workloads.merge import blas

    calls = blas._openblas_calls()
    assert calls, "numpy's OpenBLAS was not found"
    saved = [int(getter()) for _, getter in calls]
    seen = []
    real = blas.sgemm_accumulate

    def observed(left, right, out):
        seen.append(([int(getter()) for _, getter in calls], threading.current_thread().name))
        real(left, right, out)

    monkeypatch.setattr(blas, "sgemm_accumulate", observed)
    for setter, _ in calls:
        setter(2)
    try:
        write_base(tmp_path / "base")
        run(tmp_path / "base", tmp_path / "out", workers=2, shard_size=1)  # a shard per tensor
        after = [int(getter()) for _, getter in calls]
    finally:
        for (setter, _), count in zip(calls, saved, strict=True):
            setter(count)
    assert seen and all(counts == [1] * len(calls) for counts, _ in seen)
    assert all(name.startswith("merge-shard") for _, name in seen)
    assert after == [2] * len(calls)


def test_parts_of_shards_written_by_two_workers_give_the_same_files(tmp_path, monkeypatch):
    """Shards cut into parts smaller than a tensor (targets between row blocks, copies anywhere)
    and written at their offsets by two threads: the same shards, checksums and index as
    one job writing each shard whole."""
    write_base(tmp_path / "base")
    monkeypatch.setattr(stream, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(parts, "COPY_GRAIN", 64)
    layout = st.read_layout(str(tmp_path / "base"))
    plans = stream.plan_shards(layout, 6000, {"format": "pt"})
    cuts = [
        p
        for plan in plans
        for p in parts.plan_parts(
            plan, "x", layout, some_deltas(), stream.part_size(layout.total_bytes, 2, 6000), 1024
        )
    ]
    split = {piece.info.name for p in cuts for piece in p.pieces if not piece.last}
    assert Q in split and len(split) >= 3, "some tensors, a target among them, span parts"
    one = run(tmp_path / "base", tmp_path / "one", workers=1, shard_size=6000)
    two = run(tmp_path / "base", tmp_path / "two", workers=2, shard_size=6000, block_bytes=1024)
    assert two.workers == 2 and len(two.shards) == len(one.shards) >= 2
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(os.listdir(tmp_path / "two"))
    for name in names:  # the shards, their checksums in merge_metadata.json, the index
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    for name, entry in two.shards.items():
        assert digest.matches(tmp_path / "two" / name, entry) == (True, entry["crc32c"])
