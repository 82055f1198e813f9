"""The official flow's judging, replayed for tests: verilog-eval's compile and run commands on
the code its extraction keeps (extract.Extraction.official_code), then its analyzer's letters.

Only for code the tests wrote: nothing is sandboxed here but the directory and a timeout.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

from workloads.evaluation import judge, problems

_PASSING = re.compile(r"^Mismatches: 0 in \d+ samples$", re.MULTILINE)


def status(official_code: str, problem: problems.Problem, workdir: pathlib.Path) -> str:
    """The analyzer's letter for one sample: `iverilog ... sample.sv test.sv ref.sv`, then the
    compiled program run as is (`./sim`: vvp without -n), a TIMEOUT line if it runs past 10 s.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "sample.sv").write_text(official_code)
    shutil.copyfile(problem.test_path, workdir / "test.sv")
    shutil.copyfile(problem.ref_path, workdir / "ref.sv")
    compiled = subprocess.run(
        ["iverilog", *judge.IVERILOG_FLAGS, "-o", "sim", "sample.sv", "test.sv", "ref.sv"],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=False,
    )
    log = compiled.stdout + compiled.stderr
    if (workdir / "sim").exists():
        try:
            ran = subprocess.run(
                ["vvp", "sim"],
                cwd=workdir,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=10,
                check=False,
            )
            log += ran.stdout + ran.stderr
        except subprocess.TimeoutExpired:
            log += "\nTIMEOUT\n"
    # The analyzer passes a sample on any `Mismatches: 0` line, whatever the exit status.
    failed = judge.compile_status(log, compile_ok=True)
    if failed is not None:
        return failed[0]
    return "." if _PASSING.search(log) else "R"
