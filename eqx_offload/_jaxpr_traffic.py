"""**Adapter**: the host <-> device moves of a traced program, read from its jaxpr.

Every `device_put` between memory spaces, times the length of the scans around it,
with where its operand comes from. On the platform it is compiled for: of a
`jax.lax.platform_dependent` choice (the optimizer update, the read-ahead loop), only
the branch that platform runs counts. An operand is followed back to an input of the
program (through the slicing of scans and of the streamed update) or to a checkpoint
name (`"residuals"`). `_report/_traffic.py` names the rest from the scopes.
"""

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _jaxpr, _scopes
from ._custom_types import Direction
from ._memory_kinds import is_host_aval


class Put(NamedTuple):
    """One kind of move: its direction, whether the optimizer update makes it, where
    its operand comes from (`what`, `name`: both `""` if computed) and the name stack
    around it."""

    direction: Direction
    update: bool
    what: str
    name: str
    scope: str


_UNKNOWN = ("", "")


def puts(
    closed: Any, inputs: Sequence[tuple[str, str]], platform: str
) -> dict[Put, int]:
    """The bytes of each kind of move per run of `closed` (a `ClosedJaxpr`) on
    `platform` ("tpu", "cpu", ...), whose inputs are `inputs` (what, name) in order."""
    totals: dict[Put, int] = defaultdict(int)
    jaxpr = closed.jaxpr
    known = len(inputs) == len(jaxpr.invars)
    origins = dict(zip(jaxpr.invars, map(tuple, inputs))) if known else {}
    _walk(jaxpr, origins, _Counting(platform, totals, {}))
    return {k: n for k, n in totals.items() if n}


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize


def _get(origins: dict, v: Any) -> tuple[str, str]:
    return _UNKNOWN if _jaxpr.is_literal(v) else origins.get(v, _UNKNOWN)


class _Counting(NamedTuple):
    """How a (sub-)program's moves count: for which platform, into which totals, the
    branch each `platform_index` output chooses, how many times a step runs it (the
    scans around it), whether in the update."""

    platform: str
    totals: dict
    branch_of: dict
    times: int = 1
    update: bool = False


def _walk(jaxpr: Any, origins: dict, walk: _Counting) -> None:
    """Counts the moves of `jaxpr` into `walk.totals`; `origins` holds where its
    inputs come from, and gains its values'."""
    for eqn in jaxpr.eqns:
        ins = [_get(origins, v) for v in eqn.invars]
        # Sub-programs are traced with name stacks of their own.
        update = walk.update or _scopes.UPDATE in str(eqn.source_info.name_stack)
        handle = next((h for match, h in _HANDLERS if match(eqn)), _other)
        handle(origins, eqn, ins, walk._replace(update=update))


def _platform_index(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    found = _branch(_jaxpr.platform_index_platforms(eqn), walk.platform)
    if found is not None:
        walk.branch_of[eqn.outvars[0]] = found


def _device_put(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    scope = str(eqn.source_info.name_stack)
    destinations = _jaxpr.device_put_destinations(eqn)
    for v, (what, name), where in zip(eqn.invars, ins, destinations):
        if not isinstance(where, jax.memory.Space):
            continue
        to_host = where == jax.memory.Space.Host
        if is_host_aval(v.aval) != to_host:
            direction = "device_to_host" if to_host else "host_to_device"
            put = Put(direction, walk.update, what, name, scope)
            walk.totals[put] += _nbytes(v.aval) * walk.times
    _pass_through(origins, eqn, ins, walk)


def _pass_through(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    origins.update(zip(eqn.outvars, ins))


def _checkpoint_name(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    if eqn.invars:
        for out in eqn.outvars:
            origins[out] = ("residuals", _jaxpr.checkpoint_name_of(eqn))


def _scan(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    scan = _jaxpr.scan_layout(eqn)
    # A carry is the leaf it starts as only in the first iteration: it is not
    # followed (the streamed update names what it carries).
    carries = set(scan.body.invars[scan.consts : scan.consts + scan.carry])
    inner = {v: o for v, o in zip(scan.body.invars, ins) if v not in carries}
    _walk(scan.body, inner, walk._replace(times=walk.times * scan.length))
    _pass_out(scan.body, inner, eqn, origins)


def _cond(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    index = walk.branch_of.get(eqn.invars[0])
    platforms = _jaxpr.cond_platforms(eqn)
    if platforms:
        index = _branch(platforms, walk.platform)
    # A conditional that is not a platform's choice: its largest branch.
    found = []
    for i, sub in enumerate(_jaxpr.sub_jaxprs(eqn) or ()):
        if index is None or i == index:
            inner = _inputs_of(sub, ins)
            mine: dict[Put, int] = defaultdict(int)
            _walk(sub.jaxpr, inner, walk._replace(totals=mine))
            found.append((sum(mine.values()), sub.jaxpr, mine, inner))
    if found:  # (the first of the largest)
        _, branch, mine, inner = max(found, key=lambda f: f[0])
        for key, n in mine.items():
            walk.totals[key] += n
        _pass_out(branch, inner, eqn, origins)


def _while(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    # Not made by this library: its body is counted once.
    subs = _jaxpr.sub_jaxprs(eqn)
    assert subs is not None
    _, body = subs
    _walk(body.jaxpr, _inputs_of(body, ins), walk)


def _other(origins: dict, eqn: Any, ins: list, walk: _Counting) -> None:
    """A call (`jax.jit`, `jax.checkpoint`, ...), or an operation whose result is
    its first operand (a slice, a cast)."""
    subs = _jaxpr.sub_jaxprs(eqn)
    if subs is not None:
        (sub,) = subs
        inner = _inputs_of(sub, ins)
        _walk(sub.jaxpr, inner, walk)
        _pass_out(sub.jaxpr, inner, eqn, origins)
    elif _jaxpr.keeps_first_operand(eqn) and ins and ins[0] != _UNKNOWN:
        origins.update(dict.fromkeys(eqn.outvars, ins[0]))


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
