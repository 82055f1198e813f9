"""The Verilog sandbox holds against hostile designs, whatever the preprocessor does.

Two layers are tested apart. The operating-system sandbox alone (the textual check switched off):
a design that tries to read host files or write outside its directory can do neither, and since
its logic is only right when the escape works, it fails. And the whole judge: preprocessor tricks
(token pasting, `include built by a macro) are refused, runaway designs end promptly with a
clear verdict. Host files used as bait are world-readable and world-writable on purpose, so that
only the mount namespace, not file permissions, keeps the design away from them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from tests.evaluation import verilog_samples as vs
from workloads.common import errors
from workloads.evaluation import judge, problems, sandbox

pytestmark = pytest.mark.skipif(
    shutil.which("iverilog") is None or shutil.which("bwrap") is None,
    reason="needs Icarus Verilog and bubblewrap",
)

FAST = judge.Limits(timeout_s=2, output_bytes=64 * 1024)
HEADER = "module TopModule (input a, input b, input c, output y);\n"
MAJORITY = "((a & b) | (a & c) | (b & c))"


@pytest.fixture(scope="module")
def majority() -> problems.Problem:
    [problem] = problems.load(str(problems.SAMPLE_DIR), only="majority")
    return problem


@pytest.fixture
def bait() -> Iterator[pathlib.Path]:
    """A world-writable directory in /tmp holding a world-readable secret."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-bait-", dir="/tmp"))
    directory.chmod(0o777)
    secret = directory / "secret.txt"
    secret.write_text(secrets.token_hex(16) + "\n")
    secret.chmod(0o644)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def no_textual_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the operating-system sandbox stands between the design and the host."""
    monkeypatch.setattr(judge, "_FORBIDDEN_RE", re.compile(r"(?!)"))


def _only_right_if(condition: str) -> str:
    """Majority logic that is right only when `condition` holds at time 0, else inverted."""
    return f"  reg escaped = 0;\n  assign y = escaped ? {MAJORITY} : ~{MAJORITY};\n"


def _reads(path: str) -> str:
    """A design that passes only if it can open `path` and read a line from it."""
    return (
        HEADER
        + _only_right_if("read")
        + "  integer fd, got;\n  reg [8*200-1:0] line;\n"
        + f'  initial begin\n    fd = $fopen("{path}", "r");\n'
        + "    if (fd != 0) begin got = $fgets(line, fd); escaped = got > 0; "
        + '$display("read: %0s", line); end\n  end\nendmodule\n'
    )


def _writes(path: str) -> str:
    """A design that passes only if it can create `path` and write to it."""
    return (
        HEADER
        + _only_right_if("written")
        + "  integer fd;\n"
        + f'  initial begin\n    fd = $fopen("{path}", "w");\n'
        + '    if (fd != 0) begin $fdisplay(fd, "pwned"); $fclose(fd); escaped = 1; end\n'
        + "  end\nendmodule\n"
    )


def _judge(code: str, problem: problems.Problem, limits: judge.Limits = FAST) -> judge.Verdict:
    started = time.monotonic()
    verdict = judge.judge_sample(code, problem, expected_samples=57, limits=limits)
    # Whatever the design does, the verdict comes within the two steps' timeouts (+ start-up).
    assert time.monotonic() - started < 3 * limits.timeout_s + 3, verdict
    assert not verdict.passed and verdict.status not in (".", ""), verdict
    assert verdict.reason and "\n" not in verdict.reason
    return verdict


def test_the_escape_designs_pass_when_the_escape_works(majority, no_textual_check):
    """The designs below are real attempts: with a file inside its own directory (what the
    sandbox allows) the reading and the writing design both pass."""
    # The testbench's copy sits in the sample directory: reading it is allowed.
    assert judge.judge_sample(_reads("test.sv"), majority, expected_samples=57).passed
    assert judge.judge_sample(_writes("mine.txt"), majority, expected_samples=57).passed


@pytest.mark.parametrize(
    "target",
    ["{bait}/secret.txt", "/etc/passwd", "/etc/hostname", "/proc/self/environ", "../ref.sv"],
)
def test_a_design_cannot_read_host_files(majority, bait, no_textual_check, target):
    path = target.format(bait=bait)
    verdict = _judge(_reads(path), majority)
    assert verdict.status == "R", verdict.reason  # it ran, the read failed, the logic is wrong
    assert (bait / "secret.txt").read_text().strip() not in verdict.log_tail
    assert "root:" not in verdict.log_tail
    assert "read:" not in verdict.log_tail


@pytest.mark.parametrize(
    "target",
    ["{bait}/pwned.txt", "../pwned.txt", "/tmp/sandbox-pwned.txt", "/dev/shm/sandbox-pwned.txt"],
)
def test_a_design_cannot_write_outside_its_directory(
    majority, bait, no_textual_check, tmp_path, monkeypatch, target
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sample directories land here
    path = target.format(bait=bait)
    verdict = _judge(_writes(path), majority)
    assert verdict.status == "R", verdict.reason
    assert sorted(p.name for p in bait.iterdir()) == ["secret.txt"]
    assert list(tmp_path.iterdir()) == []  # no ../pwned.txt next to the sample directory
    for leaked in ("/tmp/sandbox-pwned.txt", "/dev/shm/sandbox-pwned.txt"):
        assert not os.path.exists(leaked)


def test_the_tools_run_as_an_unprivileged_user(tmp_path):
    """What the design writes belongs to uid 65534 (when the judge is root) or to the calling
    user (already unprivileged): never to root."""
    sample = tmp_path / "sample"
    sample.mkdir()
    (sample / "s.sv").write_text(
        'module tb; integer f; initial begin f = $fopen("made.txt", "w"); $fclose(f); end\n'
        "endmodule\n"
    )
    box = sandbox.current()
    box.prepare(str(sample))
    assert judge._run(["iverilog", "-o", "sim", "s.sv"], str(sample), FAST).returncode == 0
    assert judge._run(["vvp", "-n", "sim"], str(sample), FAST).returncode == 0
    owner = (sample / "made.txt").stat().st_uid
    expected = sandbox.SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
    assert owner == expected != 0
    if os.geteuid() == 0:
        assert stat.S_IMODE(sample.stat().st_mode) == 0o700


def test_the_sandbox_sees_only_the_tools(tmp_path):
    """Inside: the tools' own files, /dev/null and the sample; no /etc, /tmp, /proc, /home."""
    box = sandbox.current()
    box.prepare(str(tmp_path))
    script = (
        "for p in /etc /tmp /proc /home /root /dev/shm /work /mnt /sample /dev/null; do "
        'if [ -e "$p" ]; then echo "have $p"; else echo "no $p"; fi; done; '
        "{ echo x > /made; } 2>/dev/null || echo readonly-root"
    )
    out = judge._run(["sh", "-c", script], str(tmp_path), FAST)
    assert out.returncode == 0, out.text
    assert out.text.split("\n")[:-1] == [
        "no /etc",
        "no /tmp",
        "no /proc",
        "no /home",
        "no /root",
        "no /dev/shm",
        "no /work",
        "no /mnt",
        "have /sample",
        "have /dev/null",
        "readonly-root",
    ]
    command = box.command(["vvp", "-n", "sim"], str(tmp_path))
    assert "--clearenv" in command and "--die-with-parent" in command
    assert "--unshare-net" in command or "--unshare-all" in command
    # Read-only binds only, of the tools and their libraries; the sample is the one writable bind.
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--bind"] == [str(tmp_path)]
    sources = [command[i + 1] for i, arg in enumerate(command) if arg == "--ro-bind"]
    assert all(s.startswith(("/usr/", "/lib", "/bin/")) for s in sources), sources


HOSTILE_MACROS = {
    # The original escape: $fopen pasted together by a macro, writing outside the sample.
    "token-pasted $fopen": "`define CAT(a,b) a``b\n"
    + HEADER
    + f"  assign y = {MAJORITY};\n  integer f;\n"
    + '  initial begin f = `CAT($fo,pen)("{bait}/pwned.txt", "w"); '
    + '`CAT($fdis,play)(f, "x"); end\nendmodule\n',
    "token-pasted $readmemh": "`define CAT(a,b) a``b\n"
    + HEADER
    + f"  assign y = {MAJORITY};\n  reg [7:0] m [0:3];\n"
    + '  initial `CAT($readme,mh)("{bait}/secret.txt", m);\nendmodule\n',
    "token-pasted $system": "`define CAT(a,b) a``b\n"
    + HEADER
    + f"  assign y = {MAJORITY};\n"
    + '  initial `CAT($sys,tem)("touch {bait}/pwned.txt");\nendmodule\n',
    "`include built by a macro": '`define INC `include "/etc/passwd"\n`INC\n'
    + HEADER
    + f"  assign y = {MAJORITY};\nendmodule\n",
    "`include of a host file": '`include "{bait}/secret.txt"\n'
    + HEADER
    + f"  assign y = {MAJORITY};\nendmodule\n",
    # ref.sv sits next to the design at compile time: including it would copy the answer.
    "`include of the reference": '`define RefModule Stolen\n`include "ref.sv"\n'
    + HEADER
    + "  Stolen s (.a(a), .b(b), .c(c), .out(y));\nendmodule\n",
    "`include of itself": '`include "sample.sv"\n' + vs.MAJORITY_OK,
    # A verdict line of its own, the word pasted and made a string by macros.
    "verdict string pasted": '`define CAT(a,b) a``b\n`define STR(x) `"x`"\n'
    + HEADER
    + f"  assign y = {MAJORITY};\n"
    + '  initial $display({`STR(`CAT(Mis,matches)), ": 0 in 57 samples"});\nendmodule\n',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_MACROS))
def test_preprocessor_tricks_are_refused(majority, bait, name):
    code = HOSTILE_MACROS[name].replace("{bait}", str(bait))
    verdict = _judge(code, majority)
    assert verdict.status == "F", verdict.reason
    assert verdict.reason.startswith("refused before compiling:")
    assert sorted(p.name for p in bait.iterdir()) == ["secret.txt"]


def test_a_pasted_fopen_is_named_after_preprocessing(majority, bait):
    code = HOSTILE_MACROS["token-pasted $fopen"].replace("{bait}", str(bait))
    verdict = _judge(code, majority)
    assert verdict.reason == "refused before compiling: uses $fopen (after preprocessing)"


def test_includes_are_named(majority):
    verdict = _judge(HOSTILE_MACROS["`include of the reference"], majority)
    assert verdict.reason == "refused before compiling: includes ref.sv"


@pytest.mark.parametrize("name", sorted(HOSTILE_MACROS))
def test_preprocessor_tricks_gain_nothing_without_the_textual_check(
    majority, bait, no_textual_check, name
):
    """Even if the textual check missed one, the design could not touch the host."""
    code = HOSTILE_MACROS[name].replace("{bait}", str(bait))
    verdict = judge.judge_sample(code, majority, expected_samples=57, limits=FAST)
    assert sorted(p.name for p in bait.iterdir()) == ["secret.txt"]
    assert (bait / "secret.txt").read_text().strip() not in verdict.log_tail
    assert "root:x:" not in verdict.log_tail
    if "include" in name:
        assert verdict.status == "F"


RUNAWAY = {
    # Writes a file in its own directory forever: the file-size limit kills the simulator.
    "fills the disk": HEADER
    + f"  assign y = {MAJORITY};\n  integer f;\n"
    + '  initial begin f = $fopen("big.txt", "w"); forever $fdisplay(f, "%0128d", 1); end\n'
    + "endmodule\n",
    # Files under the size limit each, without end: the directory's budget stops it.
    "writes many files": HEADER
    + f"  assign y = {MAJORITY};\n  integer f, i, j;\n  reg [8*16-1:0] name;\n"
    + "  initial for (i = 0; 1; i = i + 1) begin\n"
    + '    $sformat(name, "f%0d.txt", i);\n    f = $fopen(name, "w");\n'
    + '    for (j = 0; j < 4096; j = j + 1) $fdisplay(f, "%0127d", j);\n'
    + "    $fclose(f);\n  end\nendmodule\n",
    # A simulation-time memory bomb: the address-space limit stops it.
    "allocates a huge memory": HEADER
    + f"  assign y = {MAJORITY};\n  reg [31:0] mem [0:(1<<28)-1];\n  integer i;\n"
    + "  initial for (i = 0; i < (1<<28); i = i + 1) mem[i] = i;\nendmodule\n",
    # A compile-time memory bomb: a hundred million instances.
    "elaborates without end": "module leaf (output o);\n  assign o = 1;\nendmodule\n"
    + HEADER
    + f"  assign y = {MAJORITY};\n  wire [99999999:0] w;\n  genvar i;\n"
    + "  generate for (i = 0; i < 100000000; i = i + 1) begin : g\n"
    + "    leaf u (.o(w[i]));\n  end endgenerate\nendmodule\n",
    # Output as fast as the simulator can print.
    "prints without end": vs.HOSTILE["huge_output"],
    "loops at time 0": vs.HOSTILE["infinite_loop"],
    # Macros that double 30 times: 16 GiB of preprocessed text.
    "macro bomb": "`define A0 xxxxxxxxxxxxxxxx\n"
    + "".join(f"`define A{i + 1} `A{i} `A{i}\n" for i in range(30))
    + HEADER
    + "  wire z = `A30;\nendmodule\n",
    # A macro that expands to itself forever, and a file that includes itself.
    "recursive macro": "`define LOOP `LOOP `LOOP\n"
    + HEADER
    + f"  assign y = {MAJORITY};\n  wire z = `LOOP;\nendmodule\n",
}


RUNAWAY_VERDICTS = {
    "fills the disk": ("A", "the simulator was killed by signal 25 SIGXFSZ"),
    "writes many files": ("O", "the simulation wrote over 2097152 bytes of files"),
    "allocates a huge memory": (
        "A",
        "the simulator was killed by signal 6 SIGABRT",
    ),
    "elaborates without end": ("T", "compilation ran past the timeout"),
    "prints without end": ("O", "simulation output over 65536 bytes"),
    "loops at time 0": ("T", "timeout: TIMEOUT"),
    "recursive macro": ("S", "syntax error: sample.sv:4: syntax error"),
    "macro bomb": ("O", "preprocessing ran past the size limits (1048576 bytes out)"),
}


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_designs_end_promptly(majority, tmp_path, monkeypatch, no_textual_check, name):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    limits = judge.Limits(
        timeout_s=2,
        output_bytes=64 * 1024,
        file_bytes=1 << 20,
        memory_bytes=512 << 20,
        directory_bytes=2 << 20,
    )
    verdict = _judge(RUNAWAY[name], majority, limits)
    if name == "elaborates without end" and verdict.status == "C":
        # On a quiet machine iverilog reaches the address-space limit before the timeout and
        # reports it as a compile error: a failed sample either way, and a prompt one.
        assert verdict.reason == "compile error"
    else:
        assert (verdict.status, verdict.reason) == RUNAWAY_VERDICTS[name]
    assert len(verdict.log_tail) <= 2000
    assert list(tmp_path.iterdir()) == []  # the sample directory, big.txt included, is gone


def test_without_bwrap_nothing_runs(majority, monkeypatch, tmp_path):
    """No silent fallback: without the sandbox the judge refuses, in one line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("iverilog", "vvp", "setpriv", "ldd"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    sandbox.current.cache_clear()
    sandbox.require.cache_clear()
    try:
        with pytest.raises(errors.UserError) as caught:
            judge.require_tools()
        message = str(caught.value)
        assert message.startswith("bwrap not found on PATH")
        assert message.endswith("apt-get install bubblewrap") and "\n" not in message
        with pytest.raises(errors.UserError, match="bwrap not found"):
            judge.judge_sample(vs.MAJORITY_OK, majority, expected_samples=57, limits=FAST)
    finally:
        sandbox.current.cache_clear()
        sandbox.require.cache_clear()


def test_a_sandbox_that_cannot_start_is_refused(monkeypatch, tmp_path):
    """bwrap present but namespaces not allowed (a locked-down container): one line, no run."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    real = sandbox.current()
    sandbox.require.cache_clear()
    monkeypatch.setattr(sandbox, "current", lambda: real.__class__(str(fake), *_rest(real)))
    try:
        with pytest.raises(errors.UserError) as caught:
            sandbox.require()
        assert "No permissions to creating new namespace" in str(caught.value)
        assert "\n" not in str(caught.value)
    finally:
        sandbox.require.cache_clear()


def _rest(box: sandbox.Sandbox) -> tuple[object, ...]:
    return (box.read_only, box.drop_privileges)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_the_unprivileged_path_holds_too(bait):
    """What the eval unit does on the VM (a dynamic, unprivileged user): bwrap makes a user
    namespace itself. Run here as uid 4321: the design reads and writes only its directory."""
    box = dataclasses.replace(sandbox.current(), drop_privileges=())
    sample = bait / "sample"  # in /tmp, where uid 4321 can reach it
    sample.mkdir()
    os.chown(sample, 4321, 4321)
    (sample / "s.sv").write_text(
        "module tb; integer r, w, m; reg [8*64-1:0] line;\n"
        '  initial begin r = $fopen("/etc/passwd", "r"); '
        f'w = $fopen("{bait}/pwned.txt", "w"); m = $fopen("mine.txt", "w");\n'
        '    $display("read=%0d write=%0d mine=%0d", r != 0, w != 0, m != 0); end\nendmodule\n'
    )
    become = ["setpriv", "--reuid=4321", "--regid=4321", "--clear-groups", "--"]
    env = {"PATH": "/usr/bin:/bin"}
    for argv in (["iverilog", "-o", "sim", "s.sv"], ["vvp", "-n", "sim"]):
        ran = subprocess.run(
            become + box.command(argv, str(sample)),
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=30,
        )
        assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "read=0 write=0 mine=1"
    assert (sample / "mine.txt").stat().st_uid == 4321
    assert sorted(p.name for p in bait.iterdir()) == ["sample", "secret.txt"]
