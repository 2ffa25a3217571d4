"""The quickstart's GPT trained in bf16 with fp32 master weights on the host, its
batch split into micro-batches inside the one compiled step, next to the same
model trained in fp32.

    python examples/bf16_microbatches.py     # about a minute on 2 CPU cores

`Policy.offload_all(compute_dtype=jnp.bfloat16)` keeps the fp32 masters and the
optimizer state on the host and moves bf16 copies of the weights to the device
(half the bytes); `train_step(..., microbatches=4)` accumulates the gradients of
four parts of each batch inside the step. The script trains fp32, bf16 and bf16 with
micro-batches side by side, prints their losses, and, compiled for one TPU v5e
chip, each step's device memory and the parameter bytes it moves to the device.
"""

import argparse
import importlib.util

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from quickstart import counting_sequences, GPT, loss_fn
from tqdm import tqdm

import eqx_offload as eo


MIB = 2**20


def main():
    p = argparse.ArgumentParser(description="bf16 compute and micro-batches.")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument(
        "--target",
        default="tpu-v5e" if importlib.util.find_spec("libtpu") else "none",
        choices=["none", "tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"],
    )
    p.add_argument("--plot", default="bf16_microbatches_memory.png")
    args = p.parse_args()
    vocab = 64
    optimizer = optax.adamw(3e-3)
    bf16 = eo.Policy.offload_all(
        compute_dtype=jnp.bfloat16,
        keep_dtype=("**.norm*",),  # the LayerNorms (and the loss) stay fp32
    )
    runs = {
        "fp32": (eo.Policy.offload_all(), 1),
        "bf16": (bf16, 1),
        f"bf16, {args.microbatches} micro-batches": (bf16, args.microbatches),
    }
    states = {}
    for name, (policy, k) in runs.items():
        model = GPT(vocab, args.dim, args.depth, args.seq, key=jax.random.key(0))
        model = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(loss_fn, optimizer, policy, microbatches=k)
        states[name] = [model, opt_state, step]

    batch = counting_sequences(np.random.default_rng(0), args.batch, args.seq, vocab)
    if args.target != "none":
        reports = []
        print(
            f"{'compiled for ' + args.target:<32}{'device':>14}{'host':>14}"
            f"{'params to device, fwd/bwd':>30}"
        )
        for name, (model, opt_state, step) in states.items():
            r = eo.memory_report(step, model, opt_state, *batch, target=args.target)
            params = r.transfer_bytes(
                "host_to_device", phase="forward/backward", what="params", compiled=True
            )
            row = f"{name:<32}{r.device_bytes / MIB:>10.2f} MiB"
            row += f"{r.host_bytes / MIB:>10.2f} MiB{params / MIB:>26.2f} MiB"
            print(row)
            reports.append(r)
        print(
            "bf16 moves half the parameter bytes; micro-batches move the weights "
            "again for each part,\nand pay off where activations, not weights, "
            "fill the device (docs/benchmarks/microbatches-bf16-metrics.md).\n"
        )
        if args.plot:
            matplotlib.use("Agg")
            ax = reports[0].plot(
                *reports[1:],
                labels=list(states),
                unit="MiB",
                title=f"one train step on {args.target}",
            )
            ax.figure.savefig(args.plot, dpi=120)
            print(f"saved {args.plot}\n")

    rng = np.random.default_rng(1)
    losses: dict[str, list[float]] = {name: [] for name in states}
    for _ in tqdm(range(args.steps), desc="training both", unit="step"):
        for name, state in states.items():
            state[0], state[1], loss, _ = state[2](state[0], state[1], *batch)
            losses[name].append(float(loss))
        batch = counting_sequences(rng, args.batch, args.seq, vocab)
    print(f"\n{'step':>6}" + "".join(f"{name:>28}" for name in states))
    for i in sorted({0, args.steps // 4, args.steps // 2, args.steps - 1}):
        print(f"{i:>6}" + "".join(f"{losses[n][i]:>28.4f}" for n in states))
    model = states[list(states)[-1]][0]
    weight = model.blocks.layers.mlp.layers[0].weight
    print(f"\nthe bf16 run's masters: {weight.dtype} on {weight.sharding.memory_kind}")


if __name__ == "__main__":
    main()
