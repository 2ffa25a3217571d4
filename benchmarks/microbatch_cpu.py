"""Micro-batches train as one batch does, at the widths people train: the
`compile_matrix.py` `llama` model (2 blocks of width 2048 and MLP 8192 by default)
trained for a few AdamW steps on this CPU with `train_step(microbatches=k)` and
with `microbatches=1`, under `offload_all` and `offload_residuals`, in float32 and
with `compute_dtype=bfloat16`; the losses compared (relative difference), and the
parameters (the largest difference, in units of `lr * steps`: Adam moves an element
by about `lr` a step whatever its gradient); and, for the scale of bf16's own
rounding, the bf16 run with one batch against the fp32 one.

    python benchmarks/microbatch_cpu.py [--width 2048] [--ks 2 4] [--json FILE]

Each case is a real run (concrete arrays): at width 2048 about 2 GB of memory and
half a minute a case on 2 cores.
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import compile_matrix as cm
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import parser, table, write_json

import eqx_offload as eo


BATCH, SEQ = 8, 32
LR = 1e-3


def train(width: int, mlp: int | None, policy: eo.Policy, k: int, steps: int):
    """The losses and the final parameters (as numpy arrays) of `steps` AdamW steps
    of the `llama` model with `k` micro-batches."""
    hidden = cm.mlp_width(width) if mlp is None else mlp
    model = cm.Llama(cm.VOCAB, width, hidden, 2, key=jax.random.key(0))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cm.token_loss, optimizer, policy, microbatches=k)
    keys = jax.random.split(jax.random.key(1), steps)
    losses = []
    for key in keys:
        tokens = jax.random.randint(key, (BATCH, SEQ + 1), 0, cm.VOCAB)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        model, opt_state, loss, _ = step(model, opt_state, inputs, targets)
        losses.append(float(loss))
    params = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    return losses, params


def compare(ours, theirs, steps: int) -> tuple[float, float]:
    """The largest relative loss difference, and the largest parameter difference
    in units of `LR * steps`: Adam moves every element by about `LR` a step
    whatever its gradient, so the rounding of a gradient near zero (summed in
    another order over micro-batches) can move an element by up to that much
    (`tests/numerics.py`: why the tests compare such runs through SGD instead)."""
    (losses, params), (ref_losses, ref_params) = ours, theirs
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param = max(float(np.max(np.abs(a - b))) for a, b in zip(params, ref_params))
    return loss, param / (LR * steps)


def main():
    p = parser(__doc__)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--mlp", type=int)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--presets", nargs="+", default=["offload_all", "offload_residuals"])
    args = p.parse_args()
    rows = []

    def add(preset: str, compute: str, k: int, ours, reference) -> None:
        loss, param = compare(ours, reference, args.steps)
        row = {
            "preset": preset,
            "compute": compute,
            "microbatches": k,
            "loss rel diff": loss,
            "param diff / (lr x steps)": param,
        }
        print(row, flush=True)
        rows.append(row)

    for preset in args.presets:
        runs = {}
        for compute in (None, jnp.bfloat16):
            name = "fp32" if compute is None else "bf16"
            policy = getattr(eo.Policy, preset)(compute_dtype=compute)
            runs[name] = train(args.width, args.mlp, policy, 1, args.steps)
            for k in args.ks:
                ours = train(args.width, args.mlp, policy, k, args.steps)
                add(preset, name, k, ours, runs[name])
        # The scale of bf16's own rounding: bf16 compute against fp32, one batch.
        add(preset, "bf16 vs fp32", 1, runs["bf16"], runs["fp32"])
    headers = list(rows[0])
    print(
        table(
            headers,
            [
                [
                    f"{v:.2e}" if isinstance(v, float) and v < 1e-2 else v
                    for v in r.values()
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, "microbatch_cpu", {"width": args.width, "rows": rows})


if __name__ == "__main__":
    main()
