"""The cost of `train_step(..., metrics=True)` on one TPU v5e chip: the GPT-style
stack of `microbatch.py` (8 blocks, `offload_all`, AdamW, fp32), compiled with the
metrics off and on.

    python benchmarks/metrics.py [--json FILE]

Device and host bytes are the compiled step's footprint; H2D and D2H the bytes the
compiled program moves per step.
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import MIB, parser, table, write_json
from microbatch import BATCH, DEPTH, DIM, SEQ, VOCAB
from models.gpt import GPT, loss_fn

import eqx_offload as eo


def main():
    p = parser(__doc__)
    p.add_argument("--target", default="tpu-v5e")
    args = p.parse_args()
    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(1e-4)
    abstract = eqx.filter_eval_shape(GPT, VOCAB, DIM, DEPTH, key=jax.random.key(0))
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    rows = []
    for metrics in (False, True):
        step = eo.train_step(loss_fn, optimizer, policy, metrics=metrics)
        r = eo.memory_report(step, model, opt_state, tokens, tokens, target=args.target)
        rows.append(
            {
                "metrics": "on" if metrics else "off",
                "device bytes": r.device_bytes,
                "host bytes": r.host_bytes,
                "H2D MiB": r.host_to_device_bytes / MIB,
                "D2H MiB": r.device_to_host_bytes / MIB,
            }
        )
        print(rows[-1], flush=True)
    headers = list(rows[0])
    print(table(headers, [[row[h] for h in headers] for row in rows]))
    growth = rows[1]["device bytes"] / rows[0]["device bytes"] - 1
    print(f"metrics on: device bytes {100 * growth:+.1f}%")
    write_json(args.json, "metrics", {"target": args.target, "rows": rows})


if __name__ == "__main__":
    main()
