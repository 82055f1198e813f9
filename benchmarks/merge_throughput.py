"""Merge throughput and peak memory: our streamed merge next to a naive load-everything merge.

Builds a synthetic bf16 checkpoint with the REAL Gemma 4 31B layer shapes (workloads.catalog):
one global layer (k_eq_v, 4 KV heads of 512) and as many sliding-window layers (16 KV heads of
256) as the size asks for, plus a vision-tower-like set of non-target tensors, written as several
safetensors shards; and random rank-64 LoRA factors on every target of those layers in an Orbax
checkpoint laid out exactly as tunix's CheckpointManager writes it. Then it runs, each in its own
subprocess so that peak RSS is that approach's alone:

- streamed: `workloads.merge.merge_lora` (restore LoRA, stream shard by shard, sha256, index last);
- naive: what the paper's recipe does: load every tensor into RAM, add each delta to the whole
  tensor, write one safetensors file.

Usage: python benchmarks/merge_throughput.py [--size-gb 3.5] [--shard-size 1GB] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

P = "model.language_model."


def peak_rss() -> int:
    """Peak RSS of this program (VmHWM; see workloads.merge.peak_rss_bytes)."""
    from workloads import merge

    return merge.peak_rss_bytes()


def layer_shapes(spec, layer: int, glob: bool) -> dict[str, tuple[int, ...]]:
    """HF tensors of one decoder layer of the real model (workloads.catalog, HF layout)."""
    h = spec.global_head_dim if glob else spec.head_dim
    k = spec.num_global_kv_heads if glob else spec.num_kv_heads
    d, f, n = spec.embed_dim, spec.mlp_dim, spec.num_heads
    pre = f"{P}layers.{layer}."
    shapes = {
        f"{pre}self_attn.q_proj.weight": (n * h, d),
        f"{pre}self_attn.k_proj.weight": (k * h, d),
        f"{pre}self_attn.o_proj.weight": (d, n * h),
        f"{pre}mlp.gate_proj.weight": (f, d),
        f"{pre}mlp.up_proj.weight": (f, d),
        f"{pre}mlp.down_proj.weight": (d, f),
        f"{pre}self_attn.q_norm.weight": (h,),
        f"{pre}self_attn.k_norm.weight": (h,),
        f"{pre}layer_scalar": (1,),
    }
    if not glob:
        shapes[f"{pre}self_attn.v_proj.weight"] = (k * h, d)
    for norm in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ):
        shapes[f"{pre}{norm}.weight"] = (d,)
    return shapes


def lora_shapes(spec, layer: int, glob: bool, rank: int) -> dict[str, tuple[int, ...]]:
    """Qwix LoRA factor shapes of one layer, keyed like nnx.state(LoRAParam)."""
    h = spec.global_head_dim if glob else spec.head_dim
    k = spec.num_global_kv_heads if glob else spec.num_kv_heads
    d, f, n, r = spec.embed_dim, spec.mlp_dim, spec.num_heads, rank
    kv = ("k_einsum", (r, k, h)) if glob else ("kv_einsum", (r, 2, k, h))
    modules = {
        "attn": {
            "q_einsum": ((d, r), (r, n, h)),
            kv[0]: ((d, r), kv[1]),
            "attn_vec_einsum": ((n, h, r), (r, d)),
        },
        "mlp": {
            "gate_proj": ((d, r), (r, f)),
            "up_proj": ((d, r), (r, f)),
            "down_proj": ((f, r), (r, d)),
        },
    }
    out = {}
    for block, mods in modules.items():
        for module, (a, b) in mods.items():
            kind = "w" if block == "attn" else "kernel"
            out[f"layers.{layer}.{block}.{module}.{kind}_lora_a"] = a
            out[f"layers.{layer}.{block}.{module}.{kind}_lora_b"] = b
    return out


def random_bf16(rng, shape):
    """Random bf16 weights of magnitude ~0.01 straight from random bits (fast for GBs)."""
    import ml_dtypes
    import numpy as np

    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return ((bits & np.uint16(0x807F)) | np.uint16(0x3C00)).view(ml_dtypes.bfloat16)


def build(workdir: pathlib.Path, size_gb: float, rank: int, base_shard_gb: float) -> dict:
    """Writes base/ (safetensors shards + config.json) and run/checkpoints/ (Orbax + lora_meta)."""
    import numpy as np
    import orbax.checkpoint as ocp
    import safetensors.numpy

    from workloads import adapter_meta, catalog, runconfig, tiny_model

    spec = catalog.model("gemma-4-31b")
    rng = np.random.default_rng(0)
    vision = {
        f"model.vision_tower.encoder.layers.{i}.mlp.fc{j}.weight": (4304, 1152)
        if j == 1
        else (1152, 4304)
        for i in range(8)
        for j in (1, 2)
    }  # ~160 MB of non-target tensors
    # Global layer 5, then sliding layers 4, 3, ... until the size is reached.
    layers: list[tuple[int, bool]] = []
    total = sum(np.prod(s) * 2 for s in vision.values())
    candidates = (
        [(5, True)]
        + [(i, False) for i in (4, 3, 2, 1, 0)]
        + [(11, True)]
        + [(i, False) for i in range(10, 5, -1)]
    )
    for layer, glob in candidates:
        nbytes = sum(np.prod(s) * 2 for s in layer_shapes(spec, layer, glob).values())
        if layers and total + nbytes > size_gb * 1e9:
            break
        layers.append((layer, glob))
        total += nbytes
    shapes = dict(vision)
    for layer, glob in sorted(layers):
        shapes.update(layer_shapes(spec, layer, glob))

    base = workdir / "base"
    base.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if groups[-1] and used + nbytes > base_shard_gb * 1e9:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    weight_map = {}
    for i, names in enumerate(groups):  # one shard in memory at a time
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {name: random_bf16(rng, shapes[name]) for name in names}
        safetensors.numpy.save_file(part, str(base / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del part
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = tiny_model.catalog_hf_config(spec)
    (base / "config.json").write_text(json.dumps(config, indent=2))

    # LoRA factors exactly as tunix's CheckpointManager lays out nnx.state(model, nnx.LoRAParam).
    tree: dict = {}
    for layer, glob in layers:
        for name, shape in lora_shapes(spec, layer, glob, rank).items():
            scale = 1.0 / np.sqrt(shape[0]) if name.endswith("_a") else 0.01
            value = (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
            node = tree
            parts = name.split(".")
            for part in parts:
                node = node.setdefault(part, {})
            node["value"] = value
    checkpoints = workdir / "run" / "checkpoints"
    targets = tuple(runconfig.ALL_LORA_TARGETS)
    adapter_meta.write(
        str(checkpoints),
        adapter_meta.AdapterMeta(
            rank=rank, alpha=float(rank), targets=targets, base=str(base), hf_config=config
        ),
    )
    manager = ocp.CheckpointManager(
        str(checkpoints), item_handlers={"model_params": ocp.PyTreeCheckpointHandler()}
    )
    manager.save(100, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
    manager.wait_until_finished()
    manager.close()
    return {
        "base_bytes": int(total),
        "layers": [f"{i}{'g' if g else 's'}" for i, g in sorted(layers)],
        "base_files": len(groups),
        "tensors": len(shapes),
    }


def _import_common() -> None:
    """What both approaches load anyway (Orbax and JAX restore the LoRA factors), imported before
    the idle RSS is taken so that "RSS over idle" is the merge's own memory."""
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import safetensors.numpy  # noqa: F401


def worker_streamed(base: str, run: str, out: str, shard_size: str) -> dict:
    from workloads import merge

    _import_common()
    idle = peak_rss()
    started = time.monotonic()
    result = merge.merge_lora(base, run, out, shard_size=shard_size, progress=False)
    return {
        "seconds": time.monotonic() - started,
        "peak_rss": peak_rss(),
        "idle_rss": idle,
        "files": len(result.shards),
    }


def worker_naive(base: str, run: str, out: str) -> dict:
    """Load everything, merge whole tensors, write one file (the recipe's approach)."""
    import numpy as np
    import safetensors.numpy

    from workloads import adapter_meta
    from workloads.merge import lora_restore, mapping

    _import_common()
    idle = peak_rss()
    started = time.monotonic()
    meta = adapter_meta.read(f"{run}/checkpoints")
    params = lora_restore.restore_lora_params(f"{run}/checkpoints", 100)
    deltas = mapping.build_deltas(params, rank=meta.rank, alpha=meta.alpha, targets=meta.targets)
    index = json.loads(pathlib.Path(base, "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(safetensors.numpy.load_file(str(pathlib.Path(base, file))))
    for name, delta in deltas.items():
        weight = tensors[name]
        tensors[name] = (weight.astype(np.float32) + delta.full()).astype(weight.dtype)
    os.makedirs(out)
    path = pathlib.Path(out, "model.safetensors")
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return {
        "seconds": time.monotonic() - started,
        "peak_rss": peak_rss(),
        "idle_rss": idle,
        "files": 1,
    }


def compare_outputs(streamed: pathlib.Path, naive: pathlib.Path) -> float:
    """Largest |difference| between the two outputs, over all tensors (0.0: identical)."""
    import numpy as np
    from safetensors import safe_open

    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    worst = 0.0
    with safe_open(str(naive / "model.safetensors"), "np") as n:
        for name, file in index["weight_map"].items():
            with safe_open(str(streamed / file), "np") as s:
                a, b = s.get_tensor(name), n.get_tensor(name)
            if a.tobytes() != b.tobytes():
                worst = max(
                    worst, float(np.max(np.abs(a.astype(np.float32) - b.astype(np.float32))))
                )
    return worst


def default_scratch(size_gb: float) -> str | None:
    """/dev/shm when it has room for the base and both outputs (where the TPU VMs stage models),
    else $TMPDIR."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize > 3.5 * size_gb * 1e9 else None


def run_worker(approach: str, workdir: pathlib.Path, shard_size: str) -> dict:
    out = workdir / f"out-{approach}"
    command = [
        sys.executable,
        __file__,
        "--worker",
        approach,
        "--workdir",
        str(workdir),
        "--shard-size",
        shard_size,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"{approach} merge failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["out"] = str(out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-gb", type=float, default=3.5, help="synthetic base size (default 3.5)"
    )
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank (default 64, the paper's)")
    parser.add_argument(
        "--shard-size", default="1GB", help="output shard size of the streamed merge"
    )
    parser.add_argument(
        "--base-shard-gb", type=float, default=1.0, help="shard size of the synthetic base"
    )
    parser.add_argument(
        "--workdir", default=None, help="scratch directory (default: a new temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--skip-naive", action="store_true", help="only the streamed merge")
    parser.add_argument("--worker", choices=("streamed", "naive"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        workdir = pathlib.Path(args.workdir)
        out = str(workdir / f"out-{args.worker}")
        base, run = str(workdir / "base"), str(workdir / "run")
        result = (
            worker_streamed(base, run, out, args.shard_size)
            if args.worker == "streamed"
            else worker_naive(base, run, out)
        )
        print(json.dumps(result))
        return 0

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    workdir = pathlib.Path(
        args.workdir or tempfile.mkdtemp(prefix="merge-bench-", dir=default_scratch(args.size_gb))
    )
    if args.workdir and workdir.exists() and any(workdir.iterdir()):
        raise SystemExit(f"--workdir {workdir} is not empty")
    try:
        started = time.monotonic()
        info = build(workdir, args.size_gb, args.rank, args.base_shard_gb)
        print(
            f"synthetic base: {info['base_bytes'] / 1e9:.2f} GB bf16 in {info['base_files']} "
            "files, "
            f"{info['tensors']} tensors, 31B layers {', '.join(info['layers'])} (s = sliding, "
            f"g = global), LoRA rank {args.rank} on all targets; built in "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        approaches = ["streamed"] + ([] if args.skip_naive else ["naive"])
        results = {a: run_worker(a, workdir, args.shard_size) for a in approaches}
        gb = info["base_bytes"] / 1e9
        rows = [("approach", "wall s", "GB/s", "peak RSS GiB", "RSS over idle GiB", "output files")]
        for name, r in results.items():
            rows.append(
                (
                    name,
                    f"{r['seconds']:.1f}",
                    f"{gb / r['seconds']:.2f}",
                    f"{r['peak_rss'] / 2**30:.2f}",
                    f"{(r['peak_rss'] - r['idle_rss']) / 2**30:.2f}",
                    str(r["files"]),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
            for row in rows
        ]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        print("\n".join(lines))
        if "naive" in results:
            diff = compare_outputs(
                pathlib.Path(results["streamed"]["out"]), pathlib.Path(results["naive"]["out"])
            )
            print(f"outputs agree: max |streamed - naive| = {diff:g}")
        print(
            f"(scratch {workdir}; {os.cpu_count()} CPU cores; both runs read the same base files)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
