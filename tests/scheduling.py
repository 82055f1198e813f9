"""The order in which pytest-xdist hands test files to its workers: the heaviest first.

With `--dist loadfile` each file runs whole in one worker, and a worker takes the next file in
the queue when it is nearly done with its own. xdist's default queue puts the files with the
most tests first, which says nothing of their time: a file of one 3-minute test could start
last, and the step then waits minutes for one worker while the others idle (2026-11-30: the
waiting slow tests' three workers ran 416, 287 and 352 s of tests, the step 430 s). Longest
first (the LPT rule) ends the workers close together.

The weights are the seconds each file took (setup, call and teardown of its tests) in a run
with `--durations=0`, kept in tests/durations.json by `benchmarks/record_test_durations.py`.
A file not in the table weighs nothing and goes after the weighed ones, in collection order.

The order applies with `--no-loadscope-reorder` only (tests/conftest.py), which also makes
xdist keep it; .ci/run passes it to the waiting slow tests: a few files of one to three long
tests each, where it paid (that step 484 s against 548 s). Other runs keep xdist's own order
(the files with most tests first): in the default suite, with the heaviest files first, the
CPU-heavy ones (the deviceless 31B compile, the reference run, the kernel checks) all ran at
once beside the rehearsal's VM boots, and the suite took 879 s against 793-827 s.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

DURATIONS = pathlib.Path(__file__).resolve().parent / "durations.json"


class Item(Protocol):
    nodeid: str


T = TypeVar("T", bound=Item)


def file_of(nodeid: str) -> str:
    """The test file of a pytest node id ("tests/a/test_b.py::test_c[x]" -> "tests/a/test_b.py")."""
    return nodeid.split("::", 1)[0]


def load(path: pathlib.Path = DURATIONS) -> dict[str, float]:
    """The recorded seconds per test file; empty if the table is missing."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in table["seconds"].items()}


def heaviest_files_first(items: Sequence[T], seconds: Mapping[str, float]) -> list[T]:
    """`items` with their files ordered by recorded seconds, most first; a file's tests stay
    together and in their order, and files of equal weight (unrecorded: 0) keep theirs."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(file_of(item.nodeid), len(first_seen))

    def key(indexed: tuple[int, T]) -> tuple[float, int, int]:
        index, item = indexed
        name = file_of(item.nodeid)
        return (-seconds.get(name, 0.0), first_seen[name], index)

    return [item for _, item in sorted(enumerate(items), key=key)]
