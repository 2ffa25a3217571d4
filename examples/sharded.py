"""The quickstart's GPT laid out over 8 devices (fully sharded data parallel) with
its parameters, optimizer state and block inputs on the host, on this machine's CPU
split into 8 devices; then the same step compiled for a TPU v5e slice of 8 chips.

    python examples/sharded.py               # about a minute on 2 CPU cores

It trains the sharded model and the same model on one device side by side from the
same initial weights and batches, and prints both losses: sharding changes where
each byte lives, not what is computed. On a real slice the script is the same; only
the mesh comes from the machine's devices.
"""

import argparse
import importlib.util

import jax


jax.config.update("jax_num_cpu_devices", 8)  # before any device is used

import equinox as eqx  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AbstractMesh, AxisType  # noqa: E402
from quickstart import counting_sequences, GPT, loss_fn  # noqa: E402
from tqdm import tqdm  # noqa: E402

import eqx_offload as eo  # noqa: E402


def main() -> tuple[list[float], list[float]]:
    """Trains both runs; returns their losses, step by step (8 devices, one)."""
    p = argparse.ArgumentParser(description="The quickstart GPT over 8 devices.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="split over the 8 devices")
    p.add_argument(
        "--target",
        default="tpu-v5e:2x4" if importlib.util.find_spec("libtpu") else "none",
        help="also compile the step for this TPU slice (libtpu), e.g. tpu-v5e:2x4",
    )
    p.add_argument("--plot", default="sharded_memory.png")
    args = p.parse_args()
    vocab = 64
    make = lambda: GPT(vocab, args.dim, args.depth, args.seq, key=jax.random.key(0))  # noqa: E731

    # FSDP: every large leaf split over the "fsdp" axis, and the batch with it.
    # `Auto` axes let the partitioner place what the model computes.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    sharded = eo.Policy.offload_all(shard="fsdp", batch="fsdp")
    single = eo.Policy.offload_all()
    optimizer = optax.adamw(3e-3)
    # Made outside the mesh, as the reference below is: the same eager
    # initialisation, compiled once for both.
    model = make()
    with jax.set_mesh(mesh):
        model = eo.place(model, sharded)
    opt_state = eo.init_opt_state(optimizer, model, sharded)
    step = eo.train_step(loss_fn, optimizer, sharded)
    reference = eo.place(make(), single)
    reference_state = eo.init_opt_state(optimizer, reference, single)
    reference_step = eo.train_step(loss_fn, optimizer, single)

    weight = model.blocks.layers.mlp.layers[0].weight
    print(f"mesh: {dict(mesh.shape)}; blocks.mlp.layers[0].weight {weight.shape}")
    print(
        f"  sharding {weight.sharding.spec}, memory kind {weight.sharding.memory_kind}"
    )
    print(f"  one device holds {weight.addressable_shards[0].data.shape}\n")

    rng = np.random.default_rng(0)
    batch = counting_sequences(rng, args.batch, args.seq, vocab)
    reports = [eo.memory_report(step, model, opt_state, *batch)]
    print(reports[0])
    if args.target != "none":
        # A slice you do not have: the same model, abstract, on a mesh of its shape.
        chips = int(np.prod([int(n) for n in args.target.split(":")[1].split("x")]))
        abstract_mesh = AbstractMesh((chips,), ("fsdp",))
        abstract = eo.place(eqx.filter_eval_shape(make), sharded, mesh=abstract_mesh)
        abstract_state = eo.init_opt_state(optimizer, abstract, sharded)
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch]
        reports.append(
            eo.memory_report(
                step, abstract, abstract_state, *shapes, target=args.target
            )
        )
        print()
        print(reports[-1])
    if args.plot:
        matplotlib.use("Agg")
        labels = ["8 CPU devices"] + [args.target] * (len(reports) - 1)
        title = "sharded GPT: one train step"
        ax = reports[0].plot(*reports[1:], labels=labels, unit="MiB", title=title)
        ax.figure.savefig(args.plot, dpi=120)
        print(f"saved {args.plot}")

    losses: list[float] = []
    expected: list[float] = []
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for _ in bar:
            model, opt_state, loss, _ = step(model, opt_state, *batch)
            reference, reference_state, reference_loss, _ = reference_step(
                reference, reference_state, *batch
            )
            losses.append(float(loss))
            expected.append(float(reference_loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            batch = counting_sequences(rng, args.batch, args.seq, vocab)
    largest = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"\nlast loss: 8 devices {losses[-1]:.4f}, one device {expected[-1]:.4f}")
    print(f"largest difference between the two runs' losses: {largest:.1e}")
    return losses, expected


if __name__ == "__main__":
    main()
