"""The metrics `train_step(..., metrics=True)` returns: global norms of the
gradients, the updates and the new parameters; and the update as a function of
flat leaves that the streamed and host updates trace, with each leaf's part of
those norms."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import optax


METRICS = ("grad_norm", "update_norm", "param_norm")


def norms(grads: Any, updates: Any, params: Any) -> dict[str, Any]:
    """The global L2 norms of the gradients, the updates and the (new)
    parameters, over all their array leaves, in float32."""

    def norm(tree: Any) -> Any:
        return optax.tree.norm([x.astype(jnp.float32) for x in jtu.tree_leaves(tree)])

    return dict(zip(METRICS, (norm(grads), norm(updates), norm(params))))


def from_squares(squares: list, n: int) -> dict[str, Any]:
    """The norms of `norms` from each leaf's sum of squares: `n` for the gradients,
    then `n` for the updates and `n` for the new parameters."""
    sums = [sum(squares[i * n : (i + 1) * n]) for i in range(len(METRICS))]
    return dict(zip(METRICS, map(jnp.sqrt, sums)))


def flat_update(
    optimizer: optax.GradientTransformation,
    trees: tuple[Any, Any, Any],
    squares: Callable[[Any], Any] | None,
) -> tuple[Callable[..., list], tuple[list, list, list], tuple[Any, Any]]:
    """`optimizer`'s update as a function of flat leaves: the gradients, the state
    and the parameters (the leaves of `trees`) to the new parameters and state, and
    with `squares`, each gradient's, update's and new parameter's `squares`. A
    gradient sent in a narrower dtype (the compute dtype) is cast to its
    parameter's where the update runs.

    **Returns:** that function, the leaves of the gradients, the state and the
    parameters, and the treedefs of the parameters and the state."""
    g_leaves = jtu.tree_leaves(trees[0])
    s_leaves, s_def = jtu.tree_flatten(trees[1])
    p_leaves, p_def = jtu.tree_flatten(trees[2])
    n_g, n_s = len(g_leaves), len(s_leaves)

    def apply(*xs: Any) -> list:
        g, s, p = xs[:n_g], xs[n_g : n_g + n_s], xs[n_g + n_s :]
        g = [widened(gi, pi) for gi, pi in zip(g, p, strict=True)]
        grads, p_tree = jtu.tree_unflatten(p_def, g), jtu.tree_unflatten(p_def, p)
        updates, state = optimizer.update(grads, jtu.tree_unflatten(s_def, s), p_tree)
        new = eqx.apply_updates(p_tree, updates)
        out = jtu.tree_leaves(new) + jtu.tree_leaves(state)
        if squares is not None:
            for tree in (grads, updates, new):
                out += [squares(x) for x in jtu.tree_leaves(tree)]
        return out

    return apply, (g_leaves, s_leaves, p_leaves), (p_def, s_def)


def widened(g: Any, p: Any) -> Any:
    """A gradient `g` sent in a narrower dtype than its parameter `p` (the compute
    dtype, `_microbatch`), cast to the parameter's; no gradient (`None`) stays."""
    return g if g is None or g.dtype.itemsize >= p.dtype.itemsize else g.astype(p.dtype)


def squares(x: Any) -> Any:
    """The sum of the squares of an array's elements, in float32: one leaf's
    part of a global norm."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def row_squares(x: Any) -> Any:
    """The sum of squares of each row of `x` (of `x` itself, for a scalar)."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
