"""Re-plan `largest.py`'s GPT (width 2048, one v5e chip, 48 GB of host) at a depth:
what `eo.plan` chooses by default (no experimental stage, ties within the model's
error) and with all three experimental stages asked for.

    JAX_PLATFORMS=cpu python benchmarks/replan.py --depths 54 \
        --json benchmarks/results/replan.json

The two plans share an optimizer object, so the second reuses the first's compiles.
Its page is docs/benchmarks/largest-gpt.md (§13).
"""

import time

import _common
import equinox as eqx
import jax
import jax.numpy as jnp
import largest
import optax
from models import decoder
from models.decoder import chunked_loss

import eqx_offload as eo
import eqx_offload.internal as eoi


EXPERIMENTAL = ("prefetch", "next_forward", "host_update")


def rows(p: eo.Plan) -> list[dict]:
    return [
        {
            "label": r.label,
            "status": r.status,
            "fits": r.fits,
            "tied": r.tied,
            "device GiB": None if r.device_bytes is None else r.device_bytes / 2**30,
            "host GiB": None if r.host_bytes is None else r.host_bytes / 2**30,
            "step s": r.seconds,
            "error": r.error,
            "kind": r.kind,
            "rates": r.rates_text,
        }
        for r in p.table.rows
        if r.status in ("chosen", "compiled")
    ]


def replan(depth: int) -> list[dict]:
    abstract = eqx.filter_eval_shape(
        decoder.Decoder, largest.shape(2048, depth), key=jax.random.key(0)
    )
    tokens = jax.ShapeDtypeStruct((largest.BATCH, largest.SEQ), jnp.int32)
    optimizer = optax.adamw(1e-4)
    out = []
    for experimental in ((), EXPERIMENTAL):
        start = time.perf_counter()
        p = eoi.search_plan(
            chunked_loss,
            optimizer,
            abstract,
            (tokens, tokens),
            target=largest.TARGET,
            host_budget=largest.HOST,
            experimental=experimental,
        ).found
        assert isinstance(p, eo.Plan), p
        print(f"\n=== depth {depth}, experimental={experimental}", flush=True)
        print(p, flush=True)
        t = p.report.time
        out.append(
            {
                "depth": depth,
                "experimental": list(experimental),
                "plan": next(r.label for r in p.table.rows if r.status == "chosen"),
                "step s": None if t is None else t.seconds,
                "error": None if t is None else t.error,
                "kind": None if t is None else t.kind,
                "device GiB": p.report.device_bytes / 2**30,
                "host GiB": p.report.host_bytes / 2**30,
                "decision": p.table.decision,
                "compiled": p.compiled,
                "reused": p.reused,
                "seconds": time.perf_counter() - start,
                "rows": rows(p),
            }
        )
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--depths", type=int, nargs="+", default=[54])
    args = p.parse_args()
    results = [r for depth in args.depths for r in replan(depth)]
    _common.write_json(args.json, "replan", {"plans": results})


if __name__ == "__main__":
    main()
