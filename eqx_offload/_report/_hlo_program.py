"""Walking a program compiled for a TPU or GPU (its HLO, parsed by `_compiler.py`):
the computations that run with how many times each runs per step (loop trip
counts), values followed back to the entry's parameters, and the instructions
that move data between host memory (memory space 5) and device memory.
`_compiled_traffic.py` attributes the moves; `_costs.py` prices them."""

from collections.abc import Iterator

from .. import _compiler
from .._compiler import Computation, Instruction


# Operations that can move data between host and device memory (`moved`).
_MOVES = ("dynamic-slice", "slice", "copy", "dynamic-update-slice")
# Operations whose result is (a piece of, a view of) their first operand (as is
# every `*-done`'s).
_PASS = {*_MOVES, "bitcast", "copy-start", "reshape"}


class Walker:
    """Visits the computations reachable from the entry, with the number of times
    each runs per step, and follows values back to the entry's parameters."""

    def __init__(self, comps: dict[str, Computation], entry: str):
        self.comps = comps
        self.entry = entry
        # computation -> (caller computation, calling instruction)
        self.callers: dict[str, tuple[str, Instruction]] = {}

    def visits(self) -> Iterator[tuple[Computation, int]]:
        """Each computation once per call (the call graph of an HLO module is a
        tree, apart from reductions' `to_apply`, which move nothing)."""
        stack = [(self.entry, 1)]
        while stack:
            name, times = stack.pop()
            if (comp := self.comps.get(name)) is None:
                continue
            yield comp, times
            for inst in comp.insts.values():
                for callee, n in self._callees(comp, inst):
                    self.callers.setdefault(callee, (comp.name, inst))
                    stack.append((callee, times * n))

    def _callees(self, comp: Computation, inst: Instruction) -> list[tuple[str, int]]:
        if (found := self.control(comp, inst)) is not None:
            return found
        if inst.opcode.endswith(("-done", "-update")):
            return []  # the computation an asynchronous start called
        callee = inst.computation("calls")
        return [(callee, 1)] if callee else []

    def control(
        self, comp: Computation, inst: Instruction
    ) -> list[tuple[str, int]] | None:
        """The computations a loop or conditional `inst` runs, with how many times
        each: a loop's body per trip; of a conditional, one branch. Which one the
        text does not say: the first (the platform choices the library makes are
        resolved by then). `None` for other instructions."""
        if inst.opcode == "while":
            body = inst.computation("body")
            return [(body, self.trips(comp, inst))] if body else []
        if inst.opcode == "conditional":
            return [(n, 1) for n in inst.branches[:1]]
        return None

    def trips(self, comp: Computation, inst: Instruction) -> int:
        """How many times the loop `inst` (of `comp`) runs: its known trip count,
        or `N - i0` for a condition `i < N` on a counter that starts at the
        constant `i0` (1 if neither is found)."""
        if inst.known_trip_count is not None:
            return inst.known_trip_count
        c = self.comps.get(inst.computation("condition") or "")
        if c is None or not c.root:
            return 1
        root = c.insts[c.root]
        if root.opcode != "compare" or root.direction != "LT":
            return 1
        counter, limit = (c.insts.get(o) for o in root.operands[:2])
        if limit is None or counter is None or limit.constant is None:
            return 1
        return max(limit.constant - _start(comp, inst, counter), 0)

    def origin(
        self, comp: Computation, name: str, index: int | None = None
    ) -> int | None:
        """The number of the entry parameter that value `name` of `comp` (tuple
        element `index`) is, or a piece of; None if it is computed."""
        for _ in range(200):
            if (inst := comp.insts.get(name)) is None:
                return None
            if inst.opcode == "parameter":
                if comp.name == self.entry:
                    return inst.parameter_number
                if (found := self._argument(comp, name)) is None:
                    return None
                comp, name = found
                continue
            if (back := _operand(inst, index)) is None:
                return None
            name, index = back
        return None

    def _argument(self, comp: Computation, name: str) -> tuple[Computation, str] | None:
        """What the caller of `comp` passes as its parameter `name`."""
        if (caller := self.callers.get(comp.name)) is None:
            return None
        caller_comp, call = self.comps[caller[0]], caller[1]
        if call.opcode == "while":
            return caller_comp, call.operands[0]  # the loop's initial tuple
        number = next((k for k, v in comp.params.items() if v == name), None)
        if number is not None and number < len(call.operands):
            return caller_comp, call.operands[number]
        return None


def _operand(inst: Instruction, index: int | None) -> tuple[str, int | None] | None:
    """The value (and tuple element) that `inst`'s result, or its element `index`,
    is a piece or view of; None if it computes it."""
    op = inst.opcode
    if op == "get-tuple-element":
        return inst.operands[0], inst.index
    if op == "opt-barrier" and index is not None:
        return inst.operands[0], index
    if op == "tuple" and index is not None:
        return (inst.operands[index], None) if index < len(inst.operands) else None
    if op == "while":
        return inst.operands[0], index
    if op in _PASS or op.endswith("-done") or op == "async-start":
        return (inst.operands[0], None) if inst.operands else None
    return None


def _start(comp: Computation, loop: Instruction, counter: Instruction) -> int:
    """The constant a loop's `counter` (an element of its state) starts at; 0 if
    not found."""
    index = counter.index
    if counter.opcode != "get-tuple-element" or index is None or not loop.operands:
        return 0
    init = comp.insts.get(loop.operands[0])
    if init is None or init.opcode != "tuple":
        return 0
    element = comp.insts.get(init.operands[index])
    return (element.constant if element else None) or 0


def moved(comp: Computation, inst: Instruction) -> tuple[str, int, str] | None:
    """(direction, bytes, the operand moved) if `inst` moves data between host and
    device memory: synchronously, or the start of an asynchronous move."""
    op = inst.opcode.removesuffix("-start")  # (a slice, a copy, ...)
    if op not in _MOVES:
        return None
    out = _compiler.arrays(made(inst))
    operands = [comp.insts.get(o) for o in inst.operands]
    if len(out) != 1 or not operands or operands[0] is None:
        return None
    first = _compiler.arrays(operands[0].shape)
    if len(first) != 1:
        return None
    source = inst.operands[0]
    if op == "dynamic-update-slice":
        if out[0].host and (written := _written(operands)) is not None:
            return "device_to_host", written, source
        return None
    if first[0].host and not out[0].host:
        return "host_to_device", out[0].nbytes, source
    if out[0].host and not first[0].host and op == "copy":
        return "device_to_host", out[0].nbytes, source
    return None


def _written(operands: list[Instruction | None]) -> int | None:
    """The bytes a `dynamic-update-slice` writes from device memory (its update,
    one array on the device), else None."""
    update = operands[1] if len(operands) > 1 else None
    written = _compiler.arrays(update.shape) if update is not None else []
    return written[0].nbytes if len(written) == 1 and not written[0].host else None


def made(inst: Instruction) -> str:
    """The shape `inst` makes; of an asynchronous start, the result it starts ("" if
    its shape is not a tuple). Its shape is `(operands, result, context)`, a
    copy's `(result, operand, ...)`."""
    if not inst.opcode.endswith("-start"):
        return inst.shape
    parts = _compiler.tuple_elements(inst.shape)
    if len(parts) < 2:
        return ""
    return parts[0] if inst.opcode == "copy-start" else parts[1]
