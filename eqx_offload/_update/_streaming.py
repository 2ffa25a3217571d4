"""The streamed optimizer update: the device sees one piece at a time.

Parameters, gradients and optimizer state go to the device piece by piece. A piece
is one layer of a `Stacked`, or one block of rows of a large leaf. The loop is a
`lax.scan` whose transfers the compiler cannot hoist.

The optimizer is applied to pieces without changing its result. `_dataflow.py`
reads from its jaxpr which values are shared, piecewise or global. This module runs
it. Global reductions come first, from per-piece partials. Then one loop per group
of pieces writes every new piece into its (donated) leaf, in place.

A piece is a slice of the leaf along axis 0. It is read and written with
`dynamic_slice`/`dynamic_update_slice` on the leaf itself. The TPU compiler's
host-offload passes stream such slices. They reject a reshape of a host array into
`(pieces, rows, ...)` ("Only handling bitcasts with majormost dimension of size 1").
Which leaves can be cut at all is `_tiling.py`'s rule. The others are updated whole.
A leaf whose rows `Policy(shard=...)` splits over chips is cut by part: a piece is
a block of rows of each chip's part (`_tiling.parts`), so each chip moves its own.
Each piece's slicing and transfers run under `jax.named_scope(<leaf path>)`. So a
compiler message about one of them names its leaf. The loop over one group's pieces
is `_piece_loop.py`.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax

from .. import _jaxpr_dataflow as _dataflow, _layout, _paths, _scopes, _tiling
from .._jaxpr_dataflow import Flow, NotStreamable, ValueFlow
from .._memory_kinds import is_host, to_device, to_space
from . import _metrics
from ._piece_loop import Group, Input, Output, scan_pieces
from ._state_tree import state_owners


# Backends on which step `k` of a streamed loop reads piece `k` of the arrays it
# updates in place; the others read one piece ahead (`_piece_loop.py`).
READ_IN_STEP = ("tpu",)


def update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    stacked: list[int | None],
    out_kinds: tuple[list[str], list[str]],
    paths: list[str],
    metrics: bool = False,
    shards: list[int] | None = None,
) -> tuple[Any, Any, dict[str, Any] | None]:
    """`optax.apply_updates(params, optimizer.update(grads, opt_state, params))`.

    This one is streamed.

    - `params`: the trainable part of the model.
    - `stacked[i]`: the number of layers of the `Stacked` holding trainable leaf `i`,
        or None.
    - `out_kinds`: the memory kind of each new parameter and state leaf.
    - `paths`: the path of each trainable leaf, for named scopes.
    - `metrics`: also the global norms of the gradients, updates and new parameters.
        They are streamed reductions, like any global value of the update.
    - `shards[i]`: in how many parts trainable leaf `i`'s rows are split over the
        mesh (`layout`); None: none is.

    **Returns:** the new parameters and optimizer state, in their memory kinds,
    and the metrics (on the device) or None.
    """
    given = (optimizer, grads, opt_state, params)
    prepared = prepare(*given, stacked, paths, shards, metrics)
    new_params, new_state, extra, _ = execute(prepared, out_kinds)
    squares = [jnp.sum(x) for x in extra]
    norms = _metrics.from_squares(squares, len(prepared.params)) if metrics else None
    return new_params, new_state, norms


def layout(params: Any, policy: Any = None) -> tuple[list, list[str], list[int]]:
    """`update`'s `stacked`, `paths` and `shards` for `params` (the trainable part
    of a model): per leaf, the number of layers of its `Stacked` (or None), its
    path, and in how many parts `policy.shard` splits its rows over the mesh it is
    traced on (1 without a `policy`)."""
    leaves = _paths.leaves(params)
    layers = [x.value.shape[0] if x.stacked is not None else None for x in leaves]
    shards = [_layout.row_parts(x, policy) for x in leaves]
    return layers, [x.path for x in leaves], shards


@dataclasses.dataclass
class Prepared:
    """An optimizer update read for streaming: its dataflow, its inputs (by
    argument), their groups of pieces, and the trees of its results."""

    dataflow: _dataflow.Dataflow
    grads: list[Input]
    state: list[Input]
    params: list[Input]
    groups: dict[Any, Group]
    p_def: Any
    s_def: Any

    @property
    def replaced(self) -> list[Input]:
        """The input each new leaf replaces: the parameters, then the state."""
        return self.params + self.state

    def scan(self, key: Any, env: dict, outputs: list[Output]) -> list:
        """The value of each of `outputs`, computed piece by piece over the group
        `key` (`_piece_loop.scan_pieces`)."""
        return scan_pieces(self.dataflow, self.groups[key], env, outputs, READ_IN_STEP)


def prepare(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    stacked: list[int | None],
    paths: list[str],
    shards: list[int] | None = None,
    metrics: bool = False,
    waits: list[str | None] | None = None,
) -> Prepared:
    """The update of `update` (same arguments), read for streaming. `waits[i]`,
    if given, names the `Stacked` whose update of trainable leaf `i` waits for
    the next step (`_deferred.py`): its pieces form a group of their own."""
    # The update's dataflow: traced on whole leaves and on one piece of each. Each
    # leaf's squares per row are piecewise, computed in the update's loops.
    apply, (g_leaves, s_leaves, p_leaves), (p_def, s_def) = _metrics.flat_update(
        optimizer, (grads, opt_state, params), _metrics.row_squares if metrics else None
    )
    owner = state_owners(optimizer, opt_state, params)
    waiting = [None] * len(p_leaves) if waits is None else waits
    groups: dict[Any, Group] = {}
    leaf_groups = [
        _group(p, (stacked[i], i, shards[i] if shards else 1), waiting[i], groups)
        for i, p in enumerate(p_leaves)
    ]
    inputs: list[Input] = []

    def add(value: Any, label: str, leaf: int | None) -> Input:
        """The next input, streamed with trainable leaf `leaf` (if it is cut)."""
        group = None if leaf is None else leaf_groups[leaf]
        x = Input(len(inputs), value, label, None if group is None else group.key)
        inputs.append(x)
        if group is not None:
            group.inputs.append(x)
        return x

    grad, state = _scopes.GRAD, _scopes.OPT_STATE
    g_in = [add(g, f"{grad}.{p}", i) for i, (g, p) in enumerate(zip(g_leaves, paths))]
    s_in = [
        add(s, state if i is None else f"{state}.{paths[i]}", i)
        for s, i in zip(s_leaves, owner, strict=True)
    ]
    p_in = [add(p, path, i) for i, (p, path) in enumerate(zip(p_leaves, paths))]

    def trace(chunked: bool) -> Any:
        avals = []
        for x in inputs:
            shape = tuple(x.value.shape)
            if chunked and x.group is not None:
                shape = (groups[x.group].rows,) + shape[1:]
            avals.append(jax.ShapeDtypeStruct(shape, x.value.dtype))
        return jax.make_jaxpr(apply)(*avals)

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
    flows = [
        ValueFlow(Flow.SHARED if x.group is None else Flow.PIECEWISE, x.group)
        for x in inputs
    ]
    dataflow = _dataflow.Dataflow(whole, _dataflow.flatten(traced), flows)
    return Prepared(dataflow, g_in, s_in, p_in, groups, p_def, s_def)


def _group(leaf: Any, where: tuple, waits: str | None, groups: dict) -> Group | None:
    """The group of pieces a trainable leaf is streamed in, or None: the one of
    its key in `groups`, else a new one added there. `where`: `pieces`'s
    arguments after the leaf. `waits`: the `Stacked` whose update of it waits."""
    cut = pieces(leaf, *where)
    if cut is None:
        return None
    key, count, rows = cut
    if waits is not None and key[0] == "stacked":
        key = ("waits", waits, count)
    return groups.setdefault(key, Group(key, count, rows, where[2]))


def pieces(leaf: Any, layers: int | None, index: int, shards: int = 1) -> tuple | None:
    """How a trainable leaf is streamed: `(group key, pieces, rows per piece)`, or
    None if it is updated whole. One piece per layer of its `Stacked`, or blocks of
    rows of at most `_tiling.PIECE_BYTES` (on a chip) for a large leaf, where
    `_tiling` says the TPU compiler can cut it that way. Rows split in `shards`
    parts over a mesh are cut by part (`_tiling.parts`): a piece is a block of each
    part."""
    shape = tuple(leaf.shape)
    if layers is not None:
        if layers > 1 and _tiling.slices_by_layer(shape):
            return ("stacked", layers), layers, 1
        return None
    count = _tiling.chip_blocks(shape, leaf.dtype, shards)
    return (("leaf", index), count, shape[0] // count) if count > 1 else None


def execute(
    prepared: Prepared, out_kinds: tuple[list[str], list[str]]
) -> tuple[Any, Any, list, dict[Any, list]]:
    """Runs the update `prepared`, each new leaf in its memory kind (`out_kinds`). A
    group of pieces whose update waits (`prepare(waits=...)`) is not run: its
    leaves come back as they are, and the values its update reads besides its
    pieces (step counts, global norms) come back by group key, for `apply_held`.

    **Returns:** the new parameters and state, the metrics' per-row partial sums,
    and the held values."""
    dataflow = prepared.dataflow
    env: dict[int, Any] = dict(dataflow.whole.consts)
    # Shared inputs (small leaves, counts) to the device, where they are computed on.
    for x in prepared.grads + prepared.state + prepared.params:
        if x.group is None:
            with jax.named_scope(x.label):
                env[dataflow.whole.ins[x.position]] = to_device(x.value)
    _run_globals(prepared, env)
    dataflow.run_shared(env, None)

    # The outputs: the new parameters, the new state, then the metrics' per-row
    # partial sums (on the device).
    outputs = output_list(prepared, out_kinds)
    outs = [_whole_value(out, env) for out in outputs]
    held: dict[Any, list] = {}
    for key in prepared.groups:
        positions = [k for k, out in enumerate(outputs) if out.group == key]
        if not positions:
            continue
        mine = [outputs[k] for k in positions]
        if key[0] == "waits":
            shared = dataflow.shared_inputs([o.whole for o in mine])
            held[key] = [env[w] for w, _ in shared]
            values = [_unchanged(out) for out in mine]
        else:
            values = prepared.scan(key, env, mine)
        for k, value in zip(positions, values):
            outs[k] = value
    n_p, n = len(prepared.params), len(prepared.replaced)
    new_params = jtu.tree_unflatten(prepared.p_def, outs[:n_p])
    new_state = jtu.tree_unflatten(prepared.s_def, outs[n_p:n])
    return new_params, new_state, outs[n:], held


def _run_globals(prepared: Prepared, env: dict) -> None:
    """The global values, level by level: partial reductions scanned over the
    pieces, combined, and what is computed from them on whole values."""
    dataflow = prepared.dataflow
    roots = list(dataflow.roots.values())
    for level in sorted({dataflow.flows[r.out].level for r in roots}):
        dataflow.run_shared(env, level - 1)
        now = [r for r in roots if dataflow.flows[r.out].level == level]
        for key in dict.fromkeys(r.group for r in now):
            mine = [r for r in now if r.group == key]
            partials = [Output(r.out, r.piece_out) for r in mine]
            for r, value in zip(mine, prepared.scan(key, env, partials)):
                env[r.out] = r.combine(value, axis=0)


def _whole_value(out: Output, env: dict) -> Any:
    """An output computed on whole values, in its memory kind (None for one
    computed piece by piece)."""
    if isinstance(out.whole, _dataflow.Literal):
        return out.whole.value
    if out.group is not None:
        return None
    assert out.kind is not None
    with jax.named_scope(out.label):
        return to_space(env[out.whole], out.kind, "")


def _unchanged(out: Output) -> Any:
    """A new leaf whose update waits: the leaf it replaces, in its memory kind."""
    assert out.replaces is not None
    return to_space(out.replaces.value, out.kind or "device", "")


def output_list(
    prepared: Prepared, out_kinds: tuple[list[str], list[str]]
) -> list[Output]:
    """Each output of the update: its references, memory kind, label, group, and
    the input it replaces and may overwrite."""
    dataflow = prepared.dataflow
    kinds = out_kinds[0] + out_kinds[1]
    pairs = list(zip(dataflow.whole.outs, dataflow.piece.outs))
    outputs = [
        Output(ref, p_ref, kind, x.label, replaces=x)
        for (ref, p_ref), kind, x in zip(pairs, kinds, prepared.replaced, strict=False)
    ]
    outputs += [
        Output(ref, p_ref, "device", "metrics", summed=True)
        for ref, p_ref in pairs[len(kinds) :]
    ]
    return [_in_group(dataflow, out) for out in outputs]


def _in_group(dataflow: _dataflow.Dataflow, out: Output) -> Output:
    """`out` with its group and the input it overwrites, if it is piecewise.

    Its group is the one its value comes from. A value made afresh (zeros of a
    piece's shape) takes the group of the leaf it replaces."""
    if not dataflow.is_piecewise(out.whole):
        return out
    source = out.replaces
    key = dataflow.flows[out.whole].group or (None if source is None else source.group)
    if key is None:
        raise NotStreamable("a new leaf has the shape of a piece but no pieces")
    overwrite = None
    if source is not None and source.group == key:
        # Written in place into the input it replaces where it has the same shape,
        # dtype and memory kind.
        x, aval = source.value, dataflow.whole.avals[out.whole]
        same = x.shape == aval.shape and x.dtype == aval.dtype
        if same and ("pinned_host" if is_host(x) else "device") == out.kind:
            overwrite = source.position
    return out._replace(group=key, overwrite=overwrite)


def waiting_outputs(outputs: list[Output], key: Any) -> list[int]:
    """The positions (among the new parameters, then the new state) of the
    outputs the group `key` computes."""
    return [k for k, out in enumerate(outputs) if out.group == key and not out.summed]


def apply_held(
    prepared: Prepared, out_kinds: tuple[list[str], list[str]], held: dict[Any, list]
) -> tuple[Any, Any]:
    """The update of the groups in `held` (by key, the values `execute` held for
    them), every other leaf as it is in `prepared`'s inputs."""
    kinds = out_kinds[0] + out_kinds[1]
    outputs = output_list(prepared, out_kinds)
    outs = [
        to_space(x.value, kind, "")
        for x, kind in zip(prepared.replaced, kinds, strict=True)
    ]
    for key, values in held.items():
        positions = waiting_outputs(outputs, key)
        mine = [outputs[k] for k in positions]
        shared = prepared.dataflow.shared_inputs([o.whole for o in mine])
        env = dict(zip([w for w, _ in shared], values))
        for k, value in zip(positions, prepared.scan(key, env, mine)):
            outs[k] = value
    new_params = jtu.tree_unflatten(prepared.p_def, outs[: len(prepared.params)])
    return new_params, jtu.tree_unflatten(prepared.s_def, outs[len(prepared.params) :])
