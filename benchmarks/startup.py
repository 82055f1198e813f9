"""Time from `pulumi up` to the first training step: what can be measured here, measured, and
a cold and a warm estimate (bands) for the rest from stated public figures and assumptions.

Measured on this machine (each in its own process where JAX is involved):

- install: the training VM's whole pinned set into a fresh venv from an empty cache, by pip and
  by uv (what the startup scripts run), and the hub client alone (its own small venv);
- venv: restoring a subset of the pinned environment (jax, jaxlib, numpy, ml_dtypes: the
  bulk of the TPU stack's bytes besides libtpu) from a zstd tar archive, against a fresh
  `pip install --no-deps` of the same pinned versions into a new venv (from pip's local cache
  when it has the wheels, else PyPI: the line says which rate that is);
- staging: `cp` of a 1 GiB file from the boot disk to /dev/shm (the RAM-backed staging dir);
- loading: a synthetic bf16 checkpoint (real Gemma 4 layer structure, reduced sizes) onto N
  CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): tunix's loader against
  workloads.model.parallel_load with one worker and with its default pool;
- compile beside loading: the tiny 6-layer model's training step on 4 CPU devices, compiled
  after loading (serial) and in the background while loading (workloads.train.compile_ahead),
  each into a fresh persistent cache;
- data: 10,000 synthetic CodeV-R1-style rows rendered, tokenized (the tiny test tokenizer) and
  packed, against the same data read back from the run directory's prepared_data.npz
  (workloads.data.prepared_cache), which is what a restarted trainer does.

The cold start's longest stage, the step's compile beside the weights' arrival and loading, is
combined from two measured overlaps rather than assumed to overlap perfectly:

- contention: how much of the shorter of (load, compile) the compile-beside-loading run above
  hid (`compile_overlap`); what is not hidden is added to the longer;
- order: whether the trainer's compile began while the weights were still arriving at all, read
  from a VM's stage records (`--stage-records`: a training VM's /var/lib/gemma4/stages.jsonl, or
  the one `python -m localcloud rehearse` reads with its weights slowed, `record_overlap`). A
  compile that began after the weights were staged runs after them: the stage is their sum.

Usage: python benchmarks/startup.py [--devices 4] [--load-mb 400] [--skip-venv] [--skip-compile]
           [--stage-records FILE] [--json FILE] [--from-json FILE]
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

GB = 1e9
VENV_SUBSET = ("jax", "jaxlib", "numpy", "ml_dtypes")

# ---------------------------------------------------------------------------------------------
# Figures this machine cannot measure, each with where it comes from. Bands are (low, high) in
# seconds unless named otherwise. None of them is tuned to reach a target.
PUBLIC = {
    # The paper's own account of its manual start on a v5p-8: provisioning 3-5 min, installing
    # the stack ~5 min, then staging and a 3-8 min first-step compile.
    "vm_create_s": ((180, 300), "paper (arXiv 2605.25645): TPU VM provisioning 3-5 min"),
    "paper_install_s": ((300, 300), "paper: installing the software stack ~5 min, by hand"),
    "compile_31b_s": (
        (180, 480),
        "paper: first step compiles for 3-8 min on the v5p-8 host; the same step compiled "
        "deviceless on 2 cores here took 9.4 min",
    ),
    # Assumption: 62.5 GB from the Hugging Face hub to a GCE VM in the US at 0.25-1 GB/s
    # (parallel files, Xet high-performance mode); the long tail of a slow shard is the risk.
    "hub_gbps": ((0.25, 1.0), "assumption: hub download 0.25-1 GB/s to a GCE VM (parallel)"),
    # Assumption: GCS to a VM in the same region with parallel composite reads, 0.5-2 GB/s.
    "gcs_gbps": ((0.5, 2.0), "assumption: same-region GCS read 0.5-2 GB/s (parallel objects)"),
    # Assumption: apt python3.11 from deadsnakes + venv creation on a fresh VM.
    "python_s": ((40, 90), "assumption: deadsnakes python3.11 apt install 40-90 s"),
    # Assumption: 62.5 GB from /dev/shm into the 4 chips' HBM at 0.7-2 GB/s effective: the
    # host side (page faults on the mapped files, layout transposes) on the VM's many cores,
    # the transfers in parallel. This machine's 2 busy cores are no model for that host; the
    # loading rate measured here on CPU devices is printed for the loaders' ratio only.
    "load_s": ((30, 90), "assumption: 62.5 GB /dev/shm -> HBM at 0.7-2 GB/s: 0.5-1.5 min"),
    # Assumption: starting the trainer process: Python imports, JAX and the TPU runtime.
    "process_s": ((20, 40), "assumption: imports + TPU runtime start 20-40 s"),
    # Assumption: tokenizing and packing 10,000 CodeV-R1 rows on the VM's host.
    "data_s": ((15, 60), "assumption: read, render, tokenize and pack 10k rows: 15-60 s"),
    # Assumption: with the step in the persistent cache, the first step still traces and
    # lowers the 60-layer step in Python and reads the executable back.
    "cached_step_s": ((30, 90), "assumption: trace + lower 60 layers and read the cache: 30-90 s"),
}
MODEL_GB = 62.5  # bf16 weights of Gemma 4 31B
# Real tokens of the paper's epoch (763 real tokens/s for 3.34 h): the size of the prepared data
# a restart reads back, to scale the read-back rate measured here.
EPOCH_REAL_TOKENS = 763 * 3.34 * 3600
# uv as .ci/setup installs it (the dev extra): beside this venv's Python.
UV = pathlib.Path(sys.executable).parent / "uv"
VM_VENV_GB = 2.7  # the pinned stack's venv on disk as installed here (torch included)


def _site_packages() -> pathlib.Path:
    import sysconfig

    return pathlib.Path(sysconfig.get_paths()["purelib"])


def _du(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def measure_venv(scratch: pathlib.Path) -> dict:
    """Archive restore against fresh install of VENV_SUBSET (same pinned versions)."""
    from importlib import metadata

    site = _site_packages()
    names: list[str] = []
    pins = []
    for pkg in VENV_SUBSET:
        dist = metadata.distribution(pkg)
        pins.append(f"{dist.metadata['Name']}=={dist.version}")
        names.append(pkg)
        names.extend(p.name for p in site.glob(f"{pkg}-{dist.version}*.dist-info"))
    subset_bytes = sum(_du(site / n) for n in names)
    archive = scratch / "venv.tar.zst"
    started = time.monotonic()
    subprocess.run(
        ["tar", "-I", "zstd -T0 -3", "-cf", str(archive), "-C", str(site), *names], check=True
    )
    pack_s = time.monotonic() - started
    dest = scratch / "restored"
    dest.mkdir()
    started = time.monotonic()
    subprocess.run(["tar", "-I", "zstd -d -T0", "-xf", str(archive), "-C", str(dest)], check=True)
    restore_s = time.monotonic() - started
    fresh = scratch / "fresh"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(fresh / "bin" / "python"),
            "install",
            "--no-deps",
            "--quiet",
            *pins,
        ],
        capture_output=True,
        text=True,
    )
    install_s = time.monotonic() - started
    # The hub client alone, as the training VM installs it into its own venv before the hub
    # download: a venv, then uv installs huggingface-hub and hf-xet with their dependencies,
    # pinned by the lock, from an empty cache.
    hub = scratch / "hub"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(hub)], check=True)
    hub_install = subprocess.run(
        [
            str(UV),
            "pip",
            "install",
            "-q",
            "--no-cache",
            "--compile-bytecode",
            "--python",
            str(hub / "bin" / "python"),
            "-c",
            str(ROOT / "constraints.txt"),
            "huggingface-hub",
            "hf-xet",
        ],
        capture_output=True,
        text=True,
    )
    hub_client_s = time.monotonic() - started
    return {
        "hub_client_s": hub_client_s if hub_install.returncode == 0 else None,
        "subset": pins,
        "subset_bytes": subset_bytes,
        "archive_bytes": archive.stat().st_size,
        "pack_s": pack_s,
        "restore_s": restore_s,
        "install_s": install_s if install.returncode == 0 else None,
        "install_error": None if install.returncode == 0 else install.stderr.strip()[-300:],
    }


def measure_data(scratch: pathlib.Path, rows: int = 10_000) -> dict:
    """Preparing synthetic rows with the tiny tokenizer, then reading the result back."""
    from transformers import AutoTokenizer

    from workloads.contract import runconfig
    from workloads.data import prepared_cache, synthetic
    from workloads.data import tokenizer as tiny_tokenizer

    dataset = scratch / "codev.jsonl"
    synthetic.write_synthetic_codev(str(dataset), rows, seed=0)
    model_dir = scratch / "tokenizer"
    model_dir.mkdir()
    tiny_tokenizer.write_tokenizer_files(model_dir)
    cfg = runconfig.parse(
        {
            "run_name": "startup-bench",
            "model": {"base": str(model_dir)},
            "data": {"dataset": str(dataset), "max_seq_len": 3072},
            "train": {"output_dir": str(scratch / "run"), "micro_batch": 4},
        }
    )
    seconds = []
    for _ in range(2):  # the first prepares and keeps it, the second reads it back
        started = time.monotonic()
        prepared = prepared_cache.prepare_cached(
            cfg,
            str(model_dir),
            lambda: AutoTokenizer.from_pretrained(str(model_dir)),
            host_index=0,
            host_count=1,
            write=True,
            log=None,
        )
        seconds.append(time.monotonic() - started)
    return {
        "rows": rows,
        "dataset_bytes": dataset.stat().st_size,
        "real_tokens": prepared.stats.real_tokens,
        "file_bytes": pathlib.Path(prepared_cache.path_for(str(scratch / "run"))).stat().st_size,
        "prepare_s": seconds[0],
        "read_back_s": seconds[1],
    }


def measure_install(scratch: pathlib.Path) -> dict:
    """The training VM's whole pinned set (its requirements, the lock as constraints, then the
    no-deps packages) installed into fresh venvs from an empty cache: pip as before, uv as the
    startup script now does (both compile bytecode). The --find-links line for libtpu's own index
    is left out (not reachable from every machine; libtpu installs from PyPI)."""
    from infra.vm import startup as vm_startup

    if not UV.exists():
        return {"error": f"no uv at {UV} (bash .ci/setup installs it)"}
    requirements = scratch / "requirements.txt"
    requirements.write_text(
        "\n".join(r for r in vm_startup.train_requirements() if not r.startswith("--"))
    )
    constraints = scratch / "constraints.txt"
    constraints.write_text("\n".join(vm_startup.lock()))
    no_deps = list(vm_startup.train_no_deps())
    out: dict = {}
    for tool in ("pip", "uv"):
        venv = scratch / f"install-{tool}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        target = str(venv / "bin" / "python")
        if tool == "pip":
            base = [sys.executable, "-m", "pip", "--python", target, "install", "-q"]
            base += ["--no-cache-dir", "--disable-pip-version-check"]
        else:
            base = [str(UV), "pip", "install", "-q", "--no-cache", "--compile-bytecode"]
            base += ["--python", target]
        started = time.monotonic()
        for args in (["-r", str(requirements)], ["--no-deps", *no_deps]):
            done = subprocess.run(
                [*base, "-c", str(constraints), *args], capture_output=True, text=True
            )
            if done.returncode:
                return {"error": f"{tool}: {done.stderr.strip()[-300:]}"}
        out[f"{tool}_s"] = time.monotonic() - started
        site = next((venv / "lib").glob("python*/site-packages"))
        out[f"{tool}_dists"] = len(list(site.glob("*.dist-info")))
        out[f"{tool}_bytes"] = _du(venv)
    return out


def measure_staging(scratch: pathlib.Path) -> dict:
    """`cp` of 1 GiB from the boot disk (page-cached after writing) to /dev/shm."""
    source = scratch / "blob"
    with open(source, "wb") as handle:
        block = os.urandom(1 << 20)
        for _ in range(1024):
            handle.write(block)
    shm = pathlib.Path(tempfile.mkdtemp(prefix="startup-bench-", dir="/dev/shm"))
    try:
        started = time.monotonic()
        subprocess.run(["cp", str(source), str(shm / "blob")], check=True)
        seconds = time.monotonic() - started
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {"bytes": 1 << 30, "seconds": seconds}


# --------------------------------------------------------------------------- loading (worker)

_LOAD_WORKER = r"""
import json, sys, time
from workloads.model import gemma4, parallel_load
import jax
mode, path = sys.argv[1], sys.argv[2]
mesh = gemma4.make_mesh(jax.device_count() // 2, 2)  # tp=2 divides every head count
def load():
    if mode == "tunix":
        with mesh:
            return gemma4.load_model(path, mesh=mesh, dtype="bfloat16")
    return parallel_load.load_model(path, mesh=mesh, dtype="bfloat16",
                                    workers=1 if mode == "serial" else None)
jax.block_until_ready(jax.tree.leaves(load()))  # JAX's one-time start-up, files page-cached
started = time.monotonic()
jax.block_until_ready(jax.tree.leaves(load()))
print("SECONDS", time.monotonic() - started)
"""


def _run_worker(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"worker {argv[3:]} failed:\n{done.stderr[-3000:]}")
    return done


def write_checkpoint(directory: pathlib.Path, target_mb: int) -> int:
    """A bf16 Gemma 4 checkpoint with the real layer structure and sizes scaled to ~target_mb."""
    import ml_dtypes
    import numpy as np

    from workloads.model import tiny_model

    layers = 6
    cfg = tiny_model.hf_config(32768, layers, "bfloat16", {"bos": 2, "eos": 1, "pad": 0})
    text = cfg["text_config"]
    # Per layer about 16 * hidden^2 parameters at these ratios (+ the embedding).
    hidden = 256
    while 2 * (layers * 16 * (hidden + 256) ** 2 + 32768 * (hidden + 256)) < target_mb * 1e6:
        hidden += 256
    text.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=8,
        head_dim=hidden // 8,
        global_head_dim=hidden // 4,
    )
    tensors = {
        k: v.astype(ml_dtypes.bfloat16) for k, v in tiny_model.random_weights(cfg, 0).items()
    }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    tiny_model.write_shards(directory, tensors, 4)
    return int(sum(np.asarray(t).nbytes for t in tensors.values()))


def measure_loading(scratch: pathlib.Path, devices: int, target_mb: int) -> dict:
    path = scratch / "ckpt"
    size = write_checkpoint(path, target_mb)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    out: dict = {"bytes": size, "devices": devices}
    for mode in ("tunix", "serial", "parallel"):  # each timed on its second load (warm)
        done = _run_worker([sys.executable, "-c", _LOAD_WORKER, mode, str(path)], env)
        out[mode] = float(done.stdout.split("SECONDS", 1)[1])
    return out


# --------------------------------------------------------------------------- compile (worker)

_COMPILE_WORKER = r"""
import json, pathlib, sys, time
from workloads.model import gemma4, parallel_load, tiny_model
from workloads.contract import runconfig
from workloads.train import compile_ahead, trainer
from workloads.model import lora as lora_lib
import jax
mode, work = sys.argv[1], pathlib.Path(sys.argv[2])
model_dir = tiny_model.write_tiny_model(work / "model", seed=0)
cfg = runconfig.parse({
    "run_name": "bench", "model": {"base": str(model_dir), "dtype": "float32"},
    "data": {"dataset": "unused.jsonl", "max_seq_len": 256, "packing": True, "seed": 0},
    "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0},
    "train": {"output_dir": str(work / "run"), "micro_batch": 2, "grad_accum": 1,
              "max_steps": 10, "mesh": {"fsdp": 2, "tp": 2}, "remat": True,
              "compile_cache_dir": str(work / "cache")},
})
gemma4.set_compilation_cache(cfg.train.compile_cache_dir)
hf = gemma4.read_hf_config(str(model_dir))
mesh = gemma4.make_mesh(2, 2)
def compile_step():
    compile_ahead.lower_step(cfg, hf, mesh, 10, kernel=False).compile()
started = time.monotonic()
if mode == "overlapped":
    ahead = compile_ahead.CompileAhead(compile_step, lambda line: None).start()
model, _ = trainer.build_lora_model(cfg, model_dir, mesh)
loaded = time.monotonic() - started
if mode == "overlapped":
    ahead.wait()
else:
    compile_step()
print("RESULT " + json.dumps({"load_s": loaded, "total_s": time.monotonic() - started}))
"""


def measure_compile(scratch: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    out = {}
    for mode in ("serial", "overlapped"):
        work = scratch / f"compile-{mode}"
        work.mkdir()
        done = _run_worker([sys.executable, "-c", _COMPILE_WORKER, mode, str(work)], env)
        out[mode] = json.loads(done.stdout.split("RESULT ", 1)[1])
    return out


# --------------------------------------------------------------------------- the overlaps


def compile_overlap(comp: dict) -> float:
    """The share of the shorter of (load, compile) that compiling beside the load hid, from the
    serial and the overlapped run (0: no gain, the two only took turns; 1: the shorter was
    wholly hidden)."""
    serial, overlapped = comp["serial"], comp["overlapped"]
    load = serial["load_s"]
    compile_s = serial["total_s"] - load
    shorter = min(load, compile_s)
    if shorter <= 0:
        return 0.0
    hidden = serial["total_s"] - overlapped["total_s"]
    return min(1.0, max(0.0, hidden / shorter))


def record_overlap(records: list[dict]) -> dict:
    """What a VM's stage records (its latest boot) say of the trainer beside the weights: when the
    weights stage began and ended, when the trainer's data and step compile began and ended, all
    in seconds from the weights' start, and the share of the compile that ran while the weights
    still arrived.

    Raises:
        ValueError: the records lack one of those stages (not a training VM's first boot).
    """
    from workloads.common import stage_records

    boot = stage_records.latest_boot(records)
    at = {
        (r["stage"], r["event"]): float(r["at"])
        for r in records
        if r.get("boot") == boot and (r.get("event") == "start" or r.get("ok"))
    }
    wanted = ("weights", "data", "compile_ahead")
    missing = [f"{st} {ev}" for st in wanted for ev in ("start", "end") if (st, ev) not in at]
    if missing:
        raise ValueError(f"stage records lack {', '.join(missing)} in their latest boot")
    zero = at["weights", "start"]
    weights_end = at["weights", "end"] - zero
    begun, ended = at["compile_ahead", "start"] - zero, at["compile_ahead", "end"] - zero
    inside = max(0.0, min(ended, weights_end) - max(begun, 0.0))
    return {
        "weights_s": weights_end,
        "data_start_s": at["data", "start"] - zero,
        "data_end_s": at["data", "end"] - zero,
        "compile_start_s": begun,
        "compile_end_s": ended,
        "compile_inside": inside / (ended - begun) if ended > begun else 0.0,
    }


def _beside(longer_or_not: tuple[float, float], efficiency: float) -> float:
    """Two stages run side by side: the longer, plus what of the shorter the overlap does not
    hide."""
    a, b = longer_or_not
    return max(a, b) + (1.0 - efficiency) * min(a, b)


# --------------------------------------------------------------------------- the estimate


def _band(low: float, high: float) -> str:
    return f"{low / 60:4.1f} - {high / 60:4.1f} min"


def _measured_efficiency(measured: dict) -> tuple[float, str]:
    """How much of the shorter of (the compile, the weights' arrival and load) the first VM hides,
    with where that figure comes from."""
    records = measured.get("records")
    if records is not None and records["compile_start_s"] >= records["weights_s"]:
        return 0.0, (
            "measured: the VM's stage records show the compile beginning "
            f"{records['compile_start_s'] - records['weights_s']:.0f} s after the weights were "
            "staged, so the two add up"
        )
    order = (
        f"the stage records show the compile beginning {records['compile_start_s']:.0f} s "
        f"into the weights' {records['weights_s']:.0f} s ({records['compile_inside']:.0%} of it "
        "while they arrived)"
        if records is not None
        else "the trainer beginning while the weights arrive is not measured here (no "
        "--stage-records)"
    )
    comp = measured.get("compile")
    if not comp:
        return 1.0, f"assumption: the shorter wholly hidden (not measured); {order}"
    efficiency = compile_overlap(comp)
    return efficiency, (
        f"measured: compiling beside the load hid {efficiency:.0%} of the shorter here (the "
        f"rest added to the longer); {order}"
    )


def estimate(measured: dict) -> list[tuple[str, str, list[tuple[str, float, float, str]]]]:
    """Cold, warm-restart and new-VM scenarios as lists of (stage, low s, high s, source)."""
    p = {k: v[0] for k, v in PUBLIC.items()}
    src = {k: v[1] for k, v in PUBLIC.items()}
    venv = measured.get("venv") or {}
    if venv.get("restore_s"):
        rate = venv["subset_bytes"] / venv["restore_s"]
        restore = (VM_VENV_GB * GB / rate, VM_VENV_GB * GB / rate * 2)
        restore_src = (
            f"measured: archive restore {rate / GB:.2f} GB/s here x {VM_VENV_GB} GB "
            "(high: 2x), + the archive's GCS read"
        )
    else:
        restore, restore_src = (10.0, 40.0), "assumption: archive restore 10-40 s (not measured)"
    archive_read = tuple(0.4 * VM_VENV_GB / g for g in p["gcs_gbps"][::-1])  # zstd ~0.4x
    hub = tuple(MODEL_GB / g for g in p["hub_gbps"][::-1])
    gcs = tuple(MODEL_GB / g for g in p["gcs_gbps"][::-1])
    load_band = p["load_s"]
    compile_band = p["compile_31b_s"]
    hub_client = (venv or {}).get("hub_client_s")
    if hub_client:
        client, client_src = (
            (hub_client, 3 * hub_client),
            (f"measured: the hub client's venv in {hub_client:.0f} s here (high: 3x)"),
        )
    else:
        client, client_src = (10.0, 60.0), "assumption: the hub client's venv in 10-60 s"
    install = measured.get("install") or {}
    if install.get("uv_s"):
        ratio = install["uv_s"] / install["pip_s"]
        fresh_install = (install["uv_s"], 300.0 * ratio)
        fresh_src = (
            f"measured: uv installs the whole pinned set in {install['uv_s']:.0f} s here (pip "
            f"{install['pip_s']:.0f} s); high: the paper's 5 min install x uv/pip {ratio:.2f}"
        )
    else:
        fresh_install = (150.0, 300.0)
        fresh_src = "assumption: a pip install of the stack 2.5-5 min (uv not measured)"
    data = measured.get("data") or {}
    if data.get("read_back_s"):
        rate = data["real_tokens"] / data["read_back_s"]
        read_back = (EPOCH_REAL_TOKENS / rate, 4 * EPOCH_REAL_TOKENS / rate)
        read_back_src = (
            f"measured: prepared data read back at {rate / 1e6:.0f} M tokens/s here x the "
            f"paper's {EPOCH_REAL_TOKENS / 1e6:.1f} M real tokens (high: 4x)"
        )
    else:
        read_back, read_back_src = (1.0, 10.0), "assumption: prepared data read back in 1-10 s"
    # Side by side (the startup script's weights stage runs beside its venv stage). The host is
    # ready once the venv and the model's small files are there: the trainer starts, prepares the
    # data and compiles the step while the shards arrive, and loads them once they are whole. So
    # the first step comes at the later of (venv, trainer start, data, compile) and (hub client,
    # download, then load, which cannot start before the trainer reaches it), band end by end.
    before_compile = tuple(fresh_install[i] + p["process_s"][i] + p["data_s"][i] for i in (0, 1))
    weights_then_load = tuple(
        max(client[i] + hub[i], before_compile[i]) + load_band[i] for i in (0, 1)
    )
    efficiency, overlap_src = _measured_efficiency(measured)
    compile_or_load = tuple(
        _beside((compile_band[i], weights_then_load[i] - before_compile[i]), efficiency)
        for i in (0, 1)
    )
    cold = [
        ("VM create to boot", *p["vm_create_s"], src["vm_create_s"]),
        ("python 3.11", *p["python_s"], src["python_s"]),
        (
            "venv (uv), trainer start, data",
            *before_compile,
            f"the venv ({fresh_src}), then {src['process_s']}, then {src['data_s']}; the "
            "host is ready once the venv and the model's config and tokenizer are there",
        ),
        (
            "compile || weights arrive + load",
            *compile_or_load,
            f"the compile ({src['compile_31b_s']}) beside what is left of the weights, "
            f"begun beside the venv: the hub client ({client_src}) + the download of "
            f"{MODEL_GB} GB ({src['hub_gbps']}), then the load ({src['load_s']}); "
            f"{overlap_src}",
        ),
    ]
    # The same on a new VM, from the bucket: the trainer starts on the restored venv and the
    # model's small files, reads the prepared data back and traces the step (read from the
    # cache) while the shards are copied, then loads them.
    before_step = tuple(
        restore[i] + archive_read[i] + p["process_s"][i] + read_back[i] for i in (0, 1)
    )
    step_or_load = tuple(
        max(p["cached_step_s"][i], max(gcs[i], before_step[i]) + load_band[i] - before_step[i])
        for i in (0, 1)
    )
    warm_vm = [
        ("VM create to boot", *p["vm_create_s"], src["vm_create_s"]),
        ("python 3.11", *p["python_s"], src["python_s"]),
        (
            "venv archive, trainer start, data",
            *before_step,
            f"the venv ({restore_src}), then {src['process_s']}, then the data read back "
            f"({read_back_src} + its GCS read)",
        ),
        (
            "cached step || weights + load",
            *step_or_load,
            f"the later of the step from the cache ({src['cached_step_s']}) and what is left "
            f"of {MODEL_GB} GB from GCS ({src['gcs_gbps']}), begun beside the venv, then the "
            f"load ({src['load_s']})",
        ),
    ]
    warm_process = [
        ("trainer process start", *p["process_s"], src["process_s"]),
        ("data: read back", *read_back, read_back_src),
        (
            "load || cached step",
            max(load_band[0], p["cached_step_s"][0]),
            max(load_band[1], p["cached_step_s"][1]),
            f"weights still in /dev/shm; {src['load_s']}; {src['cached_step_s']}",
        ),
    ]
    return [
        ("COLD: first `pulumi up`, empty bucket", "cold", cold),
        (
            "WARM: trainer restarted on the same VM (weights in /dev/shm, step in the cache)",
            "warm",
            warm_process,
        ),
        (
            "NEW VM after a preemption (venv archive, weights and step cache in the bucket)",
            "new-vm",
            warm_vm,
        ),
    ]


def report(measured: dict) -> str:
    lines = ["# Measured here"]
    venv = measured.get("venv")
    if venv:
        gb = venv["subset_bytes"] / GB
        lines.append(
            f"venv subset {', '.join(venv['subset'])}: {gb:.2f} GB on disk, archive "
            f"{venv['archive_bytes'] / GB:.2f} GB (zstd -3, packed in {venv['pack_s']:.1f} s); "
            f"restore {venv['restore_s']:.1f} s ({gb / venv['restore_s']:.2f} GB/s)"
        )
        if venv["install_s"] is not None:
            lines.append(
                f"  fresh `pip install --no-deps` of the same pins: {venv['install_s']:.1f} s "
                f"({venv['install_s'] / venv['restore_s']:.1f}x the restore; pip's cache/PyPI)"
            )
        else:
            lines.append(f"  fresh install failed here: {venv['install_error']}")
    if venv and venv.get("hub_client_s"):
        lines.append(
            f"  the hub client (huggingface-hub, hf-xet and their dependencies, pinned) into a "
            f"fresh venv by uv: {venv['hub_client_s']:.1f} s"
        )
    install = measured.get("install")
    if install and install.get("uv_s"):
        lines.append(
            f"training VM's whole pinned set ({install['uv_dists']} distributions, "
            f"{install['uv_bytes'] / GB:.2f} GB), fresh venv, empty cache: pip "
            f"{install['pip_s']:.1f} s, uv {install['uv_s']:.1f} s "
            f"({install['pip_s'] / install['uv_s']:.1f}x; both compile bytecode)"
        )
    elif install:
        lines.append(f"whole pinned set: not measured ({install['error']})")
    data = measured.get("data")
    if data:
        lines.append(
            f"data: {data['rows']:,} synthetic rows ({data['dataset_bytes'] / 1e6:.1f} MB, "
            f"{data['real_tokens'] / 1e6:.2f} M real tokens, tiny tokenizer): prepared in "
            f"{data['prepare_s']:.1f} s, read back from prepared_data.npz "
            f"({data['file_bytes'] / 1e6:.1f} MB) in {data['read_back_s']:.2f} s "
            f"({data['prepare_s'] / data['read_back_s']:.0f}x)"
        )
    stage = measured.get("staging")
    if stage:
        lines.append(
            f"staging: cp 1 GiB disk (page-cached) -> /dev/shm in {stage['seconds']:.2f} s "
            f"({stage['bytes'] / stage['seconds'] / GB:.2f} GB/s)"
        )
    load = measured.get("loading")
    if load:
        gb = load["bytes"] / GB
        lines.append(
            f"loading {gb:.2f} GB bf16 onto {load['devices']} CPU devices: tunix "
            f"{load['tunix']:.2f} s ({gb / load['tunix']:.2f} GB/s), parallel_load 1 worker "
            f"{load['serial']:.2f} s, default pool {load['parallel']:.2f} s "
            f"({gb / load['parallel']:.2f} GB/s, {load['tunix'] / load['parallel']:.1f}x tunix)"
        )
    comp = measured.get("compile")
    if comp:
        s, o = comp["serial"], comp["overlapped"]
        lines.append(
            f"tiny 6-layer step on 4 CPU devices: load then compile {s['total_s']:.1f} s "
            f"(load {s['load_s']:.1f} s); compile beside loading {o['total_s']:.1f} s "
            f"(load {o['load_s']:.1f} s, slower while both share the cores)"
        )
    records = measured.get("records")
    if records:
        lines.append(
            f"stage records: the weights staged in {records['weights_s']:.0f} s; the trainer's "
            f"data from {records['data_start_s']:.0f} to {records['data_end_s']:.0f} s, its "
            f"step's compile from {records['compile_start_s']:.0f} to "
            f"{records['compile_end_s']:.0f} s ({records['compile_inside']:.0%} of it while the "
            "weights arrived)"
        )
    if comp:
        lines.append(
            f"the compile beside the load hid {compile_overlap(comp):.0%} of the shorter of "
            "the two (the cold estimate adds the rest)"
        )
    lines.append(f"({os.cpu_count()} CPU cores, shared: rates move with the machine's load)")
    limits = {"cold": 600, "warm": 180}  # the targets: cold <= 10 min, warm restart <= 3
    for title, kind, stages in estimate(measured):
        low = sum(s[1] for s in stages)
        high = sum(s[2] for s in stages)
        lines.append("")
        lines.append(f"# {title}: {_band(low, high)}")
        for name, lo, hi, source in stages:
            lines.append(f"  {name:34s} {_band(lo, hi)}   [{source}]")
        top = max(stages, key=lambda s: s[2])
        limit = limits.get(kind)
        if limit is not None and high > limit:
            lines.append(
                f"  -> above {limit // 60} min at the high end; the largest stage is "
                f"'{top[0]}' (up to {top[2] / 60:.1f} min)"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="CPU devices for the load test")
    parser.add_argument("--load-mb", type=int, default=400, help="synthetic checkpoint size")
    parser.add_argument("--skip-venv", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument(
        "--stage-records",
        help="a training VM's stages.jsonl (or the rehearsal's): whether its trainer compiled "
        "while the weights arrived, for the cold estimate",
    )
    parser.add_argument("--json", help="also write the measurements to this file")
    parser.add_argument("--from-json", help="print the report of measurements saved by --json")
    args = parser.parse_args()
    if args.from_json:
        print(report(json.loads(pathlib.Path(args.from_json).read_text())))
        return 0
    measured: dict = {}
    if args.stage_records:
        from workloads.common import stage_records

        try:
            measured["records"] = record_overlap(stage_records.read_records(args.stage_records))
        except (OSError, ValueError) as exc:
            print(f"--stage-records {args.stage_records}: {exc}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        scratch = pathlib.Path(tmp)
        if not args.skip_venv and shutil.which("zstd") is None:
            print("note: no `zstd` on PATH: the venv archive is not measured (apt install zstd)")
        elif not args.skip_venv:
            (scratch / "venv").mkdir()
            measured["venv"] = measure_venv(scratch / "venv")
        if not args.skip_venv:
            (scratch / "install").mkdir()
            measured["install"] = measure_install(scratch / "install")
        (scratch / "data").mkdir()
        measured["data"] = measure_data(scratch / "data")
        (scratch / "stage").mkdir()
        measured["staging"] = measure_staging(scratch / "stage")
        (scratch / "load").mkdir()
        measured["loading"] = measure_loading(scratch / "load", args.devices, args.load_mb)
        if not args.skip_compile:
            measured["compile"] = measure_compile(scratch)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(measured, indent=2))
    print(report(measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
