"""Loads a verilog-eval `dataset_spec-to-rtl` directory (local or gs://).

The official layout is flat: for every problem `ProbNNN_name` there are three files,
`ProbNNN_name_prompt.txt` (the natural-language spec, which names `module TopModule` and its
ports), `ProbNNN_name_test.sv` (a testbench `module tb` that instantiates `RefModule` and
`TopModule` and prints `Mismatches: M in N samples` from a `final` block) and
`ProbNNN_name_ref.sv` (the reference solution, `module RefModule`). Other files are ignored.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile

from workloads.common import errors, storage

_PROMPT_RE = re.compile(r"^(Prob(\d+)_\w+)_prompt\.txt$")

# Three problems in this layout shipped with the package (written for this project: a majority
# gate, a counter, a delay line), for the demo's evaluation and the tests.
SAMPLE_DIR = (
    pathlib.Path(__file__).resolve().parents[1]
    / "assets"
    / "verilog-eval-sample"
    / ("dataset_spec-to-rtl")
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One spec-to-rtl problem, with its testbench and reference on the local disk.

    Attributes:
        name: `ProbNNN_name`, the key in every result file.
        number: NNN.
        prompt: the spec text exactly as the prompt file holds it.
        test_path: local path of `<name>_test.sv`.
        ref_path: local path of `<name>_ref.sv`.
    """

    name: str
    number: int
    prompt: str
    test_path: str
    ref_path: str


def load(
    directory: str,
    *,
    stage_dir: str | None = None,
    only: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Reads every problem of a dataset directory, sorted by problem number.

    Args:
        directory: a local directory or a gs:// prefix in the official flat layout.
        stage_dir: where a gs:// directory is copied to (a new temporary directory if None);
            simulation needs local files.
        only: a regular expression; keep only problems whose name it finds (re.search).
        limit: keep only the first N problems (after `only`), for smoke runs.

    Returns:
        The problems.

    Raises:
        errors.UserError: the directory is missing or empty, a prompt has no testbench or
            reference, or `only` is not a valid regular expression.
    """
    if storage.is_remote(directory):
        local = storage.stage_directory(
            directory, stage_dir or tempfile.mkdtemp(prefix="verilog-eval-problems-")
        )
    else:
        local = directory
    names = set(storage.list_files(local))
    try:
        pattern = re.compile(only) if only else None
    except re.error as exc:
        raise errors.UserError(
            f"--only {only!r} is not a valid regular expression: {exc}"
        ) from None

    problems: list[Problem] = []
    incomplete: list[str] = []
    for file_name in sorted(names):
        match = _PROMPT_RE.match(file_name)
        if not match:
            continue
        name = match.group(1)
        if pattern is not None and not pattern.search(name):
            continue
        test, ref = f"{name}_test.sv", f"{name}_ref.sv"
        missing = [f for f in (test, ref) if f not in names]
        if missing:
            incomplete.append(f"{name} (missing {', '.join(missing)})")
            continue
        root = pathlib.Path(local)
        problems.append(
            Problem(
                name=name,
                number=int(match.group(2)),
                prompt=(root / file_name).read_text(encoding="utf-8"),
                test_path=str(root / test),
                ref_path=str(root / ref),
            )
        )
    if incomplete:
        raise errors.UserError(f"{directory}: incomplete problems: {'; '.join(incomplete)}")
    if not problems:
        what = f" matching {only!r}" if only else ""
        raise errors.UserError(
            f"{directory}: no ProbNNN_<name>_prompt.txt problems{what} (expected a verilog-eval "
            "dataset_spec-to-rtl directory)"
        )
    problems.sort(key=lambda p: (p.number, p.name))
    return problems[:limit] if limit is not None else problems
