"""Merge throughput against `cp` of the same files, and peak memory against a naive merge.

Builds a synthetic bf16 checkpoint with the REAL Gemma 4 31B layer shapes
(workloads.contract.catalog): one global layer (k_eq_v, 4 KV heads of 512) and as many
sliding-window layers (16 KV heads of 256) as the size asks for, plus a vision-tower-like set of
non-target tensors, written as several safetensors shards; and random rank-64 LoRA factors on every
target of those layers in an Orbax checkpoint laid out exactly as tunix's CheckpointManager writes
it. Then, for each worker count asked for (and each repeat):

- cp: `cp` of the base's safetensors files to the same scratch directory, then fsync of every copy
  (the merge fsyncs its shards: both numbers are bytes on stable storage), timed right before
- streamed: `workloads.merge.merge_lora` with that many worker threads (restore LoRA, then the
  streaming pass: read, merge, checksum, write, fsync, index last), in its own process so that peak
  RSS is its alone;

and prints both rates, their ratio, the cores used and the load average before each pair (on a
shared machine the ratio of two runs taken back to back is the number to read; the rates move with
the load). Last, once:

- naive: what the paper's recipe does: load every tensor into RAM, add each whole delta to the
  whole tensor, write one safetensors file; its output is compared byte for byte with the
  streamed one.

Before the runs it prints the CPU seconds per GB of each step of merging a LoRA target (read, widen,
product + add, non-finite check, round, checksum, write), on one core's CPU clock
(`--skip-profile`).

Usage: python benchmarks/merge_throughput.py [--size-gb 3.5] [--shard-size 1GB] [--workdir DIR]
           [--workers 1,auto] [--repeats 1] [--skip-naive] [--skip-profile]
(`taskset -c 0 python benchmarks/...` measures the merge as if the host had one core.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
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


def cpu_seconds() -> float:
    """CPU time (user + system) of this process (all its threads) and of its children that have
    exited (`cp`)."""
    import resource

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def layer_shapes(spec, layer: int, glob: bool) -> dict[str, tuple[int, ...]]:
    """HF tensors of one decoder layer of the real model (workloads.contract.catalog, HF layout)."""
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

    from workloads.checkpoint import adapter_meta
    from workloads.contract import catalog, runconfig
    from workloads.model import tiny_model

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


def worker_streamed(base: str, run: str, out: str, shard_size: str, workers: int | None) -> dict:
    from workloads import merge

    _import_common()
    idle = peak_rss()
    cpu = cpu_seconds()
    started = time.monotonic()
    result = merge.merge_lora(
        base, run, out, shard_size=shard_size, progress=False, workers=workers
    )
    return {
        "seconds": time.monotonic() - started,
        "cpu_seconds": cpu_seconds() - cpu,
        "stream_cpu_seconds": result.cpu_seconds,
        "stream_seconds": result.seconds,
        "peak_rss": peak_rss(),
        "idle_rss": idle,
        "workers": result.workers,
        "files": len(result.shards),
    }


def worker_naive(base: str, run: str, out: str) -> dict:
    """Load everything, merge whole tensors, write one file (the recipe's approach)."""
    import numpy as np
    import safetensors.numpy

    from workloads.checkpoint import adapter_meta, lora_restore
    from workloads.merge import mapping

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


def stage_profile(scratch: pathlib.Path, rank: int, repeats: int = 5) -> list[tuple[str, float]]:
    """CPU seconds per GB of bf16 weights of each step the merge takes on a LoRA target, measured
    with the thread's CPU clock (so other jobs on a shared machine do not count) on 512-row blocks
    of the 31B model's two widths (5,376 and 21,504 columns), best of `repeats`: what a core spends
    per GB whatever the load, against which the wall-clock rates are read."""
    totals: dict[str, float] = {}
    gb = 0.0
    for cols in (5376, 21504):
        for name, seconds in _profile_width(scratch, rank, cols, repeats).items():
            totals[name] = totals.get(name, 0.0) + seconds
        gb += 512 * cols * 2 / 1e9
    return [(name, seconds / gb) for name, seconds in totals.items()]


def _profile_width(scratch: pathlib.Path, rank: int, cols: int, repeats: int) -> dict[str, float]:
    import ml_dtypes
    import numpy as np

    from workloads.common import digest
    from workloads.merge import blas, mapping
    from workloads.merge import safetensors_io as st
    from workloads.merge.shard_worker import overflow_limit

    rng = np.random.default_rng(cols)
    rows = mapping.ROW_BLOCK
    limit = overflow_limit(np.dtype(ml_dtypes.bfloat16))
    delta = mapping.Delta(
        "w",
        rng.standard_normal((rows, rank), dtype=np.float32) * 0.01,
        rng.standard_normal((rank, cols), dtype=np.float32) / 64,
        "profile",
    )
    base = random_bf16(rng, (rows, cols))
    path, written = scratch / "profile.bin", scratch / "profile.out"
    path.write_bytes(base.tobytes())
    raw = np.empty(base.nbytes, np.uint8)
    acc = np.empty((rows, cols), np.float32)
    out = np.empty((rows, cols), ml_dtypes.bfloat16)
    out_bytes = out.view(np.uint8).reshape(-1)
    fd = os.open(path, os.O_RDONLY)
    sink = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    appended = [0]

    def write_new_pages() -> None:
        """As the shard writer does: new bytes at the end of the file (fresh page-cache pages,
        which an overwrite at offset 0 would not need), in st.WRITE_SLICE pieces."""
        view = memoryview(out_bytes)
        for start in range(0, len(view), st.WRITE_SLICE):
            piece = view[start : start + st.WRITE_SLICE]
            os.pwrite(sink, piece, appended[0])
            appended[0] += len(piece)

    steps = {
        "read (pread, page cache)": lambda: os.preadv(fd, [raw], 0),
        "widen bf16 -> f32": lambda: np.copyto(
            acc, raw.view(ml_dtypes.bfloat16).reshape(rows, cols), casting="unsafe"
        ),
        f"product + add (sgemm beta=1, rank {rank})": lambda: delta.add_rows_to(acc, 0),
        "non-finite check (min/max)": lambda: acc.max() < limit and acc.min() > -limit,
        "round f32 -> bf16": lambda: np.copyto(out, acc, casting="unsafe"),
        "checksum (crc32c, C extension)": lambda: digest.new(digest.CRC32C).update(out_bytes),
        "write (new page-cache pages)": write_new_pages,
    }
    best: dict[str, float] = {}
    try:
        with blas.single_threaded():
            for name, step in steps.items():
                step()
                best[name] = min(_thread_seconds(step) for _ in range(repeats))
    finally:
        os.close(fd)
        os.close(sink)
        path.unlink()
        written.unlink()
    return best


def _thread_seconds(step) -> float:
    started = time.thread_time()
    step()
    return time.thread_time() - started


def compare_outputs(streamed: pathlib.Path, naive: pathlib.Path) -> tuple[int, float]:
    """Tensors whose bytes differ between the two outputs, and the largest |difference|."""
    import numpy as np
    from safetensors import safe_open

    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    differing, worst = 0, 0.0
    with safe_open(str(naive / "model.safetensors"), "np") as n:
        for name, file in index["weight_map"].items():
            with safe_open(str(streamed / file), "np") as s:
                a, b = s.get_tensor(name), n.get_tensor(name)
            if a.tobytes() != b.tobytes():
                differing += 1
                worst = max(
                    worst, float(np.max(np.abs(a.astype(np.float32) - b.astype(np.float32))))
                )
    return differing, worst


def time_cp(base: pathlib.Path, dest: pathlib.Path) -> tuple[float, float]:
    """Seconds (wall, CPU) for `cp` of the base's safetensors files to `dest`, then fsync of the
    copies (the merge fsyncs its shards too: both numbers are bytes on stable storage). `dest` is
    removed afterwards."""
    files = sorted(str(f) for f in base.glob("*.safetensors"))
    dest.mkdir()
    try:
        cpu = cpu_seconds()
        started = time.monotonic()
        subprocess.run(["cp", *files, str(dest)], check=True)
        for copy in dest.iterdir():
            with open(copy, "rb") as handle:
                os.fsync(handle.fileno())
        return time.monotonic() - started, cpu_seconds() - cpu
    finally:
        shutil.rmtree(dest)


def default_scratch(size_gb: float) -> str | None:
    """/dev/shm when it has room for the base and both outputs (where the TPU VMs stage models),
    else $TMPDIR."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize > 3.5 * size_gb * 1e9 else None


def run_worker(
    approach: str, workdir: pathlib.Path, shard_size: str, workers: int | None = None, tag: str = ""
) -> dict:
    out = workdir / f"out-{approach}{tag}"
    command = [
        sys.executable,
        __file__,
        "--worker",
        approach,
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        "--shard-size",
        shard_size,
    ]
    if workers is not None:
        command += ["--workers", str(workers)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"{approach} merge failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["out"] = str(out)
    return result


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def parse_workers(text: str) -> list[int | None]:
    """ "1,2,auto" -> [1, 2, None] (None: the merge's default, one worker per core)."""
    values: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "auto":
            values.append(None)
        elif item.isdigit() and int(item) > 0:
            values.append(int(item))
        else:
            raise SystemExit(f"--workers {text!r}: expected a list of positive counts or auto")
    return values


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
    parser.add_argument(
        "--workers",
        default="1,auto",
        help="worker counts of the streamed merge, each run in turn (default 1,auto; auto = one "
        "per core)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each worker count (default 1)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--skip-naive", action="store_true", help="only the streamed merge")
    parser.add_argument(
        "--skip-profile", action="store_true", help="no CPU profile of the merge's steps"
    )
    parser.add_argument("--worker", choices=("streamed", "naive"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        workdir = pathlib.Path(args.workdir)
        base, run = str(workdir / "base"), str(workdir / "run")
        result = (
            worker_streamed(
                base, run, args.out, args.shard_size, parse_workers(args.workers or "auto")[0]
            )
            if args.worker == "streamed"
            else worker_naive(base, run, args.out)
        )
        print(json.dumps(result))
        return 0

    counts = parse_workers(args.workers)
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
        gb = info["base_bytes"] / 1e9
        if not args.skip_profile:
            profile = stage_profile(workdir, args.rank)
            print(
                table(
                    [("step of a LoRA target (one core)", "CPU s per GB")]
                    + [(name, f"{value:.2f}") for name, value in profile]
                    + [("sum", f"{sum(v for _, v in profile):.2f}")]
                ),
                flush=True,
            )
        rows = [
            (
                "run",
                "workers",
                "cp+fsync GB/s",
                "merge GB/s",
                "merge / cp",
                "whole merge s",
                "CPU s/GB: merge pass (whole), cp",
                "peak RSS GiB",
                "load avg",
            )
        ]
        ratios: dict[int, list[float]] = {}
        last: dict = {}
        for repeat in range(args.repeats):
            for count in counts:
                # cp right before the merge, so both see the same load on a shared machine.
                load = os.getloadavg()[0]
                cp_seconds, cp_cpu = time_cp(workdir / "base", workdir / "cp-copy")
                last = run_worker("streamed", workdir, args.shard_size, count, f"-{repeat}")
                ratio = cp_seconds / last["stream_seconds"]
                ratios.setdefault(last["workers"], []).append(ratio)
                rows.append(
                    (
                        str(repeat + 1),
                        f"{last['workers']}" + (" (auto)" if count is None else ""),
                        f"{gb / cp_seconds:.2f}",
                        f"{gb / last['stream_seconds']:.2f}",
                        f"{100 * ratio:.0f}%",
                        f"{last['seconds']:.1f}",
                        f"{last['stream_cpu_seconds'] / gb:.2f} ({last['cpu_seconds'] / gb:.2f}), "
                        f"{cp_cpu / gb:.2f}",
                        f"{last['peak_rss'] / 2**30:.2f}",
                        f"{load:.1f}",
                    )
                )
                print(table([rows[0], rows[-1]]).splitlines()[-1], flush=True)
                if repeat + 1 < args.repeats or count is not counts[-1]:
                    shutil.rmtree(last["out"])
        print(table(rows))
        for workers, values in sorted(ratios.items()):
            print(
                f"{workers} worker(s): merge at {100 * min(values):.0f}-{100 * max(values):.0f}% "
                f"of cp over {len(values)} run(s) (median {100 * statistics.median(values):.0f}%) "
                f"on {workers} of {len(os.sched_getaffinity(0))} cores"
            )
        print(
            "merge GB/s: tensor bytes over the streaming pass (plan, read, merge, checksum, write, "
            "fsync; the LoRA restore before it is in 'whole merge s'); CPU s/GB: user + system "
            "seconds per GB of the streaming pass (all threads), of the whole merge (imports "
            "and restore included) and of cp"
        )
        if not args.skip_naive:
            naive = run_worker("naive", workdir, args.shard_size)
            print(
                f"naive (load everything, one file): {naive['seconds']:.1f} s, "
                f"{gb / naive['seconds']:.2f} GB/s, peak RSS {naive['peak_rss'] / 2**30:.2f} GiB"
            )
            differing, worst = compare_outputs(
                pathlib.Path(last["out"]), pathlib.Path(naive["out"])
            )
            print(
                "streamed and naive outputs are bit-identical"
                if differing == 0
                else f"streamed and naive outputs differ in {differing} tensor(s): "
                f"max |diff| {worst:g}"
            )
        print(
            f"(scratch {workdir}; {len(os.sched_getaffinity(0))} CPU cores usable, "
            f"{os.cpu_count()} in the machine; cp and merge read the same files; load avg: the "
            "1-minute load average before each cp)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
