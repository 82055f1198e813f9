"""The workers' order of test files (tests/scheduling.py) and its table
(benchmarks/record_test_durations.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from tests import scheduling


@dataclasses.dataclass
class Item:
    nodeid: str


def ids(items):
    return [item.nodeid for item in items]


def test_the_heaviest_files_go_first_each_whole_and_in_its_own_order():
    items = [
        Item("tests/a.py::t1"),
        Item("tests/a.py::t2"),
        Item("tests/b.py::t1[x]"),
        Item("tests/c.py::t1"),
        Item("tests/b.py::t2"),  # a file's tests need not be adjacent in the collection
        Item("tests/d.py::t1"),
    ]
    seconds = {"tests/c.py": 200.0, "tests/b.py": 90.0, "tests/gone.py": 500.0}

    ordered = scheduling.heaviest_files_first(items, seconds)

    assert ids(ordered) == [
        "tests/c.py::t1",
        "tests/b.py::t1[x]",
        "tests/b.py::t2",
        # unrecorded files weigh nothing: after the weighed ones, in collection order
        "tests/a.py::t1",
        "tests/a.py::t2",
        "tests/d.py::t1",
    ]


def test_without_a_table_the_order_is_the_collections(tmp_path):
    items = [Item("tests/b.py::t"), Item("tests/a.py::t")]
    seconds = scheduling.load(tmp_path / "missing.json")
    assert seconds == {}
    assert ids(scheduling.heaviest_files_first(items, seconds)) == ids(items)


def test_the_committed_table_names_existing_files_only():
    seconds = scheduling.load()
    assert seconds, "tests/durations.json is empty"
    root = scheduling.DURATIONS.parent.parent
    missing = [name for name in seconds if not (root / name).is_file()]
    assert not missing, f"tests/durations.json names files that are gone: {missing}"


def test_the_recorder_adds_up_each_files_phases_over_all_logs(tmp_path):
    default = tmp_path / "default.log"
    default.write_text(
        "============ slowest durations ============\n"
        "30.50s call     tests/x/test_a.py::test_one[p]\n"
        "4.00s setup    tests/x/test_a.py::test_one[p]\n"
        "2.00s call     tests/x/test_b.py::test_two\n"
        "(3 durations < 0.005s hidden.  Use -vv to show these durations.)\n"
    )
    slow = tmp_path / "slow.log"
    slow.write_text("100.00s call     tests/x/test_a.py::test_slow\n")
    out = tmp_path / "durations.json"

    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/record_test_durations.py",
            "--note",
            "a test",
            "--out",
            str(out),
            str(default),
            str(slow),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=scheduling.DURATIONS.parent.parent,
    )

    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())
    # 134.5 s for test_a; test_b's 2 s is under the 5 s bound and left out
    assert table == {"note": "a test", "seconds": {"tests/x/test_a.py": 134}}
