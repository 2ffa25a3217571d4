"""Single layers stacked by the smaller benchmarks: `TanhLayer` (`checkpoint_memory.py`)
and `GeluLayer` (`optimizer.py`, the JAX tutorial's layer)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


def gelu(x):
    """The JAX host-offloading tutorial's GELU (`examples/offloading_tutorial.py`)."""
    return 0.5 * x * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x**3)))


class TanhLayer(eqx.Module):
    w: Float[Array, "dim dim"]

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        self.w = jax.random.normal(key, (dim, dim)) / dim**0.5

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return jnp.tanh(self.w @ x)


class GeluLayer(eqx.Module):
    w: Float[Array, "dim dim"]

    def __call__(self, x: Float[Array, "n dim"]) -> Float[Array, "n dim"]:
        return gelu(x @ self.w)
