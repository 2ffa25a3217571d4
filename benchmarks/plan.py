"""`eo.plan` on the Llama-3.2-1B-shaped model of `llama.py`: the placement it
chooses on one tpu-v5e chip and one H100 with their default budgets (the device's
capacity, its host RAM per device), against the presets, and what planning costs.

    python benchmarks/plan.py [--targets tpu-v5e gpu-h100] [--json FILE]
        [--experimental prefetch next_forward host_update]
        [--workspace-margin 2GiB] [--hardware CALIBRATION.json]

The model, loss (`chunked`) and optimizer (AdamW) are `llama.py`'s; batch 8 x
1024. Only compiled, never run: every step time is an estimate, with the rates it
used (measured, nominal, assumed) and how far it can be off (±).
"""

import time

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import GIB, parser, table, write_json
from models.decoder import chunked_loss, Decoder
from models.shapes import LLAMA_3_2_1B, SEQ

import eqx_offload as eo


BATCH = 8


def main():
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["tpu-v5e", "gpu-h100"])
    p.add_argument(
        "--experimental",
        nargs="+",
        default=[],
        choices=("prefetch", "next_forward", "host_update"),
    )
    p.add_argument("--workspace-margin", help="as for `eo.plan` (default: its own)")
    p.add_argument("--hardware", help="a calibration file, for a GPU target")
    args = p.parse_args()
    hardware = (
        None if args.hardware is None else eo.Hardware.from_measurements(args.hardware)
    )
    abstract = eqx.filter_eval_shape(Decoder, LLAMA_3_2_1B, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    results = []
    for target in args.targets:
        start = time.perf_counter()
        plan = eo.plan(
            chunked_loss,
            optax.adamw(1e-4),
            abstract,
            tokens,
            tokens,
            target=target,
            experimental=tuple(args.experimental),
            workspace_margin=args.workspace_margin,
            hardware=hardware,
        )
        seconds = time.perf_counter() - start
        print(plan, flush=True)
        rows = []
        for r in plan.table.rows:
            rows.append(
                {
                    "candidate": r.label,
                    "status": r.status,
                    "fits": r.fits,
                    "device GiB": None
                    if r.device_bytes is None
                    else r.device_bytes / GIB,
                    "host GiB": None if r.host_bytes is None else r.host_bytes / GIB,
                    "step s": r.seconds,
                    "±": r.error,
                    "rates": r.rates_text,
                    "tied": r.tied,
                    "moved GiB": None
                    if r.transfer_bytes is None
                    else r.transfer_bytes / GIB,
                }
            )
        chosen = next(r for r in rows if r["status"] == "chosen")
        results.append(
            {
                "target": target,
                "device budget GiB": plan.table.device_budget / GIB,
                "host budget GiB": plan.table.host_budget / GIB,
                "workspace margin GiB": plan.table.workspace_margin / GIB,
                "experimental": list(args.experimental),
                "decision": plan.table.decision,
                "chosen": chosen["candidate"],
                "chosen step s": chosen["step s"],
                "compiled": plan.compiled,
                "planning s": seconds,
                "rows": rows,
            }
        )
        headers = ["candidate", "status", "device GiB", "host GiB", "step s", "±"]
        print(table(headers, [[r[h] for h in headers] for r in rows]))
    write_json(args.json, "plan", results)


if __name__ == "__main__":
    main()
