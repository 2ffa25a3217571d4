"""The three experiments of JAX's host-offloading tutorial ("JAX Memories and Host
Offloading"), written with eqx_offload: offloading activations, parameters and
optimizer state. Each step is compiled (never run) for this machine and for one
TPU v5e chip, and its memory printed as the tutorial prints it.

    python examples/offloading_tutorial.py                 # about a minute
    python examples/offloading_tutorial.py --target none   # this machine only

1. **Activations**: ten layers of two matmuls in a `Stacked`; under
   `Policy.offload_residuals()` the activation entering each layer goes to pinned
   host memory in the forward pass and comes back for the backward pass.
2. **Parameters**: the same layers with their weights on `pinned_host`; the scan
   brings one layer's weights to the device at a time.
3. **Optimizer state**: a dict of four 7168 x 7168 weights trained with
   clip + Adam; with `Policy.none(opt_state="pinned_host")` the moments live on
   the host and the update streams them through the device in blocks of rows.

`benchmarks/tutorial.py` compares the same steps with the tutorial's hand-written
recipes (docs/benchmarks/tutorial.md). The figures on this machine are estimates by
memory kind (the CPU compiler has one memory); the TPU ones are the compiler's.
"""

import argparse
import importlib.util
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import optax
from jaxtyping import Array, Float

import eqx_offload as eo


MIB = 2**20


# --- Experiments 1 and 2: a scan over layers of two matmuls ----------------------


class TwoLayers(eqx.Module):
    """One layer of the tutorial's scan: `x @ w1 @ w2`."""

    w1: Float[Array, "in hidden"]
    w2: Float[Array, "hidden in"]

    def __call__(self, x: Float[Array, "n in"]) -> Float[Array, "n in"]:
        return (x @ self.w1) @ self.w2


def stacked_loss(stacked: eo.Stacked[TwoLayers], x: Float[Array, "n in"]):
    return jnp.sum(stacked(x))


def abstract_layers(layers: int, width: int, hidden: int) -> eo.Stacked[TwoLayers]:
    """The tutorial's `(10, 256, 1024)` and `(10, 1024, 256)` weights, as a
    `Stacked` of shapes only: nothing is allocated."""
    return jax.eval_shape(
        lambda: eo.Stacked(
            TwoLayers(
                jnp.zeros((layers, width, hidden)), jnp.zeros((layers, hidden, width))
            )
        )
    )


# --- Experiment 3: a dict of four square weights, clip + Adam --------------------

optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate=0.1))


def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x**3)))


def compute_loss(params: dict[str, Array], inputs: Array):
    """The tutorial's loss: four GELU layers, a reconstruction error and an L2
    penalty over every weight."""
    x = inputs
    for i in range(1, 5):
        x = gelu(x @ params[f"w{i}"])
    l2 = 0.001 * sum(jnp.sum(w**2) for w in jax.tree.leaves(params))
    return jnp.mean((x - inputs) ** 2) + l2


def experiments(tiny: bool) -> list[tuple[str, str, Callable, tuple]]:
    """(experiment, version, step, arguments): all compiled from shapes only. The
    version's first word is its label in the picture."""
    layers, width, hidden, dim = (2, 128, 256, 64) if tiny else (10, 256, 1024, 7168)
    x = jax.ShapeDtypeStruct((width, width), jnp.float32)
    stacked = abstract_layers(layers, width, hidden)
    rows: list[tuple[str, str, Callable, tuple]] = []
    for version, policy in (
        ("remat: no offload, Policy.remat()", eo.Policy.remat()),
        ("offloaded: Policy.offload_residuals()", eo.Policy.offload_residuals()),
    ):
        # `memory_report` compiles a `filter_offload` function's gradient.
        loss = eo.filter_offload(stacked_loss, policy)
        rows.append(("1. activations", version, loss, (stacked, x)))
    policy = eo.Policy.offload_residuals(params="pinned_host")
    loss = eo.filter_offload(stacked_loss, policy)
    rows.append(
        (
            "2. parameters",
            'offloaded: offload_residuals(params="pinned_host")',
            loss,
            (eo.place(stacked, policy), x),
        )
    )
    inputs = jax.ShapeDtypeStruct((dim, dim), jnp.float32)
    params = {
        f"w{i}": jax.ShapeDtypeStruct((dim, dim), jnp.float32) for i in range(1, 5)
    }
    for version, policy in (
        ("none: no offload, Policy.none()", eo.Policy.none()),
        (
            'offloaded: Policy.none(opt_state="pinned_host")',
            eo.Policy.none(opt_state="pinned_host"),
        ),
    ):
        params = eo.place(params, policy)
        state = eo.init_opt_state(optimizer, params, policy)
        step = eo.train_step(compute_loss, optimizer, policy)
        rows.append(("3. optimizer state", version, step, (params, state, inputs)))
    return rows


def main():
    p = argparse.ArgumentParser(
        description="The JAX offloading tutorial's experiments."
    )
    p.add_argument(
        "--target",
        default="tpu-v5e" if importlib.util.find_spec("libtpu") else "none",
        choices=["none", "tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"],
    )
    p.add_argument("--tiny", action="store_true", help="small shapes (for tests)")
    p.add_argument("--plot", default="offloading_tutorial_memory.png")
    args = p.parse_args()

    targets = [None] + ([] if args.target == "none" else [args.target])
    header = f"{'version':<52}" + "".join(
        f"{(t or 'this machine') + ' ' + m:>24}"
        for t in targets
        for m in ("device", "host")
    )
    reports: dict[str, list[tuple[str, eo.MemoryReport]]] = {}
    current = None
    for experiment, version, step, step_args in experiments(args.tiny):
        if experiment != current:
            print(f"\n{experiment}\n{header}\n{'-' * len(header)}")
            current = experiment
        line = f"{version:<52}"
        for target in targets:
            report = eo.memory_report(step, *step_args, target=target)
            for n in (report.device_bytes, report.host_bytes):
                line += f"{n / MIB:>20.2f} MiB"
            if target == targets[-1]:
                label = version.split(":")[0]
                reports.setdefault(experiment, []).append((label, report))
        print(line)
        if report.residuals and not experiment.startswith("3"):
            saved = ", ".join(
                f"{r.name} {r.bytes / MIB:.2f} MiB on {r.memory_kind}"
                for r in report.residuals
            )
            print(f"{'':<4}saved for the backward pass: {saved}")
        if report.opt_state:
            kinds = ", ".join(
                f"{k} {v / MIB:.2f} MiB" for k, v in report.opt_state.items()
            )
            print(f"{'':<4}optimizer state: {kinds}")
    if args.plot:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(
            1, len(reports), figsize=(5.5 * len(reports), 4.5), layout="constrained"
        )
        for ax, (experiment, rows) in zip(axes, reports.items()):
            labels, rs = zip(*rows)
            rs[0].plot(*rs[1:], labels=labels, ax=ax, unit="MiB", title=experiment)
        figure.savefig(args.plot, dpi=110)
        print(f"\nsaved {args.plot}")


if __name__ == "__main__":
    main()
