"""The parallel loader (workloads.model.parallel_load) gives the model tunix's loader gives, leaf
for leaf and sharding for sharding, without a host copy for tensors already in the target dtype."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from workloads.common import errors
from workloads.model import gemma4, parallel_load


def _leaves(model):
    import jax
    from flax import nnx

    return jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]


def _mesh():
    import jax

    return gemma4.make_mesh(1, jax.device_count())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_model_and_shardings_as_tunix_loader(tiny_model_dir, dtype):
    mesh = _mesh()
    with mesh:
        reference = gemma4.load_model(tiny_model_dir, mesh=mesh, dtype=dtype)
    ours = parallel_load.load_model(tiny_model_dir, mesh=mesh, dtype=dtype, workers=3)
    expected, got = _leaves(reference), _leaves(ours)
    assert [p for p, _ in got] == [p for p, _ in expected]
    for (path, want), (_, have) in zip(expected, got, strict=True):
        assert have.dtype == want.dtype, path
        assert have.sharding.is_equivalent_to(want.sharding, want.ndim), path
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want), err_msg=str(path))
    # The tensor-parallel axis really splits the attention weights over the devices.
    q = ours.layers[0].attn.q_einsum.w.value
    assert len(q.sharding.device_set) == mesh.devices.size


def test_a_tensor_in_the_target_dtype_is_not_copied(tiny_model_dir):
    file = parallel_load.MappedFile(sorted(tiny_model_dir.glob("*.safetensors"))[0])
    name = next(n for n in file.names() if n.endswith("layernorm.weight"))
    view = file.tensor(name)
    assert not view.flags.owndata and not view.flags.writeable  # a view of the mapped file
    assert parallel_load.as_dtype(view, view.dtype) is view
    cast = parallel_load.as_dtype(view, np.dtype("float16"))
    assert cast.flags.owndata and np.allclose(cast, view, rtol=1e-3)


def test_layout_only_transposes_stay_views(tiny_model_dir):
    """A weight whose HF layout only needs a transpose (the MLP kernels) reaches the transfer
    as a view of the file: the one host copy left is the transfer itself."""
    cfg = gemma4.tunix_config_from_hf(gemma4.read_hf_config(str(tiny_model_dir)))
    files = [parallel_load.MappedFile(p) for p in sorted(tiny_model_dir.glob("*.safetensors"))]
    tensors = parallel_load.host_tensors(files, cfg)
    gate = tensors["layers.0.mlp.gate_proj.kernel"]()
    assert not gate.flags.owndata


def test_a_missing_weight_is_one_line(tiny_model_dir, tmp_path):
    import safetensors.numpy

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    for path in sorted(broken.glob("*.safetensors")):
        tensors = safetensors.numpy.load_file(str(path))
        gone = [k for k in tensors if k.endswith("layers.1.post_attention_layernorm.weight")]
        if gone:
            del tensors[gone[0]]
            safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(errors.UserError) as info:
        parallel_load.load_model(broken, mesh=_mesh(), dtype="float32")
    assert str(info.value) == (
        f"{broken}: the checkpoint has no weight for layers.1.post_attention_norm.scale"
    )
