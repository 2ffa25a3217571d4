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
from collections.abc import Callable, Sequence
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


class _Source(NamedTuple):
    what: str
    name: str


_UNKNOWN = _Source("", "")


def count(
    closed: Any, inputs: Sequence[tuple[str, str]], platform: str
) -> tuple[Transfer, ...]:
    """The transfers of the program `closed` (a `ClosedJaxpr`) run on `platform`
    ("tpu", "cpu", ...), whose inputs are `inputs` (what, name) in order, summed
    by direction, phase, what and name."""
    totals: dict[tuple, int] = defaultdict(int)
    jaxpr = closed.jaxpr
    origins: dict[Any, _Source] = {}
    if len(inputs) == len(jaxpr.invars):
        origins = {v: _Source(*i) for v, i in zip(jaxpr.invars, inputs)}
    _walk(jaxpr, origins, _Counting(platform, totals))
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


def _get(origins: dict, v: Any) -> _Source:
    if _jaxpr.is_literal(v):
        return _UNKNOWN
    return origins.get(v, _UNKNOWN)


class _Counting(NamedTuple):
    """How a (sub-)program's transfers count: for which platform, into which
    totals, how many times a step runs it (the scans around it), and whether it
    is in the optimizer update."""

    platform: str
    totals: dict
    times: int = 1
    update: bool = False


class _Frame(NamedTuple):
    """One jaxpr's values: where each comes from, and the branch each
    `platform_index` output chooses."""

    origins: dict
    branch_of: dict


def _walk(jaxpr: Any, origins: dict, walk: _Counting) -> None:
    """Counts the transfers of `jaxpr` into `walk.totals`, `walk.times` times each;
    `origins` holds where its inputs come from, and gains its values'."""
    frame = _Frame(origins, {})
    for eqn in jaxpr.eqns:
        ins = [_get(origins, v) for v in eqn.invars]
        # Sub-programs are traced with name stacks of their own.
        update = walk.update or _scopes.UPDATE in _scope(eqn)
        handle = next((h for match, h in _HANDLERS if match(eqn)), _other)
        handle(frame, eqn, ins, walk._replace(update=update))


def _platform_index(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    found = _branch(_jaxpr.platform_index_platforms(eqn), walk.platform)
    if found is not None:
        frame.branch_of[eqn.outvars[0]] = found


def _device_put(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    _count_puts(eqn, ins, walk)
    _pass_through(frame, eqn, ins, walk)


def _pass_through(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    for out, origin in zip(eqn.outvars, ins):
        frame.origins[out] = origin


def _checkpoint_name(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    if eqn.invars:
        for out in eqn.outvars:
            frame.origins[out] = _Source("residuals", _jaxpr.checkpoint_name_of(eqn))


def _scan(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    scan = _jaxpr.scan_layout(eqn)
    # A carry is the leaf it starts as only in the first iteration: it is not
    # followed (the streamed update names what it carries).
    carries = set(scan.body.invars[scan.consts : scan.consts + scan.carry])
    inner = {v: o for v, o in zip(scan.body.invars, ins) if v not in carries}
    _walk(scan.body, inner, walk._replace(times=walk.times * scan.length))
    _pass_out(scan.body, inner, eqn, frame.origins)


def _cond(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    index = frame.branch_of.get(eqn.invars[0])
    platforms = _jaxpr.cond_platforms(eqn)
    if platforms:
        index = _branch(platforms, walk.platform)
    # A conditional that is not a platform's choice: its largest branch.
    best: tuple[Any, dict, dict] | None = None
    for i, sub in enumerate(_jaxpr.sub_jaxprs(eqn) or ()):
        if index is not None and i != index:
            continue
        inner = _inputs_of(sub, ins)
        mine: dict[tuple, int] = defaultdict(int)
        _walk(sub.jaxpr, inner, walk._replace(totals=mine))
        if best is None or sum(mine.values()) > sum(best[1].values()):
            best = (sub.jaxpr, mine, inner)
    if best is not None:
        branch, mine, inner = best
        for key, n in mine.items():
            walk.totals[key] += n
        _pass_out(branch, inner, eqn, frame.origins)


def _while(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    # Not made by this library: its body is counted once.
    subs = _jaxpr.sub_jaxprs(eqn)
    assert subs is not None
    _, body = subs
    _walk(body.jaxpr, _inputs_of(body, ins), walk)


def _other(frame: _Frame, eqn: Any, ins: list, walk: _Counting) -> None:
    """A call (`jax.jit`, `jax.checkpoint`, ...), or an operation whose result is
    its first operand (a slice, a cast)."""
    subs = _jaxpr.sub_jaxprs(eqn)
    if subs is not None:
        (sub,) = subs
        inner = _inputs_of(sub, ins)
        _walk(sub.jaxpr, inner, walk)
        _pass_out(sub.jaxpr, inner, eqn, frame.origins)
    elif _jaxpr.keeps_first_operand(eqn) and ins and ins[0] != _UNKNOWN:
        for out in eqn.outvars:
            frame.origins[out] = ins[0]


# Each equation goes to the first handler whose test it passes, else to `_other`.
_HANDLERS: tuple[tuple[Callable[[Any], bool], Callable[..., None]], ...] = (
    (_jaxpr.is_platform_index, _platform_index),
    (_jaxpr.is_device_put, _device_put),
    (_jaxpr.is_optimization_barrier, _pass_through),
    (_jaxpr.is_checkpoint_name, _checkpoint_name),
    (_jaxpr.is_scan, _scan),
    (_jaxpr.is_cond, _cond),
    (_jaxpr.is_while, _while),
)


def _inputs_of(sub: _jaxpr.SubJaxpr, ins: list) -> dict:
    """Where each input of a sub-program comes from: the operands that feed it."""
    return {sub.jaxpr.invars[k]: ins[i] for i, k in sub.operands.items()}


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


def _count_puts(eqn: Any, ins: list, walk: _Counting) -> None:
    phase = "update" if walk.update else "forward/backward"
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
            what, name = guess(scope_label, walk.update)
        elif what == "opt_state" and not walk.update and _is_copy(name):
            what, name = "params", name[len(_scopes.COPIES) + 1 :]  # a compute copy
        walk.totals[direction, phase, what, name] += _nbytes(aval) * walk.times


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
