"""Optimizer state as a tree that mirrors the parameters: which state leaves are
parameter-shaped, and which parameter each of them belongs to."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def map_state(
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    on_params: Callable[..., Any],
    on_others: Callable[[Any], Any],
    *params: PyTree,
) -> PyTree:
    """`on_params(state_leaf, *param_leaves)` on every parameter-shaped part of the
    state (skipping `optax.masked`'s holes), `on_others(leaf)` on the rest."""

    def params_leaf(s: Any, *p: Any) -> Any:
        return s if _is_masked(s) else on_params(s, *p)

    try:
        return optax.tree_utils.tree_map_params(
            optimizer,
            params_leaf,
            opt_state,
            *params,
            transform_non_params=lambda v: jtu.tree_map(on_others, v),
            is_leaf=_is_masked,
        )
    except Exception as e:
        raise ValueError(
            "`eqx_offload` could not find the parameter-shaped parts of this "
            "optimizer state with `optax.tree_utils.tree_map_params` (its structure "
            f"does not follow `optimizer.init(params)`: {e}). Build the state with "
            "`eqx_offload.init_opt_state(optimizer, model, policy)`."
        ) from e


class _Index:
    """A parameter's position standing in for it (a pytree leaf)."""

    def __init__(self, i: int | None):
        self.i = i


def state_owners(
    optimizer: optax.GradientTransformation, opt_state: PyTree, params: PyTree
) -> list[int | None]:
    """For each array leaf of `opt_state` (in `jax.tree.leaves` order), the index of
    the parameter leaf it mirrors (in a parameter-shaped part of the state, with the
    parameter's shape), or None (a count, a per-leaf scalar, a factored moment)."""
    shapes = [tuple(p.shape) for p in jtu.tree_leaves(params)]
    indices = jtu.tree_unflatten(
        jtu.tree_structure(params), [_Index(i) for i in range(len(shapes))]
    )

    def is_arraylike(s: Any) -> bool:
        return eqx.is_array(s) or isinstance(s, jax.ShapeDtypeStruct)

    def mirrors(s: Any, i: _Index) -> Any:
        if not is_arraylike(s):
            return s
        assert i.i is not None
        return _Index(i.i if tuple(s.shape) == shapes[i.i] else None)

    mapped = map_state(
        optimizer,
        opt_state,
        mirrors,
        lambda s: _Index(None) if is_arraylike(s) else s,
        indices,
    )
    return [x.i for x in jtu.tree_leaves(mapped) if isinstance(x, _Index)]
