"""`Policy(update_timing="next_forward")`: the stacked layers' update held over to
the next step.

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

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from .. import _jaxpr_dataflow as _dataflow, _paths, _pending, _tiling
from .._memory_kinds import is_arraylike, is_masked, to_space
from .._pending import PendingUpdate
from . import _streaming


def waits(params: PyTree) -> list[str | None]:
    """Per trainable array leaf: the path of the `Stacked` it is a layer leaf of,
    whose update may wait (None for the others)."""
    # (Not a leaf of a nested `Stacked`.)
    leaves = [x for x in _paths.leaves(params) if is_arraylike(x.value)]
    return [x.stacked if x.layer_axes == 1 else None for x in leaves]


def held_paths(params: PyTree, state: PendingUpdate) -> set[str]:
    """The paths of the `Stacked`s whose update `state` holds over."""
    grads = jtu.tree_leaves(state.grads, is_leaf=is_masked)
    return {
        path
        for path, g in zip(waits(params), grads, strict=True)
        if path is not None and not is_masked(g)
    }


def _prepare(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    inner: PyTree,
    params: PyTree,
) -> _streaming.Prepared:
    return _streaming.prepare(
        optimizer, grads, inner, params, *_streaming.layout(params), waits=waits(params)
    )


def _waiting_keys(prepared: _streaming.Prepared) -> list[Any]:
    return [key for key in prepared.groups if key[0] == "waits"]


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
            waiting = _waiting_keys(prepared)
            masks.append([g.group in waiting for g in prepared.grads])
            kinds = ["device"] * len(prepared.params), ["device"] * len(prepared.state)
            _, _, _, held = _streaming.execute(prepared, kinds)
            return tuple(tuple(held[key]) for key in _waiting_keys(prepared))

        abstract = jax.eval_shape(held_values, params, inner)
        mask = iter(masks[0])
        grads = jtu.tree_map(
            lambda p: jnp.zeros_like(p) if next(mask) else optax.MaskedNode(), params
        )
        held = jtu.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
        return PendingUpdate(inner, grads, held, False)

    def update(grads: PyTree, state: PendingUpdate, params: PyTree = None) -> Any:
        raise ValueError(
            "Only `train_step` updates a `Policy(update_timing=...)` state. Call "
            "`eqx_offload.apply_pending` first."
        )

    return optax.GradientTransformation(init, update)  # pyright: ignore


def _split_kinds(
    state: PendingUpdate, kinds: tuple[list[str], list[str]]
) -> tuple[tuple[list[str], list[str]], list[str]]:
    """From `kinds` (those of the parameters and of `state`'s leaves): the kinds of
    the parameters and of `state.inner`'s leaves, and those of its gradients'."""
    n_inner = len(jtu.tree_leaves(state.inner))
    return (kinds[0], kinds[1][:n_inner]), kinds[1][n_inner:]


def hold_update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    state: PendingUpdate,
    params: PyTree,
    kinds: tuple[list[str], list[str]],
) -> tuple[PyTree, PendingUpdate]:
    """The end of a step: every leaf updated but the stacked layers', whose
    gradients and held values are kept for the next step. `kinds`: the memory
    kinds of the parameters and of `state`'s leaves."""
    out_kinds, grad_kinds = _split_kinds(state, kinds)
    prepared = _prepare(optimizer, grads, state.inner, params)
    new_params, inner, _, held = _streaming.execute(prepared, out_kinds)
    found = iter(grad_kinds)

    def keep(old: Any, g: Any) -> Any:  # (`old` is masked where nothing waits)
        return old if is_masked(old) else to_space(_cast(g, old.dtype), next(found), "")

    kept = jtu.tree_map(keep, state.grads, grads, is_leaf=is_masked)
    held_values = tuple(
        tuple(to_space(jnp.asarray(x), "device", "") for x in held[key])
        for key in _waiting_keys(prepared)
    )
    return new_params, PendingUpdate(inner, kept, held_values, True)


def _cast(g: Any, dtype: Any) -> Any:
    """`g` in `dtype`, cast on the device (a cast of a host-resident array would be
    computed on the host's CPU): a gradient sent in the compute dtype, kept in its
    parameter's."""
    return g if g.dtype == dtype else to_space(g, "device", "").astype(dtype)


def _waiting(
    optimizer: optax.GradientTransformation, state: PendingUpdate, params: PyTree
) -> _streaming.Prepared:
    """The update `state` holds, read for streaming: on the waiting gradients, and
    each other leaf's parameter in its gradient's place (never read: only waiting
    groups run)."""
    grads = jtu.tree_map(
        lambda g, p: p if is_masked(g) else g, state.grads, params, is_leaf=is_masked
    )
    return _prepare(optimizer, grads, state.inner, params)


def apply_waiting(
    optimizer: optax.GradientTransformation,
    state: PendingUpdate,
    params: PyTree,
    kinds: tuple[list[str], list[str]],
) -> tuple[PyTree, PendingUpdate]:
    """The waiting update applied (in a streamed loop of its own): the new
    parameters, and the state with nothing waiting. `kinds`: the memory kinds of
    the parameters and of `state`'s leaves."""
    if not state.ready:
        return params, state
    prepared = _waiting(optimizer, state, params)
    held = dict(zip(_waiting_keys(prepared), map(list, state.held), strict=True))
    out_kinds = _split_kinds(state, kinds)[0]
    new_params, inner = _streaming.apply_held(prepared, out_kinds, held)
    return new_params, dataclasses.replace(state, inner=inner, ready=False)


def layer_updates(
    optimizer: optax.GradientTransformation,
    state: PendingUpdate,
    params: PyTree,
    kinds: tuple[list[str], list[str]],
) -> tuple[dict[str, _pending.Layers], Any]:
    """Per `Stacked` path, the waiting update as its forward scan applies it, and
    a function that takes the gradient of the step's `aux` (the new values) back
    to the new parameters and inner state. `kinds`: as for `apply_waiting`."""
    p_kinds, s_kinds = _split_kinds(state, kinds)[0]
    prepared = _waiting(optimizer, state, params)
    outputs = _streaming.output_list(prepared, (p_kinds, s_kinds))
    p_in, s_in = prepared.params, prepared.state
    layers: dict[str, _pending.Layers] = {}
    places: dict[str, tuple[list[int], list[int]]] = {}
    for key, held in zip(_waiting_keys(prepared), state.held, strict=True):
        path = key[1]
        leaves, states, parts, update = _stack_update(prepared, outputs, key)
        aux = tuple([x.value for x in part] for part in parts)
        paths = tuple(x.label for x in parts[0])
        layers[path] = _pending.Layers(paths, update, aux, tuple(held))
        places[path] = (leaves, states)

    def back(new_aux: dict[str, Any]) -> tuple[PyTree, PyTree]:
        """The parameters and inner state with each `Stacked`'s new values."""
        p_leaves, s_leaves = [x.value for x in p_in], [x.value for x in s_in]
        for path, (leaves, states) in places.items():
            new_params, _, new_state = new_aux[path]
            for t, x in zip(leaves, new_params, strict=True):
                p_leaves[t] = to_space(x, p_kinds[t], "")
            for j, x in zip(states, new_state, strict=True):
                s_leaves[j] = to_space(x, s_kinds[j], "")
        return (
            jtu.tree_unflatten(prepared.p_def, p_leaves),
            jtu.tree_unflatten(prepared.s_def, s_leaves),
        )

    return layers, back


def _stack_update(
    prepared: _streaming.Prepared, outputs: list[_streaming.Output], key: Any
) -> tuple[list[int], list[int], list[list[_streaming.Input]], Any]:
    """For the waiting group `key` (one `Stacked`'s layers): the trainable leaves
    and the state leaves its update reads and writes (their indices, and their
    inputs: the parameters, gradients and state), and one layer's update, by the
    piece jaxpr.

    That update takes one layer's slice of `aux = (params, grads, state)`, on the
    device and without the layer axis, and the shared and global values it reads
    (`held`), to the new slice. A state leaf the update reads but does not write
    stays."""
    n_p = len(prepared.params)
    positions = _streaming.waiting_outputs(outputs, key)
    leaves = [k for k in positions if k < n_p]  # new parameters, then new state
    written = {k - n_p for k in positions[len(leaves) :]}
    in_group = {j for j, x in enumerate(prepared.state) if x.group == key}
    states = sorted(written | in_group)
    dataflow, piece = prepared.dataflow, prepared.dataflow.piece
    wholes = [outputs[k].whole for k in positions]
    held_refs = [ref for _, ref in dataflow.shared_inputs(wholes)]
    wanted = dataflow.piece_eqns(wholes)
    read = (prepared.params, leaves), (prepared.grads, leaves), (prepared.state, states)
    parts = [[inputs[i] for i in which] for inputs, which in read]
    ins = [[piece.ins[x.position] for x in part] for part in parts]
    # The new parameters' and state's outputs (variables or `Literal`s); None for
    # a state leaf the update does not write.
    outs = [piece.outs[t] for t in leaves]
    outs += [piece.outs[n_p + j] if j in written else None for j in states]

    def update(aux: Any, held: Any) -> Any:
        local = dict(piece.consts)
        local.update(zip(held_refs, held, strict=True))
        for refs, values in zip(ins, aux, strict=True):
            local.update(zip(refs, [_tiling.lift(x, 1) for x in values], strict=True))
        _dataflow.run(piece, wanted, local)

        def out(ref: Any, old: Any) -> Any:
            if ref is None:
                return old
            value = ref.value if isinstance(ref, _dataflow.Literal) else local.get(ref)
            if value is None:  # (every written output's equations were run)
                raise AssertionError(
                    "`train_step`: the held-over update computed no value for a "
                    "leaf it writes: an eqx_offload bug, please report it."
                )
            return _tiling.lower(jnp.asarray(value), 1).astype(old.dtype)

        params, grads, state = aux
        new = [out(r, x) for r, x in zip(outs, [*params, *state], strict=True)]
        return new[: len(params)], grads, new[len(params) :]

    return leaves, states, parts, update


def own_state(state: Any) -> Any:
    """The wrapped optimizer's state, of a `PendingUpdate` (else `state`)."""
    return state.inner if isinstance(state, PendingUpdate) else state
