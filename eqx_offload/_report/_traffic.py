"""Host <-> device traffic of one step, as the traced program asks for it.

`_jaxpr_traffic.py` reads the moves from the jaxpr `memory_report` compiles, each
with its operand's origin: a parameter, optimizer state or batch leaf of the step's
arguments, or a residual saved under a checkpoint name (`Policy(offload=...)`). What
is computed in the step (a gradient, an accumulator, a new parameter written back)
is named here by the phase it moves in and the named scope around it.

This is what the program asks for; `_compiled_traffic.py` reads what a TPU
compiler kept of it. `table_lines` prints either as a section of a report's table.
"""

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from .. import _compiler, _jaxpr_traffic, _scopes
from .._custom_types import Direction
from ._units import header, row


class Transfer(NamedTuple):
    """Bytes moved per step in one direction, for one kind of value."""

    direction: Direction
    phase: Literal["forward/backward", "update"]
    what: str  # "params", "opt_state", "gradients", "residuals", "batch", "other"
    name: str  # a leaf path, a checkpoint name, or ""
    bytes: int


def count(
    closed: Any, inputs: Sequence[tuple[str, str]], platform: str
) -> tuple[Transfer, ...]:
    """The transfers of the program `closed` (a `ClosedJaxpr`) run on `platform`
    ("tpu", "cpu", ...), whose inputs are `inputs` (what, name) in order, summed
    by direction, phase, what and name."""
    totals: dict[tuple, int] = defaultdict(int)
    for put, n in _jaxpr_traffic.puts(closed, inputs, platform).items():
        # (A name stack has no function or operation around it.)
        what, name = named((put.what, put.name), label(f"/{put.scope}/"), put.update)
        phase = "update" if put.update else "forward/backward"
        totals[put.direction, phase, what, name] += n
    return rows(totals)


def rows(totals: dict[tuple, int]) -> tuple[Transfer, ...]:
    """The transfers of `totals`, bytes by (direction, phase, what, name), sorted."""
    found = (Transfer(d, p, w, name, n) for (d, p, w, name), n in totals.items())
    return tuple(sorted(t for t in found if t.bytes))


def named(origin: tuple[str, str], label: str, update: bool) -> tuple[str, str]:
    """What a move carries, and its name: the leaf of the step's arguments it
    comes from (`origin`, (what, name); a compute copy's is its parameter's), else
    (`("", "")`) what the named scope around it (`label`) says (`guess`)."""
    what, name = origin
    if not what:
        return guess(label, update)
    if what == "opt_state" and not update and name.startswith(_scopes.COPIES + "."):
        return "params", name[len(_scopes.COPIES) + 1 :]
    return what, name


def label(op_name: str, skip: tuple[str, ...] = (_scopes.UPDATE,)) -> str:
    """The innermost named scope of an `op_name` (`_compiler.named_scopes`) that is
    not one of `skip`: a leaf label (`grad.<path>`, `opt_state.<path>` or a path)."""
    scopes = [s for s in _compiler.named_scopes(op_name) if s not in skip]
    return scopes[-1] if scopes else ""


def guess(label: str, update: bool) -> tuple[str, str]:
    """What a computed value moving is, from the named scope around it: the
    streamed update's labels (`grad.<path>`, `opt_state.<path>`, `<path>`) and
    the step's (`grad`, `params`, `opt_state`)."""
    for prefix, what in ((_scopes.GRAD, "gradients"), (_scopes.OPT_STATE, "opt_state")):
        if label == prefix or label.startswith(prefix + "."):
            return what, label[len(prefix) + 1 :]
    if update:
        return "params", "" if label == _scopes.PARAMS else label
    # Computed in the forward or backward pass and moved: a gradient written to
    # the host, or an accumulator read back (micro-batches).
    return "gradients", label


def table_lines(transfers: tuple[Transfer, ...], how: str) -> list[str]:
    """A traffic section of the table: bytes per step by phase and kind."""
    lines = header(f"moved per step ({how})", "to device", "to host")
    totals: dict[tuple[str, str], dict[str, int]] = defaultdict(Counter)
    for t in transfers:
        totals[t.phase, t.what][t.direction] += t.bytes
    for (phase, what), by in totals.items():
        label = f"  {what} ({'update' if phase == 'update' else 'fwd/bwd'})"
        lines.append(row(label, by["host_to_device"], by["device_to_host"]))
    return lines
