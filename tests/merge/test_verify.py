"""Non-finite values never pass: `merge --verify` refuses NaN/Inf in the merged tensors, and the
merge itself refuses NaN/Inf LoRA factors (nothing that looks complete is written)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.merge.conftest import SHARD_SIZE, STEPS
from tests.train import damage
from workloads import cli
from workloads.common import errors


def test_verify_refuses_nan_in_a_merged_tensor(lora_run, merged, tmp_path, capsys):
    from workloads import merge
    from workloads.merge import safetensors_io as st
    from workloads.merge import stream

    out, _ = merged
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    layout = st.read_layout(str(copy))
    target = result_targets(copy)[0]
    info = layout.tensors[target]
    dtype = st.float_dtype(info.dtype)
    with open(copy / info.file, "r+b") as handle:  # NaN in the first 3 values, as a bit flip
        handle.seek(info.start)
        handle.write(np.full(3, np.nan, dtype).tobytes())
    # The metadata updated to the damaged bytes: the NaN check alone must catch it.
    meta = json.loads((copy / stream.METADATA_FILE).read_text())
    crc, size = st.file_digest(str(copy / info.file), "crc32c")
    meta["files"][info.file] = {"crc32c": crc, "bytes": size}
    (copy / stream.METADATA_FILE).write_text(json.dumps(meta))

    report = merge.verify_merged(str(copy), base=str(lora_run.base))
    assert not report.ok
    assert report.problems == (
        f"3 NaN/Inf values in 1 tensor(s), e.g. {target} (3); this model must not be served",
    )
    assert merge.verify_merged(str(out)).ok  # the intact merge still passes


def result_targets(out):
    return json.loads((out / "merge_metadata.json").read_text())["merged_tensors"]


def test_merge_refuses_nan_lora_factors_in_one_line(lora_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_run.run, run)
    count = damage.poison_item(run / "checkpoints" / str(STEPS[-1]) / "model_params")
    out = tmp_path / "merged"
    status = cli.main(
        [
            "merge",
            "--base",
            str(lora_run.base),
            "--checkpoint",
            str(run),
            "--out",
            str(out),
            "--shard-size",
            str(SHARD_SIZE),
            "--no-progress",
        ]
    )
    assert status == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"error: {run / 'checkpoints' / str(STEPS[-1])}: {count:,} NaN/Inf values in the LoRA "
        "factors (first in "
    )
    assert line.endswith("refusing to merge them (merge an earlier --step)")
    assert not out.exists()


def test_a_merge_whose_delta_overflows_the_dtype_is_refused(lora_run, tmp_path):
    """Finite factors whose delta overflows float32 (inf) in a merged tensor: refused while
    streaming, before the output can look complete."""
    from workloads import merge
    from workloads.merge import mapping

    def huge_q(a, b):
        ((suffix, left, right),) = mapping.RULES["q_einsum"](a, b)
        return [(suffix, left * np.float32(1e38), right * np.float32(1e38))]

    out = tmp_path / "merged"
    with pytest.raises(errors.UserError) as info:
        merge.merge_lora(
            str(lora_run.base),
            str(lora_run.run),
            str(out),
            shard_size=SHARD_SIZE,
            progress=False,
            rules={**mapping.RULES, "q_einsum": huge_q},
        )
    assert "are not finite (NaN/Inf) after adding the LoRA delta of layers." in str(info.value)
    assert not (out / "model.safetensors.index.json").exists()
