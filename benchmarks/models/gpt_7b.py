"""The 7.8B-parameter GPT of `slices.py` and `fewest.py`: 32 blocks of LayerNorm,
multi-head attention (32 heads) and a GELU MLP (4096 -> 20480), a vocabulary of
32768, sequences of 2048 tokens, its batch laid out over the "fsdp" mesh axis."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo


VOCAB, DIM, HEADS, HIDDEN, DEPTH, SEQ = 32768, 4096, 32, 5 * 4096, 32, 2048


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.mlp = eqx.nn.MLP(DIM, DIM, HIDDEN, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=causal)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    split: bool = eqx.field(static=True)  # the batch over the "fsdp" mesh axis

    def __init__(self, *, key: PRNGKeyArray, split: bool = True):
        k1, k2, k3 = jax.random.split(key, 3)
        self.split = split
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: Block(key=k), DEPTH, key=k2)
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k3)

    def __call__(self, tokens: Int[Array, "b seq"]) -> Float[Array, "b seq vocab"]:
        # Batch-level, with the activations pinned to the batch layout: left to
        # itself, sharding propagation lays the embedding's output out like the
        # (vocabulary-sharded) table and replicates the batch on every chip.
        x = self._batch_sharded(self.embed.weight[tokens])
        x = self._batch_sharded(jax.vmap(self.blocks)(x))
        x = jax.vmap(jax.vmap(self.norm))(x)
        return self._batch_sharded(jnp.einsum("bsd,vd->bsv", x, self.head.weight))

    def _batch_sharded(self, x: Array) -> Array:
        return jax.lax.with_sharding_constraint(x, P("fsdp")) if self.split else x


def loss_fn(model: GPT, tokens: Int[Array, "b seq"], targets: Int[Array, "b seq"]):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class PinnedGPT(GPT):
    """`GPT`, pinning its activations to the batch layout only where there
    is a mesh to pin them to."""

    def _batch_sharded(self, x: Array) -> Array:
        if "fsdp" not in jax.sharding.get_abstract_mesh().axis_names:
            return x
        return jax.lax.with_sharding_constraint(x, P("fsdp"))
