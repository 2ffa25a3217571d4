"""The streamed optimizer update: parameters, gradients and optimizer state go to
the device one piece at a time — one layer of a `Stacked`, or one block of rows of a
large leaf — inside a `lax.scan` whose transfers the compiler cannot hoist.

The optimizer is applied to pieces without changing its result: `_dataflow.py`
reads from its jaxpr which values are shared, piecewise or global, and this module
runs it: global reductions first, from per-piece partials, then one loop per group
of pieces that writes every new piece into its (donated) leaf in place.

A piece is a slice of the leaf along axis 0, read and written with
`dynamic_slice`/`dynamic_update_slice` on the leaf itself: the TPU compiler's
host-offload passes stream such slices, but reject a reshape of a host array into
`(pieces, rows, ...)` ("Only handling bitcasts with majormost dimension of size 1").
Which leaves can be cut at all is `_tiling.py`'s rule; the others are updated whole.
Each piece's slicing and transfers run under `jax.named_scope(<leaf path>)`, so a
compiler message about one of them names its leaf.
"""

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax

from .. import _tiling
from .._memory_kinds import is_host, to_space
from . import _dataflow
from ._dataflow import NotStreamable
from ._metrics import METRICS
from ._state_tree import state_owners


# Backends on which step `k` of a streamed loop reads piece `k` of the arrays it
# updates in place; the others read one piece ahead (`_scan_pieces`).
READ_IN_STEP = ("tpu",)


@dataclasses.dataclass
class _Group:
    """Leaves streamed together: `pieces` slices of `rows` rows along axis 0."""

    key: Any
    pieces: int
    rows: int
    inputs: list[int] = dataclasses.field(default_factory=list)  # input positions


def update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    stacked: list[int | None],
    out_kinds: tuple[list[str], list[str]],
    paths: list[str],
    metrics: bool = False,
) -> tuple[Any, Any, dict[str, Any] | None]:
    """`optax.apply_updates(params, optimizer.update(grads, opt_state, params))`,
    streamed. `params` is the trainable part of the model; `stacked[i]` is the
    number of layers of the `Stacked` holding trainable leaf `i` (or None);
    `out_kinds` the memory kind of each new parameter and state leaf; `paths` the
    path of each trainable leaf (for named scopes); `metrics`: also the global
    norms of the gradients, the updates and the new parameters, streamed
    reductions like any global value of the update.

    **Returns:** the new parameters and optimizer state, in their memory kinds,
    and the metrics (on the device) or None.
    """
    run = prepare(optimizer, grads, opt_state, params, stacked, paths, metrics)
    new_params, new_state, extra, _ = execute(run, out_kinds)
    if not metrics:
        return new_params, new_state, None
    n = len(jtu.tree_leaves(params))
    sums = [
        jnp.sqrt(sum(jnp.sum(x) for x in extra[i * n : (i + 1) * n]))
        for i in range(len(METRICS))
    ]
    return new_params, new_state, dict(zip(METRICS, sums))


@dataclasses.dataclass
class Prepared:
    """An optimizer update read for streaming: the plan, its inputs (gradients,
    state, parameters, flattened), their groups of pieces, and the trees."""

    plan: _dataflow.Dataflow
    inputs: list
    labels: list[str]
    groups: dict
    group_of: list
    p_def: Any
    s_def: Any
    n_params: int


def prepare(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    stacked: list[int | None],
    paths: list[str],
    metrics: bool = False,
    waits: list[str | None] | None = None,
) -> Prepared:
    """The update of `update` (same arguments), read for streaming. `waits[i]`,
    if given, names the `Stacked` whose update of trainable leaf `i` waits for
    the next step (`_deferred.py`): its pieces form a group of their own."""
    p_leaves, p_def = jtu.tree_flatten(params)
    g_leaves = jtu.tree_leaves(grads)
    s_leaves, s_def = jtu.tree_flatten(opt_state)
    owner = state_owners(optimizer, opt_state, params)
    assert len(owner) == len(s_leaves)
    inputs = g_leaves + s_leaves + p_leaves
    # Which group each input is streamed in (by the trainable leaf it belongs to).
    leaf_of = list(range(len(p_leaves))) + owner + list(range(len(p_leaves)))
    labels = (
        [f"grad.{p}" for p in paths]
        + [
            "opt_state" if leaf is None else f"opt_state.{paths[leaf]}"
            for leaf in owner
        ]
        + list(paths)
    )
    groups: dict[Any, _Group] = {}
    for position, leaf in enumerate(leaf_of):
        if leaf is None:
            continue
        cut = pieces(p_leaves[leaf], stacked[leaf], leaf)
        if cut is not None:
            key, count, rows = cut
            if waits is not None and waits[leaf] is not None and key[0] == "stacked":
                key = ("waits", waits[leaf], count)
            group = groups.setdefault(key, _Group(key, count, rows))
            group.inputs.append(position)
    group_of = [None] * len(inputs)
    for group in groups.values():
        for position in group.inputs:
            group_of[position] = group.key

    def apply(g: list, s: list, p: list) -> list:
        # A gradient sent in the compute dtype, cast here, a piece at a time.
        g = [
            gi.astype(pi.dtype) if gi.dtype.itemsize < pi.dtype.itemsize else gi
            for gi, pi in zip(g, p, strict=True)
        ]
        grads = jtu.tree_unflatten(p_def, g)
        updates, state = optimizer.update(
            grads, jtu.tree_unflatten(s_def, s), jtu.tree_unflatten(p_def, p)
        )
        new = eqx.apply_updates(jtu.tree_unflatten(p_def, p), updates)
        extra = []
        if metrics:  # per leaf and row: piecewise, computed in the update's loops
            for tree in (grads, updates, new):
                extra += [_row_squares(x) for x in jtu.tree_leaves(tree)]
        return jtu.tree_leaves(new) + jtu.tree_leaves(state) + extra

    n_g, n_s = len(g_leaves), len(s_leaves)

    def split(xs: list) -> tuple[list, list, list]:
        return xs[:n_g], xs[n_g : n_g + n_s], xs[n_g + n_s :]

    def avals(chunked: bool) -> list:
        out = []
        for x, key in zip(inputs, group_of):
            shape = tuple(x.shape)
            if chunked and key is not None:
                shape = (groups[key].rows,) + shape[1:]
            out.append(jax.ShapeDtypeStruct(shape, x.dtype))
        return out

    def trace(chunked: bool) -> Any:
        return jax.make_jaxpr(lambda *xs: apply(*split(list(xs))))(*avals(chunked))

    whole = _dataflow.flatten(trace(False))
    try:
        traced = trace(True)
    # Broad on purpose: the user's optimizer, traced on one piece, may raise anything
    # (e.g. state whose shape follows the parameter's); the error is kept as the
    # cause and named in the message.
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise NotStreamable(
            f"traced on one piece of each leaf, it fails ({type(e).__name__}: {first})"
        ) from e
    piece = _dataflow.flatten(traced)
    plan = _dataflow.Dataflow(
        whole,
        piece,
        [
            _dataflow.Kind(_dataflow.SHARED)
            if g is None
            else _dataflow.Kind(_dataflow.PIECEWISE, g)
            for g in group_of
        ],
    )
    return Prepared(plan, inputs, labels, groups, group_of, p_def, s_def, len(p_leaves))


def _row_squares(x: Any) -> Any:
    """The sum of squares of each row of `x` (of `x` itself, for a scalar)."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))


def pieces(leaf: Any, layers: int | None, index: int) -> tuple[Any, int, int] | None:
    """How a trainable leaf is streamed: `(group key, pieces, rows per piece)`, or
    None if it is updated whole. One piece per layer of its `Stacked`, or blocks of
    rows of at most `_tiling.PIECE_BYTES` for a large leaf, where `_tiling` says the TPU
    compiler can cut it that way."""
    shape = tuple(leaf.shape)
    if layers is not None:
        if layers > 1 and _tiling.slices_by_layer(shape):
            return ("stacked", layers), layers, 1
        return None
    if math.prod(shape) * leaf.dtype.itemsize < 2 * _tiling.PIECE_BYTES:
        return None
    count = _tiling.row_blocks(shape, leaf.dtype, _tiling.PIECE_BYTES)
    return (("leaf", index), count, shape[0] // count) if count > 1 else None


class _Output(NamedTuple):
    """One value a loop over the pieces of a group computes, and how it comes back."""

    whole: Any  # the value in the whole program (a reference or a `_dataflow.Literal`)
    piece: Any  # its counterpart in the piece program
    # The memory kind of each new piece, stacked by the loop into the new leaf;
    # None for partials, which come back with a leading axis of pieces.
    kind: str | None = None
    label: str = ""  # the named scope of its transfers
    overwrite: int | None = None  # the input written piece by piece with it, in place
    summed: bool = False  # a metric: added up over the pieces, back as its sum


def execute(
    run: Prepared, out_kinds: tuple[list[str], list[str]]
) -> tuple[Any, Any, list, dict[Any, list]]:
    """Runs the update `run`, each new leaf in its memory kind (`out_kinds`). A
    group of pieces whose update waits (`prepare(waits=...)`) is not run: its
    leaves come back as they are, and the values its update reads besides its
    pieces (step counts, global norms) come back by group key, for `apply_held`.

    **Returns:** the new parameters and state, the metrics' per-row partial sums,
    and the held values."""
    plan, inputs, labels, groups = run.plan, run.inputs, run.labels, run.groups
    n_params = run.n_params
    whole, piece = plan.whole, plan.piece
    kinds = out_kinds[0] + out_kinds[1]
    env: dict[int, Any] = dict(whole.consts)

    def is_piecewise(r: Any) -> bool:
        return isinstance(r, int) and plan.kinds[r].what == _dataflow.PIECEWISE

    # Shared inputs (small leaves, counts) to the device, where they are computed on.
    for i, x, label in zip(whole.ins, inputs, labels):
        if not is_piecewise(i):
            with jax.named_scope(label):
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
            partials = [
                _Output(whole.eqns[r.eqn].outs[0], piece.eqns[r.eqn].outs[0])
                for r in mine
            ]
            values = _scan_pieces(plan, groups[key], inputs, labels, env, partials)
            for r, value in zip(mine, values):
                env[whole.eqns[r.eqn].outs[0]] = r.combine(value, axis=0)
    _run_shared(plan, env, None)

    # The outputs: the new parameters, the new state, then the metrics' per-row
    # partial sums (on the device). Each new leaf replaces an input (`_source`).
    outputs = output_list(run, out_kinds)
    by_group: dict[Any, list[int]] = {}  # group key -> positions of its outputs
    for position, out in enumerate(outputs):
        if is_piecewise(out.whole):
            by_group.setdefault(_group_of(run, position, len(kinds)), []).append(
                position
            )

    outs: list = [None] * len(whole.outs)
    for position, out in enumerate(outputs):
        if isinstance(out.whole, _dataflow.Literal):
            outs[position] = out.whole.value
        elif not is_piecewise(out.whole):
            assert out.kind is not None
            with jax.named_scope(out.label):
                outs[position] = to_space(env[out.whole], out.kind, "")
    held: dict[Any, list] = {}
    for key, group in groups.items():
        positions = by_group.get(key, [])
        if not positions:
            continue
        mine = [outputs[position] for position in positions]
        if key[0] == "waits":
            held[key] = [env[w] for w, _ in shared_inputs(plan, mine)]
            for position, out in zip(positions, mine):
                source = inputs[_source(position, n_params, len(kinds))]
                outs[position] = to_space(source, out.kind or "device", "")
            continue
        values = _scan_pieces(plan, group, inputs, labels, env, mine)
        for position, value in zip(positions, values):
            outs[position] = value
    new_params = jtu.tree_unflatten(run.p_def, outs[:n_params])
    new_state = jtu.tree_unflatten(run.s_def, outs[n_params : len(kinds)])
    return new_params, new_state, outs[len(kinds) :], held


def _group_of(run: Prepared, position: int, n_outputs: int) -> Any:
    """The group whose loop computes the piecewise output at `position`: the one
    its value comes from, or (for a value made afresh, such as zeros of a
    piece's shape) the one of the leaf it replaces."""
    ref = run.plan.whole.outs[position]
    source = (
        None if position >= n_outputs else _source(position, run.n_params, n_outputs)
    )
    key = run.plan.kinds[ref].group or (
        None if source is None else run.group_of[source]
    )
    if key is None:
        raise NotStreamable("a new leaf has the shape of a piece but no pieces")
    return key


def output_list(run: Prepared, out_kinds: tuple[list[str], list[str]]) -> list[_Output]:
    """Each output of the update with its piece counterpart, memory kind, label
    and the input it may overwrite."""
    plan, kinds = run.plan, out_kinds[0] + out_kinds[1]
    outputs = []
    for position, (ref, p_ref) in enumerate(zip(plan.whole.outs, plan.piece.outs)):
        if position >= len(kinds):
            outputs.append(_Output(ref, p_ref, "device", "metrics", summed=True))
            continue
        source = _source(position, run.n_params, len(kinds))
        out = _Output(ref, p_ref, kinds[position], run.labels[source])
        piecewise = isinstance(ref, int) and plan.kinds[ref].what == _dataflow.PIECEWISE
        if piecewise and run.group_of[source] == _group_of(run, position, len(kinds)):
            overwrite = _overwritable(
                run.inputs[source], plan.whole.avals[ref], out.kind
            )
            out = out._replace(overwrite=source if overwrite else None)
        outputs.append(out)
    return outputs


def waiting_outputs(
    run: Prepared, out_kinds: tuple[list[str], list[str]], key: Any
) -> list[int]:
    """The positions (among the new parameters, then the new state) of the
    outputs the group `key` computes."""
    n = len(out_kinds[0] + out_kinds[1])
    return [
        position
        for position, ref in enumerate(run.plan.whole.outs[:n])
        if isinstance(ref, int)
        and run.plan.kinds[ref].what == _dataflow.PIECEWISE
        and _group_of(run, position, n) == key
    ]


def apply_held(
    run: Prepared,
    out_kinds: tuple[list[str], list[str]],
    held: dict[Any, list],
) -> tuple[Any, Any]:
    """The update of the groups in `held` (by key, the values `execute` held for
    them), every other leaf as it is in `run`'s inputs."""
    kinds = out_kinds[0] + out_kinds[1]
    outputs = output_list(run, out_kinds)
    outs = [
        to_space(run.inputs[_source(k, run.n_params, len(kinds))], kinds[k], "")
        for k in range(len(kinds))
    ]
    for key, values in held.items():
        positions = waiting_outputs(run, out_kinds, key)
        mine = [outputs[k] for k in positions]
        env = dict(zip([w for w, _ in shared_inputs(run.plan, mine)], values))
        found = _scan_pieces(
            run.plan, run.groups[key], run.inputs, run.labels, env, mine
        )
        for k, value in zip(positions, found):
            outs[k] = value
    new_params = jtu.tree_unflatten(run.p_def, outs[: run.n_params])
    return new_params, jtu.tree_unflatten(run.s_def, outs[run.n_params :])


def shared_inputs(
    plan: _dataflow.Dataflow, outputs: list[_Output]
) -> list[tuple[Any, Any]]:
    """The shared and global values (whole-program reference, piece-program
    reference) that computing `outputs` piece by piece reads, in a fixed order."""
    whole, piece = plan.whole, plan.piece

    def is_shared(r: Any) -> bool:
        return plan.kinds[r].what != _dataflow.PIECEWISE

    pairs: dict[Any, Any] = {}
    for n in plan.needed([o.whole for o in outputs], is_shared):
        for w_ref, p_ref in zip(whole.eqns[n].ins, piece.eqns[n].ins):
            if isinstance(w_ref, int) and is_shared(w_ref):
                pairs.setdefault(w_ref, p_ref)
    return list(pairs.items())


def _source(position: int, n_params: int, n_outputs: int) -> int:
    """The input an output replaces: outputs are the new parameters then the new
    state; inputs the gradients, the state, then the parameters."""
    n_state = n_outputs - n_params
    if position < n_params:
        return n_params + n_state + position
    return position  # n_params gradients come first, then the state


def _overwritable(x: Any, aval: Any, kind: str | None) -> bool:
    """Whether an output (of abstract value `aval`, going to `kind`) can be written
    in place into the input `x` it replaces: same shape, dtype and memory kind."""
    same = x.shape == aval.shape and x.dtype == aval.dtype
    return same and ("pinned_host" if is_host(x) else "device") == kind


def _run_shared(plan: _dataflow.Dataflow, env: dict, level: int | None) -> None:
    """Evaluates (on whole values) every shared or global value whose inputs are
    known, up to `level` rounds of global reductions (all of them with None)."""
    whole = plan.whole
    for n, e in enumerate(whole.eqns):
        if all(o in env for o in e.outs) or n in plan.roots:
            continue
        if any(plan.kinds[o].what == _dataflow.PIECEWISE for o in e.outs):
            continue  # computed piece by piece, in the loops
        if level is not None and any(plan.kinds[o].level > level for o in e.outs):
            continue
        if all(r in env for r in e.ins if isinstance(r, int)):
            _dataflow.run(whole, [n], env)


def _scan_pieces(
    plan: _dataflow.Dataflow,
    group: _Group,
    inputs: list,
    labels: list[str],
    env: dict,
    outputs: list[_Output],
) -> list:
    """Runs the `piece` program over the pieces of `group` in a `lax.scan` and
    returns the value of each of `outputs`. Each piece's inputs are sliced from
    their leaves and moved to the device inside the body, so only one piece is
    there at a time.

    An output with an `overwrite` input position is written piece by piece into
    that input (a loop carry: with the input donated, the update happens in place)
    and comes back whole. A `summed` output is added up over the pieces, in the
    loop's carry, and comes back as its sum. The others come back as scan
    outputs, with a leading axis of pieces (a piece of one row, a layer, without
    its row axis: stacked, they are the whole leaf).

    How the overwritten inputs are read depends on the backend. On a TPU, step `k`
    reads piece `k` of each and the compiler streams it from the host. Elsewhere,
    XLA (its CPU backend, at least) fuses that read into the computation of another
    input's new piece — after the write into the first — and then copies every
    overwritten input at every step; so there, step `k` reads piece `k + 1` from
    the arrays it has just written piece `k` into, and carries it to the next step;
    the last piece is updated after the loop, so that nothing is read twice. (On
    a TPU that read-ahead keeps two pieces on the device and costs memory.)"""
    piece = plan.piece
    rows = group.rows

    def is_shared(r: Any) -> bool:
        return plan.kinds[r].what != _dataflow.PIECEWISE

    wanted = plan.needed([o.whole for o in outputs], is_shared)
    known = dict(piece.consts)
    for w_ref, p_ref in shared_inputs(plan, outputs):  # what the body reads
        known[p_ref] = env[w_ref]

    def piece_of(full: Any, index: Any, position: int) -> Any:
        with jax.named_scope(labels[position]):
            value = _tiling.read(full, index, rows)
            value = to_space(value, "device", "") if is_host(value) else value
            return _tiling.lift(value, rows)

    # Only the pieces the body computes with are read (a global norm's scan
    # needs the gradients, not the moments).
    refs = [r for n in wanted for r in piece.eqns[n].ins] + [o.piece for o in outputs]
    used = {r for r in refs if isinstance(r, int)}
    overwritten = {o.overwrite for o in outputs}
    carried = [i for i in group.inputs if i in overwritten]
    streamed = [
        i for i in group.inputs if i not in overwritten and piece.ins[i] in used
    ]
    # The loop's carry: the overwritten inputs, then one running sum per `summed`.
    sum_slot = dict(
        zip(
            [k for k, o in enumerate(outputs) if o.summed],
            range(len(carried), len(carried) + len(outputs)),
        )
    )

    def step(index: Any, others: list, current: list, fulls: list) -> tuple:
        """One piece: its new values, written into `fulls` or returned as `ys`."""
        local = dict(known)
        for position, x in zip(streamed, others):
            local[piece.ins[position]] = piece_of(x, index, position)
        for position, x in zip(carried, current):
            local[piece.ins[position]] = x
        _dataflow.run(piece, wanted, local)
        fulls, ys = list(fulls), []
        for k, out in enumerate(outputs):
            value = local[out.piece] if isinstance(out.piece, int) else out.piece.value
            if out.summed:
                fulls[sum_slot[k]] = fulls[sum_slot[k]] + jnp.sum(value)
            elif out.overwrite is None:  # stacked by the scan
                if out.kind is not None:  # a new leaf's piece (of a layer: the leaf)
                    value = to_space(_tiling.lower(value, rows), out.kind, "")
                ys.append(value)
            else:
                c = carried.index(out.overwrite)
                # The transfer under the leaf's scope, which names it in reports.
                with jax.named_scope(out.label):
                    new = _tiling.lower(value, rows)
                    new = new if out.kind is None else to_space(new, out.kind, "")
                    fulls[c] = _tiling.write(fulls[c], new, index, rows)
        return fulls, ys

    def current(fulls: list, index: Any) -> list:
        # A leaf whose new value does not read the old (a compute copy) is written
        # without being read.
        return [
            piece_of(f, index, i) if piece.ins[i] in used else None
            for f, i in zip(fulls, carried)
        ]

    def loop(fulls: list, others: list, read_ahead: bool) -> tuple[list, list]:
        def body(carry: Any, index: Any) -> tuple[Any, list]:
            if not read_ahead:
                return step(index, others, current(carry, index), carry)
            fulls, ys = step(index, others, *carry)
            ahead = jnp.minimum(index + 1, group.pieces - 1)
            return (current(fulls, ahead), fulls), ys

        indices = jnp.arange(group.pieces)
        if not read_ahead:
            return jax.lax.scan(body, fulls, indices)
        # The last piece after the loop: it has no next piece to read ahead (in
        # the loop it would read itself again). Not where a new host-resident
        # leaf is stacked from the pieces (it would be joined on the host).
        stacked_on_host = any(
            o.overwrite is None and o.kind == "pinned_host" for o in outputs
        )
        if group.pieces == 1 or stacked_on_host:
            (_, fulls), ys = jax.lax.scan(body, (current(fulls, 0), fulls), indices)
            return fulls, ys
        first = (current(fulls, 0), fulls)
        (now, fulls), ys = jax.lax.scan(body, first, indices[:-1])
        fulls, last = step(indices[-1], others, now, fulls)
        return fulls, [jnp.concatenate([y, z[None]]) for y, z in zip(ys, last)]

    fulls = [inputs[i] for i in carried] + [jnp.zeros((), jnp.float32)] * len(sum_slot)
    others = [inputs[i] for i in streamed]
    if carried:
        direct = {p: functools.partial(loop, read_ahead=False) for p in READ_IN_STEP}
        ahead = functools.partial(loop, read_ahead=True)
        fulls, ys = jax.lax.platform_dependent(fulls, others, **direct, default=ahead)
    else:
        fulls, ys = loop(fulls, others, read_ahead=False)
    return _collect(outputs, fulls, iter(ys), carried, sum_slot, rows)


def _collect(
    outputs: list[_Output],
    fulls: list,
    ys: Iterator,
    carried: list[int],
    sum_slot: dict[int, int],
    rows: int,
) -> list:
    """The value of each output from what a loop over pieces gave back: its
    overwritten input or its sum (in the carry), or its stacked pieces."""
    values = []
    for k, out in enumerate(outputs):
        if out.summed:
            values.append(fulls[sum_slot[k]])
        elif out.overwrite is not None:
            values.append(fulls[carried.index(out.overwrite)])
        else:
            y = next(ys)
            if out.kind is not None and rows > 1:  # pieces of rows: one leaf
                y = y.reshape((y.shape[0] * rows,) + y.shape[2:])
            values.append(y)
    return values
