"""Speed of the eqx_offload train step against the same model and policy written by
hand in plain JAX (`models/handwritten.py`), on this CPU: step time and
trace+compile time, interleaved in one run (single steps alternate), as ratios
of medians.

    python benchmarks/speed.py [--repeats 7] [--steps 10] [--json FILE]

All use `Policy.offload_all()`: parameters and optimizer state on pinned host
memory, each layer's parameters moved to the device inside the scan, the carry
entering each layer offloaded. The hand-written step brings the whole optimizer
state to the device for the update, as the JAX tutorial does; eqx_offload is timed
with its default update (`"auto"`: the whole update on this CPU, streamed on a
TPU), with the streamed update forced (`update="streamed"`), and with
`update="whole"`, the same algorithm as the hand-written step. All start from the
same weights; the losses of the first steps are compared as a check that they
compute the same thing.
"""

import statistics
import time
from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import parser, table, write_json
from models import handwritten
from models.gpt import GPT, loss_fn

import eqx_offload as eo


VOCAB, DIM, DEPTH, SEQ, BATCH = 2048, 256, 8, 128, 4


VERSIONS = {
    "eqx_offload (default)": eo.Policy.offload_all(),  # update="auto": whole here
    'eqx_offload, update="streamed"': eo.Policy.offload_all(update="streamed"),
    'eqx_offload, update="whole"': eo.Policy.offload_all(update="whole"),
}
HAND = "handwritten"


def setups(optimizer) -> dict[str, tuple[Any, list[Any]]]:
    """Fresh (step, [model, opt_state]) for every version, from the same weights."""
    model = GPT(VOCAB, DIM, DEPTH, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    params = handwritten.to_host(params)
    out: dict[str, tuple[Any, list[Any]]] = {
        HAND: (
            handwritten.make_step(optimizer, static),
            [params, handwritten.init_opt_state(optimizer, params)],
        )
    }
    for name, policy in VERSIONS.items():
        placed = eo.place(model, policy)
        out[name] = (
            eo.train_step(loss_fn, optimizer, policy),
            [placed, eo.init_opt_state(optimizer, placed, policy)],
        )
    return out


def compile_seconds(step, state, batch) -> float:
    start = time.perf_counter()
    step.trace(*state, *batch).lower().compile()  # (a jitted function or a step)
    return time.perf_counter() - start


def step_seconds(step, state, batch) -> float:
    """One step, waited for."""
    start = time.perf_counter()
    state[0], state[1], loss, *_ = step(state[0], state[1], *batch)  # (+ metrics)
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
    losses: dict[str, list[float]] = {name: [] for name in setups(optimizer)}
    versions = setups(optimizer)
    for _ in range(3):
        for name, (step, state) in versions.items():
            state[0], state[1], loss, *_ = step(*state, *batch)
            losses[name].append(float(loss))
    reference = np.array(losses[HAND])
    difference = max(
        float(np.max(np.abs(np.array(v) - reference) / np.abs(reference)))
        for v in losses.values()
    )
    for name, values in losses.items():
        print(f"losses, {name}: {values}")

    names = list(versions)
    compile_times: dict[str, list[float]] = {name: [] for name in names}
    step_times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        versions = setups(optimizer)  # fresh jits
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            compile_times[name].append(compile_seconds(*versions[name], batch))
        for name in names:  # warm up: compile for the call path
            step_seconds(*versions[name], batch)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.steps):  # alternate single steps: same machine state
            for name in names[i % len(names) :] + names[: i % len(names)]:
                samples[name].append(step_seconds(*versions[name], batch))
        for name, times in samples.items():
            step_times[name].append(statistics.median(times))
        print(f"  repeat {r + 1}/{args.repeats} done", flush=True)

    rows = []
    for name in names:
        step_ms = 1000 * statistics.median(step_times[name])
        compile_ms = 1000 * statistics.median(compile_times[name])
        rows.append([name, step_ms, compile_ms])
    hand_step, hand_compile = rows[0][1], rows[0][2]
    for row in rows:
        row += [row[1] / hand_step, row[2] / hand_compile]
    print(
        f"\nGPT-style stack ({DEPTH} layers, dim {DIM}, seq {SEQ}, batch {BATCH}, "
        f"vocab {VOCAB}), Policy.offload_all(), medians of {args.repeats} repeats "
        f"({args.steps} steps each):"
    )
    headers = ["", "step ms", "trace + compile ms", "step ratio", "compile ratio"]
    print(table(headers, rows))
    print(f"largest relative loss difference over 3 steps: {difference:.2e}")
    write_json(
        args.json,
        "speed",
        {
            "rows": [dict(zip(["version", *headers[1:]], row)) for row in rows],
            "loss_difference": difference,
            "raw": {"step": step_times, "compile": compile_times},
        },
    )


if __name__ == "__main__":
    main()
