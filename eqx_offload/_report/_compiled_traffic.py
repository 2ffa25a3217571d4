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
"""

import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from .. import _vocab_blocks
from .._update import UPDATE_SCOPE
from . import _traffic
from ._traffic import Transfer


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
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
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


class _Array(NamedTuple):
    nbytes: int
    host: bool


class _Inst(NamedTuple):
    name: str
    shape: str
    opcode: str
    args: str  # the text between the parentheses (a constant's value)
    operands: list[str]
    attrs: str


class _Comp(NamedTuple):
    name: str
    insts: dict[str, _Inst]
    params: dict[int, str]  # parameter number -> instruction name
    root: str


def _arrays(shape: str) -> list[_Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _BYTES and not dtype.startswith(("f8", "s4", "u4")):
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        size = _BYTES.get(dtype, 1)
        out.append(_Array(n * size, "S(5)" in (layout or "")))
    return out


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def _parse_inst(line: str) -> _Inst | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if not line.startswith("%") or " = " not in line:
        return None
    name, rest = line[1:].split(" = ", 1)
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    end = _closing(rest, paren)
    args = rest[paren + 1 : end]
    operands = re.findall(r"%([^\s,()]+)", args)
    return _Inst(name, shape, opcode, args, operands, rest[end + 1 :])


def parse(text: str) -> tuple[dict[str, _Comp], str]:
    """The computations of an HLO module's text, and the entry's name."""
    comps: dict[str, _Comp] = {}
    entry = ""
    current: _Comp | None = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) \(.*\{\s*$", line)
        if header:
            current = _Comp(header[2], {}, {}, "")
            if header[1]:
                entry = header[2]
            continue
        if line.startswith("}"):
            if current is not None:
                comps[current.name] = current
            current = None
            continue
        if current is None:
            continue
        inst = _parse_inst(line)
        if inst is None:
            continue
        current.insts[inst.name] = inst
        if line.strip().startswith("ROOT "):
            current = current._replace(root=inst.name)
        if inst.opcode == "parameter":
            if re.fullmatch(r"\d+", inst.args.strip()):
                current.params[int(inst.args)] = inst.name
    return comps, entry


def _attr(attrs: str, key: str) -> str | None:
    found = re.search(rf"\b{key}=%([^\s,}}]+)", attrs)
    return found[1] if found else None


def _op_name(attrs: str) -> str:
    found = re.search(r'op_name="([^"]*)"', attrs)
    return found[1] if found else ""


class _Walker:
    """Visits the computations reachable from the entry, with the number of times
    each runs per step, and follows values back to the entry's parameters."""

    def __init__(self, comps: dict[str, _Comp], entry: str):
        self.comps = comps
        self.entry = entry
        # computation -> (caller computation, calling instruction)
        self.callers: dict[str, tuple[str, _Inst]] = {}

    def visits(self) -> Iterator[tuple[_Comp, int]]:
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

    def _callees(self, comp: _Comp, inst: _Inst) -> list[tuple[str, int]]:
        if inst.opcode == "while":
            body = _attr(inst.attrs, "body")
            trips = self._trips(comp, inst, _attr(inst.attrs, "condition"))
            return [(body, trips)] if body else []
        if inst.opcode.endswith(("-done", "-update")):
            return []  # the computation an asynchronous start called
        if inst.opcode == "conditional":
            found = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
            names = re.findall(r"%([^\s,}]+)", found[1]) if found else []
            true = _attr(inst.attrs, "true_computation")
            false = _attr(inst.attrs, "false_computation")
            names += [n for n in (true, false) if n]
            # One branch runs; which one the text does not say: the first (the
            # platform choices the library makes are resolved by then).
            return [(n, 1) for n in names[:1]]
        callee = _attr(inst.attrs, "calls")
        return [(callee, 1)] if callee else []

    def _trips(self, comp: _Comp, inst: _Inst, cond: str | None) -> int:
        """How many times the loop `inst` runs: its known trip count, or `N - i0`
        for a condition `i < N` on a counter that starts at the constant `i0`
        (1 if neither is found)."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
        if known:
            return int(known[1])
        c = self.comps.get(cond or "")
        if c is None or not c.root:
            return 1
        root = c.insts[c.root]
        if root.opcode != "compare" or "direction=LT" not in root.attrs:
            return 1
        counter, limit = (c.insts.get(o) for o in root.operands[:2])
        if limit is None or counter is None:
            return 1
        value = _constant(limit)
        if value is None:
            return 1
        start = 0
        if counter.opcode == "get-tuple-element":
            index = _index(counter.attrs)
            init = comp.insts.get(inst.operands[0]) if inst.operands else None
            if init is not None and init.opcode == "tuple" and index is not None:
                element = comp.insts.get(init.operands[index])
                start = (_constant(element) if element else None) or 0
        return max(value - start, 0)

    def origin(self, comp: _Comp, name: str, index: int | None = None) -> int | None:
        """The number of the entry parameter that value `name` of `comp` (tuple
        element `index`) is, or a piece of; None if it is computed."""
        for _ in range(200):
            inst = comp.insts.get(name)
            if inst is None:
                return None
            op = inst.opcode
            if op == "parameter":
                if comp.name == self.entry:
                    return int(inst.args)
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
                name, index = inst.operands[0], _index(inst.attrs)
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


def _constant(inst: _Inst) -> int | None:
    if inst.opcode != "constant":
        return None
    return int(inst.args) if re.fullmatch(r"-?\d+", inst.args.strip()) else None


def _index(attrs: str) -> int | None:
    found = re.search(r"index=(\d+)", attrs)
    return int(found[1]) if found else None


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
    comps, entry = parse(text)
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
            scope = _op_name(inst.attrs) or _users_scope(comp, inst.name)
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


def _results(entry: _Comp) -> dict[str, int]:
    """The instructions whose values the entry returns: name -> output number."""
    root = entry.insts.get(entry.root)
    if root is None or root.opcode != "tuple":
        return {}
    return {name: i for i, name in enumerate(root.operands)}


def _output(comp: _Comp, inst: _Inst, results: dict[str, int]) -> int | None:
    """The output `inst` writes (directly, or through its asynchronous done)."""
    if inst.name in results:
        return results[inst.name]
    for user in comp.insts.values():
        if user.opcode.endswith("-done") and user.operands[:1] == [inst.name]:
            return results.get(user.name)
    return None


def _users_scope(comp: _Comp, name: str, depth: int = 3) -> str:
    """The `op_name` of the first instruction that uses `name` (through an
    asynchronous start's done), for an instruction the compiler made."""
    for inst in comp.insts.values():
        if name in inst.operands:
            found = _op_name(inst.attrs)
            if found:
                return found
            if depth and (inst.opcode.endswith("-done") or inst.opcode == "bitcast"):
                found = _users_scope(comp, inst.name, depth - 1)
                if found:
                    return found
    return ""


# Parts of an `op_name` that are JAX's structure, not a named scope.
_STRUCTURE = re.compile(
    r"^(while|body|cond|closed_call|checkpoint|remat|rematted_computation"
    r"|branch_\d+_fun|jit\(.*\)|vmap\(.*\)|pjit|scan|.*_p"
    rf"|{_vocab_blocks.SCOPE})$"
)


def _label(op_name: str) -> str:
    """The innermost named scope of an instruction's `op_name` (without the
    operation's own name and JAX's transformation wrappers)."""
    parts = op_name.split("/")[1:-1]  # the jitted function's name; the operation
    for part in reversed(parts):
        while "(" in part and part.endswith(")") and not part.startswith("jit("):
            part = part[part.index("(") + 1 : -1]
        if part and not _STRUCTURE.match(part) and part != UPDATE_SCOPE:
            return part
    return ""


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, b, ...)`."""
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            out.append(shape[start:i].strip())
            start = i + 1
    return out


_MOVES = ("dynamic-slice", "slice", "copy", "dynamic-update-slice")


def _moved(comp: _Comp, inst: _Inst) -> tuple[str, int, str] | None:
    """(direction, bytes, the operand moved) if `inst` moves data between host and
    device memory: synchronously, or the start of an asynchronous move (whose
    shape is `(operands, result, context)`; a copy's `(result, operand, ...)`)."""
    op, shape = inst.opcode, inst.shape
    if op.endswith("-start") and op[: -len("-start")] in _MOVES:
        op = op[: -len("-start")]
        parts = _elements(shape)
        if len(parts) < 2:
            return None
        shape = parts[0] if op == "copy" else parts[1]
    elif op not in _MOVES:
        return None
    out = _arrays(shape)
    if len(out) != 1:
        return None
    operands = [comp.insts.get(o) for o in inst.operands]
    if not operands or operands[0] is None:
        return None
    first = _arrays(operands[0].shape)
    if len(first) != 1:
        return None
    if op == "dynamic-update-slice":
        update = operands[1] if len(operands) > 1 else None
        moved = _arrays(update.shape) if update is not None else []
        if out[0].host and len(moved) == 1 and not moved[0].host:
            return "device_to_host", moved[0].nbytes, inst.operands[0]
        return None
    if first[0].host and not out[0].host:
        return "host_to_device", out[0].nbytes, inst.operands[0]
    if out[0].host and not first[0].host and op == "copy":
        return "device_to_host", out[0].nbytes, inst.operands[0]
    return None
