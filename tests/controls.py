"""Post-hoc negative controls for comparisons without an `origin` (losses,
outputs, gradients, optimizer state): `numerics.scaled_update` scales an update
from the parameters it started from; these values start from zero."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree


def scaled(tree: PyTree, factor: float) -> PyTree:
    """`tree` with every floating leaf (array or Python float) times `factor`, as
    NumPy arrays: `1.01` is a loss or a gradient 1% too large, `-1` one of the wrong
    sign. A negative control asserts `numerics.excess(scaled(ours, ...),
    reference) > 10`."""

    def scale(x):
        if isinstance(x, float) or (
            eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)
        ):
            x = np.asarray(x)
            return (np.float64(factor) * x).astype(x.dtype)
        return x

    return jax.tree.map(scale, tree)
