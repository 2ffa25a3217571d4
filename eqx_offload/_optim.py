"""Optimizer state: where it lives (`init_opt_state`) and how a step updates it."""

from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from . import _paths
from ._memory_kinds import backend_kinds, is_arraylike, kind_of, to_space
from ._placement import move
from ._policy import Policy


def is_trainable(x: Any) -> bool:
    """Floating-point arrays (or their `jax.ShapeDtypeStruct`s): what gets gradients."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
    return eqx.is_inexact_array(x)


def trainable(model: PyTree) -> PyTree:
    """The parameters an optimizer sees: `model` with non-trainable leaves `None`."""
    return eqx.filter(model, is_trainable)


def state_kinds(
    optimizer: optax.GradientTransformation, opt_state: PyTree, kind: str
) -> list[tuple[_paths.Leaf, str]]:
    """Each array leaf of `opt_state` with its memory kind: `kind` for the
    parameter-shaped state (moments, momenta, ...), `"device"` for the rest (step
    counts and other scalars), in `jax.tree.leaves` order."""
    try:
        kinds = optax.tree_utils.tree_map_params(
            optimizer,
            lambda _: kind,
            opt_state,
            transform_non_params=lambda v: jtu.tree_map(lambda _: "device", v),
        )
    except Exception as e:
        raise ValueError(
            "`eqx_offload` could not find the parameter-shaped parts of this optimizer "
            "state with `optax.tree_utils.tree_map_params`; build it with "
            "`eqx_offload.init_opt_state(optimizer, model, policy)`."
        ) from e
    leaves = [leaf for leaf in _paths.leaves(opt_state) if is_arraylike(leaf.value)]
    flat_kinds = [
        k
        for k, v in zip(jtu.tree_leaves(kinds), jtu.tree_leaves(opt_state))
        if is_arraylike(v)
    ]
    return list(zip(leaves, flat_kinds))


def init_opt_state(
    optimizer: optax.GradientTransformation, model: PyTree, policy: Policy
) -> PyTree:
    """Initialises `optimizer` for `model`'s trainable leaves and puts the state where
    `policy.opt_state` says.

    The parameter-shaped state (Adam's moments, momentum, ...) goes to
    `policy.opt_state` with each parameter's sharding; the rest (step counts) stays
    on the device. An abstract model (`jax.ShapeDtypeStruct` leaves, e.g. from
    `eqx.filter_eval_shape`) gives an abstract state and allocates nothing.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation`.
    - `model`: the model, usually already placed with `eqx_offload.place`. The
        optimizer sees `eqx.filter(model, eqx.is_inexact_array)`.
    - `policy`: an `eqx_offload.Policy`.

    **Returns:**

    The optimizer state, ready for `eqx_offload.train_step`.

    !!! Example

        ```python
        opt_state = eo.init_opt_state(optax.adamw(3e-4), model, policy)
        ```
    """
    if policy.opt_state not in backend_kinds():
        raise ValueError(
            f"`Policy(opt_state={policy.opt_state!r})`: the {jax.default_backend()!r} "
            "backend has no such memory; valid kinds here: "
            f"{_paths.quoted(backend_kinds())}."
        )
    params = trainable(model)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(params)):
        state = jax.eval_shape(optimizer.init, params)
    else:
        # Eager ops on host-resident arrays fail ("Memory kind mismatch"); jitted
        # ones work, and return the state on the default device.
        state = jax.jit(optimizer.init)(params)

    def like_param(s: Any, p: Any) -> Any:
        """Parameter-shaped state gets its parameter's sharding, in `opt_state`."""
        sharding = getattr(p, "sharding", None)
        if sharding is None or not is_arraylike(s) or s.shape != p.shape:
            return move(s, policy.opt_state, "") if is_arraylike(s) else s
        return move(s, policy.opt_state, "", sharding)

    return optax.tree_utils.tree_map_params(
        optimizer,
        like_param,
        state,
        params,
        transform_non_params=lambda v: jtu.tree_map(
            lambda x: move(x, "device", "") if is_arraylike(x) else x, v
        ),
    )


def check_state(
    optimizer: optax.GradientTransformation, opt_state: PyTree, policy: Policy
) -> list[tuple[_paths.Leaf, str]]:
    """The kinds `opt_state` should be in; raises if a leaf is elsewhere."""
    kinds = state_kinds(optimizer, opt_state, policy.opt_state)
    for leaf, kind in kinds:
        if kind == "unpinned_host":
            to_space(leaf.value, kind, f"opt_state.{leaf.path}")  # raises
        if kind_of(leaf.value) != kind:
            raise ValueError(
                f"`train_step`: optimizer state leaf {leaf.path!r} is in "
                f"{kind_of(leaf.value)!r} but the policy puts it in {kind!r}; create "
                "the state with `eqx_offload.init_opt_state(optimizer, model, policy)`."
            )
    return kinds


def update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    model: PyTree,
) -> tuple[PyTree, PyTree]:
    """One optimizer update on the device: gradients, state and parameters are
    brought to the device, updated there, and returned there (the caller puts them
    back where they live)."""

    def to_device(tree: PyTree) -> PyTree:
        return jtu.tree_map(
            lambda x: to_space(x, "device", "") if eqx.is_array(x) else x, tree
        )

    model = to_device(model)
    updates, opt_state = optimizer.update(
        to_device(grads), to_device(opt_state), trainable(model)
    )
    return eqx.apply_updates(model, updates), opt_state
