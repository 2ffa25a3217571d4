"""Host <-> device traffic of one step read from the *compiled* program: the TPU
compiler's HLO after optimisation, where host memory is memory space 5 (`S(5)` in
a layout), so every transfer the compiler kept is an instruction with a host
operand and a device result (a read: `dynamic-slice`, `slice`, `copy`) or the
other way round (a write: `dynamic-update-slice` into a host buffer, `copy`), often
wrapped in an asynchronous computation. Each is counted once per iteration of the
`while` loops around it (the trip count read from the loop's condition, `i < N`).

What a transfer moves is read the way `_traffic.py` reads the traced program: its
operand followed back (through tuples, loops and calls) to an argument of the
step, whose XLA name (`model_dynamic[3]`, `opt_dynamic[0]`, ...) says which leaf it
is; failing that, the named scope in the instruction's `op_name` (the streamed
update's `grad.<path>`, `opt_state.<path>`, `<path>`).

The text is read in `_compiler.py`; this module reads the transfers off it.
"""

from collections import defaultdict
from collections.abc import Iterator, Sequence

from .. import _compiler, _vocab_blocks
from .._compiler import Computation, Instruction
from .._update import UPDATE_SCOPE
from . import _traffic
from ._traffic import Transfer


# Operations whose result is (a piece of, a view of) their first operand.
_PASS = {
    "bitcast",
    "copy",
    "copy-start",
    "copy-done",
    "dynamic-slice",
    "slice",
    "reshape",
    "dynamic-update-slice",
    "async-done",
    "dynamic-slice-done",
    "dynamic-update-slice-done",
    "slice-done",
}


class _Walker:
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
            comp = self.comps.get(name)
            if comp is None:
                continue
            yield comp, times
            for inst in comp.insts.values():
                for callee, n in self._callees(comp, inst):
                    self.callers.setdefault(callee, (comp.name, inst))
                    stack.append((callee, times * n))

    def _callees(self, comp: Computation, inst: Instruction) -> list[tuple[str, int]]:
        if inst.opcode == "while":
            body = inst.computation("body")
            trips = self._trips(comp, inst, inst.computation("condition"))
            return [(body, trips)] if body else []
        if inst.opcode.endswith(("-done", "-update")):
            return []  # the computation an asynchronous start called
        if inst.opcode == "conditional":
            names = inst.branches
            # One branch runs; which one the text does not say: the first (the
            # platform choices the library makes are resolved by then).
            return [(n, 1) for n in names[:1]]
        callee = inst.computation("calls")
        return [(callee, 1)] if callee else []

    def _trips(self, comp: Computation, inst: Instruction, cond: str | None) -> int:
        """How many times the loop `inst` runs: its known trip count, or `N - i0`
        for a condition `i < N` on a counter that starts at the constant `i0`
        (1 if neither is found)."""
        if inst.known_trip_count is not None:
            return inst.known_trip_count
        c = self.comps.get(cond or "")
        if c is None or not c.root:
            return 1
        root = c.insts[c.root]
        if root.opcode != "compare" or root.direction != "LT":
            return 1
        counter, limit = (c.insts.get(o) for o in root.operands[:2])
        if limit is None or counter is None:
            return 1
        value = limit.constant
        if value is None:
            return 1
        start = 0
        if counter.opcode == "get-tuple-element":
            index = counter.index
            init = comp.insts.get(inst.operands[0]) if inst.operands else None
            if init is not None and init.opcode == "tuple" and index is not None:
                element = comp.insts.get(init.operands[index])
                start = (element.constant if element else None) or 0
        return max(value - start, 0)

    def origin(
        self, comp: Computation, name: str, index: int | None = None
    ) -> int | None:
        """The number of the entry parameter that value `name` of `comp` (tuple
        element `index`) is, or a piece of; None if it is computed."""
        for _ in range(200):
            inst = comp.insts.get(name)
            if inst is None:
                return None
            op = inst.opcode
            if op == "parameter":
                if comp.name == self.entry:
                    return inst.parameter_number
                caller = self.callers.get(comp.name)
                if caller is None:
                    return None
                caller_comp, call = self.comps[caller[0]], caller[1]
                number = next((k for k, v in comp.params.items() if v == name), None)
                if call.opcode == "while":
                    name = call.operands[0]  # the loop's initial tuple
                elif number is not None and number < len(call.operands):
                    name = call.operands[number]
                else:
                    return None
                comp = caller_comp
                continue
            if op == "get-tuple-element":
                name, index = inst.operands[0], inst.index
                continue
            if op in ("tuple", "opt-barrier") and index is not None:
                if op == "opt-barrier":
                    name = inst.operands[0]
                    continue
                if index >= len(inst.operands):
                    return None
                name, index = inst.operands[index], None
                continue
            if op == "while":
                name = inst.operands[0]
                continue
            if op in _PASS or op.endswith("-done"):
                if not inst.operands:
                    return None
                name, index = inst.operands[0], None
                continue
            if op == "async-start" and inst.operands:
                name, index = inst.operands[0], None
                continue
            return None
        return None


def count(
    text: str,
    inputs: Sequence[tuple[str, str]],
    outputs: Sequence[tuple[str, str]],
    traced: Sequence[Transfer],
) -> tuple[Transfer, ...]:
    """The transfers of a compiled module (its HLO text), summed by direction,
    phase, what and name. `inputs`: (what, name) of each of its parameters;
    `outputs`: of its first outputs (a step's new parameters and optimizer state),
    written back in the update; `traced`: the traced program's transfers, whose
    phase a transfer the compiler made (without a named scope) takes when it
    moves the same leaf."""
    comps, entry = _compiler.parse_hlo(text)
    walker = _Walker(comps, entry)
    results = _results(comps[entry]) if entry in comps else {}
    phases: dict[tuple, set[str]] = defaultdict(set)
    for t in traced:
        phases[t.direction, t.what, t.name].add(t.phase)
    totals: dict[tuple, int] = defaultdict(int)
    for comp, times in walker.visits():
        for inst in comp.insts.values():
            moved = _moved(comp, inst)
            if moved is None:
                continue
            direction, nbytes, source = moved
            scope = inst.op_name or _users_scope(comp, inst.name)
            update = UPDATE_SCOPE in scope
            number = walker.origin(comp, source)
            found = (
                inputs[number] if number is not None and number < len(inputs) else None
            )
            output = _output(comp, inst, results) if comp.name == entry else None
            if output is not None and output < len(outputs):
                (what, name), update = outputs[output], True
            elif found is not None and found[0]:
                what, name = found
                if what == "opt_state" and not update and name.startswith("copies."):
                    what, name = "params", name[len("copies.") :]
            else:
                what, name = _traffic.guess(_label(scope), update)
                if what == "gradients" and not name and not update:
                    # Computed in the forward or backward pass: a gradient, an
                    # offloaded residual or an accumulator; the compiled program
                    # does not say which.
                    what = "computed"
            phase = "update" if update else "forward/backward"
            if not scope and len(phases[direction, what, name]) == 1:
                (phase,) = phases[direction, what, name]
            totals[direction, phase, what, name] += nbytes * times
    rows = [Transfer(d, p, w, n, b) for (d, p, w, n), b in totals.items() if b]
    return tuple(sorted(rows, key=lambda t: (t.direction, t.phase, t.what, t.name)))


def _results(entry: Computation) -> dict[str, int]:
    """The instructions whose values the entry returns: name -> output number."""
    root = entry.insts.get(entry.root)
    if root is None or root.opcode != "tuple":
        return {}
    return {name: i for i, name in enumerate(root.operands)}


def _output(
    comp: Computation, inst: Instruction, results: dict[str, int]
) -> int | None:
    """The output `inst` writes (directly, or through its asynchronous done)."""
    if inst.name in results:
        return results[inst.name]
    for user in comp.insts.values():
        if user.opcode.endswith("-done") and user.operands[:1] == [inst.name]:
            return results.get(user.name)
    return None


def _users_scope(comp: Computation, name: str, depth: int = 3) -> str:
    """The `op_name` of the first instruction that uses `name` (through an
    asynchronous start's done), for an instruction the compiler made."""
    for inst in comp.insts.values():
        if name in inst.operands:
            found = inst.op_name
            if found:
                return found
            if depth and (inst.opcode.endswith("-done") or inst.opcode == "bitcast"):
                found = _users_scope(comp, inst.name, depth - 1)
                if found:
                    return found
    return ""


def _label(op_name: str) -> str:
    """The innermost named scope of an instruction's `op_name` that is not one of
    the library's own."""
    ours = (_vocab_blocks.SCOPE, UPDATE_SCOPE)
    scopes = [s for s in _compiler.named_scopes(op_name) if s not in ours]
    return scopes[-1] if scopes else ""


_MOVES = ("dynamic-slice", "slice", "copy", "dynamic-update-slice")


def _moved(comp: Computation, inst: Instruction) -> tuple[str, int, str] | None:
    """(direction, bytes, the operand moved) if `inst` moves data between host and
    device memory: synchronously, or the start of an asynchronous move (whose
    shape is `(operands, result, context)`; a copy's `(result, operand, ...)`)."""
    op, shape = inst.opcode, inst.shape
    if op.endswith("-start") and op[: -len("-start")] in _MOVES:
        op = op[: -len("-start")]
        parts = _compiler.tuple_elements(shape)
        if len(parts) < 2:
            return None
        shape = parts[0] if op == "copy" else parts[1]
    elif op not in _MOVES:
        return None
    out = _compiler.arrays(shape)
    if len(out) != 1:
        return None
    operands = [comp.insts.get(o) for o in inst.operands]
    if not operands or operands[0] is None:
        return None
    first = _compiler.arrays(operands[0].shape)
    if len(first) != 1:
        return None
    if op == "dynamic-update-slice":
        update = operands[1] if len(operands) > 1 else None
        moved = _compiler.arrays(update.shape) if update is not None else []
        if out[0].host and len(moved) == 1 and not moved[0].host:
            return "device_to_host", moved[0].nbytes, inst.operands[0]
        return None
    if first[0].host and not out[0].host:
        return "host_to_device", out[0].nbytes, inst.operands[0]
    if out[0].host and not first[0].host and op == "copy":
        return "device_to_host", out[0].nbytes, inst.operands[0]
    return None
