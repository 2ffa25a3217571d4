"""Speed of the eqx_offload train step against the same model and policy written by
hand in plain JAX (`handwritten.py`), on this CPU: step time and trace+compile time,
interleaved in one run (single steps alternate), as ratios of medians.

    python benchmarks/speed.py [--repeats 7] [--steps 10] [--json FILE]

Both steps use `Policy.offload_all()`: parameters and optimizer state on pinned host
memory, each layer's parameters moved to the device inside the scan, the carry
entering each layer offloaded. They start from the same weights; the losses of the
first steps are compared as a check that they compute the same thing.
"""

import statistics
import time

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import handwritten
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import parser, table, write_json
from gpt import GPT, loss_fn

import eqx_offload as eo


VOCAB, DIM, DEPTH, SEQ, BATCH = 2048, 256, 8, 128, 4


def setups(optimizer):
    """Fresh (step, arguments) for both versions, from the same weights."""
    policy = eo.Policy.offload_all()
    model = GPT(VOCAB, DIM, DEPTH, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    params = handwritten.to_host(params)
    hand = (
        handwritten.make_step(optimizer, static),
        [params, handwritten.init_opt_state(optimizer, params)],
    )
    model = eo.place(model, policy)
    ours = (
        eo.train_step(loss_fn, optimizer, policy),
        [model, eo.init_opt_state(optimizer, model, policy)],
    )
    return ours, hand


def compile_seconds(step, state, batch) -> float:
    start = time.perf_counter()
    if hasattr(step, "split"):  # eqx_offload's step: trace its jitted function
        dynamic, statics = step.split(*state, *batch)
        step.jitted.trace(*dynamic, statics).lower().compile()
    else:
        step.trace(*state, *batch).lower().compile()
    return time.perf_counter() - start


def step_seconds(step, state, batch) -> float:
    """One step, waited for."""
    start = time.perf_counter()
    state[0], state[1], loss = step(state[0], state[1], *batch)
    jax.block_until_ready((state, loss))
    return time.perf_counter() - start


def main():
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    optimizer = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ + 1)))
    batch = (tokens[:, :-1], tokens[:, 1:])

    # The same computation: a few steps from the same weights.
    (ours, ours_state), (hand, hand_state) = setups(optimizer)
    losses = [[], []]
    for _ in range(3):
        ours_state[0], ours_state[1], a = ours(*ours_state, *batch)
        hand_state[0], hand_state[1], b = hand(*hand_state, *batch)
        losses[0].append(float(a))
        losses[1].append(float(b))
    ours_losses, hand_losses = np.array(losses[0]), np.array(losses[1])
    difference = float(np.max(np.abs(ours_losses - hand_losses) / np.abs(hand_losses)))
    print(f"losses, eqx_offload: {losses[0]}\nlosses, handwritten: {losses[1]}")

    compile_times: dict[str, list[float]] = {"eqx_offload": [], "handwritten": []}
    step_times: dict[str, list[float]] = {"eqx_offload": [], "handwritten": []}
    for r in range(args.repeats):
        (ours, ours_state), (hand, hand_state) = setups(optimizer)  # fresh jits
        order = [("eqx_offload", ours, ours_state), ("handwritten", hand, hand_state)]
        for name, step, state in order if r % 2 == 0 else order[::-1]:
            compile_times[name].append(compile_seconds(step, state, batch))
        for name, step, state in order:  # warm up: compile for the call path
            step_seconds(step, state, batch)
        samples: dict[str, list[float]] = {"eqx_offload": [], "handwritten": []}
        for i in range(args.steps):  # alternate single steps: same machine state
            for name, step, state in order if (r + i) % 2 == 0 else order[::-1]:
                samples[name].append(step_seconds(step, state, batch))
        for name, times in samples.items():
            step_times[name].append(statistics.median(times))
        print(f"  repeat {r + 1}/{args.repeats} done", flush=True)

    rows = []
    for what, times in (("step", step_times), ("trace + compile", compile_times)):
        ours_median = statistics.median(times["eqx_offload"])
        hand_median = statistics.median(times["handwritten"])
        rows.append(
            [what, 1000 * ours_median, 1000 * hand_median, ours_median / hand_median]
        )
    print(
        f"\nGPT-style stack ({DEPTH} layers, dim {DIM}, seq {SEQ}, batch {BATCH}, "
        f"vocab {VOCAB}), Policy.offload_all(), medians of {args.repeats} repeats "
        f"({args.steps} steps each):"
    )
    print(table(["", "eqx_offload ms", "handwritten ms", "ratio"], rows))
    print(f"largest relative loss difference over 3 steps: {difference:.2e}")
    write_json(
        args.json,
        "speed",
        {
            "step_ratio": rows[0][3],
            "compile_ratio": rows[1][3],
            "step_ms": {"eqx_offload": rows[0][1], "handwritten": rows[0][2]},
            "compile_ms": {"eqx_offload": rows[1][1], "handwritten": rows[1][2]},
            "loss_difference": difference,
            "raw": {"step": step_times, "compile": compile_times},
        },
    )


if __name__ == "__main__":
    main()
