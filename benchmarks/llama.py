"""A Llama-3.2-1B-shaped model on one TPU v5e chip: which policies fit, and what
`eo.chunked_cross_entropy` saves over the plain loss on its 128k vocabulary, with
the tied table on the device and streamed from the host (`Policy(stream=...)`).

    python benchmarks/llama.py [--json FILE]

The model: dim 2048, 16 blocks of grouped-query attention (32 query heads, 8
key/value heads, head dim 64, RoPE; 256 queries at a time, as a fused attention
kernel would) and a SwiGLU MLP (8192), RMSNorm, a tied 128256-token embedding;
1.24e9 parameters, fp32, AdamW; batch 8 x 1024 tokens. Abstract
(`eqx.filter_eval_shape`) and only compiled: the whole `train_step`.
"""

import math
import re

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import GIB, parser, table, write_json
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo


VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 128256, 2048, 16, 32, 8, 64, 8192
BATCH, SEQ = 8, 1024
PRESETS = ("none", "remat", "offload_residuals", "offload_all")


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]

    def __init__(self, dim: int):
        self.weight = jnp.ones(dim)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        scale = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
        return x * scale * self.weight


def rope(x: Float[Array, "seq heads hd"]) -> Float[Array, "seq heads hd"]:
    seq, _, hd = x.shape
    freqs = 500000.0 ** (-jnp.arange(0, hd, 2) / hd)
    angles = jnp.arange(seq)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


QUERY_BLOCK = 256


def attention(
    q: Float[Array, "seq kv g hd"],
    k: Float[Array, "seq kv hd"],
    v: Float[Array, "seq kv hd"],
) -> Float[Array, "seq kv g hd"]:
    """Causal grouped-query attention, `QUERY_BLOCK` queries at a time, each block
    recomputed in the backward pass: the scores of one block exist at a time (as
    a fused attention kernel would keep them), so the logits are what is left."""
    seq = q.shape[0]
    blocks = q.reshape(seq // QUERY_BLOCK, QUERY_BLOCK, *q.shape[1:])

    @jax.checkpoint
    def block(args: tuple) -> Array:
        qb, start = args
        scores = jnp.einsum("qkgd,skd->kgqs", qb, k) / math.sqrt(HEAD_DIM)
        rows = start + jnp.arange(QUERY_BLOCK)[:, None]
        scores = jnp.where(rows >= jnp.arange(seq)[None, :], scores, -1e30)
        return jnp.einsum("kgqs,skd->qkgd", jax.nn.softmax(scores, axis=-1), v)

    starts = jnp.arange(0, seq, QUERY_BLOCK)
    return jax.lax.map(block, (blocks, starts)).reshape(q.shape)


class Block(eqx.Module):
    attn_norm: RMSNorm
    wq: Float[Array, "dim qd"]
    wk: Float[Array, "dim kvd"]
    wv: Float[Array, "dim kvd"]
    wo: Float[Array, "qd dim"]
    mlp_norm: RMSNorm
    w_gate: Float[Array, "dim mlp"]
    w_up: Float[Array, "dim mlp"]
    w_down: Float[Array, "mlp dim"]

    def __init__(self, *, key: PRNGKeyArray):
        keys = jax.random.split(key, 7)

        def init(k: PRNGKeyArray, shape: tuple[int, int]) -> Array:
            return jax.random.normal(k, shape) / math.sqrt(shape[0])

        self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.wq = init(keys[0], (DIM, HEADS * HEAD_DIM))
        self.wk = init(keys[1], (DIM, KV_HEADS * HEAD_DIM))
        self.wv = init(keys[2], (DIM, KV_HEADS * HEAD_DIM))
        self.wo = init(keys[3], (HEADS * HEAD_DIM, DIM))
        self.w_gate = init(keys[4], (DIM, MLP))
        self.w_up = init(keys[5], (DIM, MLP))
        self.w_down = init(keys[6], (MLP, DIM))

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq = x.shape[0]
        h = self.attn_norm(x)
        q = rope((h @ self.wq).reshape(seq, HEADS, HEAD_DIM))
        k = rope((h @ self.wk).reshape(seq, KV_HEADS, HEAD_DIM))
        v = (h @ self.wv).reshape(seq, KV_HEADS, HEAD_DIM)
        out = attention(q.reshape(seq, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), k, v)
        x = x + out.reshape(seq, HEADS * HEAD_DIM) @ self.wo
        h = self.mlp_norm(x)
        return x + (jax.nn.silu(h @ self.w_gate) * (h @ self.w_up)) @ self.w_down


class Llama(eqx.Module):
    embed: Float[Array, "vocab dim"]  # tied: also the output projection
    blocks: eo.Stacked[Block]
    norm: RMSNorm

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (VOCAB, DIM)) * 0.02
        self.blocks = eo.Stacked.from_fn(lambda k: Block(key=k), LAYERS, key=k2)
        self.norm = RMSNorm(DIM)

    def hidden(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        return self.trunk(self.embed[tokens])

    def trunk(self, h: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return self.norm(self.blocks(h))


def plain_loss(model: Llama, tokens, targets):
    logits = jax.vmap(model.hidden)(tokens) @ model.embed.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def chunked_loss(model: Llama, tokens, targets):
    h, table = eo.embed(model.embed, tokens)
    hidden = jax.vmap(model.trunk)(h)
    return eo.chunked_cross_entropy(hidden, table, targets, chunk=1024)


def trunk_only(model: Llama, tokens, targets):
    """No head at all: the floor any loss is measured against."""
    h, _ = eo.embed(model.embed, tokens)
    return jnp.mean(jax.vmap(model.trunk)(h))


# "streamed": the chunked loss with the tied table left on the host and read by
# blocks of rows (`Policy(stream=("embed",))`); only where the table is on the host.
# "trunk only": the same without the head, what no loss can go below.
LOSSES = {
    "plain": plain_loss,
    "chunked": chunked_loss,
    "streamed": chunked_loss,
    "trunk only": trunk_only,
}
STREAMED = ("streamed", "trunk only")


def report(preset: str, loss: str, target: str) -> eo.MemoryReport:
    stream = ("embed",) if loss in STREAMED else ()
    policy = getattr(eo.Policy, preset)(stream=stream)
    optimizer = optax.adamw(1e-4)
    model = eo.place(eqx.filter_eval_shape(Llama, key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    step = eo.train_step(LOSSES[loss], optimizer, policy)
    return eo.memory_report(step, model, opt_state, tokens, tokens, target=target)


def main():
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--target", default="tpu-v5e")
    args = p.parse_args()
    abstract = eqx.filter_eval_shape(Llama, key=jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(abstract) if hasattr(x, "size"))
    logits = BATCH * SEQ * VOCAB * 4
    print(f"{n / 1e9:.3f}e9 parameters; full logits {logits / GIB:.2f} GiB")
    rows = []
    for preset in args.presets:
        for loss in LOSSES:
            if loss in STREAMED and preset != "offload_all":
                continue
            row = {"preset": preset, "loss": loss}
            try:
                r = report(preset, loss, args.target)
            except eo.DoesNotFit as e:
                found = re.search(r"([\d.]+)G\) exceeds", str(e))
                row.update({"device GiB": None, "host GiB": None, "fits": False})
                row["note"] = f"needs {found[1]}G" if found else "does not fit"
            else:
                row.update(
                    {
                        "device GiB": r.device_bytes / GIB,
                        "host GiB": r.host_bytes / GIB,
                        "fits": r.fits,
                        "note": "",
                    }
                )
            rows.append(row)
            print(row, flush=True)
    headers = list(rows[0])
    print(table(headers, [[row.get(h) for h in headers] for row in rows]))
    found = {r["loss"]: r["device GiB"] for r in rows if r["preset"] == "offload_all"}
    summary = {}
    if {"plain", "streamed", "trunk only"} <= found.keys():
        saved = found["plain"] - found["streamed"]
        most = found["plain"] - found["trunk only"]
        print(
            f"offload_all: the streamed loss needs {saved:.2f} GiB less than the "
            f"plain one = {saved * GIB / logits:.3f}x the full logits; no head at "
            f"all would save {most:.2f} GiB ({most * GIB / logits:.3f}x), so the "
            f"streamed head costs {found['streamed'] - found['trunk only']:.3f} GiB"
        )
        summary = {
            "saved GiB": saved,
            "saved / logits": saved * GIB / logits,
            "most any loss can save GiB": most,
            "most / logits": most * GIB / logits,
            "streamed head GiB": found["streamed"] - found["trunk only"],
        }
    write_json(
        args.json,
        "llama",
        {
            "target": args.target,
            "parameters": n,
            "logits_bytes": logits,
            "rows": rows,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
