"""Bytes a compiled program moves through device memory, read from its optimized HLO text.

XLA's own cost analysis is empty for a program compiled for a described GPU (no GPU attached),
so this walk counts what every kernel of the program reads and writes, once each: the
operands and results of each top-level instruction (a fusion, a custom call such as cuDNN's
attention, a copy, a collective), a `while` body times its known trip count, the costlier
branch of a `conditional`. Inside a fusion it sees what XLA:GPU does in place: an operand
only sliced (`dynamic-slice`) counts the slices, a buffer updated in place
(`dynamic-update-slice` at the root) counts the update, not the whole buffer. What it cannot
see: a kernel that reads an operand twice, caches, and a loop whose trip count XLA did not
record (counted once; `Traffic.unknown_loops` says how many). It is a measure to compare two
programs of the same model and shapes, e.g. lclm's step against the plain one
(bench/compile_speed.py), not a roofline.
"""

from __future__ import annotations

import dataclasses
import math
import re

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
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
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# no kernel runs for these: views, tuples, control flow (its bodies are walked instead)
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (`f32[8,128]{1,0}`, or a tuple of them: their sum); float8
    types count one byte each."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    inside: str  # the text between the opcode's parentheses (a parameter's number)
    attributes: str
    root: bool


def _split_operands(rest: str) -> tuple[str, str]:
    """(the text inside an opcode's parentheses, the attributes after them) of the text
    after its `(`."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return rest[:i], rest[i + 1 :]
            depth -= 1
    return rest, ""


def parse(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """(computation name -> its instructions in order, the entry computation's name)."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = computations.setdefault(head.group(1), [])
            if line.startswith("ENTRY"):
                entry = head.group(1)
            continue
        if line.startswith("}"):
            current = None
            continue
        found = _INSTRUCTION.match(line) if current is not None else None
        if found and current is not None:
            root, name, shape, opcode, rest = found.groups()
            inside, attributes = _split_operands(rest)
            operands = re.findall(r"%([\w.\-]+)", inside)
            current.append(
                _Instruction(name, shape, opcode, operands, inside, attributes, bool(root))
            )
    return computations, entry


@dataclasses.dataclass
class Traffic:
    """Bytes moved by one execution of a program, and what the count could not see."""

    bytes: int
    unknown_loops: int  # `while` loops without a known trip count, counted as one trip


class _Walk:
    def __init__(self, text: str):
        self.computations, self.entry = parse(text)
        self.shapes = {i.name: i.shape for body in self.computations.values() for i in body}
        self.unknown_loops = 0
        self._cost: dict[str, int] = {}

    def cost(self, computation: str) -> int:
        if computation not in self._cost:
            self._cost[computation] = sum(
                self.instruction(i) for i in self.computations.get(computation, [])
            )
        return self._cost[computation]

    def _called(self, attributes: str, key: str) -> list[str]:
        found = re.search(rf"{key}=\{{([^}}]*)\}}", attributes) or re.search(
            rf"{key}=%?([\w.\-]+)", attributes
        )
        return re.findall(r"%?([\w.\-]+)", found.group(1)) if found else []

    def instruction(self, i: _Instruction) -> int:
        if i.opcode in _FREE or i.opcode.endswith("-done"):
            return 0
        if i.opcode == "while":
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attributes)
            if trips is None:
                self.unknown_loops += 1
            body = self._called(i.attributes, "body") + self._called(i.attributes, "condition")
            return int(trips.group(1) if trips else 1) * sum(self.cost(c) for c in body)
        if i.opcode == "conditional":
            branches = self._called(i.attributes, "branch_computations") or (
                self._called(i.attributes, "true_computation")
                + self._called(i.attributes, "false_computation")
            )
            return max((self.cost(b) for b in branches), default=0)
        if i.opcode == "call":
            return sum(self.cost(c) for c in self._called(i.attributes, "to_apply"))
        operands = [shape_bytes(self.shapes.get(o, "")) for o in i.operands]
        if i.opcode in ("fusion", "fusion-start"):  # the latter: an asynchronous one
            called = self._called(i.attributes, "calls")
            if called:
                return _fusion_bytes(self.computations.get(called[0], []), operands, i.shape)
        if i.opcode == "dynamic-update-slice":  # in place: the update is read and written
            return 2 * operands[1] + sum(operands[2:])
        if i.opcode == "dynamic-slice":
            return 2 * shape_bytes(i.shape) + sum(operands[1:])
        if i.opcode.endswith("-start"):  # its result also holds its operands: count them twice
            return 2 * sum(operands)
        return sum(operands) + shape_bytes(i.shape)


def _fusion_bytes(body: list[_Instruction], operands: list[int], result: str) -> int:
    """Bytes a fusion reads and writes: each operand whole, or the slices taken of it, or
    nothing for a buffer it updates in place; its result whole, or the updates written."""
    by_name = {i.name: i for i in body}

    def origin(name: str) -> str:  # through views, to what a name is a view of
        while name in by_name and by_name[name].opcode == "bitcast":
            name = by_name[name].operands[0]
        return name

    root = next((i for i in body if i.root), None)
    if root is None:
        return sum(operands) + shape_bytes(result)
    outputs = (
        [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else [root]
    )
    in_place, written = set(), 0
    for out in outputs:
        out = by_name.get(origin(out.name), out)
        if out.opcode == "dynamic-update-slice":
            in_place.add(origin(out.operands[0]))
            written += (
                shape_bytes(by_name[out.operands[1]].shape) if out.operands[1] in by_name else 0
            )
        else:
            written += shape_bytes(out.shape)
    uses: dict[str, list[_Instruction]] = {}
    for i in body:
        if i.opcode == "bitcast":
            continue
        for o in i.operands:
            uses.setdefault(origin(o), []).append(i)
    read = 0
    for p in (i for i in body if i.opcode == "parameter"):
        number = int(p.inside)
        whole = operands[number] if number < len(operands) else shape_bytes(p.shape)
        users = uses.get(p.name, [])
        if p.name in in_place and all(u.opcode == "dynamic-update-slice" for u in users):
            continue
        if users and all(
            u.opcode == "dynamic-slice" and origin(u.operands[0]) == p.name for u in users
        ):
            read += sum(shape_bytes(u.shape) for u in users)
        else:
            read += whole
    return read + written


def traffic(text: str) -> Traffic:
    """The bytes one execution of the compiled program `text` (`compiled.as_text()`) moves."""
    walk = _Walk(text)
    return Traffic(walk.cost(walk.entry), walk.unknown_loops)
