"""The GPT-style stack the depth and speed benchmarks use: token embedding, N blocks
of LayerNorm + MLP (dim -> 4 dim -> dim, residual), a final LayerNorm, a linear
head. `handwritten.py` is the same model in plain JAX."""

import equinox as eqx
import jax
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        self.norm = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(
            dim, dim, 4 * dim, depth=1, activation=jax.nn.gelu, key=key
        )

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, depth: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: Block(dim, key=k), depth, key=k2)
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=k3)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = self.blocks(jax.vmap(self.embed)(tokens))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(model: GPT, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
