"""Training metrics: one stdout line per logged step, `metrics.jsonl` and TensorBoard scalars.

Stdout lines are plain text (no progress bar, no carriage returns) so they read the same in a
terminal, in `journalctl` and in a CI log. For a gs:// run directory the files are written to a
local mirror and uploaded when a checkpoint is saved and at the end (GCS objects cannot be
appended to). Throughput is real (non-padding) and computed tokens/s, the measured
counterparts of the compile check's estimate (infra/preflight/compile_check.py); no "6N MFU" is
logged:
6 FLOPs per parameter and token overstate a LoRA step, which computes no frozen-weight gradients.
Each training process also keeps its segment (steps, wall and compile time, tokens) in
`segments/`, so the run summary totals a preempted and resumed run over all its processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import tempfile
import time
import uuid
from typing import Any

from workloads.common import storage
from workloads.contract import catalog, runconfig

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train_summary.json"
TENSORBOARD_DIR = "tensorboard"

# jax `device_kind` -> catalog generation. v5p reports "TPU v5" (v5e is "TPU v5 lite").
_DEVICE_KINDS = {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def accelerator() -> tuple[str | None, float | None]:
    """(accelerator name, total bf16 peak FLOP/s of all devices); (None, None) on CPU.

    The name is the catalog's (`v5p-8`) when the device kind and count match an entry, else the
    JAX device kind; the peak is known only for catalog TPU generations.
    """
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return None, None
    generation = _DEVICE_KINDS.get(device.device_kind)
    for acc in catalog.ACCELERATORS.values():
        if acc.generation == generation and acc.jax_devices == jax.device_count():
            return acc.name, acc.peak_bf16_flops_per_chip * acc.chips
    if generation is not None:
        peak = next(
            a.peak_bf16_flops_per_chip
            for a in catalog.ACCELERATORS.values()
            if a.generation == generation
        )
        return f"{device.device_kind} x{jax.device_count()}", peak * jax.device_count()
    return f"{device.device_kind} x{jax.device_count()}", None


def device_memory() -> tuple[int | None, int | None]:
    """(bytes in use, peak bytes in use), the largest over local devices; None where JAX does
    not report it (CPU)."""
    import jax

    stats = [d.memory_stats() for d in jax.local_devices()]
    if not stats or any(s is None for s in stats):
        return None, None
    return (
        max(int(s.get("bytes_in_use", 0)) for s in stats),
        max(int(s.get("peak_bytes_in_use", 0)) for s in stats),
    )


def host_rss() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}TiB"


def format_line(record: dict[str, Any], total_steps: int) -> str:
    """The stdout line of one step."""
    mem = record.get("device_memory_bytes")
    mem_text = (
        _fmt_bytes(mem) if mem is not None else f"rss {_fmt_bytes(record.get('host_rss_bytes'))}"
    )
    return (
        f"step {record['step']}/{total_steps}"
        f"  loss {record['loss']:.4f}"
        f"  lr {record['learning_rate']:.2e}"
        f"  grad_norm {record['grad_norm']:.3f}"
        f"  {record['tokens_per_s']:.0f} real tok/s"
        f" ({record.get('computed_tokens_per_s', 0.0):.0f} computed)"
        f"  mem {mem_text}"
        f"  {record['step_seconds']:.2f} s/step"
    )


class RunLog:
    """Writes metrics.jsonl and TensorBoard under a run dir (local, or mirrored for gs://).

    On a resumed run the records after the restored step are dropped: those steps run again.
    With write=False (the other hosts of a multi-host slice) it keeps the records in memory and
    prints, but writes nothing.
    """

    def __init__(self, output_dir: str, *, resume_step: int, total_steps: int, write: bool = True):
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.write = write
        self.remote = storage.is_remote(output_dir)
        self.records = self._previous_records(resume_step)
        if self.remote or not write:
            self.local_dir = pathlib.Path(tempfile.mkdtemp(prefix="gemma4-run-"))
        else:
            self.local_dir = pathlib.Path(output_dir)
            self.local_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.local_dir / METRICS_FILE
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self._writer: Any = None
        if not write:
            return
        try:
            from tensorboardX import SummaryWriter

            # A unique suffix: a restart in the same second on the same host would otherwise
            # reuse (and overwrite) the previous event file.
            self._writer = SummaryWriter(
                str(self.local_dir / TENSORBOARD_DIR), filename_suffix=f".{uuid.uuid4().hex[:8]}"
            )
        except ImportError:  # the metrics file still has everything
            self._writer = None

    def _previous_records(self, resume_step: int) -> list[dict[str, Any]]:
        path = runconfig.join(self.output_dir, METRICS_FILE)
        text = storage.read_text(path) if storage.exists(path) else ""
        records = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(record, dict) and record.get("step", math.inf) <= resume_step:
                records.append(record)
        return records

    def log(self, record: dict[str, Any]) -> None:
        """Records one step: a stdout line, a metrics.jsonl line and TensorBoard scalars."""
        record = {**record, "time": time.time()}
        self.records.append(record)
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        print(format_line(record, self.total_steps), flush=True)
        if self._writer is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, int | float):
                    self._writer.add_scalar(f"train/{key}", value, record["step"])

    def sync(self) -> None:
        """Flushes TensorBoard and, for a gs:// run dir, uploads the mirror."""
        if self._writer is not None:
            self._writer.flush()
        if not (self.remote and self.write):
            return
        for path in self.local_dir.rglob("*"):
            if path.is_file():
                rel = path.relative_to(self.local_dir).as_posix()
                storage.upload_file(str(path), runconfig.join(self.output_dir, rel))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.sync()


def write_summary(output_dir: str, summary: dict[str, Any]) -> str:
    """Writes train_summary.json (read by the report and `infra.ops`) and returns its path."""
    path = runconfig.join(output_dir, SUMMARY_FILE)
    storage.write_text_atomic(path, json.dumps(summary, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- run segments

SEGMENTS_DIR = "segments"
# JAX's compile-time events: tracing, lowering to MLIR, and XLA compilation (or its retrieval from
# the persistent compilation cache, which the backend-compile event includes).
_COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)


class CompileTimer:
    """Sums JAX's compile-time events while active (a context manager); `seconds` is None when
    this JAX reports none (the event names are JAX's and may change)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def _listen(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds = (self.seconds or 0.0) + float(duration_secs)

    def __enter__(self) -> CompileTimer:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: object) -> None:
        from jax import monitoring

        # Possibly gone already: tunix's MetricsLogger.close() clears every JAX event listener
        # when the trainer closes (after the compilations, which happen at the first steps).
        with contextlib.suppress(AssertionError, ValueError):
            monitoring.unregister_event_duration_listener(self._listen)


class Segment:
    """What one training process did, kept durably in `<output_dir>/segments/<start>-<id>.json`.

    A run that was preempted and resumed is several segments. Each process rewrites its own file
    atomically (same name) at its first step, before every checkpoint save and when it ends, so
    a SIGKILLed process still counts up to its last checkpoint; its time after that is lost (not
    recorded anywhere). `step_real_tokens` lists the real tokens of steps start+1..end, so the
    run's summary can count each step of the final trajectory once (`combine_segments`).
    With write=False (the other hosts of a slice) nothing is written.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        start_step: int,
        computed_per_step: int,
        accelerator: str | None,
        write: bool = True,
    ):
        self.start_step = start_step
        self.computed_per_step = computed_per_step
        self.accelerator = accelerator
        self.write_enabled = write
        self.path = runconfig.join(
            output_dir, SEGMENTS_DIR, f"{start_step:08d}-{uuid.uuid4().hex[:12]}.json"
        )
        self.started_at = time.time()
        self.clock = time.time()
        self.step_real_tokens: list[int] = []
        self.compile = CompileTimer()

    def start(self) -> None:
        """Starts the wall clock of the training loop."""
        self.clock = time.time()

    @property
    def end_step(self) -> int:
        return self.start_step + len(self.step_real_tokens)

    def record(self, step: int, real_tokens: int) -> None:
        """Real tokens of optimizer step `step` (idempotent; steps come in order)."""
        index = step - self.start_step - 1
        if index == len(self.step_real_tokens):
            self.step_real_tokens.append(int(real_tokens))
        elif 0 <= index < len(self.step_real_tokens):
            self.step_real_tokens[index] = int(real_tokens)

    def to_json(self, status: str, wall_seconds: float | None = None) -> dict[str, Any]:
        """The segment file's content. status: running (still going, or killed), finished,
        stopped (SIGTERM or a step limit, with a checkpoint) or failed (an exception)."""
        steps = len(self.step_real_tokens)
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "steps": steps,
            "wall_seconds": time.time() - self.clock if wall_seconds is None else wall_seconds,
            "compile_seconds": self.compile.seconds,
            "real_tokens": sum(self.step_real_tokens),
            "computed_tokens": steps * self.computed_per_step,
            "computed_tokens_per_step": self.computed_per_step,
            "status": status,
            "accelerator": self.accelerator,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "step_real_tokens": list(self.step_real_tokens),
        }

    def write(self, status: str = "running", wall_seconds: float | None = None) -> dict[str, Any]:
        """Writes (replaces) this segment's file atomically; returns its content."""
        data = self.to_json(status, wall_seconds)
        if self.write_enabled:
            storage.write_text_atomic(self.path, json.dumps(data) + "\n")
        return data


def read_segments(output_dir: str) -> dict[str, dict[str, Any]]:
    """Segment files of a run dir by path ({} when there are none; unreadable ones skipped)."""
    folder = runconfig.join(output_dir, SEGMENTS_DIR)
    if not storage.exists(folder):
        return {}
    found = {}
    for name in storage.list_files(folder):
        if not name.endswith(".json") or "/" in name:
            continue
        path = runconfig.join(folder, name)
        try:
            data = json.loads(storage.read_text(path))
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and isinstance(data.get("step_real_tokens"), list):
            found[path] = data
    return found


def combine_segments(
    segments: list[dict[str, Any]], final_step: int, fallback: dict[int, int] | None = None
) -> dict[str, Any]:
    """Run totals over all segments.

    Cost counts all wall time actually spent: `wall_seconds` and `compile_seconds` are sums over
    the segments, steps computed again after a resume included (`steps_run` counts them).
    Tokens count the final trajectory: each step 1..final_step once, taken from the last segment
    that ran it (a resumed run re-runs the steps after its checkpoint); steps no segment recorded
    come from `fallback` (step -> real tokens, e.g. metrics.jsonl) or are counted in
    `untracked_steps`. `tokens_per_second` is trajectory real tokens over the total wall time.
    """
    ordered = sorted(segments, key=lambda s: (s["start_step"], s.get("started_at", 0.0)))
    per_step: dict[int, tuple[int, int]] = {}
    for seg in ordered:
        per = int(seg.get("computed_tokens_per_step", 0))
        for offset, real in enumerate(seg["step_real_tokens"]):
            per_step[seg["start_step"] + 1 + offset] = (int(real), per)
    default_per = next((int(s["computed_tokens_per_step"]) for s in reversed(ordered)), 0)
    real = computed = untracked = 0
    for step in range(1, final_step + 1):
        if step in per_step:
            real += per_step[step][0]
            computed += per_step[step][1]
        elif fallback is not None and step in fallback:
            real += int(fallback[step])
            computed += default_per
        else:
            untracked += 1
    wall = sum(float(s["wall_seconds"]) for s in ordered)
    compiles = [
        float(s["compile_seconds"]) for s in ordered if s.get("compile_seconds") is not None
    ]
    return {
        "wall_seconds": wall,
        "real_tokens": real,
        "computed_tokens": computed,
        "tokens_per_second": real / wall if wall > 0 else 0.0,
        "computed_tokens_per_second": computed / wall if wall > 0 else 0.0,
        "compile_seconds": sum(compiles) if compiles else None,
        "segments": len(ordered),
        "steps_run": sum(int(s["steps"]) for s in ordered),
        "untracked_steps": untracked,
    }
