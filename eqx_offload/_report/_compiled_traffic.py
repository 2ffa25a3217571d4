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
from collections.abc import Sequence

from .. import _compiler, _scopes
from .._compiler import Computation, Instruction
from . import _traffic
from ._costs import Program
from ._hlo_program import made, moved
from ._traffic import Transfer


def count(
    program: Program,
    inputs: Sequence[tuple[str, str]],
    outputs: Sequence[tuple[str, str]],
    traced: Sequence[Transfer],
) -> tuple[Transfer, ...]:
    """The transfers of a compiled module (`program`), summed by direction,
    phase, what and name. `inputs`: (what, name) of each of its parameters;
    `outputs`: of its first outputs (a step's new parameters and optimizer state),
    written back in the update; `traced`: the traced program's transfers, whose
    phase a transfer the compiler made (without a named scope) takes when it
    moves the same leaf."""
    comps, entry, walker = program.comps, program.entry, program.walker
    phases: dict[tuple, set[str]] = defaultdict(set)
    for t in traced:
        phases[t.direction, t.what, t.name].add(t.phase)
    results = _results(comps[entry]) if entry in comps else {}

    def key(
        comp: Computation, inst: Instruction, direction: str, source: str, label: str
    ) -> tuple[str, str, str, str]:
        """(direction, phase, what, name) of one move of `inst`."""
        scope = label or inst.op_name or _users_scope(comp, inst.name)
        if _compiler.in_host_compute(scope) and _scopes.UPDATE in scope:
            # A move XLA:GPU makes for a host computation's operand or result
            # (named after the computation that uses it).
            scope = _HOST_CALL_SCOPES[direction]
        update = _scopes.UPDATE in scope
        number = walker.origin(comp, source)
        found = inputs[number] if number is not None and number < len(inputs) else None
        output = _output(comp, inst, results) if comp.name == entry else None
        if output is not None and output < len(outputs):
            (what, name), update = outputs[output], True
        else:
            what, name = _what(found, scope, update)
        phase = "update" if update else "forward/backward"
        if not scope and len(phases[direction, what, name]) == 1:
            (phase,) = phases[direction, what, name]
        return direction, phase, what, name

    totals: dict[tuple, int] = defaultdict(int)
    for comp, times in walker.visits():
        for inst in comp.insts.values():
            for direction, nbytes, source, label in _moves(comp, inst):
                totals[key(comp, inst, direction, source, label)] += nbytes * times
    return _traffic.rows(totals)


def _what(found: tuple[str, str] | None, scope: str, update: bool) -> tuple[str, str]:
    """What a move carries and its name (`_traffic.named`): the step argument it
    comes from (`found`), else what its named scope says."""
    label = _traffic.label(scope, (_scopes.VOCAB_BLOCKS, _scopes.UPDATE))
    what, name = _traffic.named(found or ("", ""), label, update)
    if what == "gradients" and not name and not update:
        # Computed in the forward or backward pass: a gradient, an offloaded
        # residual or an accumulator; the compiled program does not say which.
        what = "computed"
    return what, name


# The `op_name` a host computation's own moves are described by (`_moves`): the
# values it reads from device memory are the gradients (or device-resident
# parameters and state, found by their argument), what it writes there parameters.
_HOST_CALL_SCOPES = {
    "device_to_host": f"jit(step)/{_scopes.UPDATE}/{_scopes.GRAD}/host_call",
    "host_to_device": f"jit(step)/{_scopes.UPDATE}/{_scopes.PARAMS}/host_call",
}


def _moves(comp: Computation, inst: Instruction) -> list[tuple[str, int, str, str]]:
    """(direction, bytes, the operand moved, a named scope or "") of each move
    `inst` makes: a transfer (`moved`), or a call of a host computation
    (`update="host"`), which on a TPU takes its operands in device memory to the
    host and brings its results in device memory back itself."""
    if not inst.is_host_call:
        found = moved(comp, inst)
        return [] if found is None else [(*found, "")]
    # The optimizer update's (a host computation elsewhere keeps its own name).
    update = _scopes.UPDATE in inst.op_name
    scopes = _HOST_CALL_SCOPES if update else {d: "" for d in _HOST_CALL_SCOPES}
    out = []
    for name in inst.operands:
        operand = comp.insts.get(name)
        for array in _compiler.arrays(operand.shape) if operand is not None else []:
            if not array.host:
                direction = "device_to_host"
                out.append((direction, array.nbytes, name, scopes[direction]))
    for array in _compiler.arrays(made(inst)):
        if not array.host:
            direction = "host_to_device"
            out.append((direction, array.nbytes, inst.name, scopes[direction]))
    return out


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
            if inst.op_name:
                return inst.op_name
            if depth and (inst.opcode.endswith("-done") or inst.opcode == "bitcast"):
                if found := _users_scope(comp, inst.name, depth - 1):
                    return found
    return ""
