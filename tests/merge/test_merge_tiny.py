"""The proof on a tiny f32 Gemma 4 (5 sliding : 1 global layer, GQA, k_eq_v, window 16):
the merged checkpoint, loaded WITHOUT LoRA by Tunix and by HF transformers, computes what the LoRA
model computes on 39-token sequences; the rest of the checkpoint is untouched; corrupted mappings
and bad inputs fail loudly."""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors import safe_open

from tests.merge.conftest import ALPHA, RANK, SHARD_SIZE, STEPS, jax_logits, single_device_mesh
from workloads import cli, merge
from workloads.common import errors
from workloads.merge import mapping, stream
from workloads.merge import safetensors_io as st

TOL = 1e-4  # f32 end to end; measured ~2e-5 (the adapters move the logits by ~4)


def test_merged_model_without_lora_matches_the_lora_model(lora_run, merged):
    out, result = merged
    assert result.step == STEPS[-1] and (result.rank, result.alpha) == (RANK, ALPHA)
    lora = lora_run.lora_logits[STEPS[-1]]
    assert np.max(np.abs(lora - lora_run.base_logits)) > 0.5  # the adapters do something
    assert np.max(np.abs(jax_logits(out, lora_run.tokens) - lora)) < TOL


def test_compare_logits_restores_the_lora_model_through_tunix(lora_run, merged):
    out, _ = merged
    comparison = merge.compare_logits(str(lora_run.base), str(lora_run.run), str(out))
    assert comparison.seq_len > 2 * 16 and comparison.lora_effect > 0.5
    assert comparison.max_abs_diff < TOL, comparison.summary()


def test_the_logits_pass_leaves_the_models_arrays_as_they_were(lora_run):
    """verify.forward runs the model as one compiled program, which hands back the model's
    state: the caller's model still holds its own arrays afterwards (not copies placed as the
    compiler chose), and a second pass gives the same logits."""
    from flax import nnx

    from workloads.merge import verify
    from workloads.model import gemma4

    mesh = single_device_mesh()
    model = gemma4.load_model(lora_run.base, mesh=mesh, dtype="float32")
    before = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    first = verify.forward(model, lora_run.tokens, mesh)
    after = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    assert len(after) == len(before) > 0 and all(a is b for a, b in zip(after, before, strict=True))
    np.testing.assert_array_equal(verify.forward(model, lora_run.tokens, mesh), first)
    np.testing.assert_allclose(first, lora_run.base_logits, rtol=0, atol=1e-4)


def test_hf_transformers_loads_it_with_no_missing_keys_and_the_same_logits(lora_run, merged):
    import torch
    import transformers

    out, _ = merged
    model, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32
    )
    assert {k: v for k, v in info.items() if v} == {}  # missing, unexpected, mismatched, errors
    with torch.no_grad():
        hf = model.eval()(input_ids=torch.tensor(lora_run.tokens, dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(hf - lora_run.lora_logits[STEPS[-1]])) < TOL


def test_non_targets_are_byte_identical_and_the_metadata_is_complete(lora_run, merged):
    out, result = merged
    meta = json.loads((out / stream.METADATA_FILE).read_text())
    assert {k: meta[k] for k in ("step", "rank", "alpha", "targets", "base")} == {
        "step": STEPS[-1],
        "rank": RANK,
        "alpha": ALPHA,
        "targets": list(lora_run.targets),
        "base": str(lora_run.base),
    }
    assert meta["source_checkpoint"] == str(lora_run.checkpoints)
    index = json.loads((out / st.INDEX_FILE).read_text())
    assert (
        sorted(set(index["weight_map"].values())) == sorted(meta["files"]) == sorted(result.shards)
    )
    assert len(meta["files"]) > 1
    for name, entry in meta["files"].items():
        assert (out / name).stat().st_size <= SHARD_SIZE
        assert st.file_digest(str(out / name), "crc32c") == (entry["crc32c"], entry["bytes"])
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).read_bytes() == (lora_run.base / name).read_bytes()
    # Independent of our reader: the safetensors library, tensor by tensor.
    base_layout = st.read_layout(str(lora_run.base))
    targets = set(meta["merged_tensors"])
    assert (
        len(targets) == 6 * 5 + 5 * 2 + 1
    )  # every layer: q o gate up down; k+v on 5 sliding; k on 1 global
    for name, info in base_layout.tensors.items():
        with (
            safe_open(str(lora_run.base / info.file), "np") as b,
            safe_open(str(out / index["weight_map"][name]), "np") as m,
        ):
            same = b.get_tensor(name).tobytes() == m.get_tensor(name).tobytes()
        assert same != (name in targets), name
    report = merge.verify_merged(str(out), base=str(lora_run.base))
    assert report.ok and report.identical_copies == len(base_layout.tensors) - len(targets), (
        report.summary()
    )
    assert report.changed_targets == len(targets)


def swapped_kv(a, b):
    k, v = mapping._kv(a, b)
    return [(k[0], v[1], v[2]), (v[0], k[1], k[2])]


def k_without_transpose(a, b):
    # The K delta laid out (D, K*H) and reshaped, not transposed, into k_proj's (K*H, D): the
    # shape fits, only the logits can tell.
    k, v = mapping._kv(a, b)
    name, left, right = k
    full = (left @ right).T.reshape(left.shape[0], right.shape[1])
    return [(name, full, np.eye(full.shape[1], dtype=np.float32)), v]


def o_reshaped_not_transposed(a, b):
    ((name, left, right),) = mapping._o(a, b)
    full = (left @ right).T.reshape(
        left.shape[0], right.shape[1]
    )  # the classic reshape-for-transpose bug
    return [(name, full, np.eye(full.shape[1], dtype=np.float32))]


@pytest.mark.parametrize(
    "module,corrupt",
    [
        ("kv_einsum", swapped_kv),
        ("kv_einsum", k_without_transpose),
        ("attn_vec_einsum", o_reshaped_not_transposed),
    ],
)
def test_negative_control_a_corrupted_mapping_fails_the_comparison(
    lora_run, tmp_path, module, corrupt
):
    rules = {**mapping.RULES, module: corrupt}
    merge.merge_lora(
        str(lora_run.base), str(lora_run.run), str(tmp_path / "bad"), rules=rules, progress=False
    )
    diff = np.max(
        np.abs(jax_logits(tmp_path / "bad", lora_run.tokens) - lora_run.lora_logits[STEPS[-1]])
    )
    assert diff > 100 * TOL


def test_negative_control_a_missing_mlp_transpose_is_a_shape_error(lora_run, tmp_path):
    rules = {**mapping.RULES, "gate_proj": lambda a, b: [("mlp.gate_proj.weight", a, b)]}
    with pytest.raises(
        errors.UserError,
        match=r"layers\.0\.mlp\.gate_proj\.weight: base tensor has shape \[192, 96\] "
        r"but the LoRA delta from layers\.0\.gate_proj has shape \[96, 192\]",
    ):
        merge.merge_lora(
            str(lora_run.base),
            str(lora_run.run),
            str(tmp_path / "bad"),
            rules=rules,
            progress=False,
        )
    assert not (tmp_path / "bad").exists()


def test_an_earlier_step_is_merged_on_request(lora_run, tmp_path):
    result = merge.merge_lora(
        str(lora_run.base),
        str(lora_run.checkpoints),
        str(tmp_path / "s3"),
        step=STEPS[0],
        shard_size="5GB",
        progress=False,
    )
    assert result.step == STEPS[0] and len(result.shards) == 1
    assert (
        np.max(
            np.abs(jax_logits(tmp_path / "s3", lora_run.tokens) - lora_run.lora_logits[STEPS[0]])
        )
        < TOL
    )


def cli_error(capsys, *args):
    """Runs `merge --no-progress *args`; returns the exit code and the last line on stderr."""
    code = cli.main(["merge", "--no-progress", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def merge_argv(lora_run, out, *extra):
    """`merge` arguments for the fixture's run into `out`, with 200 kB shards."""
    base, run = str(lora_run.base), str(lora_run.run)
    return ["merge", "--no-progress", "--base", base, "--checkpoint", run, "--out", str(out),
            "--shard-size", "200KB", *extra]  # fmt: skip


def test_cli_merges_verifies_and_refuses_a_non_empty_output(lora_run, tmp_path, capsys):
    out = tmp_path / "out"
    argv = merge_argv(lora_run, out)
    assert cli.main([*argv, "--verify"]) == 0
    printed = capsys.readouterr().out
    assert f"merged step {STEPS[-1]} (rank {RANK}, alpha 8)" in printed and ": OK" in printed
    code, line = cli_error(capsys, *argv[2:])
    assert (
        code == 2
        and line == f"error: {out}: output directory is not empty; pass --overwrite to replace it"
    )
    assert cli.main([*argv, "--overwrite"]) == 0


def test_config_merge_is_what_the_vm_unit_runs_and_a_rerun_keeps_the_finished_merge(
    lora_run, tmp_path, capsys
):
    """The merge unit runs `merge --config run.yaml` after every successful training start (a
    reboot restarts a finished run, which exits 0): the second call must keep the output."""
    from workloads.contract import runconfig

    out = tmp_path / "merged"
    cfg = runconfig.parse(
        {
            "run_name": "merge-test",
            "model": {"base": str(lora_run.base), "dtype": "float32"},
            "data": {"dataset": str(tmp_path / "unused.jsonl")},
            "train": {"output_dir": str(lora_run.run)},
            "merge": {"out": str(out), "shard_size": str(SHARD_SIZE), "step": STEPS[0]},
        }
    )
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    assert cli.main(["merge", "--config", str(config), "--no-progress"]) == 0
    assert f"merged step {STEPS[0]}" in capsys.readouterr().out
    meta = json.loads((out / "merge_metadata.json").read_text())
    assert meta["step"] == STEPS[0] and len(meta["files"]) > 1  # shard size from the config
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert cli.main(["merge", "--config", str(config), "--no-progress"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # A different step into the same output is still refused without --overwrite.
    code, line = cli_error(capsys, "--config", str(config), "--step", str(STEPS[1]))
    assert code == 2 and "not empty" in line


def write_copy(src: pathlib.Path, dest: pathlib.Path, change):
    """A copy of a tiny checkpoint whose tensors pass through change(dict) -> dict."""
    import shutil

    import safetensors.numpy

    shutil.copytree(src, dest)
    index = json.loads((dest / st.INDEX_FILE).read_text())
    tensors = {}
    for file in set(index["weight_map"].values()):
        tensors.update(safetensors.numpy.load_file(str(dest / file)))
        (dest / file).unlink()
    tensors = change(tensors)
    safetensors.numpy.save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / st.INDEX_FILE).unlink()


def test_bad_inputs_are_one_line_errors(lora_run, tmp_path, capsys):
    base, run = str(lora_run.base), str(lora_run.run)
    out = str(tmp_path / "out")
    v0 = "model.language_model.layers.0.self_attn.v_proj.weight"
    no_v = tmp_path / "no-v"
    write_copy(lora_run.base, no_v, lambda t: {k: v for k, v in t.items() if k != v0})
    bad_meta = tmp_path / "bad-meta"
    import shutil

    shutil.copytree(lora_run.checkpoints, bad_meta)
    meta = json.loads((bad_meta / "lora_meta.json").read_text())
    (bad_meta / "lora_meta.json").write_text(json.dumps({**meta, "rank": 8}))
    cases = [
        (
            ["--base", str(no_v), "--checkpoint", run],
            f"LoRA target {v0} (from layers.0.kv_einsum) has no tensor",
        ),
        (
            ["--base", base, "--checkpoint", str(bad_meta)],
            "layers.0.attn_vec_einsum: LoRA factors A (8, 32, 4) / B (4, 96) "
            "have rank 4/4 but lora_meta.json says rank 8",
        ),
        (
            ["--base", base, "--checkpoint", run, "--step", "5"],
            "no checkpoint for step 5; available: 3, 7",
        ),
        (["--base", base, "--checkpoint", str(tmp_path)], "no lora_meta.json here"),
        (
            ["--base", base, "--checkpoint", run, "--shard-size", "5 parsecs"],
            "--shard-size: size '5 parsecs'",
        ),
        (
            ["--base", str(tmp_path / "nowhere"), "--checkpoint", run],
            "nowhere/config.json: file not found",
        ),
    ]
    for argv, message in cases:
        code, line = cli_error(capsys, *argv, "--out", out)
        assert code == 2 and line.startswith("error: ") and message in line, (argv, line)
    code, line = cli_error(
        capsys, "--base", base, "--checkpoint", run, "--out", base, "--overwrite"
    )
    assert code == 2 and "overlaps the base directory" in line
    assert not pathlib.Path(out).exists()


def test_shape_mismatch_in_the_base_is_named(lora_run, tmp_path):
    q0 = "model.language_model.layers.0.self_attn.q_proj.weight"
    odd = tmp_path / "odd"
    write_copy(lora_run.base, odd, lambda t: {**t, q0: np.zeros((96, 256), np.float32)})
    with pytest.raises(
        errors.UserError,
        match=rf"{q0}: base tensor has shape \[96, 256\] but the LoRA delta from "
        r"layers\.0\.q_einsum has shape \[256, 96\]",
    ):
        merge.merge_lora(str(odd), str(lora_run.run), str(tmp_path / "out"), progress=False)


_KILL_AFTER_FIRST_SHARD = """
import os, sys
from workloads.merge import stream
real = stream._LocalSink.finish
def finish_then_die(self, name):
    real(self, name)
    os._exit(137)  # a hard crash: no cleanup, no exception handlers, other shards being written
stream._LocalSink.finish = finish_then_die
from workloads import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def processes_with_files_in(directory: pathlib.Path) -> list[int]:
    """Processes that hold a file under `directory` open (from /proc/<pid>/fd)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            targets = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone, or not ours to look at
            continue
        if any(t.startswith(f"{directory}/") for t in targets):
            pids.append(int(proc.name))
    return pids


def test_streamed_targets_are_bit_identical_to_a_naive_whole_tensor_merge(lora_run, merged):
    """The default merge (one thread per core, blocks of rows) against the paper's approach: every
    tensor loaded whole, float32(weight) + the whole delta, cast back."""
    import safetensors.numpy

    from workloads.checkpoint import adapter_meta, lora_restore

    out, result = merged
    assert result.workers > 1 or os.cpu_count() == 1
    meta = adapter_meta.read(str(lora_run.checkpoints))
    params = lora_restore.restore_lora_params(str(lora_run.checkpoints), STEPS[-1])
    deltas = mapping.build_deltas(params, rank=meta.rank, alpha=meta.alpha, targets=meta.targets)
    base = {}
    for file in st.read_layout(str(lora_run.base)).files:
        base.update(safetensors.numpy.load_file(str(lora_run.base / file)))
    index = json.loads((out / st.INDEX_FILE).read_text())
    for name, delta in deltas.items():
        naive = (base[name].astype(np.float32) + delta.full()).astype(base[name].dtype)
        with safe_open(str(out / index["weight_map"][name]), "np") as shard:
            assert shard.get_tensor(name).tobytes() == naive.tobytes(), name


def test_workers_below_one_are_refused(lora_run, tmp_path, capsys):
    code, line = cli_error(capsys, *merge_argv(lora_run, tmp_path / "out")[2:], "--workers", "0")
    assert code == 2 and line.endswith("--workers 0: must be at least 1"), line
    assert not (tmp_path / "out").exists()


def test_a_killed_merge_leaves_nothing_that_looks_complete(lora_run, tmp_path):
    out = tmp_path / "out"
    argv = merge_argv(lora_run, out)
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_FIRST_SHARD, *argv],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", **os.environ},
    )
    assert killed.returncode == 137, killed.stderr
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.merge-tmp-")]
    assert len(leftovers) == 1 and not (leftovers[0] / st.INDEX_FILE).exists()
    # Its threads died with it: nothing holds a file of the dead merge open.
    deadline = time.monotonic() + 10
    while (writers := processes_with_files_in(leftovers[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert writers == []
    # The next run cleans up after the dead one and completes.
    assert cli.main(argv) == 0
    assert (out / st.INDEX_FILE).exists() and not leftovers[0].exists()


def test_a_gs_checkpoint_merges_into_gs_with_the_same_bytes(lora_run, merged, gcs_bucket):
    """The VM's merge: the run's checkpoints in gs:// (Orbax through TensorStore's GCS driver),
    the merged shards uploaded to gs://; the objects are the local merge's files, byte for byte."""
    from workloads.common import storage

    run, out = f"{gcs_bucket}/run", f"{gcs_bucket}/merged"
    storage.copy_tree(str(lora_run.run), run)
    merge.merge_lora(str(lora_run.base), run, out, shard_size=SHARD_SIZE, progress=False)
    local_out, _ = merged
    local = {p.name: p.read_bytes() for p in local_out.iterdir() if p.is_file()}
    assert sorted(storage.list_files(out)) == sorted(local)
    for name, data in local.items():
        if name != "merge_metadata.json":  # it names the checkpoint it came from
            assert storage.read_bytes(f"{out}/{name}") == data, name
