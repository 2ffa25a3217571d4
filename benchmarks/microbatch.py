"""Micro-batches and bf16 compute on one TPU v5e chip: the GPT-style stack of
`depth.py` (8 blocks; vocab 32768, dim 1024, sequence 1024, batch 8, AdamW), its
whole `train_step` compiled for k = 1, 2, 4, 8 micro-batches under `remat`,
`offload_residuals` and `offload_all`, in fp32 and with `compute_dtype=bfloat16`.

    python benchmarks/microbatch.py [--ks 1 2 4 8] [--json FILE]

Nothing is allocated: the model is abstract and only compiled. Device and host
bytes are the compiled step's footprint per chip; the traffic columns are the
bytes moved per step, as the compiled program moves them (`memory_report`'s
`compiled_transfers`): parameters host -> device in the forward and backward
passes, and everything host <-> device.
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import MIB, parser, table, write_json
from models.gpt import GPT, loss_fn

import eqx_offload as eo


VOCAB, DIM, DEPTH, SEQ, BATCH = 32768, 1024, 8, 1024, 8
PRESETS = ("remat", "offload_residuals", "offload_all")


def report(preset: str, k: int, bf16: bool, target: str) -> eo.MemoryReport:
    policy = getattr(eo.Policy, preset)(compute_dtype=jnp.bfloat16 if bf16 else None)
    optimizer = optax.adamw(1e-4)
    abstract = eqx.filter_eval_shape(GPT, VOCAB, DIM, DEPTH, key=jax.random.key(0))
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    step = eo.train_step(loss_fn, optimizer, policy, microbatches=k)
    return eo.memory_report(step, model, opt_state, tokens, tokens, target=target)


def main():
    p = parser(__doc__)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--target", default="tpu-v5e")
    args = p.parse_args()
    rows = []
    for preset in args.presets:
        for bf16 in (False, True):
            for k in args.ks:
                r = report(preset, k, bf16, args.target)
                rows.append(
                    {
                        "preset": preset,
                        "compute": "bf16" if bf16 else "fp32",
                        "microbatches": k,
                        "device MiB": r.device_bytes / MIB,
                        "host MiB": r.host_bytes / MIB,
                        "params H2D fwd/bwd MiB": r.transfer_bytes(
                            "host_to_device",
                            phase="forward/backward",
                            what="params",
                            compiled=True,
                        )
                        / MIB,
                        "H2D MiB": r.host_to_device_bytes / MIB,
                        "D2H MiB": r.device_to_host_bytes / MIB,
                    }
                )
                print(rows[-1], flush=True)
    headers = list(rows[0])
    print(table(headers, [[row[h] for h in headers] for row in rows]))
    write_json(args.json, "microbatch", {"target": args.target, "rows": rows})


if __name__ == "__main__":
    main()
