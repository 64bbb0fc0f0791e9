"""Communication in a compiled program: the collectives of its optimized HLO text.

:func:`collectives` reads the text XLA prints for a compiled program
(``compiled.as_text()`` or the ``*after_optimizations.txt`` of ``--xla_dump_to``) and
returns one :class:`Collective` per all-gather, all-reduce, reduce-scatter, all-to-all
and collective-permute. An async pair (``all-gather-start`` / ``all-gather-done``) is one
collective: the ``-start`` carries the groups and the operands, the ``-done`` the result.

Where it runs (``executions``): the computations are walked from ``ENTRY`` through
their call sites (fusions, calls, async wrappers, conditionals, while loops). A while
body runs ``trip count`` times per execution of its while, its condition ``trip count +
1`` times; nested loops multiply (decode: tokens x layers). The trip count is the
while's ``backend_config`` ``known_trip_count`` when the compiler wrote one (libtpu
0.0.52 does not), else it is derived from the condition: ``i < N`` (``<=``, ``>``,
``>=``, ``!=``) on a tuple element ``i`` whose initial value (a constant, through
copies) and step (``add`` of a constant in the body) are read from the while's operand
and the body's root; an initial value or step that cannot be read counts as 0 and 1.
A condition with more terms (``i < N & !all(done)``, the decode's early stop) gives the
upper bound ``N``. A loop whose count cannot be read at all counts once and is listed in
:attr:`Collective.unknown_trips`. Both branches of a conditional are counted. A
collective wrapped in ``async-start`` / ``async-done`` is counted once, where it sits.

What one chip receives per execution (``received_bytes``), for a group of ``n`` devices
and the op's buffers (bytes of every array of the shape, tuples summed; sub-byte types
packed):

- all-gather: ``(n - 1) / n`` of the gathered result (every other member's shard);
- reduce-scatter: ``(n - 1) / n`` of the input (the ring pass of the other shards);
- all-reduce: ``2 (n - 1) / n`` of the buffer (ring: a reduce-scatter then an all-gather);
- all-to-all: ``(n - 1) / n`` of the buffer;
- collective-permute: the whole buffer (a chip that is a target receives it).

These are the bandwidth-optimal ring figures: the least any algorithm moves into one
chip, so ``bytes / link bandwidth`` is a lower bound on the time. ``n`` comes from
``replica_groups``: the explicit ``{{0,1},{2,3}}`` list, the iota form ``[G,n]<=[dims]``
(optionally ``T(perm)``), the mesh-axes form ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes
``'a':(pre)size``), or ``{}`` (every partition). The groups are materialized as
partition ids when the form allows, so a caller can map them to devices (hosts, slices).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from functools import cache
from typing import Any

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# Bits per element of the HLO primitive types (sub-byte types are packed).
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
    "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128,
    "token": 0, "f4e2m1fn": 4, "f8e8m0fnu": 8,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([^\]]*)\]")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_NAME = re.compile(r"%([\w.\-]+)")


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(text: str) -> int:
    """Bytes of an HLO shape (``bf16[8,128]{1,0:T(8,128)}``, ``(f32[], s32[4])``, ...):
    every array in it, tuples summed, sub-byte types packed."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in _BITS and not dtype.startswith("f8"):
            continue  # not an element type (e.g. a layout's tiling word)
        n = 1
        for d in dims.split(","):
            d = d.strip().removeprefix("<=")
            if d:
                n *= int(d)
        total += (n * _bits(dtype) + 7) // 8
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """``"(a, b) op(...)..."`` -> ``("(a, b)", "op(...)...")``; also for a plain type."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].strip()
    i = rest.find(" ")
    return (rest, "") if i < 0 else (rest[:i], rest[i + 1:].strip())


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket closing the one at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses
    attrs: str
    root: bool


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    num_partitions: int
    replica_count: int

    def __post_init__(self) -> None:
        self.by_name = {i.name: i for instrs in self.computations.values() for i in instrs}


def parse(text: str) -> Module:
    comps: dict[str, list[Instr]] = {}
    entry = ""
    current: list[Instr] | None = None
    partitions = replicas = 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            m = re.search(r"num_partitions=(\d+)", line)
            partitions = int(m.group(1)) if m else 1
            m = re.search(r"replica_count=(\d+)", line)
            replicas = int(m.group(1)) if m else 1
            continue
        if current is None:
            m = _COMP.match(line)
            if m:
                current = comps.setdefault(m.group(2), [])
                if m.group(1):
                    entry = m.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        typ, rest = _split_type(m.group(3))
        p = rest.find("(")
        if p < 0:
            continue
        opcode = rest[:p].strip()
        end = _balanced(rest, p)
        current.append(Instr(m.group(2), typ, opcode, _NAME.findall(rest[p:end]), rest[p + 1:end - 1], rest[end:],
                             bool(m.group(1))))
    if not entry and comps:
        entry = list(comps)[-1]
    return Module(comps, entry, partitions, replicas)


# --------------------------------------------------------------------------- replica groups


def _iota_groups(shape: list[int], dims: list[int], perm: list[int] | None) -> list[list[int]]:
    import numpy as np

    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm is not None:
        ids = ids.transpose(perm)
    return ids.reshape(shape).tolist()


def _mesh_groups(text: str) -> tuple[int, list[list[int]] | None]:
    """``mesh['a'=2,'b'=4] {'b'}`` -> (group size, groups of partition ids)."""
    import numpy as np

    m = re.match(r"mesh\[([^\]]*)\]\s*(<=\[[^\]]*\](?:T\([^)]*\))?|\{[^}]*\}(?=\s*\{))?\s*\{([^}]*)\}", text)
    if not m:
        raise ValueError(f"unreadable mesh replica groups {text[:80]!r}")
    axes = [(a.strip().strip("'"), int(s)) for a, s in re.findall(r"('[^']*'|[\w]+)=(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    sizes = dict(axes)
    refs = []
    for ref in re.findall(r"('[^']*'|\w+)(?::\((\d+)\)(\d+))?", m.group(3)):
        name = ref[0].strip("'")
        pre, size = (int(ref[1]), int(ref[2])) if ref[1] else (1, sizes[name])
        refs.append((name, pre, size))
    n = math.prod(size for _, _, size in refs)
    if m.group(2):  # an explicit device order: the group size is enough
        return n, None
    # Split every axis into its referenced sub-axes (major to minor), materialize.
    cuts: dict[str, list[int]] = {a: [1, sizes[a]] for a in names}
    for name, pre, size in refs:
        cuts[name] += [pre, pre * size]
    dims: list[int] = []
    labels: list[tuple[str, int]] = []
    for a in names:
        bounds = sorted(set(cuts[a]))
        for lo, hi in itertools.pairwise(bounds):
            dims.append(hi // lo)
            labels.append((a, lo))
    ids = np.arange(math.prod(sizes[a] for a in names)).reshape(dims)
    group_axes = []
    for name, pre, size in refs:
        group_axes += [i for i, (a, lo) in enumerate(labels) if a == name and pre <= lo < pre * size]
    other = [i for i in range(len(dims)) if i not in group_axes]
    return n, ids.transpose(other + group_axes).reshape(-1, n).tolist()


def replica_groups(attrs: str, num_devices: int) -> tuple[int, list[list[int]] | None]:
    """(group size, groups of partition ids or None) of an instruction's attributes."""
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return num_devices, [list(range(num_devices))]
    text = attrs[m.end():]
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("["):
        it = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        if not it:
            raise ValueError(f"unreadable iota replica groups {text[:80]!r}")
        shape = [int(x) for x in it.group(1).split(",")]
        dims = [int(x) for x in it.group(2).split(",")]
        perm = [int(x) for x in it.group(3).split(",")] if it.group(3) else None
        return shape[-1], _iota_groups(shape, dims, perm)
    body = text[: _balanced(text, 0)]
    groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
    groups = [g for g in groups if g]
    if not groups:
        return num_devices, [list(range(num_devices))]
    return max(len(g) for g in groups), groups


# --------------------------------------------------------------------------- loops


@dataclasses.dataclass(frozen=True)
class Loop:
    name: str  # the while instruction
    trips: int | None
    source: str  # "backend_config", "condition", "unknown"


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.mod = parse(text)
        self.const: dict[str, int] = {}
        for ins in self.mod.by_name.values():
            scalar = ins.opcode == "constant" and re.fullmatch(r"[su](?:8|16|32|64)\[\].*", ins.type)
            if scalar and re.fullmatch(r"-?\d+", ins.args.strip()):
                self.const[ins.name] = int(ins.args)

    def value(self, name: str) -> int | None:
        for _ in range(16):
            if name in self.const:
                return self.const[name]
            ins = self.mod.by_name.get(name)
            if ins is None or ins.opcode not in ("copy", "bitcast", "convert") or not ins.operands:
                return None
            name = ins.operands[0]
        return None

    def tuple_index(self, name: str) -> int | None:
        """k when ``name`` is ``get-tuple-element(param, index=k)`` (through copies)."""
        for _ in range(16):
            ins = self.mod.by_name.get(name)
            if ins is None:
                return None
            if ins.opcode == "get-tuple-element":
                m = re.search(r"index=(\d+)", ins.attrs)
                src = self.mod.by_name.get(ins.operands[0]) if ins.operands else None
                return int(m.group(1)) if m and src is not None and src.opcode == "parameter" else None
            if ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
                name = ins.operands[0]
                continue
            return None
        return None

    def trips(self, w: Instr) -> Loop:
        m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', w.attrs)
        if m:
            return Loop(w.name, int(m.group(1)), "backend_config")
        cond = re.search(r"condition=%?([\w.\-]+)", w.attrs)
        body = re.search(r"body=%?([\w.\-]+)", w.attrs)
        if not cond or cond.group(1) not in self.mod.computations:
            return Loop(w.name, None, "unknown")
        best = None
        for ins in self._cond_instrs(cond.group(1)):
            if ins.opcode != "compare" or len(ins.operands) != 2:
                continue
            d = re.search(r"direction=(\w+)", ins.attrs)
            if not d:
                continue
            direction = d.group(1)
            a, b = ins.operands
            k, limit = self.tuple_index(a), self.value(b)
            if k is None or limit is None:
                k, limit = self.tuple_index(b), self.value(a)
                direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
            if k is None or limit is None:
                continue
            init = self._init(w, k)
            step = self._step(body.group(1) if body else None, k)
            if direction in ("LT", "NE"):
                n = math.ceil((limit - init) / step) if step > 0 else None
            elif direction == "LE":
                n = math.floor((limit - init) / step) + 1 if step > 0 else None
            elif direction == "GT":
                n = math.ceil((init - limit) / -step) if step < 0 else None
            elif direction == "GE":
                n = math.floor((init - limit) / -step) + 1 if step < 0 else None
            else:
                n = None
            if n is not None:
                n = max(n, 0)
                best = n if best is None else min(best, n)
        if best is None:
            return Loop(w.name, None, "unknown")
        return Loop(w.name, best, "condition")

    def _cond_instrs(self, comp: str) -> list[Instr]:
        out = []
        for ins in self.mod.computations.get(comp, []):
            out.append(ins)
            if ins.opcode == "fusion":
                c = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
                if c:
                    # A fused compare: map its parameters back to the fusion's operands.
                    for fi in self.mod.computations.get(c.group(1), []):
                        if fi.opcode == "compare":
                            ops = [self._fusion_operand(ins, o) for o in fi.operands]
                            out.append(dataclasses.replace(fi, operands=ops))
        return out

    def _fusion_operand(self, fusion: Instr, name: str) -> str:
        ins = self.mod.by_name.get(name)
        if ins is not None and ins.opcode == "parameter" and ins.args.strip().isdigit():
            idx = int(ins.args)
            if idx < len(fusion.operands):
                return fusion.operands[idx]
        return name

    def _init(self, w: Instr, k: int) -> int:
        if not w.operands:
            return 0
        t = self.mod.by_name.get(w.operands[0])
        if t is not None and t.opcode == "tuple" and k < len(t.operands):
            v = self.value(t.operands[k])
            if v is not None:
                return v
        return 0

    def _step(self, body: str | None, k: int) -> int:
        if body is None:
            return 1
        root = next((i for i in self.mod.computations.get(body, []) if i.root), None)
        if root is None or root.opcode != "tuple" or k >= len(root.operands):
            return 1
        ins = self.mod.by_name.get(root.operands[k])
        for _ in range(4):
            if ins is None or ins.opcode not in ("copy", "bitcast"):
                break
            ins = self.mod.by_name.get(ins.operands[0])
        if ins is not None and ins.opcode in ("add", "subtract") and len(ins.operands) == 2:
            for x, y in (ins.operands, ins.operands[::-1]):
                v = self.value(y)
                if v is not None and self.tuple_index(x) == k:
                    return v if ins.opcode == "add" else -v
        return 1


# --------------------------------------------------------------------------- collectives


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str  # the instruction (the -start of an async pair)
    computation: str
    loops: tuple[Loop, ...]  # enclosing while loops, outermost first (first call site)
    executions: int  # per execution of the program (trip counts multiplied, all call sites)
    shape: str  # the result (gathered / reduced / permuted buffer)
    buffer_bytes: int  # what the ring formula scales (see the module docstring)
    group_size: int
    groups: tuple[tuple[int, ...], ...] | None  # partition ids; None when not materialized
    received_bytes: float  # per chip per execution

    @property
    def total_bytes(self) -> float:
        return self.received_bytes * self.executions

    @property
    def in_loop(self) -> bool:
        return bool(self.loops)

    @property
    def unknown_trips(self) -> tuple[str, ...]:
        return tuple(lp.name for lp in self.loops if lp.trips is None)


def _received(kind: str, n: int, nbytes: int) -> float:
    if n <= 1:
        return 0.0 if kind != "collective-permute" else float(nbytes)
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "collective-permute":
        return float(nbytes)
    return (n - 1) / n * nbytes


def collectives(text: str) -> list[Collective]:
    """Every collective of the optimized HLO ``text`` (see the module docstring)."""
    r = _Reader(text)
    mod = r.mod
    devices = mod.num_partitions * mod.replica_count
    done_of: dict[str, Instr] = {}
    for instrs in mod.computations.values():
        for ins in instrs:
            if ins.opcode.endswith("-done") and ins.operands:
                done_of[ins.operands[0]] = ins
    loops: dict[str, Loop] = {}

    def loop(w: Instr) -> Loop:
        if w.name not in loops:
            loops[w.name] = r.trips(w)
        return loops[w.name]

    @cache
    def inside(comp: str) -> tuple[tuple[str, str, int, tuple[Loop, ...]], ...]:
        """(instruction, its computation, executions per run of ``comp``, loops) below comp."""
        out: list[tuple[str, str, int, tuple[Loop, ...]]] = []
        for ins in mod.computations.get(comp, []):
            base = ins.opcode.removesuffix("-start")
            if base in KINDS and not ins.opcode.endswith("-done"):
                out.append((ins.name, comp, 1, ()))
            if ins.opcode == "while":
                lp = loop(ins)
                t = lp.trips if lp.trips is not None else 1
                for key, times in (("body", t), ("condition", t + 1)):
                    c = re.search(rf"{key}=%?([\w.\-]+)", ins.attrs)
                    if c:
                        out += [(n, cc, times * e, (lp,) + ls) for n, cc, e, ls in inside(c.group(1))]
                continue
            if ins.opcode in ("async-update", "async-done"):
                continue  # the same wrapped computation as its async-start: counted there
            for c in re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)", ins.attrs):
                out += inside(c)
            b = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            if b:
                for c in _NAME.findall(b.group(1)):
                    out += inside(c)
            c = re.search(r"calls=\{([^}]*)\}", ins.attrs)
            if c:
                for cc in _NAME.findall(c.group(1)):
                    out += inside(cc)
        return tuple(out)

    merged: dict[str, list[Any]] = {}
    for name, comp, e, ls in inside(mod.entry):
        if name in merged:
            merged[name][1] += e
        else:
            merged[name] = [comp, e, ls]
    result = []
    for name, (comp, e, ls) in merged.items():
        ins = mod.by_name[name]
        kind = ins.opcode.removesuffix("-start")
        out_type = done_of[name].type if ins.opcode.endswith("-start") and name in done_of else ins.type
        if ins.opcode.endswith("-start") and name not in done_of:
            out_type = _split_type(ins.type[1:-1])[0] if ins.type.startswith("((") else ins.type
        in_bytes = sum(shape_bytes(mod.by_name[o].type) for o in ins.operands if o in mod.by_name)
        out_bytes = shape_bytes(out_type)
        if kind == "collective-permute" and ins.opcode.endswith("-start") and name not in done_of:
            out_bytes = in_bytes
        buffer = in_bytes if kind in ("reduce-scatter", "all-to-all") else out_bytes
        if kind == "collective-permute":
            m = re.search(r"source_target_pairs=\{(.*?)\}\}", ins.attrs)
            pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(0)) if m else []
            n, groups = 2, tuple(tuple(int(x) for x in p) for p in pairs) or None
        else:
            n, g = replica_groups(ins.attrs, devices)
            groups = tuple(tuple(x) for x in g) if g is not None else None
        result.append(Collective(kind=kind, name=name, computation=comp, loops=ls, executions=e, shape=out_type,
                                 buffer_bytes=buffer, group_size=n, groups=groups,
                                 received_bytes=_received(kind, n, buffer)))
    return result


def by_kind(ops: list[Collective], *, in_loop: bool | None = None) -> dict[str, float]:
    """Bytes one chip receives per program execution, by kind (``in_loop``: only the
    collectives inside / outside while loops)."""
    out = {k: 0.0 for k in KINDS}
    for op in ops:
        if in_loop is None or op.in_loop == in_loop:
            out[op.kind] += op.total_bytes
    return out


def crosses(op: Collective, domain_of: list[int]) -> bool:
    """Whether one of ``op``'s groups spans more than one domain (``domain_of[partition]``:
    a host or a slice); unknown groups do not."""
    if op.groups is None:
        return False
    return any(len({domain_of[i] for i in g if i < len(domain_of)}) > 1 for g in op.groups)


def summary(op: Collective) -> dict[str, Any]:
    return {
        "kind": op.kind, "name": op.name, "shape": re.sub(r"\{[^{}]*\}", "", op.shape),
        "group_size": op.group_size, "executions": op.executions,
        "loops": [[lp.name, lp.trips] for lp in op.loops],
        "received_bytes": op.received_bytes, "total_bytes": op.total_bytes,
    }


__all__ = ["KINDS", "Collective", "Loop", "by_kind", "collectives", "crosses", "parse", "replica_groups",
           "shape_bytes", "summary"]
