"""What an optimizer's update does to each value, read from its jaxpr: the analysis
behind the streamed update (`_update/_streaming.py`) and the host update
(`_update/_host.py`), and the evaluator that runs parts of it.

An adapter: the one module that inlines the update's jaxpr (`flatten`) and binds its
primitives (`run`). The rest of the update sees only a `FlatJaxpr`, plain data: value
ids, operations on them, and the functions here that follow and run them.

The update is traced twice: on the whole tree (`whole`) and on one piece of every
streamed leaf (`piece`). The two jaxprs have the same equations, on different
shapes; comparing them tells what every value is:

- *shared*: independent of the streamed leaves (step counts, learning rates, the
  updates of leaves too small to stream), computed once on the whole values;
- *piecewise*: has the streamed leaf's leading axis, and each piece of it depends
  only on the same piece of the inputs (elementwise arithmetic, reductions over
  other axes), computed piece by piece by the `piece` jaxpr;
- *global*: a reduction over the leading axis of a piecewise value (a global norm,
  LAMB's per-leaf trust ratio over a stacked leaf), and what is computed from it:
  every piece's partial reduction is computed in a first scan, the partials are
  combined, and the rest of the update uses the combined value.

Each value's `Flow` says which. Anything else (a value that mixes pieces, a
constant that depends on the piece size, control flow over piecewise values) is
`NotStreamable`, with the operation.
"""

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax.extend.core.primitives as _p
import jax.numpy as jnp
import numpy as np

from . import _jaxpr


# The elementwise primitives, by name: `jax.extend.core.primitives.<name>_p`.
_ELEMENTWISE = {
    getattr(_p, f"{name}_p")
    for name in """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
    convert_element_type copy cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
    ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin
    sinh sqrt square stop_gradient sub tan tanh xor""".split()
}
_REDUCTIONS = {
    _p.reduce_sum_p: jnp.sum,
    _p.reduce_max_p: jnp.max,
    _p.reduce_min_p: jnp.min,
    _p.reduce_and_p: jnp.all,
    _p.reduce_or_p: jnp.any,
    _p.reduce_prod_p: jnp.prod,
}


class NotStreamable(ValueError):
    """The optimizer's update cannot be applied piece by piece unchanged."""


# --- A flat jaxpr: the update's jaxpr with every call inlined -------------------


@dataclasses.dataclass(frozen=True)
class Literal:
    """A constant written into an operation."""

    value: Any


@dataclasses.dataclass
class Op:
    """One operation: a primitive on value ids, without sub-jaxprs."""

    primitive: Any
    params: dict
    ins: list  # value ids (int) or `Literal`s
    outs: list[int]
    avals: list  # of the outputs


@dataclasses.dataclass
class FlatJaxpr:
    """A jaxpr with every call inlined: values are ids, operations a list."""

    ins: list[int]
    outs: list  # ids or `Literal`s
    ops: list[Op]
    consts: dict[int, Any]
    avals: dict[int, Any]  # of every value


def flatten(closed: Any) -> FlatJaxpr:
    """`closed` (a closed jaxpr) as a `FlatJaxpr`: calls inlined, and each `cond`
    as both branches and a `select_n` per output."""
    flat = FlatJaxpr([], [], [], {}, {})

    def new(aval: Any) -> int:
        flat.avals[len(flat.avals)] = aval
        return len(flat.avals) - 1

    def add(primitive: Any, params: dict, ins: list, outvars: list) -> list[int]:
        outs = [new(v.aval) for v in outvars]
        flat.ops.append(Op(primitive, params, ins, outs, [v.aval for v in outvars]))
        return outs

    def inline(jaxpr: Any, const_values: list, ins: list) -> list:
        env: dict[Any, Any] = dict(zip(jaxpr.invars, ins))
        for var, value in zip(jaxpr.constvars, const_values):
            env[var] = new(var.aval)
            flat.consts[env[var]] = value

        def read(v: Any) -> Any:
            return Literal(v.val) if _jaxpr.is_literal(v) else env[v]

        for eqn in jaxpr.eqns:
            args = [read(v) for v in eqn.invars]
            sub = _jaxpr.call_body(eqn)
            if sub is not None:
                outs = inline(sub.jaxpr, sub.consts, args)
            elif _jaxpr.is_cond(eqn):
                # Both branches, then a `select_n` on the index per output: the
                # same values, and branches that hold global reductions or span
                # several groups of pieces (`optax.MultiSteps`) stream like the
                # rest. The branch not taken is computed too (and discarded).
                branches = [
                    inline(b.jaxpr, b.consts, args[1:])
                    for b in _jaxpr.cond_branches(eqn)
                ]
                outs = [
                    add(_p.select_n_p, {}, [args[0], *cases], [var])[0]
                    for var, *cases in zip(eqn.outvars, *branches)
                ]
            else:
                outs = add(eqn.primitive, dict(eqn.params), args, eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    flat.ins = [new(v.aval) for v in closed.jaxpr.invars]
    flat.outs = inline(closed.jaxpr, closed.consts, flat.ins)
    return flat


def needed(
    jaxpr: FlatJaxpr, outs: list, stop: Callable[[int], bool] = lambda r: False
) -> list[int]:
    """The operations of `jaxpr` (indices, in order) that compute `outs`, not
    looking further back than the values where `stop` holds (`outs` themselves
    are always computed)."""
    producer = {o: n for n, op in enumerate(jaxpr.ops) for o in op.outs}
    wanted: set[int] = set()
    todo = [(r, True) for r in outs if not isinstance(r, Literal)]
    while todo:
        r, start = todo.pop()
        if (stop(r) and not start) or r not in producer or producer[r] in wanted:
            continue
        wanted.add(producer[r])
        ins = jaxpr.ops[producer[r]].ins
        todo.extend((x, False) for x in ins if not isinstance(x, Literal))
    return sorted(wanted)


def reads(jaxpr: FlatJaxpr, ops: list[int], refs: list) -> set[int]:
    """The values (ids) that the operations `ops` read, and those of `refs`."""
    found = {r for n in ops for r in jaxpr.ops[n].ins if isinstance(r, int)}
    return found | {r for r in refs if isinstance(r, int)}


def dependents(jaxpr: FlatJaxpr, sources: set[int]) -> set[int]:
    """`sources` and every value computed from one of them."""
    found = set(sources)
    for op in jaxpr.ops:
        if any(isinstance(r, int) and r in found for r in op.ins):
            found.update(op.outs)
    return found


def run(jaxpr: FlatJaxpr, ops: list[int], env: dict[int, Any]) -> dict[int, Any]:
    """Evaluates some operations of `jaxpr` into `env` (as `jax.core.eval_jaxpr`
    does), and returns `env`."""
    for n in ops:
        op = jaxpr.ops[n]
        args = [r.value if isinstance(r, Literal) else env[r] for r in op.ins]
        out = op.primitive.bind(*args, **op.params)
        env.update(zip(op.outs, out if op.primitive.multiple_results else [out]))
    return env


def value(ref: Any, env: dict[int, Any]) -> Any:
    """The value of `ref` (an id or a `Literal`) in `env`."""
    return ref.value if isinstance(ref, Literal) else env[ref]


# --- What every value is: shared, piecewise or global --------------------------


class Flow(enum.Enum):
    """How a value of the update is computed when it is streamed."""

    SHARED = "shared"  # once, on whole values
    PIECEWISE = "piecewise"  # piece by piece, in a loop over its group
    GLOBAL = "global"  # from per-piece partial reductions, combined


@dataclasses.dataclass(frozen=True)
class ValueFlow:
    """The flow of one value, with its group of pieces and its level."""

    flow: Flow
    group: Any = None  # the streamed group of a piecewise value (None: any group)
    level: int = 0  # how many rounds of global reductions it needs first


@dataclasses.dataclass
class Root:
    """A reduction over the leading axis: a global value made of piece partials."""

    group: Any
    combine: Callable  # of the partials, over their leading axis of pieces
    out: int  # the reduced value in `whole`
    piece_out: int  # a piece's partial in `piece`


class Dataflow:
    """How to run `whole` piece by piece; built by comparing it with `piece`."""

    def __init__(self, whole: FlatJaxpr, piece: FlatJaxpr, inputs: list[ValueFlow]):
        self.whole, self.piece = whole, piece
        if [e.primitive for e in whole.ops] != [e.primitive for e in piece.ops]:
            raise NotStreamable(
                "its operations depend on the leaves' shapes (a piece traces others)"
            )
        self.flows: dict[int, ValueFlow] = dict(zip(whole.ins, inputs))
        for i, a in whole.consts.items():
            if not _same(a, piece.consts.get(i)):
                raise NotStreamable(
                    "it closes over a constant that depends on the leaves"
                )
            self.flows[i] = ValueFlow(Flow.SHARED)
        self.roots: dict[int, Root] = {}
        for n, (e, p) in enumerate(zip(whole.ops, piece.ops)):
            self._classify(n, e, p)

    def flow_of(self, ref: Any) -> ValueFlow:
        """The flow of a value or literal of `whole`."""
        return ValueFlow(Flow.SHARED) if isinstance(ref, Literal) else self.flows[ref]

    def is_piecewise(self, ref: Any) -> bool:
        return self.flow_of(ref).flow is Flow.PIECEWISE

    def _classify(self, n: int, e: Op, p: Op) -> None:
        """The flow of the outputs of operation `n` (`e` in `whole`, `p` in `piece`)."""
        name = _jaxpr.primitive_name(e)
        ins = [self.flow_of(r) for r in e.ins]
        pieces = [v for v in ins if v.flow is Flow.PIECEWISE]
        group = _common_group(pieces, name)
        level = max([v.level for v in ins], default=0)
        reshaped = [a.shape != b.shape for a, b in zip(e.avals, p.avals)]
        if not pieces and not any(reshaped):
            global_ = any(v.flow is Flow.GLOBAL for v in ins)
            flow = ValueFlow(Flow.GLOBAL if global_ else Flow.SHARED, None, level)
            self.flows.update(dict.fromkeys(e.outs, flow))
            return
        if _check(e, p, name, bool(pieces)):  # a reduction over the pieces
            if group is None or any(reshaped):
                raise NotStreamable(f"`{name}` reduces a constant over the pieces")
            self.roots[n] = Root(group, _REDUCTIONS[e.primitive], e.outs[0], p.outs[0])
            self.flows[e.outs[0]] = ValueFlow(Flow.GLOBAL, None, level + 1)
            return
        if not all(reshaped):
            raise NotStreamable(f"`{name}` drops the leading axis of a piece")
        piecewise = ValueFlow(Flow.PIECEWISE, group, level)
        self.flows.update(dict.fromkeys(e.outs, piecewise))

    def piece_eqns(self, outs: list) -> list[int]:
        """The operations (indices, in order) that compute `outs` piece by piece:
        back to the piecewise inputs and to the shared and global values."""
        return needed(self.whole, outs, lambda r: not self.is_piecewise(r))

    def shared_inputs(self, outs: list) -> list[tuple[Any, Any]]:
        """The shared and global values that computing `outs` piece by piece
        reads: pairs of ids (whole jaxpr, piece jaxpr), in a fixed order."""
        pairs: dict[Any, Any] = {}
        for n in self.piece_eqns(outs):
            for w, p in zip(self.whole.ops[n].ins, self.piece.ops[n].ins):
                if isinstance(w, int) and not self.is_piecewise(w):
                    pairs.setdefault(w, p)
        return list(pairs.items())

    def run_shared(self, env: dict, level: int | None) -> None:
        """Evaluates (on whole values) every shared or global value whose inputs
        are known, up to `level` rounds of global reductions (all with None)."""
        for n, e in enumerate(self.whole.ops):
            if all(o in env for o in e.outs) or n in self.roots:
                continue
            flows = [self.flows[o] for o in e.outs]
            if any(f.flow is Flow.PIECEWISE for f in flows):
                continue  # computed piece by piece, in the loops
            if level is not None and any(f.level > level for f in flows):
                continue
            if all(r in env for r in e.ins if isinstance(r, int)):
                run(self.whole, [n], env)


def _same(a: Any, b: Any) -> bool:
    """Whether two constants are equal, shapes included (`b` may be None)."""
    return b is not None and np.shape(a) == np.shape(b) and np.array_equal(a, b)


def _common_group(pieces: list[ValueFlow], name: str) -> Any:
    """The one group of pieces of an operation's piecewise inputs (None: any)."""
    groups = {v.group for v in pieces if v.group is not None}
    if len(groups) > 1:
        raise NotStreamable(
            f"`{name}` combines leaves streamed in different groups of pieces"
        )
    return next(iter(groups), None)


def _check(e: Op, p: Op, name: str, pieces: bool) -> bool:
    """Refuses an operation on reshaped values (`e` in `whole`, `p` in `piece`)
    that does not act piece by piece; whether it reduces over the pieces."""
    for a, b in zip(e.ins, p.ins):
        if isinstance(a, Literal) and isinstance(b, Literal):
            if not _same(a.value, b.value):
                raise NotStreamable(
                    f"`{name}` uses a constant that depends on the piece size"
                )
    if e.primitive in _REDUCTIONS and pieces:
        axes = _jaxpr.reduction_axes(e)
        if axes != _jaxpr.reduction_axes(p):
            raise NotStreamable(f"`{name}` reduces different axes on a piece")
        return 0 in axes
    if e.primitive is _p.broadcast_in_dim_p:
        dims_e, dims_p = _jaxpr.broadcast_dimensions(e), _jaxpr.broadcast_dimensions(p)
        if dims_e != dims_p or (pieces and (not dims_e or dims_e[0] != 0)):
            raise NotStreamable("`broadcast_in_dim` moves the leading axis")
    elif e.primitive not in _ELEMENTWISE:
        raise NotStreamable(f"`{name}` mixes the pieces of a leaf")
    elif e.params != p.params:
        raise NotStreamable(f"`{name}` has parameters that depend on the piece size")
    return False
