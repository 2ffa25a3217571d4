"""Train a small GPT-style model with its parameters, optimizer state and saved
activations offloaded to pinned host memory, on built-in synthetic data.

    bash scripts/quickstart.sh                  # or: python examples/quickstart.py
    python examples/quickstart.py --policy remat --steps 100
    python examples/quickstart.py --target tpu-v5e   # also compiled for a TPU v5e chip
    python examples/quickstart.py --target gpu-h100  # or for an H100 (`gpu-aot` extra)
    python examples/quickstart.py --bf16 --microbatches 4  # bf16 compute, 4 parts

The task: each sequence counts up from a random start with a random stride (mod the
vocabulary), so predicting the next token needs the stride, read from the context
by causal attention. The loss falls from about ln(64) = 4.2 to near 0. The memory
report is also drawn, to `quickstart_memory.png` (`--plot`).

On a machine without a GPU or TPU it runs JAX on the CPU (`JAX_PLATFORMS=cpu`, unless
set: `_platform.py`), which also lets `--target` compile for a TPU or GPU that is not
there.
"""

import argparse

import _platform  # noqa: F401  (first: JAX on the CPU where there is no GPU or TPU)
import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray
from tqdm import tqdm

import eqx_offload as eo


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(
            dim, dim, 4 * dim, depth=1, activation=jax.nn.gelu, key=k2
        )

    def __call__(
        self, x: Float[Array, "seq dim"], mask: Bool[Array, "seq seq"]
    ) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: Float[Array, "seq dim"]
    blocks: eo.Stacked[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, depth: int, seq: int, *, key: PRNGKeyArray
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.pos = 0.02 * jax.random.normal(k2, (seq, dim))
        self.blocks = eo.Stacked.from_fn(lambda k: Block(dim, 4, key=k), depth, key=k3)
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=k4)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        seq = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + self.pos[:seq]
        x = self.blocks(x, mask=jnp.tril(jnp.ones((seq, seq), dtype=bool)))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(
    model: GPT, tokens: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
) -> Float[Array, ""]:
    logits = jax.vmap(model)(tokens).astype(jnp.float32)  # the loss in fp32
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def counting_sequences(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Built-in synthetic data: `start + i * stride (mod vocab)`, stride in 1..4."""
    start = rng.integers(0, vocab, size=(batch, 1))
    stride = rng.integers(1, 5, size=(batch, 1))
    tokens = (start + stride * np.arange(seq + 1)) % vocab
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def kinds(tree) -> list[str]:
    return sorted(
        {
            x.sharding.memory_kind
            for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
        }
    )


def main():
    parser = argparse.ArgumentParser(description="Train a small offloaded GPT.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--target",
        default=None,
        choices=["tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4", "gpu-h100", "gpu-h200"],
        help="also report the step compiled for one chip of this TPU (needs libtpu) "
        "or one such GPU (needs JAX's CUDA plugin: the `gpu-aot` extra)",
    )
    parser.add_argument(
        "--policy",
        default="offload_all",
        choices=["none", "remat", "offload_residuals", "offload_all"],
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="compute in bfloat16 with fp32 master parameters (LayerNorms in fp32)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="split each batch into this many parts inside the step",
    )
    parser.add_argument(
        "--plot",
        default="quickstart_memory.png",
        help="save a picture of the memory report(s) here ('' for none)",
    )
    args = parser.parse_args()
    vocab = 64

    precision = {}
    if args.bf16:
        precision = {"compute_dtype": jnp.bfloat16, "keep_dtype": ("**.norm*",)}
    policy = getattr(eo.Policy, args.policy)(**precision)
    optimizer = optax.adamw(3e-3)
    model = eo.place(
        GPT(vocab, args.dim, args.depth, args.seq, key=jax.random.key(0)), policy
    )
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy, microbatches=args.microbatches)

    rng = np.random.default_rng(0)
    batch = counting_sequences(rng, args.batch, args.seq, vocab)
    print(f"Policy.{args.policy}(): {policy}\n")
    reports = [eo.memory_report(step, model, opt_state, *batch)]
    print(reports[0])
    if args.target:
        reports.append(
            eo.memory_report(step, model, opt_state, *batch, target=args.target)
        )
        print()
        print(reports[-1])
    if args.plot:
        matplotlib.use("Agg")  # draw to a file, no window
        labels = ["this machine"] + [args.target] * (len(reports) - 1)
        title = f"quickstart GPT, Policy.{args.policy}(): one train step"
        ax = reports[0].plot(*reports[1:], labels=labels, title=title)
        ax.figure.savefig(args.plot, dpi=120)
        print(f"\nsaved {args.plot}")
    print()

    losses = []
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for i in bar:
            model, opt_state, loss, _ = step(model, opt_state, *batch)
            batch = counting_sequences(rng, args.batch, args.seq, vocab)
            losses.append(float(loss))
            if i % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    print(f"loss: first step {losses[0]:.3f}, last step {losses[-1]:.3f}")
    print(
        f"after training, parameters live in {kinds(model)}, "
        f"optimizer state in {kinds(opt_state)} (the step count stays on the device)"
    )


if __name__ == "__main__":
    main()
