"""Records how long each test file takes, for the order in which CI's pytest workers take them
(tests/scheduling.py: the heaviest first).

    .venv/bin/python -m pytest -n logical --durations=0 ... | tee default.log
    .venv/bin/python benchmarks/record_test_durations.py --note "2026-11-30, 2-core VM" \\
        default.log slow.log ...

Reads pytest's `--durations` lines ("12.34s call     tests/a/test_b.py::test_c") from each log,
adds up setup, call and teardown per file over all of them (a file whose tests are split between
the default and the slow runs gets both), and writes tests/durations.json: every file that took
at least --min seconds, rounded to whole seconds, with the note saying when and where. Files
below the bound are left out: they weigh nothing, and go last, as before. Prints the table's
heaviest files.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import scheduling  # noqa: E402  (the table's path and the node id's file)

LINE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)s\s+(?:setup|call|teardown)\s+(\S+)\s*$")


def file_seconds(logs: list[pathlib.Path]) -> dict[str, float]:
    """Seconds per test file over the `--durations` lines of `logs`."""
    totals: collections.Counter[str] = collections.Counter()
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            match = LINE.match(line)
            if match:
                totals[scheduling.file_of(match.group(2))] += float(match.group(1))
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "logs", nargs="+", type=pathlib.Path, help="pytest output with --durations=0"
    )
    parser.add_argument("--note", required=True, help="when, at which commit, on which machine")
    parser.add_argument("--min", type=float, default=5.0, help="leave out files under this (s)")
    parser.add_argument("--out", type=pathlib.Path, default=scheduling.DURATIONS)
    args = parser.parse_args(argv)
    seconds = file_seconds(args.logs)
    if not seconds:
        print(f"no --durations lines in {', '.join(map(str, args.logs))}", file=sys.stderr)
        return 1
    kept = {
        name: round(s)
        for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])
        if s >= args.min
    }
    table = {"note": args.note, "seconds": kept}
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"{args.out}: {len(kept)} files of {len(seconds)} (>= {args.min:g} s)")
    for name, s in list(kept.items())[:10]:
        print(f"  {s:6d} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
