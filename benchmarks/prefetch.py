"""Reading layers ahead (`Policy(prefetch=1)`) on the Llama-3.2-1B-shaped model of
`llama.py` (fp32 master, AdamW, chunked loss): `offload_all` with `prefetch=0` and
`1`, at 8 and 16 sequences of 1024 tokens, on one H100 (at XLA:GPU's default async
copy limit and at 16) and one v5e chip, with `remat`'s step for scale. Per row:
the step, the exposed link time by part of the step
(`StepTime.exposed_seconds_by_phase`), the layers' exposed forward and backward
time as a share of their link time, and the device footprint.

    python benchmarks/prefetch.py [--targets gpu-h100 tpu-v5e] [--json FILE]

Only compiled (`memory_report`), never run: every time is an estimate from the
compiled program and `eo.Hardware.of(target)`.
"""

import time
from collections.abc import Callable

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
from _common import parser, table, write_json
from _compiles import compiles
from models import decoder
from models.decoder import chunked_loss
from models.shapes import LLAMA_3_2_1B, SEQ

import eqx_offload as eo


ASYNC_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"


def row(target: str, preset: str, prefetch: int, batch: int, options: dict) -> dict:
    head = {
        "target": target,
        "preset": preset,
        "prefetch": prefetch,
        "tokens": batch * SEQ,
        "options": ", ".join(f"{k.split('_')[-1]}={v}" for k, v in options.items()),
    }

    def more(r: eo.MemoryReport, t: eo.StepTime) -> dict:
        exposed, link = t.exposed_seconds_by_phase, t.transfer_seconds_by_phase
        layers_link = link["forward"] + link["backward"]
        layers_exposed = exposed["forward"] + exposed["backward"]
        return {
            "to device s": t.host_to_device_seconds,
            "to host s": t.device_to_host_seconds,
            "layers exposed / link": layers_exposed / layers_link
            if layers_link
            else 0.0,
            "device GiB": r.device_bytes / 2**30,
        }

    policy = getattr(eo.Policy, preset)(prefetch=prefetch)
    return compiled_row(head, policy, target, batch, options, more)


def compiled_row(
    head: dict,
    policy: eo.Policy,
    target: str,
    batch: int,
    options: dict,
    more: Callable[[eo.MemoryReport, eo.StepTime], dict],
) -> dict:
    """`head`, and the figures of the Llama-3.2-1B step under `policy` compiled
    for `target` with compiler `options`: the step, its exposed link time by
    part, and `more(report, step_time)`."""
    start = time.perf_counter()
    try:
        with compiles(options):
            r = decoder.step_report(
                LLAMA_3_2_1B, policy, chunked_loss, target=target, batch=batch, seq=SEQ
            )
    except eo.DoesNotFit:
        return head | {"step s": None, "fits": False}
    t = r.time
    assert t is not None
    exposed = t.exposed_seconds_by_phase
    return (
        head
        | {
            "step s": t.seconds,
            "fits": r.fits,
            "compute s": t.compute_seconds,
            "exposed s": t.exposed_transfer_seconds,
            "layers fwd exposed s": exposed["forward"],
            "layers bwd exposed s": exposed["backward"],
            "outside exposed s": exposed["outside"],
            "update exposed s": exposed["update"],
        }
        | more(r, t)
        | {"compile s": time.perf_counter() - start}
    )


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["gpu-h100", "tpu-v5e"])
    args = p.parse_args()
    rows = []
    for target in args.targets:
        settings = [{}]
        if target.startswith("gpu"):
            settings.append({ASYNC_LIMIT: 16})
        for batch in (8, 16):
            rows.append(row(target, "remat", 0, batch, {}))
            for options in settings:
                for prefetch in (0, 1):
                    rows.append(row(target, "offload_all", prefetch, batch, options))
                    print(rows[-1], flush=True)
    keys = list(max(rows, key=len))
    print(table(keys, [[r.get(k, "") for k in keys] for r in rows]))
    write_json(args.json, "prefetch", rows)


if __name__ == "__main__":
    main()
