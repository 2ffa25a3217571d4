"""A decoder-only transformer of any size, for the benchmarks that compile public
model shapes (`llama.py`, `gpu_models.py`): Llama/Mistral-style blocks (RMSNorm,
grouped-query attention with RoPE, SwiGLU MLP, no biases) or GPT-2-style blocks
(LayerNorm, multi-head attention, GELU MLP, biases, learned positions). Attention
takes `QUERY_BLOCK` queries at a time, each block recomputed in the backward pass,
as a fused attention kernel would: the scores of one block exist at a time."""

import math
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo


QUERY_BLOCK = 256


class Shape(NamedTuple):
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    tied: bool  # the embedding table is also the output projection
    style: Literal["llama", "gpt2"] = "llama"
    rope_base: float = 500000.0  # "llama" style
    positions: int = 1024  # learned positions ("gpt2" style)


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]

    def __init__(self, dim: int):
        self.weight = jnp.ones(dim)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        x32 = x.astype(jnp.float32)  # (the statistics in fp32, the result in x's dtype)
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return (x32 * scale * self.weight).astype(x.dtype)


class LayerNorm(eqx.Module):
    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]

    def __init__(self, dim: int):
        self.weight, self.bias = jnp.ones(dim), jnp.zeros(dim)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        x32 = x.astype(jnp.float32)  # (as RMSNorm)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean((x32 - mean) ** 2, axis=-1, keepdims=True)
        out = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * self.weight + self.bias
        return out.astype(x.dtype)


def rope(x: Float[Array, "seq heads hd"], base: float) -> Float[Array, "seq heads hd"]:
    """Rotary positions: the tables and the rotation in fp32, the result in x's
    dtype (bf16 compute stays bf16)."""
    seq, _, hd = x.shape
    freqs = base ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., ::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    return out.reshape(x.shape).astype(x.dtype)


def attention(
    q: Float[Array, "seq kv g hd"],
    k: Float[Array, "seq kv hd"],
    v: Float[Array, "seq kv hd"],
) -> Float[Array, "seq kv g hd"]:
    """Causal grouped-query attention, `QUERY_BLOCK` queries at a time, each block
    recomputed in the backward pass."""
    seq, head_dim = q.shape[0], q.shape[-1]
    blocks = q.reshape(seq // QUERY_BLOCK, QUERY_BLOCK, *q.shape[1:])

    @jax.checkpoint
    def block(args: tuple) -> Array:
        qb, start = args
        scores = jnp.einsum("qkgd,skd->kgqs", qb, k) / math.sqrt(head_dim)
        rows = start + jnp.arange(QUERY_BLOCK)[:, None]
        scores = jnp.where(rows >= jnp.arange(seq)[None, :], scores, -1e30)
        return jnp.einsum("kgqs,skd->qkgd", jax.nn.softmax(scores, axis=-1), v)

    starts = jnp.arange(0, seq, QUERY_BLOCK)
    return jax.lax.map(block, (blocks, starts)).reshape(q.shape)


def _init(key: PRNGKeyArray, shape: tuple[int, int]) -> Array:
    return jax.random.normal(key, shape) / math.sqrt(shape[0])


class Block(eqx.Module):
    attn_norm: RMSNorm | LayerNorm
    wq: Float[Array, "dim qd"]
    wk: Float[Array, "dim kvd"]
    wv: Float[Array, "dim kvd"]
    wo: Float[Array, "qd dim"]
    mlp_norm: RMSNorm | LayerNorm
    w_gate: Float[Array, "dim mlp"] | None  # SwiGLU ("llama" style)
    w_up: Float[Array, "dim mlp"]
    w_down: Float[Array, "mlp dim"]
    biases: dict[str, Array] | None  # "gpt2" style
    shape: Shape = eqx.field(static=True)

    def __init__(self, shape: Shape, *, key: PRNGKeyArray):
        keys = jax.random.split(key, 7)
        dim, qd = shape.dim, shape.heads * shape.head_dim
        kvd = shape.kv_heads * shape.head_dim
        gpt2 = shape.style == "gpt2"
        norm = LayerNorm if gpt2 else RMSNorm
        self.attn_norm, self.mlp_norm = norm(dim), norm(dim)
        self.wq = _init(keys[0], (dim, qd))
        self.wk = _init(keys[1], (dim, kvd))
        self.wv = _init(keys[2], (dim, kvd))
        self.wo = _init(keys[3], (qd, dim))
        self.w_gate = None if gpt2 else _init(keys[4], (dim, shape.mlp))
        self.w_up = _init(keys[5], (dim, shape.mlp))
        self.w_down = _init(keys[6], (shape.mlp, dim))
        sizes = {"q": qd, "k": kvd, "v": kvd, "o": dim, "up": shape.mlp, "down": dim}
        self.biases = {k: jnp.zeros(n) for k, n in sizes.items()} if gpt2 else None
        self.shape = shape

    def _bias(self, x: Array, name: str) -> Array:
        return x if self.biases is None else x + self.biases[name]

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        s, seq = self.shape, x.shape[0]
        h = self.attn_norm(x)
        q = self._bias(h @ self.wq, "q").reshape(seq, s.heads, s.head_dim)
        k = self._bias(h @ self.wk, "k").reshape(seq, s.kv_heads, s.head_dim)
        v = self._bias(h @ self.wv, "v").reshape(seq, s.kv_heads, s.head_dim)
        if s.style == "llama":
            q, k = rope(q, s.rope_base), rope(k, s.rope_base)
        groups = q.reshape(seq, s.kv_heads, s.heads // s.kv_heads, s.head_dim)
        out = attention(groups, k, v).reshape(seq, s.heads * s.head_dim)
        x = x + self._bias(out @ self.wo, "o")
        h = self.mlp_norm(x)
        if self.w_gate is None:
            up = jax.nn.gelu(self._bias(h @ self.w_up, "up"))
        else:
            up = jax.nn.silu(h @ self.w_gate) * (h @ self.w_up)
        return x + self._bias(up @ self.w_down, "down")


class Decoder(eqx.Module):
    embed: Float[Array, "vocab dim"]
    positions: Float[Array, "seq dim"] | None  # learned ("gpt2" style)
    blocks: eo.Stacked[Block]
    norm: RMSNorm | LayerNorm
    head: Float[Array, "vocab dim"] | None  # None: tied to `embed`

    def __init__(self, shape: Shape, *, key: PRNGKeyArray):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        gpt2 = shape.style == "gpt2"
        self.embed = jax.random.normal(k1, (shape.vocab, shape.dim)) * 0.02
        self.positions = (
            jax.random.normal(k4, (shape.positions, shape.dim)) * 0.01 if gpt2 else None
        )
        self.blocks = eo.Stacked.from_fn(
            lambda k: Block(shape, key=k), shape.layers, key=k2
        )
        self.norm = LayerNorm(shape.dim) if gpt2 else RMSNorm(shape.dim)
        self.head = (
            None
            if shape.tied
            else jax.random.normal(k3, (shape.vocab, shape.dim)) * 0.02
        )

    @property
    def table(self) -> Float[Array, "vocab dim"]:
        """The output projection's weight."""
        return self.embed if self.head is None else self.head

    def hidden(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        return self.trunk(self.embed[tokens])

    def trunk(self, h: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        if self.positions is not None:
            h = h + self.positions[: h.shape[0]]
        return self.norm(self.blocks(h))


def parameters(shape: Shape) -> int:
    abstract = eqx.filter_eval_shape(Decoder, shape, key=jax.random.key(0))
    return sum(x.size for x in jax.tree.leaves(abstract) if hasattr(x, "size"))


def step_report(
    shape: Shape,
    policy: eo.Policy,
    loss,
    *,
    target: str,
    batch: int,
    seq: int,
    hardware: eo.Hardware | None = None,
) -> eo.MemoryReport:
    """The `memory_report` of a `train_step` of `Decoder(shape)` (abstract, placed
    by `policy`) with AdamW and `loss`, on `batch` sequences of `seq` tokens."""
    optimizer = optax.adamw(1e-4)
    abstract = eqx.filter_eval_shape(Decoder, shape, key=jax.random.key(0))
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = eo.train_step(loss, optimizer, policy)
    return eo.memory_report(
        step, model, opt_state, tokens, tokens, target=target, hardware=hardware
    )


def plain_loss(model: Decoder, tokens, targets):
    logits = jax.vmap(model.hidden)(tokens) @ model.table.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def chunked_loss(model: Decoder, tokens, targets):
    """`eo.chunked_cross_entropy` over the head, or the tied table (`eo.embed`
    returns it, read by blocks of rows where `Policy(host_tables=("embed",))` leaves
    it on the host)."""
    h, table = eo.embed(model.embed, tokens)
    hidden = jax.vmap(model.trunk)(h)
    head = table if model.head is None else model.head
    return eo.chunked_cross_entropy(hidden, head, targets, chunk=1024)


def trunk_only(model: Decoder, tokens, targets):
    """No head at all: the floor any loss is measured against."""
    h, _ = eo.embed(model.embed, tokens)
    return jnp.mean(jax.vmap(model.trunk)(h))
