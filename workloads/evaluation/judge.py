"""Judges generated Verilog with Icarus Verilog, the way verilog-eval does.

Per sample (verilog-eval's Makefile.in and scripts/sv-iv-analyze):

    iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o sim sample.sv test.sv ref.sv
    vvp -n sim            (under a wall-clock timeout; "TIMEOUT" when it runs out)

and the combined log is classified with the analyzer's rules, in its order (first match wins):
`S` syntax error, `e` explicit cast needed, `0` zero-width constant, `n` no sensitivities,
`w` reg assigned as wire, `m` unknown module, `c` cannot bind clk, `T` TIMEOUT; then `p`
(cannot bind a signal) and `C` (any other line with "error"); a sample passes (`.`) only when
the testbench printed `Mismatches: 0 in N samples`.

sample.sv is the design extract.extract_code kept (TopModule and the modules it instantiates).
When it dropped modules (a helper testbench), the code as the official flow extracts it is first
compiled the official way but not run (`iverilog -t null`): if that fails (a dropped module that
does not parse, a second `tb`), the sample fails with that status, as in the official flow.

We are stricter in ways that only matter for broken or hostile samples. The testbench must reach
its own end normally: its copy gets a random tag, new for every run, in the format string of its
verdict line, and only a tagged line counts. So a design that prints its own verdict line (an
obfuscated "Mismatches: 0") and then ends the simulation before the testbench's final block
(a `$finish`, `$stop` or `$fatal` in its own final block, which runs first) fails, and so does
any run whose simulator exits with a status other than 0 (`$fatal` exits 1, a crash or a resource
limit kills it): status `A`, simulation aborted. (vvp runs with -n, so `$stop` acts as
`$finish`: the simulation ends and final blocks run, the testbench's included unless a final
block stopped first.) Further: exactly one verdict line, N > 0 and N equal to what the
reference solution itself gets (an early `$finish` or `$stop` stops counting: `R`), a zero
exit status from iverilog, and output under a size cap (`O`).

Generated Verilog is untrusted code. Every iverilog and vvp run happens inside an operating-system
sandbox (sandbox.py: bubblewrap; an unprivileged uid, no network, nothing of the host readable
but the tools' own files, only the sample's private directory writable), never through a shell,
with stdin closed, its own process group (killed as a whole on timeout), CPU-time, file-size,
address-space, open-file and core-dump limits, a byte budget for all the files of its directory,
and its output read up to a cap. Without a working sandbox nothing runs (errors.UserError naming
what to install).

On top of that, to keep the verdicts honest: the design is first preprocessed alone (`iverilog -E`,
in the sandbox, in a directory holding nothing but the design), and the sample is refused (`F`)
when that preprocessed text, what the compiler will parse, calls a file-writing or file-reading
system task or `$deposit` (it writes a net, an input port the testbench drives included, past its
drivers) or prints the testbench's verdict string, or when the design includes any file
(`include, however the macros spell it: iverilog's -Minclude list must be empty); `include
in the official code (compiled, never run) is refused too. Empty code is `X`.

A design must not reach into the testbench: it could write the testbench's mismatch counter
(`tb.wrong = 0;`, `tb.stats1.errors = 0;` in verilog-eval's testbenches) or anything else the
verdict depends on, and pass while wrong. So once the sample compiled with the testbench (and no
analyzer rule failed it), the design is elaborated again alone, in the sandbox, with TopModule
as the only root (`iverilog -g2012 -t null -s TopModule sample.sv`): iverilog binds every
hierarchical name there, however macros spelled it (`tb.x`, `$root.tb.x`, upward names such as
`stim1.x` or `top_module1.x`, `force`/`release`/`assign` on them, events, task calls, `$deposit`
arguments), and a name that leaves the design's own module tree cannot bind when the testbench
is absent. A design that elaborates with the testbench but not alone, or whose `defparam` finds
its scope only with the testbench, is refused (`H`, with the name it reached for); names inside
the design (`u_sub.q`, `TopModule.u_sub.q`) bind alone and pass. The official flow has no such
check and passes such a design: with the input ports below, the places, besides the tagged
verdict line, where our verdict differs from the official one for a design that compiles
(tests/evaluation/test_parity.py names them).

Nor may a design drive its own input ports: iverilog joins an input port with the testbench's net
(coercing a driven one to inout), so a design that forces its inputs, drives them or shorts them
to a supply with a tran hands the reference the same altered inputs, and a wrong design stuck at
the matching output passes the official flow. The elaboration alone also dumps iverilog's
netlist (-N), which says, per signal of TopModule, whether it is an input port, whether a
procedural statement writes it (force, release) and which nets it joins, and per node whether a
pin drives its net or joins it to others (a tran, an inout port's part select); an input port
written or driven from inside the design, through such joins too, is refused (`H`, naming the
port), and one only read, through an inout port too, is not. Samples run in
parallel on a thread pool of os.cpu_count() workers (the threads only wait on child processes).

Long on purpose: it reproduces verilog-eval's official judging (its iverilog commands, the
analyzer's letters, the sandbox limits) in one place, so that the parity tests compare against one
module.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import re
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

from workloads.common import errors
from workloads.evaluation import extract, problems, sandbox

IVERILOG_FLAGS = ("-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb")
_MISMATCH_RE = re.compile(r"^Mismatches: (\d+) in (\d+) samples( \[testbench [0-9a-f]+\])?$")
# The format string of verilog-eval's verdict line, as every one of its testbenches spells it.
VERDICT_FORMAT = '"Mismatches: %1d in %1d samples"'
_INCLUDE_RE = re.compile(r"`include\b")
_MISSING_INCLUDE_RE = re.compile(r"Include file (\S+) not found")
_FORBIDDEN_RE = re.compile(
    r"\$(?:fopen|fclose|fdisplay\w*|fwrite\w*|fstrobe\w*|fmonitor\w*|fputc|fflush|fread|fgets|"
    r"fgetc|fscanf|fseek|rewind|ungetc|readmem\w*|writemem\w*|dumpfile|dumpvars|dumpall|"
    r"dumpflush|dumplimit|dumpon|dumpoff|dumpports\w*|system|sdf_annotate|value\$plusargs|"
    r"test\$plusargs|deposit)\b|`include\b|Mismatches"
)
# The module the testbench instantiates: the one root of the design alone (spec-to-rtl's name).
DESIGN_TOP = "TopModule"
_ALONE_FLAGS = ("-g2012", "-Wno-timescale", "-t", "null", "-s", DESIGN_TOP)
# Names iverilog quotes in its messages: ``tb.wrong'', `tb.wrong', <tb.ev>.
_QUOTED_NAME_RE = re.compile(r"(?:``|`|<)([^\s`'<>]+)(?:''|'|>)")
# iverilog's warning for a defparam whose scope does not exist (elaboration still succeeds).
_DANGLING_DEFPARAM_RE = re.compile(r"warning: Scope of (\S+) not found\.")
# The netlist iverilog dumps (-N) after elaborating the design alone: per signal of each scope its
# port direction and how often a procedural statement (force, release, assign) writes it, and the
# nexus ("0x..." addresses) it joins; per node (gate, tran, constant, part select...) the nexus of
# each pin and whether the pin drives it (anything but I: O drives, p is a tran's passive end).
_NETLIST = "design.netlist"
_NETLIST_SIGNAL_RE = re.compile(
    r"^    \S[^:]*: (?P<name>\S+) unpacked dims=\d+ pin_count=\d+ (?:\(local\) )?"
    r"(?:(?P<port>input|output|inout) )?.*?\(eref=\d+, lref=(?P<lref>\d+)\)"
)
_NETLIST_NEXUS_RE = re.compile(r"^        \[\d+\]: (0x[0-9a-f]+)")
_NETLIST_PIN_RE = re.compile(r"^    +\d+ pin\d+ (?P<kind>\S+) .*: (?P<nexus>0x[0-9a-f]+)")
_LOG_TAIL_CHARS = 2000
_DISK_CHECK_S = 0.2
# Scratch files of the preprocessing check, removed before the testbench joins the sample.
_PREPROCESSED = "sample.preprocessed.sv"
_DEPS = "sample.includes"
_PREPROCESSED_CAP = 64 << 20
# (substring, status) checks of sv-iv-analyze that end the scan, in its order.
_ANALYZER_RULES: tuple[tuple[str, str], ...] = (
    ("syntax error", "S"),
    ("error: This assignment requires an explicit cast", "e"),
    ("error: Sized numeric constant must have a size greater than zero", "0"),
    ("warning: always_comb process has no sensitivities", "n"),
    ("found no sensitivities so it will never trigger", "n"),
    ("is declared here as wire", "w"),
    ("Unknown module type", "m"),
    ("Unable to bind wire/reg/memory `clk'", "c"),
    ("TIMEOUT", "T"),
)
STATUS_MEANINGS: dict[str, str] = {
    ".": "pass",
    "S": "syntax error",
    "C": "compile error",
    "e": "explicit cast needed",
    "0": "zero-width constant",
    "n": "process without sensitivities",
    "w": "reg assigned as wire",
    "m": "unknown module",
    "p": "cannot bind a signal",
    "c": "cannot bind clk",
    "T": "timeout",
    "R": "runtime mismatch",
    "O": "output over the cap",
    "A": "simulation aborted",
    "F": "forbidden construct",
    "H": "reaches outside the design",
    "X": "no code in the answer",
    "E": "request failed",
}
# Why samples failed, for summaries: outcome -> status letters.
STATUS_GROUPS: dict[str, tuple[str, ...]] = {
    "passed": (".",),
    "failed to compile": ("S", "C", "e", "0", "n", "w", "m", "p", "c"),
    "timed out": ("T",),
    "mismatched": ("R",),
    "aborted": ("A",),
    "refused by the sandbox": ("F", "H", "O"),
    "no code in the answer": ("X",),
    "request failed": ("E",),
}


def group_counts(status_counts: Mapping[str, int]) -> dict[str, int]:
    """Sample counts per outcome of STATUS_GROUPS (every outcome, zeros included; letters
    outside the groups count as "other", listed only when there are any)."""
    groups = {outcome: 0 for outcome in STATUS_GROUPS}
    for status, count in status_counts.items():
        outcome = next((o for o, letters in STATUS_GROUPS.items() if status in letters), "other")
        groups[outcome] = groups.get(outcome, 0) + count
    return groups


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one compile or simulation may use.

    Attributes:
        timeout_s: wall-clock seconds per step (compile, simulation); the paper used 60.
        output_bytes: bytes of stdout+stderr read per step before the process group is killed.
        file_bytes: largest file a step may write (RLIMIT_FSIZE; the testbench's wave.vcd).
        memory_bytes: address space per process (RLIMIT_AS); 0 = unlimited.
        directory_bytes: all files of the sample's directory together, checked every
            _DISK_CHECK_S while a step runs (a design that writes many files is killed).
    """

    timeout_s: float = 60.0
    output_bytes: int = 1 << 20
    file_bytes: int = 256 << 20
    memory_bytes: int = 4 << 30
    directory_bytes: int = 512 << 20


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one sample.

    Attributes:
        passed: the testbench saw no mismatch over the full run.
        status: one letter, see STATUS_MEANINGS.
        reason: one line for people.
        mismatches, samples: the testbench's `Mismatches: M in N samples` (None if absent).
        expected_samples: N of the reference solution.
        seconds: wall time spent on this sample.
        log_tail: the end of the compile + simulation log.
    """

    passed: bool
    status: str
    reason: str
    mismatches: int | None = None
    samples: int | None = None
    expected_samples: int | None = None
    seconds: float = 0.0
    log_tail: str = ""

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Reference:
    """The reference solution run through the testbench in place of the DUT.

    Attributes:
        samples: N of its `Mismatches: 0 in N samples`, or None if the reference itself failed.
        verdict: the full verdict of that run.
    """

    samples: int | None
    verdict: Verdict


@dataclasses.dataclass(frozen=True)
class _Output:
    returncode: int | None
    text: str
    timed_out: bool
    overflowed: bool
    disk_full: bool = False  # overflowed by the files in its directory, not its output


def require_tools() -> None:
    """Raises errors.UserError unless iverilog and vvp are on PATH and really run inside the
    sandbox on this machine."""
    missing = [tool for tool in ("iverilog", "vvp") if shutil.which(tool) is None]
    if missing:
        raise errors.UserError(
            f"{' and '.join(missing)} not found on PATH; install Icarus Verilog "
            "(apt-get install iverilog)"
        )
    sandbox.require()


def _clamp(kind: int, value: int) -> tuple[int, int]:
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    return value, value


def _limiter(limits: Limits, timeout_s: float) -> Callable[[], None]:
    """A preexec_fn that only calls setrlimit with values computed here, in the parent.

    preexec_fn runs between fork and exec; it touches no Python-level lock, so it is safe
    although other threads of the parent run other samples.
    """
    cpu = math.ceil(timeout_s) + 1
    settings = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL at the hard
        (resource.RLIMIT_FSIZE, _clamp(resource.RLIMIT_FSIZE, limits.file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
        # The tools need a handful of files; a file that includes itself stops at this depth.
        (resource.RLIMIT_NOFILE, _clamp(resource.RLIMIT_NOFILE, 64)),
    ]
    if limits.memory_bytes:
        settings.append((resource.RLIMIT_AS, _clamp(resource.RLIMIT_AS, limits.memory_bytes)))

    def apply() -> None:
        for kind, value in settings:
            resource.setrlimit(kind, value)

    return apply


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _run(argv: Sequence[str], cwd: str, limits: Limits) -> _Output:
    """Runs argv (an Icarus tool and its arguments) in the sandbox on the directory cwd, with
    limits; never raises for what the program does (errors.UserError without a sandbox)."""
    proc = subprocess.Popen(
        sandbox.current().command(argv, cwd),
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_limiter(limits, limits.timeout_s),
        close_fds=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    deadline = time.monotonic() + limits.timeout_s
    data = bytearray()
    timed_out = overflowed = disk_full = False
    fd = proc.stdout.fileno()
    next_disk_check = 0.0
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                timed_out = True
                break
            if now >= next_disk_check:
                if _directory_bytes(cwd) > limits.directory_bytes:
                    overflowed = disk_full = True
                    break
                next_disk_check = now + _DISK_CHECK_S
            if not selector.select(min(remaining, _DISK_CHECK_S)):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
            if len(data) > limits.output_bytes:
                overflowed = True
                break
    if not (timed_out or overflowed):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    # Always: whatever the program left behind in its process group goes too.
    _kill_group(proc.pid)
    proc.wait()
    proc.stdout.close()
    text = bytes(data[: limits.output_bytes]).decode("utf-8", errors="replace")
    if not (timed_out or overflowed) and _directory_bytes(cwd) > limits.directory_bytes:
        overflowed = disk_full = True  # grew past the budget after the last check
    returncode = None if (timed_out or overflowed) else _tool_status(proc.returncode)
    return _Output(returncode, text, timed_out, overflowed, disk_full)


def _directory_bytes(path: str) -> int:
    """Bytes in the regular files directly in path (the sandbox cannot make subdirectories:
    Verilog has no mkdir), counted as allocated blocks so sparse files count what they use."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def _tool_status(sandbox_status: int) -> int:
    """The tool's exit status as subprocess reports it (negative: killed by that signal);
    bwrap passes a tool's death by signal N on as exit status 128 + N, the way shells do."""
    signum = sandbox_status - 128
    if 0 < signum < 65 and signum in signal.valid_signals():
        return -signum
    return sandbox_status


def compile_status(log: str, *, compile_ok: bool) -> tuple[str, str] | None:
    """The analyzer's rules that fail a sample before its verdict line is read.

    Returns:
        (status letter, reason) of the first rule that matches, else None.
    """
    error_line = bind_error = False
    for line in log.splitlines():
        for needle, status in _ANALYZER_RULES:
            if needle in line:
                return status, f"{STATUS_MEANINGS[status]}: {line.strip()[:200]}"
        error_line = error_line or "error" in line
        bind_error = bind_error or "Unable to bind wire/reg" in line
    if bind_error:
        return "p", STATUS_MEANINGS["p"]
    if error_line or not compile_ok:
        first = next((ln.strip() for ln in log.splitlines() if "error" in ln.lower()), "")
        return "C", f"compile error: {first[:200]}".rstrip(": ")
    return None


def _abort_detail(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    telling = [ln for ln in lines if ln.startswith(("FATAL", "ERROR", "Error")) or "Error:" in ln]
    return (telling or lines or [""])[0 if telling else -1][:200]


def classify(
    log: str,
    *,
    compile_ok: bool,
    expected_samples: int | None,
    exit_status: int | None = 0,
    tag: str | None = None,
) -> tuple[str, str, int | None, int | None]:
    """Applies the analyzer's rules, then ours, to a compile + simulation log.

    Args:
        log: the combined log (compile output, simulation output, and "TIMEOUT" if killed).
        compile_ok: iverilog exited with status 0.
        expected_samples: the reference's N; None accepts any N > 0 (the reference run itself).
        exit_status: the simulator's exit status (negative: killed by that signal; None: it
            did not exit by itself, a timeout).
        tag: the tag the testbench's copy prints on its verdict line; lines without it were
            printed by the design. None: the testbench is untagged, every verdict line counts.

    Returns:
        (status letter, reason, mismatches, samples).
    """
    early = compile_status(log, compile_ok=compile_ok)
    if early is not None:
        return early[0], early[1], None, None
    verdicts: list[tuple[int, int]] = []
    forged: list[tuple[int, int]] = []
    for line in log.splitlines():
        match = _MISMATCH_RE.match(line.rstrip("\r"))
        if match:
            counts = (int(match.group(1)), int(match.group(2)))
            own = tag is None or match.group(3) == f" [testbench {tag}]"
            (verdicts if own else forged).append(counts)
    passing = any(m == 0 for m, _ in verdicts + forged)
    after = " after a passing verdict line" if passing else ""
    if exit_status is not None and exit_status < 0:
        name = signal.Signals(-exit_status).name if -exit_status in signal.valid_signals() else ""
        return "A", f"the simulator was killed by signal {-exit_status} {name}{after}", None, None
    if exit_status:
        return (
            "A",
            f"the simulator exited with status {exit_status}{after}: {_abort_detail(log)}",
            None,
            None,
        )
    if tag is not None and not verdicts:
        return (
            "A",
            "the testbench never printed its verdict: the simulation ended before the "
            "testbench's final block (a $finish or $stop in a final block of the design?)"
            + (f"; {len(forged)} verdict line(s) came from the design" if forged else ""),
            None,
            None,
        )
    if forged:
        return "R", f"the design printed {len(forged)} verdict line(s) of its own", None, None
    if len(verdicts) != 1:
        return (
            "R",
            f"the testbench printed {len(verdicts)} Mismatches lines, expected 1",
            None,
            None,
        )
    mismatches, samples = verdicts[0]
    if mismatches:
        return "R", f"{mismatches} mismatches in {samples} samples", mismatches, samples
    if samples <= 0:
        return "R", "the testbench compared 0 samples", mismatches, samples
    if expected_samples is not None and samples != expected_samples:
        return (
            "R",
            f"stopped early: {samples} samples, the reference runs {expected_samples}",
            mismatches,
            samples,
        )
    return ".", "pass", mismatches, samples


def _verdict(
    status: str,
    reason: str,
    started: float,
    expected: int | None,
    log: str = "",
    mismatches: int | None = None,
    samples: int | None = None,
) -> Verdict:
    return Verdict(
        passed=status == ".",
        status=status,
        reason=reason,
        mismatches=mismatches,
        samples=samples,
        expected_samples=expected,
        seconds=round(time.monotonic() - started, 3),
        log_tail=log[-_LOG_TAIL_CHARS:],
    )


def _tagged_testbench(source: str) -> tuple[str, str | None]:
    """The testbench with a fresh random tag on its verdict line, and the tag (None, and the
    source unchanged, when it does not print VERDICT_FORMAT exactly once)."""
    if source.count(VERDICT_FORMAT) != 1:
        return source, None
    tag = secrets.token_hex(8)
    return source.replace(VERDICT_FORMAT, f'{VERDICT_FORMAT[:-1]} [testbench {tag}]"'), tag


def _refusal(workdir: str, limits: Limits) -> tuple[str, str, str] | None:
    """Preprocesses sample.sv, alone in workdir, in the sandbox, the way the compiler will, and
    checks what comes out.

    Returns:
        (status, reason, log) when the sample must not be compiled (T or O when preprocessing
        itself runs away, F for a forbidden construct), else None. The scratch files are removed.
    """
    argv = ["iverilog", "-g2012", "-E", f"-Minclude={_DEPS}", "-o", _PREPROCESSED, "sample.sv"]
    ran = _run(argv, workdir, limits)
    try:
        if ran.timed_out or ran.overflowed:
            status = "T" if ran.timed_out else "O"
            return status, f"preprocessing: {STATUS_MEANINGS[status]}", ran.text
        included = _read_capped(os.path.join(workdir, _DEPS), limits.output_bytes).split()
        missing = _MISSING_INCLUDE_RE.search(ran.text)
        if included or missing:
            name = missing.group(1) if missing else included[0].removeprefix("./")
            return "F", f"refused before compiling: includes {name[:200]}", ran.text
        preprocessed = os.path.join(workdir, _PREPROCESSED)
        size = os.lstat(preprocessed).st_size if os.path.lexists(preprocessed) else 0
        if size > _PREPROCESSED_CAP or (ran.returncode or 0) < 0:  # a macro bomb
            return "O", f"preprocessing ran past the size limits ({size} bytes out)", ran.text
        if ran.returncode != 0:
            return None  # the compile step reports the preprocessor's error the official way
        forbidden = _FORBIDDEN_RE.search(_read_capped(preprocessed, _PREPROCESSED_CAP))
        if forbidden:
            return (
                "F",
                f"refused before compiling: uses {forbidden.group(0)} (after preprocessing)",
                ran.text,
            )
        return None
    finally:
        for name in (_DEPS, _PREPROCESSED):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(workdir, name))


def _read_capped(path: str, cap: int) -> str:
    """Up to cap bytes of a file the sandboxed tool wrote ("" when it wrote none, or wrote
    something other than a regular file there: never followed, never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return handle.read(cap).decode("utf-8", errors="replace")


def _outside_the_design(workdir: str, limits: Limits, full_log: str) -> tuple[str, str, str] | None:
    """Elaborates sample.sv alone (DESIGN_TOP the only root) in the sandbox, after it compiled
    with the testbench with full_log, to learn whether the design reaches outside itself.

    Returns:
        (status, reason, log) when it does (H: it needs the testbench to elaborate, a defparam
        of it lands there, or it drives one of its own input ports; T or O when this
        elaboration itself runs away), else None.
    """
    ran = _run(["iverilog", *_ALONE_FLAGS, "-N", _NETLIST, "sample.sv"], workdir, limits)
    if ran.timed_out or ran.overflowed:
        status = "T" if ran.timed_out else "O"
        return status, f"elaborating the design alone: {STATUS_MEANINGS[status]}", ran.text
    # A defparam whose scope is missing only without the testbench sets one of the testbench's.
    dangling = [
        name
        for name in _DANGLING_DEFPARAM_RE.findall(ran.text)
        if name not in _DANGLING_DEFPARAM_RE.findall(full_log)
    ]
    if ran.returncode == 0 and not dangling:
        netlist = os.path.join(workdir, _NETLIST)
        driven = _driven_inputs(_read_capped(netlist, _PREPROCESSED_CAP))
        with contextlib.suppress(FileNotFoundError):
            os.remove(netlist)  # not counted against the simulation's file budget
        if driven:
            return "H", f"refused: the design drives its own input port {driven[0][:200]}", ran.text
        return None
    return "H", _outside_reason(ran.text, dangling), ran.text


def _driven_inputs(netlist: str) -> list[str]:
    """The input ports of DESIGN_TOP that the design itself writes or drives, from the netlist
    iverilog dumped after elaborating it alone.

    An input port is the testbench's net: iverilog joins it with the net the testbench connects
    (a driven input is coerced to inout), so a design that forces its inputs, drives them or
    shorts them with a tran hands the reference the same altered inputs, and a wrong design
    stuck at the matching output passes. No design of a spec needs to.

    A net is driven by a node pin that is not an input (O), or by a procedural write (lref: a
    force, a release). Tran-like nodes (a tran primitive, or the bidirectional part select
    iverilog puts between a vector and an inout port) join nets into one island through their
    passive pins (p): an input port is driven when anything in its island is, so reading an
    input through an inout port passes, and a supply shorted to it does not.
    """
    top_inputs: dict[str, set[str]] = {}
    written: set[str] = set()  # nexus of every signal a procedural statement writes
    written_inputs: set[str] = set()
    driven: set[str] = set()
    island: dict[str, str] = {}  # nexus -> a nexus of its island (union-find)

    def root(nexus: str) -> str:
        while island.get(nexus, nexus) != nexus:
            nexus = island[nexus]
        return nexus

    section, scope = "", ""
    signal_nexus: set[str] | None = None  # the nexus of the signal being read
    signal_written = False
    node_passive: list[str] = []

    def close_node() -> None:
        for other in node_passive[1:]:
            island[root(other)] = root(node_passive[0])
        node_passive.clear()

    for line in netlist.splitlines():
        if not line.startswith(" "):
            close_node()
            section = line if line.endswith(":") and line.isupper() else section
            scope = line.split(" ", 1)[0] if section == "SCOPES:" else ""
            signal_nexus = None
            continue
        if section == "SCOPES:":
            signal = _NETLIST_SIGNAL_RE.match(line)
            if signal:
                signal_nexus, signal_written = set(), int(signal["lref"]) > 0
                if scope == DESIGN_TOP and signal["port"] == "input":
                    top_inputs[signal["name"]] = signal_nexus
                    if signal_written:
                        written_inputs.add(signal["name"])
                continue
            nexus = _NETLIST_NEXUS_RE.match(line)
            if nexus and signal_nexus is not None:
                signal_nexus.add(nexus.group(1))
                if signal_written:
                    written.add(nexus.group(1))
        elif section == "ELABORATED NODES:":
            pin = _NETLIST_PIN_RE.match(line)
            if pin is None:
                continue
            if pin["kind"] == "p":
                node_passive.append(pin["nexus"])
            elif pin["kind"] != "I":
                driven.add(pin["nexus"])
    close_node()
    driven_islands = {root(nexus) for nexus in driven | written}
    return [
        name
        for name, nexus in top_inputs.items()
        if name in written_inputs or any(root(n) in driven_islands for n in nexus)
    ]


def _outside_reason(alone_log: str, dangling: Sequence[str]) -> str:
    """One line naming what the design reached for: the first hierarchical name iverilog could
    not bind alone, else the defparam's target, else the first error line."""
    errors_alone = [ln.strip() for ln in alone_log.splitlines() if "error" in ln.lower()]
    for line in errors_alone:
        for name in _QUOTED_NAME_RE.findall(line):
            if "." in name:
                return f"refused: hierarchical reference out of the design: {name[:200]}"
    if dangling:
        return f"refused: defparam out of the design: {dangling[0][:200]}"
    first = (errors_alone or ["no error message"])[0][:200]
    return f"refused: the design does not elaborate without the testbench: {first}"


def _simulate(
    code: str,
    test_path: str,
    ref_path: str,
    *,
    expected: int | None,
    limits: Limits,
    work_root: str | None,
    official_code: str | None = None,
) -> Verdict:
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="sample-", dir=work_root)
    tag: str | None = None

    def done(status: str, reason: str, log: str, *counts: int | None) -> Verdict:
        if tag is not None:  # the tag stays secret and the log reads like the official one
            log = log.replace(f" [testbench {tag}]", "")
        return _verdict(status, reason, started, expected, log, *counts)

    try:
        sandbox.current().prepare(workdir)
        with open(os.path.join(workdir, "sample.sv"), "w", encoding="utf-8") as handle:
            handle.write(code)
        refused = _refusal(workdir, limits)
        if refused is not None:
            return done(*refused)
        with open(test_path, encoding="utf-8") as handle:
            testbench, tag = _tagged_testbench(handle.read())
        with open(os.path.join(workdir, "test.sv"), "w", encoding="utf-8") as handle:
            handle.write(testbench)
        shutil.copyfile(ref_path, os.path.join(workdir, "ref.sv"))
        if official_code is not None and official_code != code:
            # What the official flow compiles, dropped modules included: parsed, never run.
            with open(os.path.join(workdir, "official.sv"), "w", encoding="utf-8") as handle:
                handle.write(official_code)
            checked = _run(
                ["iverilog", *IVERILOG_FLAGS, "-t", "null", "official.sv", "test.sv", "ref.sv"],
                workdir,
                limits,
            )
            prefix = "the answer's code as the official flow compiles it (dropped modules too): "
            if checked.timed_out or checked.overflowed:
                status = "T" if checked.timed_out else "O"
                return done(status, prefix + STATUS_MEANINGS[status], checked.text)
            failed = compile_status(checked.text, compile_ok=checked.returncode == 0)
            if failed is not None:
                return done(failed[0], prefix + failed[1], checked.text)
        compiled = _run(
            ["iverilog", *IVERILOG_FLAGS, "-o", "sim", "sample.sv", "test.sv", "ref.sv"],
            workdir,
            limits,
        )
        log = compiled.text
        if compiled.timed_out:
            return done("T", "compilation ran past the timeout", log)
        if compiled.overflowed:
            return done("O", "compiler output over the cap", log)
        compile_ok = compiled.returncode == 0 and os.path.exists(os.path.join(workdir, "sim"))
        exit_status: int | None = None
        if compile_ok and compile_status(log, compile_ok=True) is None:
            # Only a design that would run: one that fails to compile keeps its official letter.
            outside = _outside_the_design(workdir, limits, log)
            if outside is not None:
                return done(outside[0], outside[1], log + outside[2])
        if compile_ok:
            simulated = _run(["vvp", "-n", "sim"], workdir, limits)
            log += simulated.text
            if simulated.disk_full:
                return done(
                    "O", f"the simulation wrote over {limits.directory_bytes} bytes of files", log
                )
            if simulated.overflowed:
                return done("O", f"simulation output over {limits.output_bytes} bytes", log)
            if simulated.timed_out:
                log += "\nTIMEOUT\n"
            exit_status = simulated.returncode
        status, reason, mismatches, samples = classify(
            log, compile_ok=compile_ok, expected_samples=expected, exit_status=exit_status, tag=tag
        )
        return done(status, reason, log, mismatches, samples)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def judge_sample(
    code: str,
    problem: problems.Problem,
    *,
    expected_samples: int | None,
    limits: Limits = Limits(),
    work_root: str | None = None,
    official_code: str | None = None,
) -> Verdict:
    """Compiles and simulates one extracted sample against the problem's testbench.

    Args:
        code: the design to run (extract.Extraction.code).
        problem: the problem (its test and ref files are copied next to the sample).
        expected_samples: the reference's N (see reference_run); None accepts any N > 0.
        limits: time, output, file and memory limits.
        work_root: parent of the per-sample temporary directory (the system default if None).
        official_code: the answer's code as the official flow compiles it
            (extract.Extraction.official_code); when it differs from code it must compile too.

    Returns:
        The verdict; hostile or broken code yields a failing verdict, never an exception.
    """
    started = time.monotonic()
    if not code.strip():
        return _verdict("X", STATUS_MEANINGS["X"], started, expected_samples)
    forbidden = _INCLUDE_RE.search(official_code or "")
    if forbidden:
        return _verdict(
            "F", f"refused before compiling: uses {forbidden.group(0)}", started, expected_samples
        )
    return _simulate(
        code,
        problem.test_path,
        problem.ref_path,
        expected=expected_samples,
        limits=limits,
        work_root=work_root,
        official_code=official_code,
    )


def _reference_as_dut(ref_source: str) -> str:
    """The reference renamed so that it stands in for TopModule next to the original reference."""
    mapping = {name: f"{name}__ref_as_dut" for name in extract.declared_modules(ref_source)}
    mapping["RefModule"] = "TopModule"
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in mapping) + r")\b")
    return pattern.sub(lambda m: mapping[m.group(1)], ref_source)


def reference_run(
    problem: problems.Problem, *, limits: Limits = Limits(), work_root: str | None = None
) -> Reference:
    """Runs the testbench with the reference solution as the DUT to learn its sample count N."""
    with open(problem.ref_path, encoding="utf-8") as handle:
        as_dut = _reference_as_dut(handle.read())
    verdict = _simulate(
        as_dut,
        problem.test_path,
        problem.ref_path,
        expected=None,
        limits=limits,
        work_root=work_root,
    )
    return Reference(verdict.samples if verdict.passed else None, verdict)


def judge_all(
    items: Sequence[problems.Problem],
    codes: Mapping[str, Sequence[extract.Extraction | str | None]],
    *,
    limits: Limits = Limits(),
    workers: int | None = None,
    on_done: Callable[[str, int, Verdict], None] | None = None,
) -> tuple[dict[str, Reference], dict[str, list[Verdict]]]:
    """Judges every sample of every problem in parallel.

    Args:
        items: the problems.
        codes: problem name -> per sample, its extraction (or just the code to run); None
            marks a sample whose request failed (status `E`).
        limits: per-step limits.
        workers: parallel simulations (os.cpu_count() if None).
        on_done: called as (problem name, sample index, verdict) after each sample.

    Returns:
        (problem name -> reference run, problem name -> verdicts in sample order). A problem
        whose reference fails has all its samples failed with the reference's reason.
    """
    workers = max(1, workers or os.cpu_count() or 1)
    work_root = tempfile.mkdtemp(prefix="verilog-judge-")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            ref_futures = {
                p.name: pool.submit(reference_run, p, limits=limits, work_root=work_root)
                for p in items
            }
            references = {name: f.result() for name, f in ref_futures.items()}
            futures: dict[concurrent.futures.Future[Verdict], tuple[str, int]] = {}
            verdicts: dict[str, list[Verdict | None]] = {}
            for p in items:
                sample_codes = codes.get(p.name, ())
                verdicts[p.name] = [None] * len(sample_codes)
                reference = references[p.name]
                for index, code in enumerate(sample_codes):
                    if code is None:
                        verdicts[p.name][index] = Verdict(False, "E", STATUS_MEANINGS["E"])
                    elif reference.samples is None:
                        verdicts[p.name][index] = Verdict(
                            False,
                            reference.verdict.status,
                            f"the reference solution fails: {reference.verdict.reason}",
                        )
                    else:
                        extraction = (
                            code
                            if isinstance(code, extract.Extraction)
                            else extract.Extraction(code, "given", (), code)
                        )
                        future = pool.submit(
                            judge_sample,
                            extraction.code,
                            p,
                            expected_samples=reference.samples,
                            limits=limits,
                            work_root=work_root,
                            official_code=extraction.official_code,
                        )
                        futures[future] = (p.name, index)
            for future in concurrent.futures.as_completed(futures):
                name, index = futures[future]
                verdicts[name][index] = future.result()
                if on_done is not None:
                    on_done(name, index, future.result())
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    return references, {name: [v for v in vs if v is not None] for name, vs in verdicts.items()}
