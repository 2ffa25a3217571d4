"""Fine-tune a Llama-3-8B-shaped model on one GPU: planned for the accelerator you
name, its bytes and its step time printed before anything runs; trained on built-in
data and checkpointed where that accelerator is this machine's.

    export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=160      # (see below)
    python examples/finetune_8b.py --dry-run --microbatches 64   # an H100, print
    python examples/finetune_8b.py --target gpu-h200 --tokens-per-update 524288
    python examples/finetune_8b.py --dim 256 --layers 2 --vocab 512 --seq 128 \\
        --tokens-per-update 2048 --target none --device-budget 1GiB \\
        --host-budget 1GiB                            # a tiny width, here

The model: 32 blocks of RMSNorm, grouped-query attention (32 query heads, 8 key and
value heads of 128, RoPE) and a SwiGLU MLP (14336), an untied head over a
vocabulary of 128256: 8.03e9 parameters (`--dim`, `--layers`, `--vocab` make it
smaller; heads of 128, a quarter as many for keys and values, an MLP of 3.5 x dim).
AdamW with fp32 state, bf16 compute, 4096-token sequences (`--seq`), 262,144
tokens per update (`--tokens-per-update`) in micro-batches.

`eo.plan` compiles candidate placements for the target without running them and
picks the fastest that fits (`--microbatches`: the counts to choose from; by
default it searches them). The placement an 8B model wants at this batch keeps
the masters and Adam moments (12 bytes a parameter) in pinned host memory and the
bf16 compute copies and the gradient accumulators on the GPU, so that only the
update crosses the link, once per step. On an H100 with 64 micro-batches, `plan`
picks it: 54.25 GiB on the device and 89.75 GiB on the host, a step of 73.8 s
where the compute-bound step is 70.1 s, MFU 18% (estimated, gpu-h100's rates; 29
compiles in 77 s here, measured on a 2-core CPU; docs/benchmarks/at-scale.md has
the step at each batch).

Host memory: the 8B model's masters and moments alone are 90 GiB of pinned host
memory, over the 64 GiB JAX's GPU client pins by default, which is also the host
budget `plan` gives a GPU. Raise it before JAX starts
(`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, in GiB; the machine's RAM must hold it), or
`plan` finds nothing that fits.

Then, where `jax.default_backend()` is the target's (a GPU for `gpu-*`, a TPU for
`tpu-*`; `--target none` plans for this machine's own backend, with both budgets
given), it trains `--steps` steps on counting sequences (`quickstart.py`'s data)
and saves a checkpoint (`eo.save`, `--checkpoint`). `--dry-run` stops after
printing.
"""

import argparse
import math
import time

import _platform  # noqa: F401  (first: JAX on the CPU where there is no GPU or TPU)
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from quickstart import counting_sequences

import eqx_offload as eo


QUERY_BLOCK = 256  # attention takes this many queries at a time


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]

    def __init__(self, dim: int):
        self.weight = jnp.ones(dim)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        x32 = x.astype(jnp.float32)  # statistics in fp32, the result in x's dtype
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return (x32 * scale * self.weight).astype(x.dtype)


def rope(x: Float[Array, "seq heads hd"]) -> Float[Array, "seq heads hd"]:
    seq, _, hd = x.shape
    freqs = 500000.0 ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., ::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    return out.reshape(x.shape).astype(x.dtype)


def attention(q: Array, k: Array, v: Array) -> Array:
    """Causal grouped-query attention (`q`: [seq, kv, groups, hd]), `QUERY_BLOCK`
    queries at a time, each block recomputed in the backward pass: the scores of
    one block exist at a time, as in a fused attention kernel."""
    seq, block = q.shape[0], min(QUERY_BLOCK, q.shape[0])

    @jax.checkpoint
    def one(args: tuple[Array, Array]) -> Array:
        qb, start = args
        scores = jnp.einsum("qkgd,skd->kgqs", qb, k) / math.sqrt(q.shape[-1])
        rows = start + jnp.arange(block)[:, None]
        scores = jnp.where(rows >= jnp.arange(seq)[None, :], scores, -1e30)
        return jnp.einsum("kgqs,skd->qkgd", jax.nn.softmax(scores, axis=-1), v)

    blocks = q.reshape(seq // block, block, *q.shape[1:])
    return jax.lax.map(one, (blocks, jnp.arange(0, seq, block))).reshape(q.shape)


class Block(eqx.Module):
    attn_norm: RMSNorm
    wq: Array
    wk: Array
    wv: Array
    wo: Array
    mlp_norm: RMSNorm
    w_gate: Array
    w_up: Array
    w_down: Array
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, mlp: int, *, key: PRNGKeyArray):
        self.heads = dim // 128 or 1
        kv = (self.heads // 4 or 1) * (dim // self.heads)
        sizes = [(dim, dim), (dim, kv), (dim, kv), (dim, dim)]
        sizes += [(dim, mlp), (dim, mlp), (mlp, dim)]
        keys = jax.random.split(key, len(sizes))
        w = [jax.random.normal(k, s) / math.sqrt(s[0]) for k, s in zip(keys, sizes)]
        self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down = w
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq, hd = x.shape[0], x.shape[1] // self.heads
        kv = self.wk.shape[1] // hd
        h = self.attn_norm(x)
        q = rope((h @ self.wq).reshape(seq, self.heads, hd))
        k = rope((h @ self.wk).reshape(seq, kv, hd))
        v = (h @ self.wv).reshape(seq, kv, hd)
        out = attention(q.reshape(seq, kv, self.heads // kv, hd), k, v)
        x = x + out.reshape(seq, -1) @ self.wo
        h = self.mlp_norm(x)
        return x + (jax.nn.silu(h @ self.w_gate) * (h @ self.w_up)) @ self.w_down


class Llama(eqx.Module):
    embed: Float[Array, "vocab dim"]
    blocks: eo.Stacked[Block]
    norm: RMSNorm
    head: Float[Array, "vocab dim"]

    def __init__(self, vocab: int, dim: int, layers: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        mlp = int(3.5 * dim)
        self.embed = 0.02 * jax.random.normal(k1, (vocab, dim))
        self.blocks = eo.Stacked.from_fn(
            lambda k: Block(dim, mlp, key=k), layers, key=k2
        )
        self.norm = RMSNorm(dim)
        self.head = 0.02 * jax.random.normal(k3, (vocab, dim))


def loss_fn(
    model: Llama, tokens: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
) -> Float[Array, ""]:
    """Next-token cross-entropy, 1024 tokens of logits at a time (never all)."""
    hidden = jax.vmap(lambda t: model.norm(model.blocks(model.embed[t])))(tokens)
    return eo.chunked_cross_entropy(hidden, model.head, targets, chunk=1024)


BACKENDS = {"gpu": "gpu", "tpu": "tpu"}  # a target's prefix -> its JAX backend


def main() -> eo.Plan:
    """Plans (and, on the target, trains and saves); returns the plan."""
    parser = argparse.ArgumentParser(description="Plan, fine-tune and save an 8B.")
    parser.add_argument("--target", default="gpu-h100", help="or 'gpu-h200', 'none'")
    parser.add_argument("--tokens-per-update", type=int, default=256 * 1024)
    parser.add_argument(
        "--microbatches", type=int, nargs="+", help="counts to choose from (search)"
    )
    parser.add_argument("--device-budget", help="per device, e.g. 40GiB")
    parser.add_argument("--host-budget", help="per device, e.g. 120GiB")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint", default="finetune_8b_ckpt")
    parser.add_argument("--dry-run", action="store_true", help="plan and print only")
    args = parser.parse_args()
    target = None if args.target == "none" else args.target
    sequences = args.tokens_per_update // args.seq
    make = lambda: Llama(args.vocab, args.dim, args.layers, key=jax.random.key(0))  # noqa: E731
    abstract = eqx.filter_eval_shape(make)  # nothing allocated to plan
    count = sum(x.size for x in jax.tree.leaves(abstract))
    print(f"{count:,} parameters; {sequences} sequences of {args.seq} tokens an update")
    tokens = jax.ShapeDtypeStruct((sequences, args.seq), jnp.int32)
    plan = eo.plan(
        loss_fn,
        optax.adamw(1e-5),
        abstract,
        tokens,
        tokens,
        target=target,
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        microbatches=tuple(args.microbatches) if args.microbatches else "search",
        compute_dtypes=(jnp.bfloat16,),
        progress=True,
    )
    print(plan)
    print(f"\nthe plan's policy: {plan.policy}\n")
    print(plan.report)  # where every byte lives, and the step's time
    time_ = plan.report.time
    if time_ is not None:
        mfu = getattr(time_, "mfu", None)
        print(
            f"\nestimated step: {time_.seconds:.3g} s on {time_.hardware.name}"
            + ("" if mfu is None else f", MFU {100 * mfu:.1f}%")
        )
    backend = BACKENDS.get((target or "").split("-")[0], jax.default_backend())
    if args.dry_run or jax.default_backend() != backend:
        print(f"not training: {'--dry-run' if args.dry_run else 'no ' + backend}")
        return plan
    train(plan, make, args, sequences)
    return plan


def train(plan: eo.Plan, make, args: argparse.Namespace, sequences: int) -> None:
    """`args.steps` steps of the plan's step on counting sequences, then a
    checkpoint. (The model is made on the device, in fp32, then placed: 32 GB for
    the 8B model, within an H100's.)"""
    model = plan.place(make())
    opt_state = plan.init_opt_state(model)
    step = plan.train_step()
    rng = np.random.default_rng(0)
    for i in range(args.steps):
        batch = counting_sequences(rng, sequences, args.seq, args.vocab)
        start = time.perf_counter()
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        loss = float(loss)  # (waits for the step)
        print(f"step {i + 1}: loss {loss:.4f}, {time.perf_counter() - start:.2f} s")
    eo.save(args.checkpoint, model, opt_state, step=args.steps)
    print(f"saved step {args.steps} to {args.checkpoint}")


if __name__ == "__main__":
    main()
