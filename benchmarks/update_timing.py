"""When the stacked layers' update runs (`Policy(update_timing=...)`) on the
Llama-3.2-1B-shaped model of `llama.py` (fp32 master, AdamW, chunked loss, 8
sequences of 1024 tokens): `offload_all` updating at the end of the step
(`"now"`) and in the next step's forward scan (`"next_forward"`, experimental,
the same numbers), on one H100 (at XLA:GPU's default async copy limit and at 16)
and one v5e chip, with `remat`'s step for scale. (The rows of `"delayed"`,
removed, are gone from the results.) Per row: the step, the exposed link time by
part of the step (`StepTime.exposed_seconds_by_phase`), the bytes each way, host
compute (copies the compiler adds) and the device footprint.

    python benchmarks/update_timing.py [--targets gpu-h100 tpu-v5e] [--json FILE]

Only compiled (`memory_report`, which compiles the step with an update pending),
never run: every time is an estimate from the compiled program and
`eo.Hardware.of(target)`. `benchmarks/gpu_check.py` measures the step on a GPU.
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
from _common import parser, table, write_json
from prefetch import compiled_row

import eqx_offload as eo


ASYNC_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"
BATCH = 8
GB = 1e9


def row(target: str, preset: str, timing: str, options: dict) -> dict:
    policy = getattr(eo.Policy, preset)(
        **({} if preset == "remat" else {"update_timing": timing})
    )
    head = {
        "target": target,
        "preset": preset,
        "update_timing": timing,
        "options": ", ".join(f"{k.split('_')[-1]}={v}" for k, v in options.items()),
    }

    def more(r: eo.MemoryReport, t: eo.StepTime) -> dict:
        return {
            "host compute s": t.host_compute_seconds,
            "to device GB": r.transfer_bytes("host_to_device", compiled=True) / GB,
            "to host GB": r.transfer_bytes("device_to_host", compiled=True) / GB,
            "device GiB": r.device_bytes / 2**30,
            "host GiB": r.host_bytes / 2**30,
        }

    return compiled_row(head, policy, target, BATCH, options, more)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["gpu-h100", "tpu-v5e"])
    args = p.parse_args()
    rows = []
    for target in args.targets:
        rows.append(row(target, "remat", "now", {}))
        settings = [{}]
        if target.startswith("gpu"):
            settings.append({ASYNC_LIMIT: 16})
        for options in settings:
            for timing in ("now", "next_forward"):
                rows.append(row(target, "offload_all", timing, options))
                print(rows[-1], flush=True)
    keys = list(max(rows, key=len))
    print(table(keys, [[r.get(k, "") for k in keys] for r in rows]))
    write_json(args.json, "update_timing", rows)


if __name__ == "__main__":
    main()
