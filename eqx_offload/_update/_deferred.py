"""`Policy(update_timing=...)`: the stacked layers' update held over to the next step.

At the end of a step, the update runs as the streamed update does (`_streaming.py`).
It does so for every leaf but the stacked layers' parameters and state. For those,
it keeps what their update reads besides their own pieces. That is this step's
gradients of them, and the values computed from the whole tree (step counts, the
global gradient norm). They are *held* in the optimizer state (`PendingUpdate`).

The next step applies it layer by layer, inside the forward scan (`_pending.py`,
`_prefetch.py`). Where the scan cannot, it runs in a streamed loop of its own
(`apply_waiting`). Either way, each piece is computed by the same piece jaxpr, from
the same values as `update_timing="now"`. So the numbers are the same.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from .. import _paths, _pending, _tiling
from .._memory_kinds import is_arraylike, to_space
from .._pending import (
    check_ready as check_ready,
    PendingUpdate as PendingUpdate,
    structure as structure,
)
from . import _dataflow, _streaming


def waits(params: PyTree) -> list[str | None]:
    """Per trainable array leaf: the path of the `Stacked` it is a layer leaf of,
    whose update may wait (None for the others)."""
    return [
        leaf.stacked if leaf.layer_axes == 1 else None  # (not a nested `Stacked`)
        for leaf in _paths.leaves(params)
        if is_arraylike(leaf.value)
    ]


def _layers(params: PyTree) -> list[int | None]:
    return [
        leaf.value.shape[0] if leaf.stacked is not None else None
        for leaf in _paths.leaves(params)
        if is_arraylike(leaf.value)
    ]


def _prepare(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    inner: PyTree,
    params: PyTree,
) -> _streaming.Prepared:
    paths = [leaf.path for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    return _streaming.prepare(
        optimizer, grads, inner, params, _layers(params), paths, waits=waits(params)
    )


def _waiting_keys(prepared: _streaming.Prepared) -> list[Any]:
    return [key for key in prepared.groups if key[0] == "waits"]


def _waiting_mask(prepared: _streaming.Prepared) -> list[bool]:
    """Per trainable leaf: whether its update waits."""
    waiting = _waiting_keys(prepared)
    return [g.group in waiting for g in prepared.grads]


def with_pending(
    optimizer: optax.GradientTransformation,
) -> optax.GradientTransformation:
    """`optimizer` whose state is a `PendingUpdate` with nothing waiting. (Its
    update is `train_step`'s business: the transformation's own is refused.)"""

    def init(params: PyTree) -> PendingUpdate:
        inner = optimizer.init(params)

        masks: list[list[bool]] = []  # (which leaves wait: static, from the trace)

        def held_values(params: PyTree, inner: PyTree) -> Any:
            prepared = _prepare(optimizer, params, inner, params)
            masks.append(_waiting_mask(prepared))
            _, _, _, held = _streaming.execute(prepared, _device_kinds(prepared))
            return tuple(tuple(held[key]) for key in _waiting_keys(prepared))

        abstract = jax.eval_shape(held_values, params, inner)
        mask = masks[0]
        leaves, treedef = jtu.tree_flatten(params)
        grads = jtu.tree_unflatten(
            treedef,
            [
                jnp.zeros_like(p) if m else optax.MaskedNode()
                for p, m in zip(leaves, mask, strict=True)
            ],
        )
        held = jtu.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
        return PendingUpdate(inner, grads, held, False)

    def update(grads: PyTree, state: PendingUpdate, params: PyTree = None) -> Any:
        raise ValueError(
            "Only `train_step` updates a `Policy(update_timing=...)` state. Call "
            "`eqx_offload.apply_pending` first."
        )

    return optax.GradientTransformation(init, update)  # pyright: ignore


def _device_kinds(prepared: _streaming.Prepared) -> tuple[list[str], list[str]]:
    return ["device"] * len(prepared.params), ["device"] * len(prepared.state)


def _split_kinds(
    state: PendingUpdate, state_kinds: list[str]
) -> tuple[list[str], list[str]]:
    """The kinds of `state.inner`'s leaves, and of its gradients'."""
    n_inner = len(jtu.tree_leaves(state.inner))
    n_grads = len(jtu.tree_leaves(state.grads))
    return state_kinds[:n_inner], state_kinds[n_inner : n_inner + n_grads]


def hold_update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    state: PendingUpdate,
    params: PyTree,
    param_kinds: list[str],
    state_kinds: list[str],
) -> tuple[PyTree, PendingUpdate]:
    """The end of a step: every leaf updated but the stacked layers', whose
    gradients and held values are kept for the next step."""
    inner_kinds, grad_kinds = _split_kinds(state, state_kinds)
    prepared = _prepare(optimizer, grads, state.inner, params)
    new_params, inner, _, held = _streaming.execute(
        prepared, (param_kinds, inner_kinds)
    )
    mask = _waiting_mask(prepared)
    waiting = [g for g, m in zip(jtu.tree_leaves(grads), mask, strict=True) if m]
    waiting = [
        to_space(_cast(g, p.dtype), kind, "")
        for g, p, kind in zip(
            waiting, jtu.tree_leaves(state.grads), grad_kinds, strict=True
        )
    ]
    kept = jtu.tree_unflatten(jtu.tree_structure(state.grads), waiting)
    held_values = tuple(
        tuple(to_space(jnp.asarray(x), "device", "") for x in held[key])
        for key in _waiting_keys(prepared)
    )
    return new_params, PendingUpdate(inner, kept, held_values, True)


def _cast(g: Any, dtype: Any) -> Any:
    """`g` in `dtype`, cast on the device (a cast of a host-resident array would be
    computed on the host's CPU): a gradient sent in the compute dtype, kept in its
    parameter's."""
    if g.dtype == dtype:
        return g
    return to_space(g, "device", "").astype(dtype)


def _grads_for(run_params: PyTree, state: PendingUpdate) -> PyTree:
    """A gradient tree for `_prepare`: the waiting gradients, and each other
    leaf's parameter in its place (never read: only waiting groups run)."""
    return jtu.tree_map(
        lambda g, p: p if isinstance(g, optax.MaskedNode) else g,
        state.grads,
        run_params,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


def apply_waiting(
    optimizer: optax.GradientTransformation,
    state: PendingUpdate,
    params: PyTree,
    param_kinds: list[str],
    state_kinds: list[str],
) -> tuple[PyTree, PendingUpdate]:
    """The waiting update applied (in a streamed loop of its own): the new
    parameters, and the state with nothing waiting."""
    if not state.ready:
        return params, state
    inner_kinds, _ = _split_kinds(state, state_kinds)
    prepared = _prepare(optimizer, _grads_for(params, state), state.inner, params)
    held = dict(
        zip(_waiting_keys(prepared), [list(h) for h in state.held], strict=True)
    )
    new_params, inner = _streaming.apply_held(
        prepared, (param_kinds, inner_kinds), held
    )
    return new_params, PendingUpdate(inner, state.grads, state.held, False)


def layer_updates(
    optimizer: optax.GradientTransformation,
    state: PendingUpdate,
    params: PyTree,
    param_kinds: list[str],
    state_kinds: list[str],
    delayed: bool,
) -> tuple[dict[str, _pending.Layers], Any]:
    """Per `Stacked` path, the waiting update as its forward scan applies it, and
    a function that takes the gradient of the step's `aux` (the new values) back
    to the new parameters and inner state."""
    inner_kinds, _ = _split_kinds(state, state_kinds)
    prepared = _prepare(optimizer, _grads_for(params, state), state.inner, params)
    outputs = _streaming.output_list(prepared, (param_kinds, inner_kinds))
    mask = _waiting_mask(prepared)
    names = [leaf.path for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    grad_slot = {t: k for k, t in enumerate(t for t, m in enumerate(mask) if m)}
    p_leaves = jtu.tree_leaves(params)
    g_leaves = jtu.tree_leaves(state.grads)  # the waiting leaves' only
    s_leaves = jtu.tree_leaves(state.inner)
    layers: dict[str, _pending.Layers] = {}
    places: dict[str, tuple[list[int], list[int]]] = {}
    for key, held in zip(_waiting_keys(prepared), state.held, strict=True):
        path = key[1]
        leaves, states, update = _stack_update(prepared, outputs, key, delayed)
        grads = [g_leaves[grad_slot[t]] for t in leaves]
        aux = ([p_leaves[t] for t in leaves], grads, [s_leaves[j] for j in states])
        writes = (False, True, True) if delayed else (True, False, True)
        paths = tuple(names[t] for t in leaves)
        layers[path] = _pending.Layers(paths, update, aux, tuple(held), writes)
        places[path] = (leaves, states)

    def back(new_aux: dict[str, Any]) -> tuple[PyTree, PyTree]:
        """The parameters and inner state with each `Stacked`'s new values: the
        new parameters written over the old (`"next_forward"`) or, where the
        layers computed with the old ones (`"delayed"`), over the gradients."""
        p_leaves, p_def = jtu.tree_flatten(params)
        s_leaves, s_def = jtu.tree_flatten(state.inner)
        for path, (leaves, states) in places.items():
            params_slot, grads_slot, new_state = new_aux[path]
            new_params = grads_slot if delayed else params_slot
            for t, x in zip(leaves, new_params, strict=True):
                p_leaves[t] = to_space(x, param_kinds[t], "")
            for j, x in zip(states, new_state, strict=True):
                s_leaves[j] = to_space(x, inner_kinds[j], "")
        return jtu.tree_unflatten(p_def, p_leaves), jtu.tree_unflatten(s_def, s_leaves)

    return layers, back


def _stack_update(
    prepared: _streaming.Prepared,
    outputs: list[_streaming.Output],
    key: Any,
    delayed: bool,
) -> tuple[list[int], list[int], Any]:
    """For the waiting group `key` (one `Stacked`'s layers): the trainable leaves
    and the state leaves its update reads and writes, and one layer's update."""
    n_p = prepared.n_params
    positions = _streaming.waiting_outputs(outputs, key)
    mine = [outputs[k] for k in positions]
    leaves = [k for k in positions if k < n_p]  # new parameters, then new state
    states = sorted(
        {k - n_p for k in positions if k >= n_p}
        | {j for j, x in enumerate(prepared.state) if x.group == key}
    )
    dataflow, piece = prepared.dataflow, prepared.dataflow.piece
    pairs = _streaming.shared_inputs(dataflow, mine)
    wanted = dataflow.piece_eqns([o.whole for o in mine])
    refs = _PieceRefs(
        [ref for _, ref in pairs],
        [piece.ins[prepared.params[t].position] for t in leaves],
        [piece.ins[prepared.grads[t].position] for t in leaves],
        [piece.ins[prepared.state[j].position] for j in states],
        [piece.outs[t] for t in leaves],
        [piece.outs[n_p + j] for j in states],
    )
    return leaves, states, _piece_update(piece, wanted, refs, delayed)


class _PieceRefs(NamedTuple):
    """The variables of the piece jaxpr one layer's update sets and reads."""

    held: list  # the shared and global values it reads
    params: list
    grads: list
    state: list
    new_params: list  # outputs (variable ids or `Literal`s)
    new_state: list


def _piece_update(
    piece: _dataflow.FlatJaxpr, wanted: list[int], refs: _PieceRefs, delayed: bool
) -> Any:
    """One layer's update of the waiting leaves, by the piece jaxpr.

    It takes one layer's slice of `aux = (params, grads, state)`, on the device
    and without the layer axis, to the new slice. The new parameters replace the
    old ones, or the gradients where the layers compute with the old (`delayed`)."""

    def update(aux: Any, held: Any) -> Any:
        params, grads, state = aux
        local = dict(piece.consts)
        local.update(zip(refs.held, held, strict=True))
        pairs = zip(refs.params, refs.grads, params, grads, strict=True)
        for p_ref, g_ref, p, g in pairs:
            local[g_ref] = _tiling.lift(g, 1)
            local[p_ref] = _tiling.lift(p, 1)
        for ref, x in zip(refs.state, state, strict=True):
            local[ref] = _tiling.lift(x, 1)
        _dataflow.run(piece, wanted, local)

        def out(ref: Any, old: Any) -> Any:
            value = ref.value if isinstance(ref, _dataflow.Literal) else local.get(ref)
            if value is None:  # a state leaf the update reads but does not write
                return old
            return _tiling.lower(jnp.asarray(value), 1).astype(old.dtype)

        new_params = [out(r, p) for r, p in zip(refs.new_params, params, strict=True)]
        new_state = [out(r, x) for r, x in zip(refs.new_state, state, strict=True)]
        if delayed:
            return params, new_params, new_state
        return new_params, grads, new_state

    return update


def own_state(state: Any) -> Any:
    """The wrapped optimizer's state, of a `PendingUpdate` (else `state`)."""
    return state.inner if isinstance(state, PendingUpdate) else state
