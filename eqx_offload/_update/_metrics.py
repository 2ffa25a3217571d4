"""The metrics `train_step(..., metrics=True)` returns: global norms of the
gradients, the updates and the new parameters."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import optax


METRICS = ("grad_norm", "update_norm", "param_norm")


def norms(grads: Any, updates: Any, params: Any) -> dict[str, Any]:
    """The global L2 norms of the gradients, the updates and the (new)
    parameters, over all their array leaves, in float32."""

    def norm(tree: Any) -> Any:
        leaves = [x.astype(jnp.float32) for x in jtu.tree_leaves(tree)]
        return optax.tree.norm(leaves)

    return dict(zip(METRICS, (norm(grads), norm(updates), norm(params))))


def squares(x: Any) -> Any:
    """The sum of the squares of an array's elements, in float32: one leaf's
    part of a global norm."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)))
