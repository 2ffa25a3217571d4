"""Let `eo.plan` choose the placement: the quickstart's GPT planned for one TPU v5e
chip with a device budget smaller than its plain step needs, then trained here on
the CPU with the plan's policy, on the quickstart's built-in data.

    python examples/plan.py                           # plan for a v5e chip, train
    python examples/plan.py --device-budget 40MiB --microbatches 1 2
    python examples/plan.py --target gpu-h100 --device-budget 48MiB

`plan` compiles candidate placements for the target (libtpu; JAX's CUDA plugin for
a GPU), never runs them, and picks the fastest by its step-time estimate that fits
both budgets. The table shows every candidate it considered. The chosen step then
trains here, and its first loss is checked against the plain step's
(`Policy.none()`): the plan changes where bytes live, not what is computed.
"""

import argparse

import equinox as eqx
import jax
import numpy as np
import optax
from quickstart import counting_sequences, GPT, kinds, loss_fn

import eqx_offload as eo


def main() -> tuple[list[float], float]:
    """Plans and trains; returns the plan's losses and the plain step's first."""
    parser = argparse.ArgumentParser(description="Plan a GPT's placement, train it.")
    parser.add_argument("--target", default="tpu-v5e", help="'tpu-v5e', 'gpu-h100'")
    parser.add_argument("--device-budget", default="40MiB", help="per device")
    parser.add_argument("--host-budget", default="1GiB", help="per device")
    parser.add_argument(
        "--microbatches", type=int, nargs="+", default=[1], help="counts to offer"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    vocab = 64
    optimizer = optax.adamw(3e-3)

    def make() -> GPT:
        return GPT(vocab, args.dim, args.depth, args.seq, key=jax.random.key(0))

    rng = np.random.default_rng(0)
    batch = counting_sequences(rng, args.batch, args.seq, vocab)
    plan = eo.plan(
        loss_fn,
        optimizer,
        eqx.filter_eval_shape(make),  # nothing allocated to plan
        *batch,
        target=args.target,
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        microbatches=tuple(args.microbatches),
        progress=True,
    )
    print(plan)
    print(f"\nthe plan's policy: {plan.policy}\n")

    plain = eo.train_step(loss_fn, optimizer, eo.Policy.none())
    model = make()
    _, _, plain_loss, _ = plain(
        model, eo.init_opt_state(optimizer, model, eo.Policy.none()), *batch
    )

    model = plan.place(make())
    opt_state = plan.init_opt_state(model)
    step = plan.train_step()
    losses = []
    for _ in range(args.steps):
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        losses.append(float(loss))
        batch = counting_sequences(rng, args.batch, args.seq, vocab)
    print(
        f"first step: loss {losses[0]:.4f} with the plan, {float(plain_loss):.4f} "
        "with Policy.none()"
    )
    print(f"loss: first step {losses[0]:.3f}, last step {losses[-1]:.3f}")
    print(f"parameters live in {kinds(model)}, optimizer state in {kinds(opt_state)}")
    return losses, float(plain_loss)


if __name__ == "__main__":
    main()
