"""What a compiled program does, read off its module's text: matmul FLOPs per device, each
loop counted as many times as it runs (`program_flops`), and the bytes its collectives move
(`collective_bytes`).

XLA's `cost_analysis()` counts a while loop's body once, so a scanned layer stack of 80 layers
reads as one layer. This reads the compiled module's text instead: the FLOPs of every `dot`
and `convolution` (TPU programs express matmuls as convolutions), computation by computation,
a fusion or call counted where it is called, and a while loop's body times its trip count.
The trip count is XLA's own (`known_trip_count` in the loop's backend config) or, where the
loop's condition compares its counter against one integer constant (`i < N`, as a scan's does),
the counter's steps from its start to that constant (a windowed einsum's unrolled body steps by
2); a loop bounded by a runtime value (a decode loop that stops when every row is
done) has none and is counted once, and `Flops.unbounded_loops` says how many such loops
there are. A conditional counts its largest branch. Custom calls (Pallas kernels: attention)
are not counted: their FLOPs are unknown to XLA too.
"""

from __future__ import annotations

import dataclasses
import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[^\s(]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>.+?) (?P<op>[a-z][a-z0-9-]*)\((?P<args>[^)]*)\)"
    r"(?P<attrs>.*)$")
_ARRAY = re.compile(r"^[a-z0-9]+\[(?P<dims>[0-9,]*)\]")
_CALLED = re.compile(r"\b(?:calls|to_apply)=%([^\s,}]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%([^\s,]+)|"
                       r"false_computation=%([^\s,]+))")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Flops:
    """A program's matmul FLOPs per device, and the loops whose trip count is unknown (each
    counted once)."""

    flops: float
    unbounded_loops: int


@dataclasses.dataclass
class _Instruction:
    name: str
    dims: tuple[int, ...] | None  # None: a tuple or token
    type_text: str
    op: str
    args: tuple[str, ...]  # operand names
    literal: str  # the text between the parentheses (a constant's value)
    attrs: str


def _dims(type_text: str) -> tuple[int, ...] | None:
    found = _ARRAY.match(type_text)
    if found is None:
        return None
    return tuple(int(d) for d in found.group("dims").split(",") if d)


def parse(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """The module's computations by name (instructions in order) and the entry's name."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if (head := _COMPUTATION.match(line)) is not None:
            current = computations.setdefault(head.group("name"), [])
            entry = head.group("name") if line.startswith("ENTRY") else entry
        elif line.rstrip() == "}":  # (a custom call's config may span lines starting "}}")
            current = None
        elif current is not None and (found := _INSTRUCTION.match(line)) is not None:
            operands = re.sub(r"/\*.*?\*/", "", found.group("args")).split(",")
            args = tuple(a.strip().lstrip("%") for a in operands if a.strip().startswith("%"))
            current.append(_Instruction(found.group("name"), _dims(found.group("type")),
                                        found.group("type"),
                                        found.group("op"), args, found.group("args"),
                                        found.group("attrs")))
    return computations, entry


def _index_list(attrs: str, key: str) -> tuple[int, ...]:
    found = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return tuple(int(i) for i in found.group(1).split(",") if i) if found else ()


def _matmul_flops(ins: _Instruction, shapes: dict[str, tuple[int, ...] | None]) -> float:
    """2 × output elements × contracted elements of a dot or convolution."""
    out = math.prod(ins.dims or ())
    if ins.op == "dot":
        lhs = shapes.get(ins.args[0]) or ()
        return 2.0 * out * math.prod(lhs[i] for i in _index_list(ins.attrs, "lhs_contracting_dims"))
    labels = re.search(r"dim_labels=(\w+)_(\w+)->", ins.attrs)
    lhs, rhs = shapes.get(ins.args[0]) or (), shapes.get(ins.args[1]) or ()
    if labels is None or (len(labels.group(1)), len(labels.group(2))) != (len(lhs), len(rhs)):
        return 0.0
    # Each output element sums over the kernel's input features ("i") and over the taps of
    # its window (the digit-labelled spatial dims) that land on input: XLA:TPU writes a
    # batched matmul as a convolution whose window runs over a batch-like dim of size 1 (the
    # rest is padding), or over a batch dim dilated by the window's own size (`lhs_dilate`:
    # one tap of each window hits an element), so a window dim counts at most the input's
    # size along it, and of a dilated input one tap in `lhs_dilate`.
    lhs_size = dict(zip(labels.group(1), lhs))
    dilation = re.search(r"lhs_dilate=([0-9x]+)", ins.attrs)
    dilate = [int(d) for d in dilation.group(1).split("x")] if dilation else []

    def taps(label: str, size: int) -> int:
        if label == "i":
            return size
        spread = dilate[int(label)] if int(label) < len(dilate) else 1
        return min(-(-size // spread), lhs_size.get(label, size))

    contracted = math.prod(taps(label, size)
                           for label, size in zip(labels.group(2), rhs) if label != "o")
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    return 2.0 * out * contracted / (int(groups.group(1)) if groups else 1)


def _element(ins: _Instruction) -> int | None:
    """The tuple index a get-tuple-element reads."""
    found = re.search(r"\bindex=(\d+)", ins.attrs)
    return int(found.group(1)) if ins.op == "get-tuple-element" and found else None


def _integer(ins: _Instruction | None) -> int | None:
    """An integer scalar constant's value."""
    if ins is None or ins.op != "constant" or ins.dims != ():
        return None
    return int(ins.literal) if re.fullmatch(r"-?\d+", ins.literal) else None


def _trip_count(ins: _Instruction, computations: dict[str, list[_Instruction]],
                caller: dict[str, _Instruction]) -> int | None:
    """A while loop's trip count: XLA's, or, where its condition compares one tuple element
    (the counter) against one integer constant (`i < N`, as a scan's does), the count of steps
    from the counter's start (the loop's initial tuple, `caller`'s instructions) to N by the
    constant its body adds (XLA's windowed einsums step by 2, their bodies unrolled); None if
    unknown (a decode loop bounded by a runtime value)."""
    if (known := _TRIP.search(ins.attrs)) is not None:
        return int(known.group(1))
    condition = re.search(r"condition=%([^\s,]+)", ins.attrs)
    body = re.search(r"body=%([^\s,]+)", ins.attrs)
    tests = computations.get(condition.group(1), []) if condition else []
    compares = [i for i in tests if i.op == "compare" and "direction=LT" in i.attrs]
    names = {i.name: i for i in tests}
    if len(compares) != 1:
        return None
    operands = [names.get(a) for a in compares[0].args]
    bounds = [b for b in map(_integer, operands) if b is not None]
    counters = [_element(o) for o in operands if o is not None and _element(o) is not None]
    if len(bounds) != 1:
        return None
    if len(counters) != 1:  # a bound without a counter we can follow: a step of 1 from 0
        return bounds[0]
    k = counters[0]
    start, step = 0, 1
    steps = computations.get(body.group(1), []) if body else []
    root = steps[-1] if steps else None
    if root is not None and root.op == "tuple" and k < len(root.args):
        inside = {i.name: i for i in steps}
        update = inside.get(root.args[k])
        if update is not None and update.op == "add":
            increments = [_integer(inside.get(a)) for a in update.args]
            step = next((c for c in increments if c), 1)
    initial = caller.get(ins.args[0]) if ins.args else None
    if initial is not None and initial.op == "tuple" and k < len(initial.args):
        start = _integer(caller.get(initial.args[k])) or 0
    return max(0, -(-(bounds[0] - start) // step))


def program_flops(text: str) -> Flops:
    """The matmul FLOPs per device of a compiled module's text (`Compiled.as_text()`)."""
    computations, entry = parse(text)
    memo: dict[str, tuple[float, int]] = {}

    def walk(name: str) -> tuple[float, int]:
        if name in memo:
            return memo[name]
        memo[name] = (0.0, 0)  # a cycle cannot occur in HLO; this only guards the recursion
        instructions = computations.get(name, [])
        shapes = {i.name: i.dims for i in instructions}
        by_name = {i.name: i for i in instructions}
        flops, unbounded = 0.0, 0
        for ins in instructions:
            if ins.op in ("dot", "convolution"):
                flops += _matmul_flops(ins, shapes)
            elif ins.op == "while":
                body = re.search(r"body=%([^\s,]+)", ins.attrs)
                inner, loops = walk(body.group(1)) if body else (0.0, 0)
                trips = _trip_count(ins, computations, by_name)
                unbounded += loops + (trips is None)
                flops += inner * (1 if trips is None else trips)
            elif ins.op == "conditional":
                branches = [b.strip().lstrip("%") for group in _BRANCHES.findall(ins.attrs)
                            for part in group if part for b in part.split(",")]
                results = [walk(b) for b in branches] or [(0.0, 0)]
                flops += max(f for f, _ in results)
                unbounded += max(u for _, u in results)
            else:
                for called in _CALLED.findall(ins.attrs):
                    inner, loops = walk(called)
                    flops, unbounded = flops + inner, unbounded + loops
        memo[name] = (flops, unbounded)
        return memo[name]

    return Flops(*walk(entry))


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_TYPED = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _bytes(type_text: str) -> int:
    """Bytes of every array a type names (one array, or a tuple's)."""
    return sum(_ITEMSIZE.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _TYPED.findall(type_text))


_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\S*(?: device_ids=\S+)? \{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _group_axis_size(item: str, sizes: dict[str, int]) -> int:
    """Devices along one axis of a mesh-named replica group: a whole mesh axis ('axis_1') or a
    part of one ('axis_0':(2)2, the size-2 part after a size-2 major part)."""
    name, _, part = item.partition(":")
    return int(part.rpartition(")")[2]) if part else sizes[name.strip("'")]


def _group_size(attrs: str, partitions: int) -> int:
    """Devices in each of a collective's groups (all of them where it names no groups)."""
    if (mesh := _MESH_GROUPS.search(attrs)) is not None:
        sizes = dict((name.strip("'"), int(n)) for name, n in
                     (item.split("=") for item in mesh.group(1).split(",")))
        return math.prod(_group_axis_size(item, sizes) for item in mesh.group(2).split(","))
    if (iota := _IOTA_GROUPS.search(attrs)) is not None:
        return int(iota.group(2))
    if (listed := _LIST_GROUPS.search(attrs)) is not None:
        return len(listed.group(1).split(","))
    return partitions


def _received_share(ins: _Instruction, partitions: int) -> float:
    """Bytes a device receives from others per byte of the collective's result (averaged
    over the devices): an all-gather's or all-to-all's result holds the device's own part,
    a ring all-reduce passes (g-1)/g of its result twice, a reduce-scatter's result sums g
    partial blocks, a permute's pairs include devices that keep their block."""
    op = ins.op.removesuffix("-done").removesuffix("-start")
    if op == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", _PAIRS.search(ins.attrs).group(1))
        return sum(s != t for s, t in pairs) / partitions
    g = _group_size(ins.attrs, partitions)
    return {"all-reduce": 2 * (g - 1) / g, "reduce-scatter": g - 1}.get(op, (g - 1) / g)


def collective_bytes(text: str) -> int:
    """Bytes per device (the mean over devices) that the entry computation's collectives
    bring from other devices (every all-gather, all-reduce, reduce-scatter, all-to-all and
    collective-permute; an async one at its `-start`, which names its groups, with its
    `-done`'s result): a reshard program's traffic, comparable to the planner's transfer
    bytes (a device's own part of a collective's result never crosses a link)."""
    computations, entry = parse(text)
    partitions = int(m.group(1)) if (m := _PARTITIONS.search(text)) else 1
    instructions = computations.get(entry, [])
    by_name = {ins.name: ins for ins in instructions}
    total = 0.0
    for ins in instructions:
        if ins.op in _COLLECTIVES:
            total += _bytes(ins.type_text) * _received_share(ins, partitions)
        elif ins.op.removesuffix("-done") in _COLLECTIVES and ins.args and ins.args[0] in by_name:
            total += _bytes(ins.type_text) * _received_share(by_name[ins.args[0]], partitions)
    return round(total)
