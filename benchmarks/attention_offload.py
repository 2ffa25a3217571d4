"""`offload_residuals` against `remat` for a Llama-style decoder whose attention is
`jax.nn.dot_product_attention` (XLA's implementation: a sequence's whole
`[heads, seq, seq]` scores at once) or blocked (`decoder.attention`: 256 queries at
a time, each block recomputed), compiled for one H100 (and one TPU v5e chip).

    python benchmarks/attention_offload.py [--sizes small 8b] [--json FILE]

The models: `decoder.Decoder` blocks (RMSNorm, grouped-query attention with RoPE,
SwiGLU, untied head), AdamW, batch 2 x 4096 tokens; "small": dim 1024 (8 heads, 2
key/value heads, head dim 128), MLP 3584, vocabulary 32000, 8 layers; "8b": the
widths of Llama 3 8B (dim 4096, 32 heads, 8 key/value heads, MLP 14336,
vocabulary 128256) at 8, 16 and 32 layers. fp32, and `compute_dtype=bf16`.
Abstract (`eqx.filter_eval_shape`) and only compiled: the whole `train_step`. A
step over the GPU's capacity is reported with the footprint its `DoesNotFit`
gives (the compiled program's).
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import jax
import jax.numpy as jnp
from _common import GIB, parser, table, write_json
from models import decoder
from models.decoder import plain_loss, Shape

import eqx_offload as eo


BATCH, SEQ = 2, 4096
SMALL = Shape(32000, 1024, 8, 8, 2, 128, 3584, tied=False)
LLAMA_3_8B = Shape(128256, 4096, 32, 32, 8, 128, 14336, tied=False)


def dot_product_attention(q, k, v):
    """Causal grouped-query attention by `jax.nn.dot_product_attention` (XLA's
    implementation), in `decoder.attention`'s shapes."""
    seq, kv, groups, head_dim = q.shape
    # (RoPE's float32 angles promote bf16 queries and keys: back to the values'.)
    query = q.reshape(1, seq, kv * groups, head_dim).astype(v.dtype)
    key = k[None].astype(v.dtype)
    out = jax.nn.dot_product_attention(query, key, v[None], is_causal=True)
    return out.reshape(q.shape)


def blocked(q, k, v):
    """`decoder.attention`, its queries and keys in the values' dtype (as above)."""
    return _BLOCKED(q.astype(v.dtype), k.astype(v.dtype), v)


_BLOCKED = decoder.attention
DPA = "dot_product_attention"
ATTENTION = {DPA: dot_product_attention, "blocked": blocked}


def device_bytes(shape: Shape, preset: str, dtype, attention: str, target: str) -> int:
    # `decoder.Block` looks its attention up when it is called.
    decoder.attention = ATTENTION[attention]
    policy = getattr(eo.Policy, preset)(compute_dtype=dtype)
    try:
        report = decoder.step_report(
            shape, policy, plain_loss, target=target, batch=BATCH, seq=SEQ
        )
    except eo.DoesNotFit as e:
        if e.required_bytes is None:
            raise
        return e.required_bytes
    return report.device_bytes


def main():
    p = parser(__doc__)
    p.add_argument("--sizes", nargs="+", default=["small", "8b"])
    args = p.parse_args()
    cases = []
    if "small" in args.sizes:
        for target in ("gpu-h100", "tpu-v5e"):
            for attention, dtype in [
                (DPA, None),
                (DPA, jnp.bfloat16),
                ("blocked", None),
            ]:
                cases.append(("small", SMALL, 8, target, attention, dtype))
    if "8b" in args.sizes:
        for dtype in (None, jnp.bfloat16):
            for layers in (8, 16, 32):
                cases.append(("8b", LLAMA_3_8B, layers, "gpu-h100", DPA, dtype))
            cases.append(("8b", LLAMA_3_8B, 8, "gpu-h100", "blocked", dtype))
    rows = []
    for size, shape, layers, target, attention, dtype in cases:
        shape = shape._replace(layers=layers)
        remat, offload = (
            device_bytes(shape, preset, dtype, attention, target)
            for preset in ("remat", "offload_residuals")
        )
        itemsize = 4 if dtype is None else 2
        carry = layers * BATCH * SEQ * shape.dim * itemsize  # `blocks.input`
        rows.append(
            {
                "model": size,
                "layers": layers,
                "dtype": "fp32" if dtype is None else "bf16",
                "attention": attention,
                "target": target,
                "remat GiB": round(remat / GIB, 2),
                "offload_residuals GiB": round(offload / GIB, 2),
                "saved GiB": round((remat - offload) / GIB, 2),
                "carry GiB": round(carry / GIB, 2),
            }
        )
        print(rows[-1], flush=True)
    headers = list(rows[0])
    print(table(headers, [[r[h] for h in headers] for r in rows]))
    write_json(args.json, "attention_offload", rows)


if __name__ == "__main__":
    main()
