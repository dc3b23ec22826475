"""Reading a compiled XLA program (its optimised HLO text): collectives, the cuDNN calls
of a GPU program, the scatters and sorts, the layout changes around convolutions."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape, e.g. '(f32[64]{0}, bf16[3,3]{1,0})'."""
    return sum(
        _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result's shape text
    opcode: str
    operands: tuple[str, ...]  # names of the operand instructions
    attributes: str  # everything after the operand list
    computation: str
    is_root: bool

    def attribute(self, key: str) -> str | None:
        m = re.search(rf'\b{key}="([^"]*)"', self.attributes) or re.search(
            rf"\b{key}=([^,\s]+)", self.attributes
        )
        return m.group(1) if m else None

    @property
    def source(self) -> str:
        """The JAX operation it was lowered from (its metadata's op_name, without the
        jit/shard_map/loop prefix), or '?'."""
        name = self.attribute("op_name")
        if not name:
            return "?"
        for marker in ("/closed_call/", "/body/", "/shard_map/"):
            if marker in name:
                return name.rsplit(marker, 1)[1]
        return name


_INSTRUCTION = re.compile(r"^\s+(?P<root>ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s.*\{\s*$")


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at `start` (quoted text skipped)."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif not quoted and c == "(":
            depth += 1
        elif not quoted and c == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def parse(hlo_text: str) -> list[Instruction]:
    """Every instruction of every computation of an HLO module, in text order."""
    found = []
    computation = ""
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            c = _COMPUTATION.match(line)
            if c:
                computation = c.group("name")
            continue
        rest = m.group("rest")
        shape_end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
        op = re.match(r"\s*([a-z][\w\-]*)\(", rest[shape_end:])
        if shape_end < 0 or not op:
            continue
        open_at = shape_end + op.end() - 1
        close_at = _closing(rest, open_at)
        found.append(
            Instruction(
                name=m.group("name"),
                shape=rest[:shape_end],
                opcode=op.group(1),
                operands=tuple(re.findall(r"%([^\s,()]+)", rest[open_at:close_at])),
                attributes=rest[close_at + 1 :].lstrip(", "),
                computation=computation,
                is_root=bool(m.group("root")),
            )
        )
    return found


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # the data it delivers (an async start's result, not its operand copy)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of a compiled (optimised) HLO module, in program order."""
    found = []
    for ins in parse(hlo_text):
        kind = ins.opcode.removesuffix("-start")
        if kind not in COLLECTIVES or ins.opcode.endswith("-done"):
            continue
        shape = ins.shape
        if ins.opcode.endswith("-start") and kind != "all-reduce" and shape.startswith("(("):
            shape = shape[_closing(shape, 1) + 1 :]  # ((operands), result, ...): the result
        found.append(Collective(kind, shape_bytes(shape)))
    return found


# cuDNN's convolutions as XLA's GPU compiler calls them.
CUDNN_CONVOLUTIONS = {
    "__cudnn$convForward": "forward",
    "__cudnn$convBiasActivationForward": "forward with fused bias/activation",
    "__cudnn$convBackwardInput": "backward input",
    "__cudnn$convBackwardFilter": "backward filter",
}
# Operand 1 is the filter of these (the input/output gradient otherwise).
_FILTER_AT_1 = ("forward", "forward with fused bias/activation", "backward input")
SCATTER_LIKE = ("scatter", "select-and-scatter", "sort")


@dataclasses.dataclass(frozen=True)
class Audit:
    """What a compiled GPU program does around its convolutions."""

    convolutions: dict[str, int]  # cuDNN call kind -> count
    convolution_bytes: int  # operands and results of the cuDNN calls
    scatters: list[tuple[str, int, str]]  # (opcode, elements, the JAX op it comes from)
    relayouts: dict[str, tuple[int, int]]  # where -> (count, bytes written)


def _is_relayout(ins: Instruction, roots: dict[str, Instruction]) -> bool:
    """A transpose or copy, or a fusion whose root is one (a layout change)."""
    if ins.opcode in ("transpose", "copy"):
        return True
    called = (ins.attribute("calls") or "").lstrip("%")
    return ins.opcode == "fusion" and roots.get(called, ins).opcode in ("transpose", "copy")


def _source(ins: Instruction, program: list[Instruction], users: dict) -> str:
    """The JAX operation an instruction comes from; for a sort XLA added (no op_name:
    its determinism expander sorts a scatter's indices), the scatter it feeds."""
    if ins.source != "?" or ins.opcode != "sort":
        return ins.source
    callers = {(i.attribute("calls") or "").lstrip("%"): i for i in program}
    scatter_in = {i.computation: i for i in program if i.opcode == "scatter"}
    frontier, seen = [callers.get(ins.computation, ins)], set()
    for _ in range(8):  # a few hops: get-tuple-element, bitcast, the scatter's fusion
        found = [
            scatter_in[called]
            for f in frontier
            if (called := (f.attribute("calls") or "").lstrip("%")) in scatter_in
        ]
        if found:
            return f"XLA, sorting the indices of the scatter from {found[0].source}"
        seen.update(f.name for f in frontier)
        frontier = [u for f in frontier for u in users.get(f.name, []) if u.name not in seen]
    return "?"


def _elements(shape: str) -> int:
    """Elements of the first array of a shape."""
    m = _ARRAY.search(shape)
    return math.prod(int(d) for d in m.group(2).split(",") if d) if m else 0


def audit(hlo_text: str) -> Audit:
    """cuDNN convolutions by kind; every scatter, select-and-scatter and sort with the
    JAX operation it comes from; transposes and copies that change the layout of a
    convolution's filter or activations before it, or of its result after it."""
    program = parse(hlo_text)
    by_name = {ins.name: ins for ins in program}
    roots = {ins.computation: ins for ins in program if ins.is_root}
    users: dict[str, list[Instruction]] = {}
    for ins in program:
        for operand in ins.operands:
            users.setdefault(operand, []).append(ins)

    kinds: Counter[str] = Counter()
    conv_bytes = 0
    relayouts: dict[str, list[int]] = {}

    def note(where: str, ins: Instruction) -> None:
        entry = relayouts.setdefault(where, [0, 0])
        entry[0] += 1
        entry[1] += shape_bytes(ins.shape)

    for ins in program:
        if ins.opcode != "custom-call":
            continue
        kind = CUDNN_CONVOLUTIONS.get(ins.attribute("custom_call_target") or "")
        if kind is None:
            continue
        kinds[kind] += 1
        conv_bytes += shape_bytes(ins.shape) + sum(
            shape_bytes(by_name[o].shape) for o in ins.operands if o in by_name
        )
        for i, operand in enumerate(ins.operands):
            producer = by_name.get(operand)
            if producer is not None and _is_relayout(producer, roots):
                role = "filter" if i == 1 and kind in _FILTER_AT_1 else "activations"
                note(f"before ({role})", producer)
        results = [u for u in users.get(ins.name, []) if u.opcode == "get-tuple-element"]
        for user in (u for r in results for u in users.get(r.name, [])):
            if _is_relayout(user, roots):
                note("after (result)", user)
    scatters = [
        (ins.opcode, _elements(ins.shape), _source(ins, program, users))
        for ins in program
        if ins.opcode in SCATTER_LIKE
    ]
    return Audit(
        convolutions=dict(kinds),
        convolution_bytes=conv_bytes,
        scatters=scatters,
        relayouts={k: (v[0], v[1]) for k, v in relayouts.items()},
    )


def merge_audits(audits: list[tuple[Audit, int]]) -> Audit:
    """The audit of programs run one after another, each (audit, times run)."""
    kinds: Counter[str] = Counter()
    relayouts: dict[str, tuple[int, int]] = {}
    for a, runs in audits:
        for kind, n in a.convolutions.items():
            kinds[kind] += n * runs
        for where, (count, b) in a.relayouts.items():
            before = relayouts.get(where, (0, 0))
            relayouts[where] = (before[0] + count * runs, before[1] + b * runs)
    return Audit(
        convolutions=dict(kinds),
        convolution_bytes=sum(a.convolution_bytes * runs for a, runs in audits),
        scatters=[s for a, runs in audits for _ in range(runs) for s in a.scatters],
        relayouts=relayouts,
    )
