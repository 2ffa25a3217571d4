"""The streamed optimizer update: parameters, gradients and optimizer state go to
the device one piece at a time — one layer of a `Stacked`, or one block of rows of a
large leaf — inside a `lax.scan` whose transfers the compiler cannot hoist.

The optimizer is applied to pieces without changing its result. Its update is
traced twice: on the whole tree (`whole`) and on one piece of every streamed leaf
(`piece`). The two jaxprs have the same equations, on different shapes; comparing
them tells what every value is:

- *shared*: independent of the streamed leaves (step counts, learning rates, the
  updates of leaves too small to stream), computed once on the whole values;
- *piecewise*: has the streamed leaf's leading axis, and each piece of it depends
  only on the same piece of the inputs (elementwise arithmetic, reductions over
  other axes), computed piece by piece by the `piece` jaxpr;
- *global*: a reduction over the leading axis of a piecewise value (a global norm,
  LAMB's per-leaf trust ratio over a stacked leaf), and what is computed from it:
  every piece's partial reduction is computed in a first scan, the partials are
  combined, and the rest of the update uses the combined value.

Anything else (a value that mixes pieces, a constant that depends on the piece
size, control flow over piecewise values) is refused with an error that says which
operation and how to keep the update whole (`Policy(update="whole")`).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.extend.core.primitives as jex_primitives
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax

from ._memory_kinds import is_host, to_space


# A leaf this large (or larger) is streamed in blocks of rows of at most this size.
PIECE_BYTES = 32 * 2**20
# Backends on which step `k` of a streamed loop reads piece `k` of the arrays it
# updates in place; the others read one piece ahead (`_scan_pieces`).
READ_IN_STEP = ("tpu",)

_ELEMENTWISE = {
    "abs",
    "acos",
    "acosh",
    "add",
    "and",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "cbrt",
    "ceil",
    "clamp",
    "convert_element_type",
    "copy",
    "copy_p",
    "cos",
    "cosh",
    "div",
    "eq",
    "erf",
    "erf_inv",
    "erfc",
    "exp",
    "exp2",
    "expm1",
    "floor",
    "ge",
    "gt",
    "imag",
    "integer_pow",
    "is_finite",
    "le",
    "lgamma",
    "digamma",
    "log",
    "log1p",
    "logistic",
    "lt",
    "max",
    "min",
    "mul",
    "ne",
    "neg",
    "nextafter",
    "not",
    "or",
    "pow",
    "real",
    "reduce_precision",
    "rem",
    "round",
    "rsqrt",
    "select_n",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "stop_gradient",
    "sub",
    "tan",
    "tanh",
    "xor",
}
_REDUCTIONS = {
    "reduce_sum": jnp.sum,
    "reduce_max": jnp.max,
    "reduce_min": jnp.min,
    "reduce_and": jnp.all,
    "reduce_or": jnp.any,
    "reduce_prod": jnp.prod,
}
_CALLS = {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
}


class NotStreamable(ValueError):
    """The optimizer's update cannot be applied piece by piece unchanged."""


# --- A flat program: the update's jaxpr with every call inlined -----------------


@dataclasses.dataclass(frozen=True)
class _Literal:
    value: Any


@dataclasses.dataclass
class _Eqn:
    primitive: Any
    params: dict
    ins: list  # variable ids (int) or `_Literal`s
    outs: list[int]
    avals: list  # of the outputs


@dataclasses.dataclass
class _Program:
    ins: list[int]
    outs: list  # ids or `_Literal`s
    eqns: list[_Eqn]
    consts: dict[int, Any]
    avals: dict[int, Any]  # of every variable


def _flatten(closed: Any) -> _Program:
    counter = iter(range(1 << 62))
    avals: dict[int, Any] = {}
    consts: dict[int, Any] = {}
    eqns: list[_Eqn] = []

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
            return _Literal(v.val) if isinstance(v, jex.Literal) else env[v]

        for eqn in jaxpr.eqns:
            args = [read(v) for v in eqn.invars]
            sub = _call_body(eqn)
            if sub is not None:
                outs = inline(sub.jaxpr, sub.consts, args)
                env.update(zip(eqn.outvars, outs))
                continue
            if eqn.primitive.name == "cond":
                # Both branches, then a `select_n` on the index per output: the
                # same values, and branches that hold global reductions or span
                # several groups of pieces (`optax.MultiSteps`) stream like the rest.
                # The branch not taken is computed too (its values are discarded).
                index, operands = args[0], args[1:]
                branches = [
                    inline(b.jaxpr, b.consts, operands) for b in eqn.params["branches"]
                ]
                outs = [new(v.aval) for v in eqn.outvars]
                for k, (out, var) in enumerate(zip(outs, eqn.outvars)):
                    cases = [branch[k] for branch in branches]
                    eqns.append(
                        _Eqn(
                            jex_primitives.select_n_p,
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
                _Eqn(
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
    return _Program(ins, outs, eqns, consts, avals)


def _call_body(eqn: Any) -> Any:
    """The closed jaxpr a call-like equation runs on its operands, if it is one."""
    if eqn.primitive.name not in _CALLS:
        return None
    for value in eqn.params.values():
        if isinstance(value, jex.ClosedJaxpr) and len(value.jaxpr.invars) == len(
            eqn.invars
        ):
            return value
    return None


# --- What every value is: shared, piecewise or global --------------------------

_SHARED, _PIECEWISE, _GLOBAL = "shared", "piecewise", "global"


@dataclasses.dataclass
class _Kind:
    what: str
    group: Any = None  # the streamed group of a piecewise value (None: any group)
    level: int = 0  # how many rounds of global reductions it needs first


@dataclasses.dataclass
class _Root:
    """A reduction over the leading axis: a global value made of piece partials."""

    eqn: int
    group: Any
    combine: Callable


class _Plan:
    """How to run `whole` piece by piece; built by comparing it with `piece`."""

    def __init__(self, whole: _Program, piece: _Program, inputs: list[_Kind]):
        self.whole, self.piece = whole, piece
        if [e.primitive.name for e in whole.eqns] != [
            e.primitive.name for e in piece.eqns
        ]:
            raise NotStreamable(
                "its computation depends on the shapes of the leaves (traced on one "
                "piece, it does different operations)"
            )
        self.kinds: dict[int, _Kind] = dict(zip(whole.ins, inputs))
        for i in whole.consts:
            self._check_same_const(i)
            self.kinds[i] = _Kind(_SHARED)
        self.roots: dict[int, _Root] = {}
        for n, (e, p) in enumerate(zip(whole.eqns, piece.eqns)):
            self._classify(n, e, p)

    def kind(self, ref: Any) -> _Kind:
        return _Kind(_SHARED) if isinstance(ref, _Literal) else self.kinds[ref]

    def _check_same_const(self, i: int) -> None:
        a, b = self.whole.consts[i], self.piece.consts.get(i)
        if b is None or np.shape(a) != np.shape(b) or not np.array_equal(a, b):
            raise NotStreamable("it closes over a constant that depends on the leaves")

    def _classify(self, n: int, e: _Eqn, p: _Eqn) -> None:
        name = e.primitive.name
        kinds = [self.kind(r) for r in e.ins]
        pieces = [k for k in kinds if k.what == _PIECEWISE]
        groups = {k.group for k in pieces if k.group is not None}
        if len(groups) > 1:
            raise NotStreamable(
                f"`{name}` combines leaves streamed in different groups of pieces "
                "(layers of a `Stacked`, row blocks of a large leaf)"
            )
        group = next(iter(groups), None)
        level = max([k.level for k in kinds], default=0)
        reshaped = [a.shape != b.shape for a, b in zip(e.avals, p.avals)]
        if not pieces and not any(reshaped):
            what = _GLOBAL if any(k.what == _GLOBAL for k in kinds) else _SHARED
            for o in e.outs:
                self.kinds[o] = _Kind(what, None, level)
            return
        literals = [
            (a.value, b.value)
            for a, b in zip(e.ins, p.ins)
            if isinstance(a, _Literal) and isinstance(b, _Literal)
        ]
        if any(
            np.shape(a) != np.shape(b) or not np.array_equal(a, b) for a, b in literals
        ):
            raise NotStreamable(
                f"`{name}` uses a constant that depends on the piece size"
            )
        if name in _REDUCTIONS and pieces:
            axes = tuple(e.params["axes"])
            if axes != tuple(p.params["axes"]):
                raise NotStreamable(f"`{name}` reduces different axes on a piece")
            if 0 in axes:  # over the pieces: a global value, from partials
                if group is None or any(reshaped):
                    raise NotStreamable(f"`{name}` reduces a constant over the pieces")
                self.roots[n] = _Root(n, group, _REDUCTIONS[name])
                self.kinds[e.outs[0]] = _Kind(_GLOBAL, None, level + 1)
                return
        elif name == "broadcast_in_dim":
            dims_e, dims_p = (
                e.params["broadcast_dimensions"],
                p.params["broadcast_dimensions"],
            )
            if dims_e != dims_p or (pieces and (not dims_e or dims_e[0] != 0)):
                raise NotStreamable("`broadcast_in_dim` moves the leading axis")
        elif name not in _ELEMENTWISE:
            raise NotStreamable(f"`{name}` mixes the pieces of a leaf")
        elif e.params != p.params:
            raise NotStreamable(
                f"`{name}` has parameters that depend on the piece size"
            )
        for o, changed in zip(e.outs, reshaped):
            if not changed:
                raise NotStreamable(f"`{name}` drops the leading axis of a piece")
            self.kinds[o] = _Kind(_PIECEWISE, group, level)

    def needed(self, outs: list, stop: Callable[[int], bool]) -> list[int]:
        """The equations (indices, in order) that compute `outs`, not looking
        further back than the variables where `stop` holds (`outs` themselves are
        always computed)."""
        producer = {o: n for n, e in enumerate(self.whole.eqns) for o in e.outs}
        wanted: set[int] = set()
        todo = [(r, True) for r in outs if not isinstance(r, _Literal)]
        while todo:
            r, start = todo.pop()
            if (stop(r) and not start) or r not in producer or producer[r] in wanted:
                continue
            wanted.add(producer[r])
            ins = self.whole.eqns[producer[r]].ins
            todo.extend((x, False) for x in ins if not isinstance(x, _Literal))
        return sorted(wanted)


def _run(program: _Program, eqns: list[int], env: dict[int, Any]) -> dict[int, Any]:
    """Evaluates some equations of `program` (binding their primitives)."""

    def read(r: Any) -> Any:
        return r.value if isinstance(r, _Literal) else env[r]

    for n in eqns:
        e = program.eqns[n]
        out = e.primitive.bind(*map(read, e.ins), **e.params)
        env.update(zip(e.outs, out if e.primitive.multiple_results else [out]))
    return env


# --- The streamed update --------------------------------------------------------


@dataclasses.dataclass
class _Group:
    """Leaves streamed together: the same number of pieces along axis 0."""

    key: Any
    pieces: int
    inputs: list[int] = dataclasses.field(default_factory=list)  # input positions


def update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    stacked: Any,
    out_kinds: tuple[list[str], list[str]],
) -> tuple[Any, Any]:
    """`optax.apply_updates(params, optimizer.update(grads, opt_state, params))`,
    streamed. `params` is the trainable part of the model; `stacked[i]` is the
    number of layers of the `Stacked` holding trainable leaf `i` (or None);
    `out_kinds` the memory kind of each new parameter and state leaf.

    **Returns:** the new parameters and optimizer state, in their memory kinds.
    """
    p_leaves, p_def = jtu.tree_flatten(params)
    g_leaves = jtu.tree_leaves(grads)
    s_leaves, s_def = jtu.tree_flatten(opt_state)
    owner = _state_owners(optimizer, opt_state, params, len(s_leaves))
    inputs = g_leaves + s_leaves + p_leaves
    # Which group each input is streamed in (by the trainable leaf it belongs to).
    leaf_of = list(range(len(p_leaves))) + owner + list(range(len(p_leaves)))
    groups: dict[Any, _Group] = {}
    for position, leaf in enumerate(leaf_of):
        if leaf is None:
            continue
        key, pieces = _pieces(p_leaves[leaf], stacked[leaf], leaf)
        if pieces > 1:
            group = groups.setdefault(key, _Group(key, pieces))
            group.inputs.append(position)
    group_of = [None] * len(inputs)
    for group in groups.values():
        for position in group.inputs:
            group_of[position] = group.key

    def apply(g: list, s: list, p: list) -> list:
        grads = jtu.tree_unflatten(p_def, g)
        updates, state = optimizer.update(
            grads, jtu.tree_unflatten(s_def, s), jtu.tree_unflatten(p_def, p)
        )
        new = eqx.apply_updates(jtu.tree_unflatten(p_def, p), updates)
        return jtu.tree_leaves(new) + jtu.tree_leaves(state)

    n_g, n_s = len(g_leaves), len(s_leaves)

    def split(xs: list) -> tuple[list, list, list]:
        return xs[:n_g], xs[n_g : n_g + n_s], xs[n_g + n_s :]

    def avals(chunked: bool) -> list:
        out = []
        for x, key in zip(inputs, group_of):
            shape = tuple(x.shape)
            if chunked and key is not None:
                shape = (shape[0] // groups[key].pieces,) + shape[1:]
            out.append(jax.ShapeDtypeStruct(shape, x.dtype))
        return out

    whole = _flatten(jax.make_jaxpr(lambda *xs: apply(*split(list(xs))))(*avals(False)))
    try:
        traced = jax.make_jaxpr(lambda *xs: apply(*split(list(xs))))(*avals(True))
    except Exception as e:  # e.g. state whose shape follows the parameter's
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise NotStreamable(
            f"traced on one piece of each leaf, it fails ({type(e).__name__}: {first})"
        ) from e
    piece = _flatten(traced)
    plan = _Plan(
        whole,
        piece,
        [_Kind(_SHARED) if g is None else _Kind(_PIECEWISE, g) for g in group_of],
    )
    return _execute(
        plan, inputs, groups, group_of, p_def, s_def, len(p_leaves), out_kinds
    )


def _state_owners(optimizer: Any, opt_state: Any, params: Any, n: int) -> list:
    """For each state leaf, the index of the trainable leaf it mirrors (in a
    parameter-shaped part of the state, with the parameter's shape), or None (a
    count, a per-leaf scalar, a factored moment: not streamed)."""
    from ._optim import _map_state

    shapes = [tuple(p.shape) for p in jtu.tree_leaves(params)]
    indices = jtu.tree_unflatten(
        jtu.tree_structure(params), [_Index(i) for i in range(len(shapes))]
    )

    def mirrors(s: Any, i: _Index) -> Any:
        if not (eqx.is_array(s) or isinstance(s, jax.ShapeDtypeStruct)):
            return s
        assert i.i is not None
        return _Index(i.i if tuple(s.shape) == shapes[i.i] else None)

    mapped = _map_state(
        optimizer,
        opt_state,
        mirrors,
        lambda s: _Index(None) if eqx.is_array(s) else s,
        indices,
    )
    owners = [x.i for x in jtu.tree_leaves(mapped) if isinstance(x, _Index)]
    assert len(owners) == n
    return owners


class _Index:
    def __init__(self, i: int | None):
        self.i = i


def _pieces(leaf: Any, layers: int | None, index: int) -> tuple[Any, int]:
    """How a trainable leaf is streamed: one piece per layer of its `Stacked`, or
    blocks of rows of at most `PIECE_BYTES` for a large leaf, or whole (1)."""
    if layers is not None:
        return ("stacked", layers), layers
    nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
    if not leaf.shape or nbytes < 2 * PIECE_BYTES:
        return None, 1
    rows = leaf.shape[0]
    needed = math.ceil(nbytes / PIECE_BYTES)
    pieces = next((d for d in range(needed, rows + 1) if rows % d == 0), rows)
    return ("leaf", index), pieces


def _execute(
    plan: _Plan,
    inputs: list,
    groups: dict,
    group_of: list,
    p_def: Any,
    s_def: Any,
    n_params: int,
    out_kinds: tuple[list[str], list[str]],
) -> tuple[Any, Any]:
    whole, piece = plan.whole, plan.piece
    kinds = out_kinds[0] + out_kinds[1]
    env: dict[int, Any] = dict(whole.consts)

    # Shared inputs (small leaves, counts) to the device, where they are computed on.
    def is_piecewise(r: int) -> bool:
        return plan.kinds[r].what == _PIECEWISE

    for i, x in zip(whole.ins, inputs):
        if not is_piecewise(i):
            env[i] = to_space(x, "device", "") if eqx.is_array(x) else x

    # Global values, level by level: partial reductions scanned over the pieces,
    # combined, and what is computed from them on whole values.
    for level in sorted({plan.kinds[whole.eqns[n].outs[0]].level for n in plan.roots}):
        _run_shared(plan, env, level - 1)
        roots = [
            r
            for r in plan.roots.values()
            if plan.kinds[whole.eqns[r.eqn].outs[0]].level == level
        ]
        for key in dict.fromkeys(r.group for r in roots):
            mine = [r for r in roots if r.group == key]
            partials = _scan_pieces(
                plan,
                groups[key],
                inputs,
                env,
                [whole.eqns[r.eqn].outs[0] for r in mine],
                [piece.eqns[r.eqn].outs[0] for r in mine],
                None,
            )
            for r, values in zip(mine, partials):
                env[whole.eqns[r.eqn].outs[0]] = r.combine(values, axis=0)
    _run_shared(plan, env, None)

    outs: list = [None] * len(whole.outs)
    for position, ref in enumerate(whole.outs):
        if isinstance(ref, _Literal):
            outs[position] = ref.value
        elif not is_piecewise(ref):
            outs[position] = to_space(env[ref], kinds[position], "")
    # Each piecewise output is computed in the loop over its group: the one its
    # value comes from, or (for a value made afresh, such as zeros of a piece's
    # shape) the one of the leaf it replaces.
    out_group = {
        position: plan.kinds[ref].group
        or group_of[_source(position, n_params, len(kinds))]
        for position, ref in enumerate(whole.outs)
        if isinstance(ref, int) and is_piecewise(ref)
    }
    if None in out_group.values():
        raise NotStreamable("a new leaf has the shape of a piece but no pieces")
    for key, group in groups.items():
        wanted = [
            (position, whole.outs[position])
            for position, k in out_group.items()
            if k == key
        ]
        if not wanted:
            continue
        piece_outs = [piece.outs[position] for position, _ in wanted]
        overwrite = [
            _overwritable(position, ref, inputs, whole, kinds, n_params, group)
            for position, ref in wanted
        ]
        results = _scan_pieces(
            plan,
            group,
            inputs,
            env,
            [ref for _, ref in wanted],
            piece_outs,
            [kinds[position] for position, _ in wanted],
            overwrite,
        )
        for (position, ref), value in zip(wanted, results):
            full = whole.avals[ref].shape
            outs[position] = value.reshape(full)
    new_params = jtu.tree_unflatten(p_def, outs[:n_params])
    new_state = jtu.tree_unflatten(s_def, outs[n_params:])
    return new_params, new_state


def _source(position: int, n_params: int, n_outputs: int) -> int:
    """The input an output replaces: outputs are the new parameters then the new
    state; inputs the gradients, the state, then the parameters."""
    n_state = n_outputs - n_params
    if position < n_params:
        return n_params + n_state + position
    return position  # n_params gradients come first, then the state


def _overwritable(
    position: int,
    ref: int,
    inputs: list,
    whole: _Program,
    kinds: list[str],
    n_params: int,
    group: _Group,
) -> int | None:
    """The input an output replaces (the old parameter or state leaf), if it can be
    updated in place: same shape, dtype and memory kind, in the same group."""
    source = _source(position, n_params, len(kinds))
    x, aval = inputs[source], whole.avals[ref]
    same = x.shape == aval.shape and x.dtype == aval.dtype
    same_kind = ("pinned_host" if is_host(x) else "device") == kinds[position]
    return source if same and same_kind and source in group.inputs else None


def _run_shared(plan: _Plan, env: dict, level: int | None) -> None:
    """Evaluates (on whole values) every shared or global value whose inputs are
    known, up to `level` rounds of global reductions (all of them with None)."""
    whole = plan.whole
    for n, e in enumerate(whole.eqns):
        if all(o in env for o in e.outs) or n in plan.roots:
            continue
        if any(plan.kinds[o].what == _PIECEWISE for o in e.outs):
            continue  # computed piece by piece, in the loops
        if level is not None and any(plan.kinds[o].level > level for o in e.outs):
            continue
        if all(r in env for r in e.ins if isinstance(r, int)):
            _run(whole, [n], env)


def _scan_pieces(
    plan: _Plan,
    group: _Group,
    inputs: list,
    env: dict,
    targets: list,
    piece_outs: list,
    out_kinds: list[str] | None,
    overwrite: list | None = None,
) -> list:
    """Runs the `piece` program over the pieces of `group` in a `lax.scan` and
    returns the values of `piece_outs` (the `piece` counterparts of the
    whole-program `targets`), moved to `out_kinds` if given. Each piece's inputs are
    moved to the device inside the body, so only one piece is there at a time.

    An output with an `overwrite` input position is written piece by piece into
    that input (a loop carry: with the input donated, the update happens in place);
    the others are stacked as scan outputs. Values come back with a leading axis of
    pieces.

    How the overwritten inputs are read depends on the backend. On a TPU, step `k`
    reads piece `k` of each and the compiler streams it from the host. Elsewhere,
    XLA (its CPU backend, at least) fuses that read into the computation of another
    input's new piece — after the write into the first — and then copies every
    overwritten input at every step; so there, step `k` reads piece `k + 1` from
    the arrays it has just written piece `k` into, and carries it to the next step.
    (On a TPU that read-ahead keeps two pieces on the device and costs memory.)"""
    whole, piece = plan.whole, plan.piece
    targets_of: list = overwrite or [None] * len(piece_outs)

    wanted = plan.needed(targets, lambda r: plan.kinds[r].what != _PIECEWISE)
    known = dict(piece.consts)
    for n in wanted:  # the shared and global values the body reads
        for w_ref, p_ref in zip(whole.eqns[n].ins, piece.eqns[n].ins):
            if isinstance(w_ref, int) and plan.kinds[w_ref].what != _PIECEWISE:
                known[p_ref] = env[w_ref]

    def in_pieces(x: Any) -> Any:
        return x.reshape((group.pieces, x.shape[0] // group.pieces) + x.shape[1:])

    def on_device(x: Any) -> Any:
        return to_space(x, "device", "") if is_host(x) else x

    def piece_of(full: Any, index: Any) -> Any:
        return on_device(jax.lax.dynamic_index_in_dim(full, index, keepdims=False))

    carried = [i for i in group.inputs if i in targets_of]
    streamed = [i for i in group.inputs if i not in targets_of]
    kinds = out_kinds or [None] * len(piece_outs)

    def step(index: Any, values: list, current: list, fulls: list) -> tuple:
        """One piece: its new values, written into `fulls` or returned as `ys`."""
        local = dict(known)
        for position, x in zip(streamed, values):
            local[piece.ins[position]] = on_device(x)
        for position, x in zip(carried, current):
            local[piece.ins[position]] = x
        _run(piece, wanted, local)
        fulls, ys = list(fulls), []
        for r, kind, target in zip(piece_outs, kinds, targets_of):
            value = local[r] if isinstance(r, int) else r.value
            value = value if kind is None else to_space(value, kind, "")
            if target is None:
                ys.append(value)
            else:
                k = carried.index(target)
                fulls[k] = jax.lax.dynamic_update_index_in_dim(
                    fulls[k], value, index, 0
                )
        return fulls, ys

    def loop(read_ahead: bool) -> Callable[[list, list], tuple[list, list]]:
        def run(fulls: list, others: list) -> tuple[list, list]:
            xs = (jnp.arange(group.pieces), others)

            def body(carry: Any, chunk: tuple) -> tuple[Any, list]:
                index, values = chunk
                if not read_ahead:
                    current = [piece_of(full, index) for full in carry]
                    return step(index, values, current, carry)
                fulls, ys = step(index, values, *carry)
                ahead = jnp.minimum(index + 1, group.pieces - 1)
                return ([piece_of(full, ahead) for full in fulls], fulls), ys

            if not read_ahead:
                fulls, ys = jax.lax.scan(body, fulls, xs, length=group.pieces)
                return fulls, ys
            carry = ([piece_of(full, 0) for full in fulls], fulls)
            (_, fulls), ys = jax.lax.scan(body, carry, xs, length=group.pieces)
            return fulls, ys

        return run

    fulls = [in_pieces(inputs[i]) for i in carried]
    others = [in_pieces(inputs[i]) for i in streamed]
    if carried:
        direct = {platform: loop(False) for platform in READ_IN_STEP}
        fulls, ys = jax.lax.platform_dependent(
            fulls, others, **direct, default=loop(True)
        )
    else:
        fulls, ys = loop(False)(fulls, others)
    ys, outs = iter(ys), []
    for target in targets_of:
        outs.append(next(ys) if target is None else fulls[carried.index(target)])
    return outs
