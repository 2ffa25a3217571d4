"""What an optimizer's update does to each value, read from its jaxpr: the analysis
behind the streamed update (`_streaming.py`).

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

import jax.extend.core.primitives as primitives
import jax.numpy as jnp
import numpy as np

from .. import _jaxpr


_ELEMENTWISE = {
    primitives.abs_p,
    primitives.acos_p,
    primitives.acosh_p,
    primitives.add_p,
    primitives.and_p,
    primitives.asin_p,
    primitives.asinh_p,
    primitives.atan_p,
    primitives.atan2_p,
    primitives.atanh_p,
    primitives.cbrt_p,
    primitives.ceil_p,
    primitives.clamp_p,
    primitives.convert_element_type_p,
    primitives.copy_p,
    primitives.cos_p,
    primitives.cosh_p,
    primitives.div_p,
    primitives.eq_p,
    primitives.erf_p,
    primitives.erf_inv_p,
    primitives.erfc_p,
    primitives.exp_p,
    primitives.exp2_p,
    primitives.expm1_p,
    primitives.floor_p,
    primitives.ge_p,
    primitives.gt_p,
    primitives.imag_p,
    primitives.integer_pow_p,
    primitives.is_finite_p,
    primitives.le_p,
    primitives.lgamma_p,
    primitives.digamma_p,
    primitives.log_p,
    primitives.log1p_p,
    primitives.logistic_p,
    primitives.lt_p,
    primitives.max_p,
    primitives.min_p,
    primitives.mul_p,
    primitives.ne_p,
    primitives.neg_p,
    primitives.nextafter_p,
    primitives.not_p,
    primitives.or_p,
    primitives.pow_p,
    primitives.real_p,
    primitives.reduce_precision_p,
    primitives.rem_p,
    primitives.round_p,
    primitives.rsqrt_p,
    primitives.select_n_p,
    primitives.sign_p,
    primitives.sin_p,
    primitives.sinh_p,
    primitives.sqrt_p,
    primitives.square_p,
    primitives.stop_gradient_p,
    primitives.sub_p,
    primitives.tan_p,
    primitives.tanh_p,
    primitives.xor_p,
}
_REDUCTIONS = {
    primitives.reduce_sum_p: jnp.sum,
    primitives.reduce_max_p: jnp.max,
    primitives.reduce_min_p: jnp.min,
    primitives.reduce_and_p: jnp.all,
    primitives.reduce_or_p: jnp.any,
    primitives.reduce_prod_p: jnp.prod,
}


class NotStreamable(ValueError):
    """The optimizer's update cannot be applied piece by piece unchanged."""


# --- A flat jaxpr: the update's jaxpr with every call inlined -------------------


@dataclasses.dataclass(frozen=True)
class Literal:
    """A constant written into an equation."""

    value: Any


@dataclasses.dataclass
class Eqn:
    """One equation: a primitive on variable ids, without sub-jaxprs."""

    primitive: Any
    params: dict
    ins: list  # variable ids (int) or `Literal`s
    outs: list[int]
    avals: list  # of the outputs


@dataclasses.dataclass
class FlatJaxpr:
    """A jaxpr with every call inlined: variables are ids, equations a list."""

    ins: list[int]
    outs: list  # ids or `Literal`s
    eqns: list[Eqn]
    consts: dict[int, Any]
    avals: dict[int, Any]  # of every variable


def flatten(closed: Any) -> FlatJaxpr:
    """`closed` (a closed jaxpr) as a `FlatJaxpr`: calls inlined, and each `cond`
    as both branches and a `select_n` per output."""
    counter = iter(range(1 << 62))
    avals: dict[int, Any] = {}
    consts: dict[int, Any] = {}
    eqns: list[Eqn] = []

    def new(aval: Any) -> int:
        i = next(counter)
        avals[i] = aval
        return i

    def inline(jaxpr: Any, const_values: list, ins: list) -> list:
        env: dict[Any, Any] = {}
        for var, value in zip(jaxpr.constvars, const_values):
            env[var] = new(var.aval)
            consts[env[var]] = value
        env.update(zip(jaxpr.invars, ins))

        def read(v: Any) -> Any:
            return Literal(v.val) if _jaxpr.is_literal(v) else env[v]

        for eqn in jaxpr.eqns:
            args = [read(v) for v in eqn.invars]
            sub = _jaxpr.call_body(eqn)
            if sub is not None:
                outs = inline(sub.jaxpr, sub.consts, args)
                env.update(zip(eqn.outvars, outs))
                continue
            if _jaxpr.is_cond(eqn):
                # Both branches, then a `select_n` on the index per output: the
                # same values, and branches that hold global reductions or span
                # several groups of pieces (`optax.MultiSteps`) stream like the rest.
                # The branch not taken is computed too (its values are discarded).
                index, operands = args[0], args[1:]
                branches = [
                    inline(b.jaxpr, b.consts, operands)
                    for b in _jaxpr.cond_branches(eqn)
                ]
                outs = [new(v.aval) for v in eqn.outvars]
                for k, (out, var) in enumerate(zip(outs, eqn.outvars)):
                    cases = [branch[k] for branch in branches]
                    eqns.append(
                        Eqn(
                            primitives.select_n_p,
                            {},
                            [index, *cases],
                            [out],
                            [var.aval],
                        )
                    )
                env.update(zip(eqn.outvars, outs))
                continue
            outs = [new(v.aval) for v in eqn.outvars]
            eqns.append(
                Eqn(
                    eqn.primitive,
                    dict(eqn.params),
                    args,
                    outs,
                    [v.aval for v in eqn.outvars],
                )
            )
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    ins = [new(v.aval) for v in closed.jaxpr.invars]
    outs = inline(closed.jaxpr, closed.consts, ins)
    return FlatJaxpr(ins, outs, eqns, consts, avals)


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

    eqn: int
    group: Any
    combine: Callable  # of the partials, over their leading axis of pieces
    out: int  # the reduced value in `whole`
    piece_out: int  # a piece's partial in `piece`


class Dataflow:
    """How to run `whole` piece by piece; built by comparing it with `piece`."""

    def __init__(self, whole: FlatJaxpr, piece: FlatJaxpr, inputs: list[ValueFlow]):
        self.whole, self.piece = whole, piece
        if [e.primitive for e in whole.eqns] != [e.primitive for e in piece.eqns]:
            raise NotStreamable(
                "its operations depend on the leaves' shapes (a piece traces others)"
            )
        self.flows: dict[int, ValueFlow] = dict(zip(whole.ins, inputs))
        for i in whole.consts:
            self._check_same_const(i)
            self.flows[i] = ValueFlow(Flow.SHARED)
        self.roots: dict[int, Root] = {}
        for n, (e, p) in enumerate(zip(whole.eqns, piece.eqns)):
            self._classify(n, e, p)

    def flow_of(self, ref: Any) -> ValueFlow:
        """The flow of a variable or literal of `whole`."""
        if isinstance(ref, Literal):
            return ValueFlow(Flow.SHARED)
        return self.flows[ref]

    def is_piecewise(self, ref: Any) -> bool:
        return self.flow_of(ref).flow is Flow.PIECEWISE

    def _check_same_const(self, i: int) -> None:
        a, b = self.whole.consts[i], self.piece.consts.get(i)
        if b is None or np.shape(a) != np.shape(b) or not np.array_equal(a, b):
            raise NotStreamable("it closes over a constant that depends on the leaves")

    def _classify(self, n: int, e: Eqn, p: Eqn) -> None:
        """The flow of the outputs of equation `n` (`e` in `whole`, `p` in `piece`)."""
        name = _jaxpr.primitive_name(e)
        ins = [self.flow_of(r) for r in e.ins]
        pieces = [v for v in ins if v.flow is Flow.PIECEWISE]
        group = _common_group(pieces, name)
        level = max([v.level for v in ins], default=0)
        reshaped = [a.shape != b.shape for a, b in zip(e.avals, p.avals)]
        if not pieces and not any(reshaped):
            global_ = any(v.flow is Flow.GLOBAL for v in ins)
            flow = ValueFlow(Flow.GLOBAL if global_ else Flow.SHARED, None, level)
            self.flows.update((o, flow) for o in e.outs)
            return
        _check_same_literals(e, p, name)
        reduces = e.primitive in _REDUCTIONS and bool(pieces)
        if reduces and _reduces_pieces(e, p, name):
            if group is None or any(reshaped):
                raise NotStreamable(f"`{name}` reduces a constant over the pieces")
            combine = _REDUCTIONS[e.primitive]
            self.roots[n] = Root(n, group, combine, e.outs[0], p.outs[0])
            self.flows[e.outs[0]] = ValueFlow(Flow.GLOBAL, None, level + 1)
            return
        if not reduces:
            _check_piecewise(e, p, name, bool(pieces))
        for o, changed in zip(e.outs, reshaped):
            if not changed:
                raise NotStreamable(f"`{name}` drops the leading axis of a piece")
            self.flows[o] = ValueFlow(Flow.PIECEWISE, group, level)

    def piece_eqns(self, outs: list) -> list[int]:
        """The equations (indices, in order) that compute `outs` piece by piece:
        back to the piecewise inputs and to the shared and global values."""
        return needed(self.whole, outs, lambda r: not self.is_piecewise(r))


def _common_group(pieces: list[ValueFlow], name: str) -> Any:
    """The one group of pieces of an equation's piecewise inputs (None: any)."""
    groups = {v.group for v in pieces if v.group is not None}
    if len(groups) > 1:
        raise NotStreamable(
            f"`{name}` combines leaves streamed in different groups of pieces"
        )
    return next(iter(groups), None)


def _check_same_literals(e: Eqn, p: Eqn, name: str) -> None:
    """Refuses literals that differ between the whole and the piece jaxprs."""
    for a, b in zip(e.ins, p.ins):
        if not (isinstance(a, Literal) and isinstance(b, Literal)):
            continue
        if np.shape(a.value) != np.shape(b.value) or not np.array_equal(
            a.value, b.value
        ):
            raise NotStreamable(
                f"`{name}` uses a constant that depends on the piece size"
            )


def _reduces_pieces(e: Eqn, p: Eqn, name: str) -> bool:
    """Whether a reduction of piecewise values reduces over the pieces (axis 0)."""
    axes = _jaxpr.reduction_axes(e)
    if axes != _jaxpr.reduction_axes(p):
        raise NotStreamable(f"`{name}` reduces different axes on a piece")
    return 0 in axes


def _check_piecewise(e: Eqn, p: Eqn, name: str, pieces: bool) -> None:
    """Refuses an equation on reshaped values that does not act piece by piece."""
    if e.primitive is primitives.broadcast_in_dim_p:
        dims_e, dims_p = _jaxpr.broadcast_dimensions(e), _jaxpr.broadcast_dimensions(p)
        if dims_e != dims_p or (pieces and (not dims_e or dims_e[0] != 0)):
            raise NotStreamable("`broadcast_in_dim` moves the leading axis")
    elif e.primitive not in _ELEMENTWISE:
        raise NotStreamable(f"`{name}` mixes the pieces of a leaf")
    elif e.params != p.params:
        raise NotStreamable(f"`{name}` has parameters that depend on the piece size")


def needed(
    jaxpr: FlatJaxpr, outs: list, stop: Callable[[int], bool] = lambda r: False
) -> list[int]:
    """The equations of `jaxpr` (indices, in order) that compute `outs`, not
    looking further back than the variables where `stop` holds (`outs` themselves
    are always computed)."""
    producer = {o: n for n, e in enumerate(jaxpr.eqns) for o in e.outs}
    wanted: set[int] = set()
    todo = [(r, True) for r in outs if not isinstance(r, Literal)]
    while todo:
        r, start = todo.pop()
        if (stop(r) and not start) or r not in producer or producer[r] in wanted:
            continue
        wanted.add(producer[r])
        ins = jaxpr.eqns[producer[r]].ins
        todo.extend((x, False) for x in ins if not isinstance(x, Literal))
    return sorted(wanted)


def run(jaxpr: FlatJaxpr, eqns: list[int], env: dict[int, Any]) -> dict[int, Any]:
    """Evaluates some equations of `jaxpr` into `env`, and returns `env`."""
    for n in eqns:
        e = jaxpr.eqns[n]
        args = [r.value if isinstance(r, Literal) else env[r] for r in e.ins]
        env.update(zip(e.outs, _bind(e, args)))
    return env


def _bind(e: Eqn, args: list) -> list:
    """The outputs of `e` on `args`, as `jax.core.eval_jaxpr` computes them."""
    out = e.primitive.bind(*args, **e.params)
    return out if e.primitive.multiple_results else [out]
