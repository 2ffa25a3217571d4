"""Your own training step, with the same machinery as `eo.train_step`: a
hand-written `eqx.filter_jit` step that takes its gradients through
`eo.filter_offload` and applies the optimizer with `eo.optimizer_update` (the
streamed update: host-resident parameters and optimizer state updated a layer at
a time, in place), next to `eo.train_step` for the same model and policy.

    python examples/own_step.py                  # trains both on the CPU, compares
    python examples/own_step.py --target tpu-v5e # and their memory on a TPU v5e chip

The two steps compute the same losses and keep the same bytes on the device and
the host; both reports are drawn side by side in `own_step_memory.png` (`--plot`).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_offload as eo


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        self.norm = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, depth=1, key=key)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return x + self.mlp(self.norm(x))


class Model(eqx.Module):
    blocks: eo.Stacked[Block]
    head: eqx.nn.Linear

    def __init__(self, dim: int, depth: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.blocks = eo.Stacked.from_fn(lambda k: Block(dim, key=k), depth, key=k1)
        self.head = eqx.nn.Linear(dim, 1, key=k2)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, ""]:
        return self.head(self.blocks(x))[0]


def loss_fn(model: Model, x: Float[Array, "batch dim"], y: Float[Array, " batch"]):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_own_step(optimizer: optax.GradientTransformation, policy: eo.Policy):
    """The step, written by hand: gradients, then the offloaded optimizer update.
    The model and state are donated, so the update happens in place."""
    loss = eo.filter_offload(loss_fn, policy)

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, *batch)
        model, opt_state, _ = eo.optimizer_update(
            optimizer, grads, opt_state, model, policy
        )
        return value, model, opt_state

    return step


def data(rng: np.random.Generator, batch: int, dim: int):
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x.sum(axis=1)))


def main():
    parser = argparse.ArgumentParser(description="Your own step, next to train_step.")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--target", default=None, help="e.g. tpu-v5e (needs libtpu)")
    parser.add_argument(
        "--plot",
        default="own_step_memory.png",
        help="save a picture of both steps' memory here ('' for none)",
    )
    args = parser.parse_args()

    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    batches = [data(rng, args.batch, args.dim) for _ in range(args.steps)]

    def fresh():
        model = eo.place(Model(args.dim, args.depth, key=jax.random.key(0)), policy)
        return model, eo.init_opt_state(optimizer, model, policy)

    own = make_own_step(optimizer, policy)
    model, opt_state = fresh()
    own_losses = []
    for batch in batches:
        value, model, opt_state = own(batch, model, opt_state)
        own_losses.append(float(value))

    step = eo.train_step(loss_fn, optimizer, policy)
    model, opt_state = fresh()
    losses = []
    for batch in batches:
        model, opt_state, value, _ = step(model, opt_state, *batch)
        losses.append(float(value))
    gap = max(abs(a - b) for a, b in zip(own_losses, losses))
    print(f"own step:   loss {own_losses[0]:.4f} -> {own_losses[-1]:.4f}")
    print(f"train_step: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"largest difference between their losses: {gap:.2e}")

    model, opt_state = fresh()
    batch = batches[0]
    target = args.target or "this machine"
    mine = eo.memory_report(own, batch, model, opt_state, target=args.target)
    theirs = eo.memory_report(step, model, opt_state, *batch, target=args.target)
    print(f"\ncompiled for {target}:{'device':>16}{'host':>16}")
    for name, r in (("own step", mine), ("train_step", theirs)):
        print(f"  {name:<22}{r.device_bytes:>16,}{r.host_bytes:>16,}")
    if args.plot:
        matplotlib.use("Agg")  # draw to a file, no window
        title = f"one step, compiled for {target}"
        ax = mine.plot(theirs, labels=["own step", "train_step"], title=title)
        ax.figure.savefig(args.plot, dpi=120)
        print(f"saved {args.plot}")


if __name__ == "__main__":
    main()
