"""Reading XLA:GPU's thunk sequence: how a compiled program moves bytes between
host and device memory.

XLA:GPU runs a program as a sequence of thunks. A host transfer is an
`AsyncStart` thunk, on one of a few side streams (`computation_stream[k]`), and
an `AsyncDone` thunk that makes the compute stream wait for it. What the start
runs decides what moves the bytes:

- a copy (an H2D or D2H memcpy, or a `DynamicSliceFusion` memcpy of a slice
  whose offset is affine in its loop's counter): a copy engine;
- a kernel (a slice of a host array at any other offset): the GPU's cores,
  reading or writing host memory over PCIe, beside the step's own kernels.

A start waits for all the work queued on the compute stream before it. So two
transfers overlap only where one starts before the other's done: they are then
in flight together.

`--xla_dump_to` writes the sequence (`*.thunk_sequence*.txt`), the HLO name of
each thunk (`*.thunk_metadata.txt`) and the optimised HLO, also for a program
compiled without a GPU. None of these texts is a stable interface: checked
against jax and jaxlib 0.10.2 with its CUDA 12 plugin.

It reads the compiler's text for the tests (`test_gpu_copies.py`), not for the
library: it was `eqx_offload/_compiler_thunks.py` until nothing in the package
used it. The HLO it reads is parsed by the package's `_compiler.py`.
"""

import dataclasses
import re
from pathlib import Path
from typing import Literal

import eqx_offload.internal as eoi


Direction = Literal["to device", "to host"]
Engine = Literal["copy", "kernel"]


def dump_options(directory: str | Path) -> dict[str, str]:
    """The compile options that make XLA write its dump (thunk sequence and HLO
    included) into `directory`: pass them as `compiler_options=`."""
    return {"xla_dump_to": str(directory)}


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One host transfer: an asynchronous copy between host and device memory."""

    name: str  # its start's HLO instruction
    direction: Direction
    engine: Engine  # what moves the bytes: a copy engine, or a kernel
    stream: int  # the side stream it runs on, `computation_stream[k]`
    op_name: str  # JAX's name for it ("" if the compiler made it)


@dataclasses.dataclass(frozen=True)
class Loop:
    """The host transfers of one computation: a `while` loop's body (not the
    loops nested in it), or what runs outside every loop (`name` "")."""

    name: str  # the `while` instruction
    op_name: str
    trip_count: int | None
    transfers: tuple[Transfer, ...]  # in the order they start
    # Pairs of positions in `transfers`: one started before the other's done.
    in_flight: tuple[tuple[int, int], ...]
    # Pairs of positions in `transfers`: the second slices (or writes into) the
    # host array the first wrote, so it starts after the first is done.
    waits: tuple[tuple[int, int], ...] = ()

    @property
    def phase(self) -> eoi.Phase:
        """Which part of a train step it runs, by its op_name: "forward",
        "backward", "update", or "outside" (also a loop of none of these, such
        as the micro-batches')."""
        return eoi.hlo_phase(self.op_name) if self.name else "outside"

    def overlapping(self) -> list[tuple[Transfer, Transfer]]:
        """The pairs of its transfers in flight together, each in start order."""
        return [(self.transfers[i], self.transfers[j]) for i, j in self.in_flight]

    def waiting(self) -> list[tuple[Transfer, Transfer]]:
        """The pairs of its transfers where the second slices (or writes into)
        the host array the first wrote."""
        return [(self.transfers[i], self.transfers[j]) for i, j in self.waits]


@dataclasses.dataclass(frozen=True)
class Program:
    """The host transfers of a compiled program, by loop (outside every loop
    first). A loop nested in another is listed on its own."""

    loops: tuple[Loop, ...]

    def phase(self, phase: eoi.Phase) -> list[Loop]:
        """Its loops (or the part outside every loop) of one phase."""
        return [loop for loop in self.loops if loop.phase == phase]


def read(directory: str | Path) -> Program:
    """The host transfers of the one XLA:GPU program dumped into `directory` (by
    a compile with `dump_options(directory)`).

    **Raises:** `ValueError` if the directory holds no XLA:GPU program's thunk
    sequence, or several programs'."""
    folder = Path(directory)
    sequences = sorted(folder.glob("*.thunk_sequence_after_thunk_passes.txt"))
    sequences = sequences or sorted(folder.glob("*.thunk_sequence.txt"))
    if len(sequences) != 1:
        raise ValueError(
            f"`gpu_thunks.read`: {folder} holds {len(sequences)} XLA:GPU "
            "thunk sequences; compile one program for a GPU target with "
            "`dump_options(directory)`, into an empty directory."
        )
    module = sequences[0].name.split(".thunk_sequence")[0]
    (hlo,) = folder.glob(f"{module}.*gpu_after_optimizations.txt")
    names = _thunk_names((folder / f"{module}.thunk_metadata.txt").read_text())
    return parse(sequences[0].read_text(), names, hlo.read_text())


@dataclasses.dataclass
class _Thunk:
    """One line of a thunk sequence, and the thunks nested under it."""

    id: int
    kind: str
    text: str  # the rest of the line
    nested: list["_Thunk"] = dataclasses.field(default_factory=list)
    body: list["_Thunk"] | None = None  # a `kWhile`'s body

    @property
    def async_id(self) -> int | None:
        found = re.search(r"\basync_id=(\d+)", self.text)
        return int(found[1]) if found else None

    @property
    def stream(self) -> int | None:
        found = re.search(r"\bstream=computation_stream\[(\d+)\]", self.text)
        return int(found[1]) if found else None


_LINE = re.compile(r"^( *)(\d+): (k\w+)\s*(.*)$")
# What the nested thunk of a start is when the start copies: a memcpy
# (`kCopy`: H2D, D2H or D2D), or a slice done as one (`kDynamicSliceFusion`).
_COPY_KINDS = ("kCopy", "kDynamicSliceFusion")


def _thunk_tree(text: str) -> list[_Thunk]:
    """The top-level thunks of a sequence, with nested thunks and loop bodies.

    A thunk's nested thunks are indented 4 more than it. A `kWhile` is followed
    by a `condition:` line (not indented), its thunks, a `body:` line (indented
    2 more than the while) and its thunks, all 4 more than the while."""
    top: list[_Thunk] = []
    into: dict[int, list[_Thunk]] = {0: top}  # indent -> where a thunk there goes
    last: dict[int, _Thunk] = {}  # indent -> the last thunk there
    latest = 0  # the indent of the last thunk
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() == "condition:":  # of the while just read
            into[latest + 4] = []
            continue
        if line.strip() == "body:":
            into[indent + 2] = []
            last[indent - 2].body = into[indent + 2]
            continue
        found = _LINE.match(line)
        if found is None or indent not in into:
            continue
        thunk = _Thunk(int(found[2]), found[3], found[4])
        into[indent].append(thunk)
        into = {k: v for k, v in into.items() if k <= indent}
        into[indent + 4] = thunk.nested
        last = {k: t for k, t in last.items() if k < indent}
        last[indent] = thunk
        latest = indent
    return top


def _thunk_names(metadata: str) -> dict[int, str]:
    """Thunk id -> the HLO instruction it runs, from `*.thunk_metadata.txt`."""
    pattern = r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)'
    return {int(i): name for name, i in re.findall(pattern, metadata)}


def parse(sequence: str, names: dict[int, str], hlo: str) -> Program:
    """The host transfers of a thunk sequence (its text, the HLO instruction of
    each thunk id, and the optimised HLO's text)."""
    module = eoi.parse_hlo(hlo)
    insts = {
        name: inst
        for comp in module.computations.values()
        for name, inst in comp.insts.items()
    }
    loops: list[Loop] = []

    def walk(thunks: list[_Thunk], name: str) -> None:
        transfers: list[Transfer] = []
        started: dict[int, int] = {}  # async id -> position in transfers
        in_flight: list[tuple[int, int]] = []
        for thunk in _flat(thunks):
            if thunk.kind == "kWhile" and thunk.body is not None:
                walk(thunk.body, names.get(thunk.id, ""))
            elif thunk.kind == "kAsyncStart" and thunk.async_id is not None:
                found = _transfer(thunk, names, insts)
                if found is not None:
                    in_flight += [(k, len(transfers)) for k in started.values()]
                    started[thunk.async_id] = len(transfers)
                    transfers.append(found)
            elif thunk.kind == "kAsyncDone" and thunk.async_id is not None:
                started.pop(thunk.async_id, None)
        inst = insts.get(name)
        body = module.computations.get(inst.computation("body") or "") if inst else None
        loops.append(
            Loop(
                name,
                "" if inst is None else inst.op_name,
                None if inst is None else inst.known_trip_count,
                tuple(transfers),
                tuple(in_flight),
                () if body is None else _waits(body, [t.name for t in transfers]),
            )
        )

    walk(_thunk_tree(sequence), "")
    return Program(tuple(loops[-1:] + loops[:-1]))  # outside every loop first


def _waits(body: eoi.Computation, starts: list[str]) -> tuple:
    """The pairs `(i, j)` of `starts` (async starts in `body`) where start `j`
    slices (or writes into) the host array that start `i` wrote."""
    position = {name: k for k, name in enumerate(starts)}
    pairs = set()
    for name, j in position.items():
        inst = body.insts.get(name)
        i = None if inst is None else _written_by(body, inst.operands[0], position)
        if i is not None:
            pairs.add((i, j))
    return tuple(sorted(pairs))


def _written_by(body: eoi.Computation, name: str, position: dict) -> int | None:
    """The start (by position) whose done gives the array `name`, through tuples
    (an `optimization_barrier` becomes one), or None."""
    while (inst := body.insts.get(name)) is not None:
        if inst.opcode.endswith("-done"):
            return position.get(inst.operands[0])
        if inst.opcode != "get-tuple-element" or inst.index is None:
            return None
        source = body.insts.get(inst.operands[0])
        if source is None or source.opcode not in ("tuple", "opt-barrier"):
            return None
        name = source.operands[inst.index]
    return None


def _flat(thunks: list[_Thunk]) -> list[_Thunk]:
    """`thunks` in order, a command buffer's (a CUDA graph's) replaced by the
    thunks it holds."""
    out: list[_Thunk] = []
    for thunk in thunks:
        if thunk.kind == "kCommandBuffer":
            out += _flat(thunk.nested)
        else:
            out.append(thunk)
    return out


def _transfer(
    start: _Thunk, names: dict[int, str], insts: dict[str, eoi.Instruction]
) -> Transfer | None:
    """The host transfer an `AsyncStart` thunk starts, or None for other work."""
    inst = insts.get(names.get(start.id, ""))
    if inst is None or start.stream is None:
        return None
    parts = eoi.tuple_elements(inst.shape)
    if inst.opcode == "copy-start":  # (destination, source, context)
        into, operands = parts[0], parts[1:2]
    elif inst.opcode == "async-start":  # ((operands...), result, context)
        into, operands = parts[1], eoi.tuple_elements(parts[0])
    else:
        return None
    on_host = [_on_host(shape) for shape in operands if not _scalar(shape)]
    if _on_host(into) and False in on_host:
        direction: Direction = "to host"
    elif not _on_host(into) and True in on_host:
        direction = "to device"
    else:
        return None  # within one memory
    copies = bool(start.nested) and start.nested[0].kind in _COPY_KINDS
    return Transfer(
        inst.name,
        direction,
        "copy" if copies else "kernel",
        start.stream,
        inst.op_name,
    )


def _on_host(shape: str) -> bool:
    return any(a.host for a in eoi.hlo_arrays(shape))


def _scalar(shape: str) -> bool:
    found = eoi.array_type(shape)
    return found is not None and not found[1]
