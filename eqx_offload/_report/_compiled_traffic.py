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

from .. import _compiler, _vocab_blocks
from .._compiler import Computation, Instruction
from .._update import UPDATE_SCOPE
from . import _traffic
from ._hlo_program import moved, Walker
from ._traffic import Transfer


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
    walker = Walker(comps, entry)
    results = _results(comps[entry]) if entry in comps else {}
    phases: dict[tuple, set[str]] = defaultdict(set)
    for t in traced:
        phases[t.direction, t.what, t.name].add(t.phase)
    totals: dict[tuple, int] = defaultdict(int)
    for comp, times in walker.visits():
        for inst in comp.insts.values():
            found_move = moved(comp, inst)
            if found_move is None:
                continue
            direction, nbytes, source = found_move
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
