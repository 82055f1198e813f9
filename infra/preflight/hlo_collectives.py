"""The collectives of a compiled XLA program and the bytes they move, read from its HLO text.

XLA's cost analysis prices collectives inside its step-time estimate but reports no figure for
them, and how far they overlap with compute is what a real TPU run decides. This module reads
the optimised HLO (`compiled.as_text()`) and counts every all-gather, all-reduce,
reduce-scatter, all-to-all and collective-permute per execution of the program: a collective
inside a loop body counts once per trip (XLA's `known_trip_count`, else the bound of the loop's
`counter < N` condition, which is how JAX's scans compile on TPU), unlike XLA's own cost
analysis, which counts a loop body once. Async pairs count once (the `-start`; the `-done` moves
nothing).

Two figures per collective, per device:
- buffer bytes: the largest buffer on its line (the gathered output of an all-gather, the input
  of a reduce-scatter, the reduced array of an all-reduce);
- ring bytes: what a ring algorithm sends per device for that buffer over a group of n devices:
  (n-1)/n of it for an all-gather, reduce-scatter or all-to-all, 2(n-1)/n for an all-reduce
  (reduce-scatter then all-gather), all of it for a collective-permute. Interconnects and
  XLA's algorithms differ; it is a yardstick, not a measurement.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
# `%name = <shape> <opcode>(` with an optional `%`; the opcode is the last word before `(`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][\w\-]*)\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_WHILE_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_SCALAR_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\][^ ]*\s+constant\((\d+)\)")
_COMPARE_OPERANDS = re.compile(r"compare\([^%)]*%?([\w.\-]+),\s*[^%)]*%?([\w.\-]+)\)")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
# Newer XLA names the mesh and the axes a collective runs over:
# replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")


@dataclasses.dataclass
class Collectives:
    """Per device, per execution of the program: counts and bytes by kind of collective."""

    count: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    buffer_bytes: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    ring_bytes: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    # Loops whose trips neither XLA nor their condition gives: their bodies are counted once.
    unknown_trip_counts: int = 0

    @property
    def total_buffer_bytes(self) -> float:
        return sum(self.buffer_bytes.values())

    @property
    def total_ring_bytes(self) -> float:
        return sum(self.ring_bytes.values())


def _kind(opcode: str) -> str | None:
    if opcode.endswith("-done"):
        return None
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _largest_buffer(line: str) -> float:
    sizes = [0.0]
    for dtype, dims in _SHAPE.findall(line):
        elements = 1
        for d in dims.split(","):
            if d:
                elements *= int(d)
        sizes.append(float(elements * _BYTES[dtype]))
    return max(sizes)


def _group_size(line: str, devices: int) -> int:
    named = _GROUPS_MESH.search(line)
    if named:
        sizes = {name: int(n) for name, n in _MESH_AXIS.findall(named.group(1))}
        size = 1
        for axis in re.findall(r"'([^']+)'", named.group(2)):
            size *= sizes.get(axis, 1)
        return size
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    listed = _GROUPS_LIST.search(line)
    if listed and listed.group(1):
        return len(listed.group(1).split(","))
    return devices  # no replica_groups: every device of the program


def _ring_share(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    return (n - 1) / n


def count(hlo_text: str, *, devices: int) -> Collectives:
    """The collectives of one execution of the HLO module in `hlo_text` (optimised HLO).

    Args:
        devices: devices of the program (the group size when a collective names no groups).
    """
    # Pass 1: each computation's collectives, the computations it calls, and what bounds a loop.
    own: dict[str, list[tuple[str, float, float, str | None]]] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    constants: dict[str, dict[str, int]] = defaultdict(dict)
    limits: dict[str, int] = {}  # condition computation -> N of its `counter < N`
    loops: list[tuple[str, str, str | None, int | None]] = []  # (caller, body, condition, trips)
    entry = None
    current = None
    for line in hlo_text.splitlines():
        # Computations start at the line's first column; their instructions are indented.
        header = _HEADER.match(line) if line[:1] not in ("", " ", "\t") else None
        if header:
            current = header.group(2)
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            continue
        opcode = instruction.group(2)
        kind = _kind(opcode)
        if kind is not None:
            size = _largest_buffer(line)
            share = _ring_share(kind, _group_size(line, devices))
            channel = _CHANNEL.search(line)
            own[current].append((kind, size, size * share, channel.group(1) if channel else None))
        if opcode == "constant":
            scalar = _SCALAR_CONSTANT.match(line)
            if scalar:
                constants[current][scalar.group(1)] = int(scalar.group(2))
        if opcode == "compare" and "direction=LT" in line:
            operands = _COMPARE_OPERANDS.search(line)
            if operands and operands.group(2) in constants[current]:
                limits[current] = constants[current][operands.group(2)]
        if opcode == "while":
            body_of = _WHILE_BODY.search(line)
            condition_of = _WHILE_CONDITION.search(line)
            known = _TRIP_COUNT.search(line)
            if body_of:
                loops.append(
                    (
                        current,
                        body_of.group(1),
                        condition_of.group(1) if condition_of else None,
                        int(known.group(1)) if known else None,
                    )
                )
            continue
        callees = _CALLEES.findall(line)
        branches = _BRANCHES.search(line)
        if branches:
            callees += [c.strip().lstrip("%") for c in branches.group(1).split(",") if c.strip()]
        for callee in callees:
            calls[current].append((callee, 1))
    loop_bodies = {body for _, body, _, _ in loops}
    # A loop's trips: XLA's known_trip_count, else the bound of its condition (JAX's loops
    # count from 0 in steps of 1), else once, and said.
    unknown = 0
    for caller, body, condition, known_trips in loops:
        trips = known_trips
        if trips is None and condition is not None:
            trips = limits.get(condition)
        if trips is None:
            unknown += 1
            trips = 1
        calls[caller].append((body, trips))
    result = Collectives(unknown_trip_counts=unknown)
    if entry is None:
        return result

    # Pass 2: walk from the entry computation, multiplying by loop trip counts on the way. One
    # collective can appear in several computations: an async collective fusion (libtpu's
    # overlap flags) splits it into a start and continuation fusions that each hold a copy with
    # the same channel id, all called from one computation; within one loop body (or the entry)
    # a channel id counts once.
    def visit(name: str, times: int, depth: int, seen: set[str]) -> None:
        if depth > 64:  # HLO has no recursion; a guard against a misparse
            return
        for kind, size, ring, channel in own.get(name, ()):
            if channel is not None:
                if channel in seen:
                    continue
                seen.add(channel)
            result.count[kind] += times
            result.buffer_bytes[kind] += size * times
            result.ring_bytes[kind] += ring * times
        for callee, trips in calls.get(name, ()):
            scope = set() if callee in loop_bodies else seen
            visit(callee, times * trips, depth + 1, scope)

    visit(entry, 1, 0, set())
    return result
