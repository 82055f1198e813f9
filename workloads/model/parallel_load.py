"""Loads a Gemma 4 safetensors checkpoint onto the mesh with no needless host copy and with the
transfers to the chips running in parallel.

Tunix's fast loader (what workloads.model.gemma4.load_model calls) maps the files and then, one
tensor after the other, casts every tensor with `astype` (a full host copy even when the file
already holds the target dtype) and hands it to `jax.device_put`; its q/k/v rearrangement runs
through jax.numpy, so those tensors are first placed whole on the default device and then resharded.
Here each tensor is a view of the memory-mapped file as long as it can be (no copy for a
tensor whose dtype matches and whose layout needs no transpose), the rearrangement stays in
numpy on the host, and a pool of threads prepares and transfers the tensors concurrently
(numpy's copies and JAX's host-to-device transfers release the GIL), so the chips' links and
the host's memory bandwidth are used at once instead of one tensor at a time.

The key mapping is tunix's own (tunix.models.gemma4.params_safetensors), so the result is
the same model tunix loads: tests/core/test_parallel_load.py compares every leaf and sharding.
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import pathlib
import re
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from workloads.common import errors
from workloads.model import gemma4

if TYPE_CHECKING:
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model

# safetensors dtype names -> numpy dtypes (bf16 from ml_dtypes, which JAX depends on).
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_ATTN = re.compile(r"tmp\.layers\.([0-9]+)\.attn\.([qkv])$")


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    if name not in _DTYPES:
        raise errors.UserError(f"safetensors dtype {name} is not one of {', '.join(_DTYPES)}")
    value = _DTYPES[name]
    return np.dtype(ml_dtypes.bfloat16) if value == "bfloat16" else np.dtype(value)


class MappedFile:
    """One safetensors file mapped read-only: its tensors as numpy views (no copy).

    The map is never closed explicitly: the views (and, on a CPU backend, arrays JAX may build
    on them without copying) keep it alive, and it goes away with the last of them.
    """

    def __init__(self, path: pathlib.Path):
        self.path = path
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            self.header = json.loads(handle.read(length))
            self.data_start = 8 + length
            self._map = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)

    def names(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def tensor(self, name: str) -> np.ndarray:
        meta = self.header[name]
        start, end = meta["data_offsets"]
        dtype = _np_dtype(meta["dtype"])
        return np.frombuffer(
            self._map,
            dtype=dtype,
            count=(end - start) // dtype.itemsize,
            offset=self.data_start + start,
        ).reshape(meta["shape"])


def _mapped(name: str, array: np.ndarray, key_map: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(tunix key, the tensor in tunix's layout: views while no copy is needed)."""
    from tunix.utils import torch_utils

    key, transform = torch_utils.torch_key_to_jax_key(key_map, name)
    if transform is not None:
        permute, reshape = transform
        if permute:
            array = array.transpose(permute)
        if reshape:
            array = array.reshape(reshape)  # a copy only when the transpose made it necessary
    return key, array


def _attention(cfg: gemma4_model.ModelConfig, parts: dict[str, dict[str, np.ndarray]]) -> Iterator:
    """Tunix's q/k/v rearrangement, in numpy: q (D, N, H) -> (N, D, H); k and v (D, K, H) ->
    (K, D, H), stacked as kv_einsum (2, K, D, H), or k alone as k_einsum where K = V."""
    from tunix.models.gemma4 import model as gemma4_model

    pattern = cfg.attention_pattern or gemma4_model.GEMMA4_ATTENTION_PATTERN
    for layer, slots in sorted(parts.items()):
        glob = pattern[int(layer) % len(pattern)] == gemma4_model.AttentionType.GLOBAL
        prefix = f"layers.{layer}.attn"
        if "q" in slots:
            yield f"{prefix}.q_einsum.w", lambda q=slots["q"]: q.transpose(1, 0, 2)
        if glob and cfg.k_eq_v_global and "k" in slots:
            yield f"{prefix}.k_einsum.w", lambda k=slots["k"]: k.transpose(1, 0, 2)
        elif "k" in slots and "v" in slots:
            yield (
                f"{prefix}.kv_einsum.w",
                lambda k=slots["k"], v=slots["v"]: np.stack(
                    [k.transpose(1, 0, 2), v.transpose(1, 0, 2)]
                ),
            )


def host_tensors(
    files: list[MappedFile], cfg: gemma4_model.ModelConfig
) -> dict[str, Callable[[], np.ndarray]]:
    """Every tunix key -> a function giving its host tensor (deferred: built in the workers).
    Keys the text model does not use (a multimodal checkpoint's vision tower) are left out."""
    from tunix.models.gemma4 import params_safetensors

    key_map = params_safetensors._get_key_and_transform_mapping(cfg)
    out: dict[str, Callable[[], np.ndarray]] = {}
    attention: dict[str, dict[str, np.ndarray]] = {}
    for file in files:
        for name in file.names():
            try:
                key, array = _mapped(name, file.tensor(name), key_map)
            except ValueError:
                continue  # not a text-model weight
            if match := _ATTN.fullmatch(key):
                attention.setdefault(match.group(1), {})[match.group(2)] = array
            else:
                out[key] = _constant(array)
    out.update(_attention(cfg, attention))
    return out


def _constant(array: np.ndarray) -> Callable[[], np.ndarray]:
    """A function giving `array`: one closure per tensor (a loop's lambda would share its last)."""
    return lambda: array


def as_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The tensor in `dtype`: itself (no copy) when it already is."""
    return array if array.dtype == dtype else array.astype(dtype)


def _path_key(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def load_model(
    model_dir: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh,
    dtype: str = "float32",
    workers: int | None = None,
) -> nnx.Module:
    """Loads a Gemma 4 text model from a local HF safetensors directory onto `mesh`.

    Args:
        model_dir: local directory with config.json and `model.language_model.*` safetensors.
        mesh: the mesh the weights are sharded over.
        dtype: "bfloat16" or "float32" (parameters and activations).
        workers: threads preparing and transferring tensors (default: the host's cores, 4 to 32).

    Raises:
        errors.UserError: a missing directory, config, weight or unexpected layout.
    """
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4_model
    from tunix.utils import compat

    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise errors.UserError(f"{model_dir}: model directory not found")
    cfg = gemma4.tunix_config_from_hf(gemma4.read_hf_config(str(model_dir)), dtype=dtype)
    gemma4._check_layout(model_dir, cfg)
    with compat.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: gemma4_model.Gemma4(cfg, rngs=nnx.Rngs(params=0)))
    graph_def, abs_state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(abs_state, mesh).to_pure_dict()
    shapes = abs_state.to_pure_dict()
    target = _np_dtype("BF16" if dtype == "bfloat16" else "F32")

    files = [MappedFile(p) for p in sorted(model_dir.glob("*.safetensors"))]
    tensors = host_tensors(files, cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shardings)
    shape_leaves = jax.tree_util.tree_leaves(shapes)
    jobs: list[tuple[str, Callable[[], np.ndarray], Any, tuple[int, ...]]] = []
    for (path, sharding), abstract_leaf in zip(leaves, shape_leaves, strict=True):
        key = _path_key(path)
        source = tensors.get(key, tensors.get(f"{key}.value"))
        if source is None:
            raise errors.UserError(f"{model_dir}: the checkpoint has no weight for {key}")
        jobs.append((key, source, sharding, tuple(abstract_leaf.shape)))

    def transfer(job: tuple[str, Callable[[], np.ndarray], Any, tuple[int, ...]]) -> Any:
        key, source, sharding, shape = job
        host = as_dtype(source(), target)
        if host.shape != shape:
            raise errors.UserError(
                f"{model_dir}: {key} has shape {host.shape}, the model expects {shape}"
            )
        if sharding.is_fully_addressable:
            placed = jax.device_put(host, sharding)
        else:
            # A host of a multi-host slice places only its own devices' shards. device_put
            # would also check across hosts that every host holds the same value: a collective,
            # and these threads issue theirs in no fixed order, which mismatches the hosts'
            # collectives (gloo aborts; a TPU slice would hang).
            placed = jax.make_array_from_callback(shape, sharding, host.__getitem__)
        placed.block_until_ready()  # the transfer has read the host tensor
        return placed

    count = workers or min(32, max(4, os.cpu_count() or 4))
    with concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="load") as pool:
        placed = list(pool.map(transfer, jobs))
    state = jax.tree_util.tree_unflatten(treedef, placed)
    return nnx.merge(graph_def, state)
