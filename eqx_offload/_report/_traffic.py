"""Host <-> device traffic of one step: every `device_put` between memory spaces in
the traced program, times the length of the scans around it, with what it moves.

Counted on the traced program (the jaxpr `memory_report` compiles), for the
platform it is compiled for: of a `jax.lax.platform_dependent` choice (the
optimizer update, the read-ahead loop), only the branch that platform runs is
counted. Each transfer is attributed by following its operand back to where it
came from: a parameter, optimizer state or batch leaf of the step's arguments
(through the slicing of scans and of the streamed update), or a residual saved
under a checkpoint name (`Policy(offload=...)`); what is computed in the step (a
gradient, an accumulator, a new parameter written back) is attributed by the
phase it moves in and the named scope around it.

This is what the program asks for; `_compiled_traffic.py` reads what a TPU
compiler kept of it. `table_lines` prints either as a section of a report's table.
"""

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from .. import _jaxpr, _scopes
from .._custom_types import Direction
from .._memory_kinds import is_host_aval
from ._units import size_text


class Transfer(NamedTuple):
    """Bytes moved per step in one direction, for one kind of value."""

    direction: Direction
    phase: Literal["forward/backward", "update"]
    what: str  # "params", "opt_state", "gradients", "residuals", "batch", "other"
    name: str  # a leaf path, a checkpoint name, or ""
    bytes: int


class _Origin(NamedTuple):
    what: str
    name: str


_UNKNOWN = _Origin("", "")


def count(
    closed: Any, inputs: Sequence[tuple[str, str]], platform: str
) -> tuple[Transfer, ...]:
    """The transfers of the program `closed` (a `ClosedJaxpr`) run on `platform`
    ("tpu", "cpu", ...), whose inputs are `inputs` (what, name) in order, summed
    by direction, phase, what and name."""
    totals: dict[tuple, int] = defaultdict(int)
    jaxpr = closed.jaxpr
    origins: dict[Any, _Origin] = {}
    if len(inputs) == len(jaxpr.invars):
        origins = {v: _Origin(*i) for v, i in zip(jaxpr.invars, inputs)}
    _walk(jaxpr, origins, 1, platform, totals)
    rows = [
        Transfer(direction, phase, what, name, n)
        for (direction, phase, what, name), n in totals.items()
        if n
    ]
    return tuple(sorted(rows, key=lambda t: (t.direction, t.phase, t.what, t.name)))


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize


def _scope(eqn: Any) -> str:
    return str(eqn.source_info.name_stack)


def _get(origins: dict, v: Any) -> _Origin:
    if _jaxpr.is_literal(v):
        return _UNKNOWN
    return origins.get(v, _UNKNOWN)


def _walk(
    jaxpr: Any,
    origins: dict,
    times: int,
    platform: str,
    totals: dict,
    update: bool = False,
) -> None:
    """Counts the transfers of `jaxpr` into `totals`, `times` times each (the
    scans around it); `update`: inside the optimizer update."""
    branch_of: dict[Any, int] = {}  # platform_index outputs: the branch taken
    for eqn in jaxpr.eqns:
        ins = [_get(origins, v) for v in eqn.invars]
        # Sub-programs are traced with name stacks of their own.
        inside = update or _scopes.UPDATE in _scope(eqn)
        if _jaxpr.is_platform_index(eqn):
            found = _branch(_jaxpr.platform_index_platforms(eqn), platform)
            if found is not None:
                branch_of[eqn.outvars[0]] = found
            continue
        if _jaxpr.is_device_put(eqn):
            _count_puts(eqn, ins, times, totals, inside)
            for out, origin in zip(eqn.outvars, ins):
                origins[out] = origin
            continue
        if _jaxpr.is_optimization_barrier(eqn):
            for out, origin in zip(eqn.outvars, ins):
                origins[out] = origin
            continue
        if _jaxpr.is_checkpoint_name(eqn) and eqn.invars:
            for out in eqn.outvars:
                origins[out] = _Origin("residuals", _jaxpr.checkpoint_name_of(eqn))
            continue
        if _jaxpr.is_scan(eqn):
            scan = _jaxpr.scan_layout(eqn)
            body = scan.body
            # A carry is the leaf it starts as only in the first iteration: it
            # is not followed (the streamed update names what it carries).
            inner = dict(zip(body.invars, ins))
            for v in body.invars[scan.consts : scan.consts + scan.carry]:
                inner.pop(v, None)
            _walk(body, inner, times * scan.length, platform, totals, inside)
            _pass_out(body, inner, eqn, origins)
            continue
        if _jaxpr.is_cond(eqn):
            branches = _jaxpr.cond_branches(eqn)
            index = branch_of.get(eqn.invars[0])
            platforms = _jaxpr.cond_platforms(eqn)
            if platforms:
                index = _branch(platforms, platform)
            # A conditional that is not a platform's choice: its largest branch.
            best: tuple[int, dict, dict] | None = None
            for i, branch in enumerate(branches):
                if index is not None and i != index:
                    continue
                inner = dict(zip(branch.jaxpr.invars, ins[1:]))
                mine: dict[tuple, int] = defaultdict(int)
                _walk(branch.jaxpr, inner, times, platform, mine, inside)
                if best is None or sum(mine.values()) > sum(best[1].values()):
                    best = (i, mine, inner)
            if best is not None:
                i, mine, inner = best
                for key, n in mine.items():
                    totals[key] += n
                _pass_out(branches[i].jaxpr, inner, eqn, origins)
            continue
        if _jaxpr.is_while(eqn):  # not made by this library; counted once
            loop = _jaxpr.while_layout(eqn)
            inner = dict(zip(loop.body.invars, ins[loop.cond_consts :]))
            _walk(loop.body, inner, times, platform, totals, inside)
            continue
        subs = _jaxpr.sub_jaxprs(eqn)
        if subs is not None:  # a call: `jax.jit`, `jax.checkpoint`, ...
            (sub,) = subs
            inner = {sub.jaxpr.invars[k]: ins[i] for i, k in sub.operands.items()}
            _walk(sub.jaxpr, inner, times, platform, totals, inside)
            _pass_out(sub.jaxpr, inner, eqn, origins)
            continue
        if _jaxpr.keeps_first_operand(eqn) and ins and ins[0] != _UNKNOWN:
            for out in eqn.outvars:
                origins[out] = ins[0]


def _branch(platforms: tuple, platform: str) -> int | None:
    """The branch `jax.lax.platform_dependent` takes on `platform`, of branches
    for `platforms` (`None`: the default)."""
    default = None
    for i, group in enumerate(platforms):
        if group is None:
            default = i
        elif platform in group:
            return i
    return default


def _pass_out(sub: Any, inner: dict, eqn: Any, origins: dict) -> None:
    for out, v in zip(eqn.outvars, sub.outvars):
        found = _get(inner, v)
        if found != _UNKNOWN:
            origins[out] = found


def _count_puts(eqn: Any, ins: list, times: int, totals: dict, update: bool) -> None:
    phase = "update" if update else "forward/backward"
    scope_label = label(_scope(eqn))
    destinations = _jaxpr.device_put_destinations(eqn)
    for v, origin, where in zip(eqn.invars, ins, destinations):
        aval = v.aval
        if not isinstance(where, jax.memory.Space):
            continue
        src_host, dst_host = is_host_aval(aval), where == jax.memory.Space.Host
        if src_host == dst_host:
            continue
        direction = "device_to_host" if dst_host else "host_to_device"
        what, name = origin
        if not what:
            what, name = guess(scope_label, update)
        elif (
            what == "opt_state" and not update and name.startswith(_scopes.COPIES + ".")
        ):
            what, name = "params", name[len(_scopes.COPIES) + 1 :]  # a compute copy
        totals[direction, phase, what, name] += _nbytes(aval) * times


def _is_copy(name: str) -> bool:
    """Whether an optimizer-state path is a compute copy's."""
    return name.startswith(_scopes.COPIES + ".")


def label(scope: str) -> str:
    """The innermost named scope that is a leaf label (`grad.<path>`,
    `opt_state.<path>` or a path), without JAX's transformation wrappers."""
    for part in reversed(scope.split("/")):
        part = part.strip()
        while "(" in part and part.endswith(")"):
            part = part[part.index("(") + 1 : -1]
        if part and part not in (_scopes.UPDATE, "rematted_computation"):
            return part
    return ""


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
    header = f"{f'moved per step ({how})':<34}{'to device':>14}{'to host':>14}"
    lines = [header, "-" * len(header)]
    totals: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for t in transfers:
        by = totals[t.phase, t.what]
        by[t.direction] = by.get(t.direction, 0) + t.bytes
    for (phase, what), by in totals.items():
        label = f"  {what} ({'update' if phase == 'update' else 'fwd/bwd'})"
        h2d, d2h = by.get("host_to_device", 0), by.get("device_to_host", 0)
        lines.append(f"{label:<34}{size_text(h2d):>14}{size_text(d2h):>14}")
    return lines
