"""The small models of `compile_matrix.py`, at any width: `mlp`, `attention`,
`gpt`, `llama` and `dict`, with their losses. `tests/test_tpu_compile.py` and
`tests/test_gpu_targets.py` compile them too."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo


class MLPBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        self.norm = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, depth=1, key=key)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm)(x)
        return x + jax.vmap(self.mlp)(h).astype(x.dtype)


class AttentionBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        heads = 4 if dim % 4 == 0 else 1
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, depth=1, key=k2)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h).astype(x.dtype)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x)).astype(x.dtype)


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]

    def __init__(self, dim: int):
        self.weight = jnp.ones(dim)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        x32 = x.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return (x32 * scale).astype(x.dtype) * self.weight.astype(x.dtype)


def rope(x: Float[Array, "seq heads hd"]) -> Float[Array, "seq heads hd"]:
    seq, _, hd = x.shape
    freqs = 500000.0 ** (-jnp.arange(0, hd, 2) / hd)
    angles = jnp.arange(seq)[:, None] * freqs[None, :]
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


class LlamaBlock(eqx.Module):
    """RMSNorm, RoPE, grouped-query attention (`jax.nn.dot_product_attention`,
    heads of 64, a quarter as many key/value heads) and a SwiGLU MLP, no biases."""

    attn_norm: RMSNorm
    wq: Float[Array, "dim dim"]
    wkv: Float[Array, "dim kv2"]
    wo: Float[Array, "dim dim"]
    mlp_norm: RMSNorm
    w_gate: Float[Array, "dim mlp"]
    w_up: Float[Array, "dim mlp"]
    w_down: Float[Array, "mlp dim"]
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, mlp: int, *, key: PRNGKeyArray):
        keys = jax.random.split(key, 6)
        self.heads = dim // 64 if dim % 64 == 0 else 1
        self.kv_heads = self.heads // 4 if self.heads % 4 == 0 else self.heads
        kv = 2 * self.kv_heads * (dim // self.heads)

        def init(k: PRNGKeyArray, shape: tuple[int, int]) -> Array:
            return jax.random.normal(k, shape) / shape[0] ** 0.5

        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wkv = init(keys[0], (dim, dim)), init(keys[1], (dim, kv))
        self.wo = init(keys[2], (dim, dim))
        self.w_gate, self.w_up = init(keys[3], (dim, mlp)), init(keys[4], (dim, mlp))
        self.w_down = init(keys[5], (mlp, dim))

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq, dim = x.shape
        hd = dim // self.heads
        h = self.attn_norm(x)
        q = rope((h @ self.wq).reshape(seq, self.heads, hd))
        k, v = jnp.split((h @ self.wkv).reshape(seq, 2 * self.kv_heads, hd), 2, 1)
        out = jax.nn.dot_product_attention(q, rope(k), v, is_causal=True)
        x = x + (out.reshape(seq, dim) @ self.wo).astype(x.dtype)
        h = self.mlp_norm(x)
        up = jax.nn.silu(h @ self.w_gate) * (h @ self.w_up)
        return x + (up @ self.w_down).astype(x.dtype)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[LlamaBlock]
    norm: RMSNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, mlp: int, depth: int, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(
            lambda k: LlamaBlock(dim, mlp, key=k), depth, key=k2
        )
        self.norm = RMSNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=k3)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        h = self.norm(self.blocks(jax.vmap(self.embed)(tokens)))
        return jax.vmap(self.head)(h)


class Stack(eqx.Module):
    blocks: eo.Stacked[Any]

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return self.blocks(x)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[MLPBlock]
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, depth: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: MLPBlock(dim, key=k), depth, key=k2)
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return jax.vmap(self.head)(self.blocks(jax.vmap(self.embed)(tokens)))


SEQ, BATCH, VOCAB = 8, 2, 256


def regression_loss(model, x):
    y = jax.vmap(model)(x)
    return jnp.mean(y.astype(jnp.float32) ** 2)


def token_loss(model, tokens, targets):
    logits = jax.vmap(model)(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def dict_loss(params, x):
    for i in range(len(params)):
        x = jax.nn.gelu(x @ params[f"w{i}"])
    return jnp.mean(x.astype(jnp.float32) ** 2)
