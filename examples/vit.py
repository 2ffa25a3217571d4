"""A Vision Transformer as Equinox users write it, ported to `eo.Stacked` and
trained with its parameters, optimizer state and block inputs on the host.

    python examples/vit.py               # about a minute on 2 CPU cores
    python examples/vit.py --steps 600   # longer
    python examples/vit.py --target none # without the report for a TPU v5e chip

The original model keeps its transformer blocks in a Python list and loops over
them (`PerLayerViT` below). The port changes three things and nothing else:

1. `blocks: list[Block]` becomes `blocks: eo.Stacked[Block]`, built with
   `eo.Stacked.from_fn` (one vmapped initialisation instead of a list
   comprehension);
2. the loop `for block, k in zip(self.blocks, keys): x = block(x, key=k, ...)`
   becomes `x = self.blocks(x, key=key, ...)`: `Stacked` splits the key one per
   layer and passes the other arguments to every layer;
3. nothing in `Block` changes. Weights of the original load into the port by
   their per-layer names (`eo.load_state_dict(port, eo.state_dict(original))`),
   and both compute the same logits, which this script checks before training.

The data are built in: 32 x 32 images of noise with one bright 8 x 8 square in one
of four quadrants; the label is the quadrant.
"""

import argparse
import importlib.util
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from tqdm import tqdm

import eqx_offload as eo


class Block(eqx.Module):
    """Pre-norm attention and MLP, with dropout."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, dim: int, heads: int, dropout: float, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=k3)
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(
        self,
        x: Float[Array, "tokens dim"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "tokens dim"]:
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        h = jax.vmap(self.norm1)(x)
        h = self.attention(h, h, h)
        x = x + self.dropout(h, key=k1, inference=inference)
        h = jax.vmap(lambda t: self.fc2(jax.nn.gelu(self.fc1(self.norm2(t)))))(x)
        return x + self.dropout(h, key=k2, inference=inference)


class Patches(eqx.Module):
    """Cuts an image into patches and embeds each: a strided convolution."""

    conv: eqx.nn.Conv2d
    patch: int = eqx.field(static=True)

    def __init__(self, channels: int, dim: int, patch: int, *, key: PRNGKeyArray):
        self.conv = eqx.nn.Conv2d(channels, dim, patch, stride=patch, key=key)
        self.patch = patch

    def __call__(self, image: Float[Array, "c h w"]) -> Float[Array, "n dim"]:
        x = self.conv(image)  # (dim, h / patch, w / patch)
        return x.reshape(x.shape[0], -1).T


class ViT(eqx.Module):
    """The port: the blocks are an `eo.Stacked`."""

    patches: Patches
    cls: Float[Array, " dim"]
    positions: Float[Array, "tokens dim"]
    blocks: eo.Stacked[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        *,
        image: int,
        patch: int,
        dim: int,
        depth: int,
        heads: int,
        classes: int,
        dropout: float,
        key: PRNGKeyArray,
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.patches = Patches(1, dim, patch, key=k1)
        self.cls = jnp.zeros(dim)
        self.positions = 0.02 * jax.random.normal(k2, ((image // patch) ** 2 + 1, dim))
        self.blocks = eo.Stacked.from_fn(
            lambda k: Block(dim, heads, dropout, key=k), depth, key=k3
        )
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=k4)

    def __call__(
        self,
        image: Float[Array, "c h w"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, " classes"]:
        x = jnp.concatenate([self.cls[None], self.patches(image)]) + self.positions
        x = self.blocks(x, key=key, inference=inference)
        return self.head(self.norm(x[0]))


class PerLayerViT(eqx.Module):
    """The original: the same model with its blocks in a list."""

    patches: Patches
    cls: Float[Array, " dim"]
    positions: Float[Array, "tokens dim"]
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        *,
        image: int,
        patch: int,
        dim: int,
        depth: int,
        heads: int,
        classes: int,
        dropout: float,
        key: PRNGKeyArray,
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.patches = Patches(1, dim, patch, key=k1)
        self.cls = jnp.zeros(dim)
        self.positions = 0.02 * jax.random.normal(k2, ((image // patch) ** 2 + 1, dim))
        self.blocks = [
            Block(dim, heads, dropout, key=k) for k in jax.random.split(k3, depth)
        ]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=k4)

    def __call__(
        self,
        image: Float[Array, "c h w"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, " classes"]:
        x = jnp.concatenate([self.cls[None], self.patches(image)]) + self.positions
        n = len(self.blocks)
        keys = [None] * n if key is None else list(jax.random.split(key, n))
        for block, k in zip(self.blocks, keys):
            x = block(x, key=k, inference=inference)
        return self.head(self.norm(x[0]))


def quadrant_images(
    rng: np.random.Generator, batch: int, size: int = 32
) -> tuple[Float[Array, "batch 1 size size"], Int[Array, " batch"]]:
    """Noise with one bright square; the label is the quadrant it is in."""
    images = rng.normal(0.0, 0.5, size=(batch, 1, size, size)).astype(np.float32)
    labels = rng.integers(0, 4, size=batch)
    half = size // 2
    for image, label in zip(images, labels):
        top = (label // 2) * half + rng.integers(0, half - 8)
        left = (label % 2) * half + rng.integers(0, half - 8)
        image[0, top : top + 8, left : left + 8] += 2.0
    return jnp.asarray(images), jnp.asarray(labels)


def loss_fn(
    model: ViT,
    images: Float[Array, "batch 1 h w"],
    labels: Int[Array, " batch"],
    key: PRNGKeyArray,
) -> Float[Array, ""]:
    keys = jax.random.split(key, len(images))
    logits = jax.vmap(lambda x, k: model(x, key=k))(images, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@eqx.filter_jit
def accuracy(model: ViT, images, labels) -> Float[Array, ""]:
    logits = jax.vmap(lambda x: model(x, inference=True))(images)
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)


def main() -> dict[str, Any]:
    """Ports, checks and trains; returns what the check compared: the port's and
    the original's logits (`ours`, `theirs`), the original and the image."""
    p = argparse.ArgumentParser(description="A Vision Transformer ported to Stacked.")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--test", type=int, default=256, help="held-out images")
    p.add_argument("--plot", default="vit_memory.png")
    p.add_argument(
        "--target",
        default="tpu-v5e" if importlib.util.find_spec("libtpu") else "none",
        choices=["none", "tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"],
        help="also report the step compiled for one chip of this TPU (libtpu)",
    )
    args = p.parse_args()
    config: dict[str, Any] = dict(
        image=32,
        patch=8,
        dim=args.dim,
        depth=args.depth,
        heads=4,
        classes=4,
        dropout=0.1,
    )

    # The port computes what the original computes, from the original's weights.
    original = PerLayerViT(**config, key=jax.random.key(0))
    port = ViT(**config, key=jax.random.key(1))
    port = eo.load_state_dict(port, eo.state_dict(original))
    image = quadrant_images(np.random.default_rng(0), 1)[0][0]
    ours, theirs = port(image, inference=True), original(image, inference=True)
    difference = jnp.max(jnp.abs(ours - theirs))
    print(f"port vs original, largest logit difference: {float(difference):.1e}")

    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(1e-3)
    model = eo.place(port, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy)
    rng = np.random.default_rng(1)
    test_images, test_labels = quadrant_images(np.random.default_rng(2), args.test)
    key = jax.random.key(3)
    batch = (*quadrant_images(rng, args.batch), key)
    reports = [eo.memory_report(step, model, opt_state, *batch)]
    if args.target != "none":
        reports.append(
            eo.memory_report(step, model, opt_state, *batch, target=args.target)
        )
    for report in reports:
        print(report)
    if args.plot:
        matplotlib.use("Agg")
        ax = reports[0].plot(
            *reports[1:], unit="MiB", title="ViT: one train step, offload_all"
        )
        ax.figure.savefig(args.plot, dpi=120)
        print(f"saved {args.plot}")

    def held_out() -> float:
        on_device = eo.place(model, eo.Policy(params="device"))
        return float(accuracy(on_device, test_images, test_labels))

    print(f"held-out accuracy before: {held_out():.2f}")
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for _ in bar:
            key, subkey = jax.random.split(key)
            images, labels = quadrant_images(rng, args.batch)
            model, opt_state, loss, _ = step(model, opt_state, images, labels, subkey)
            bar.set_postfix(loss=f"{float(loss):.3f}")
    print(f"held-out accuracy after {args.steps} steps: {held_out():.2f}")
    return {"ours": ours, "theirs": theirs, "original": original, "image": image}


if __name__ == "__main__":
    main()
