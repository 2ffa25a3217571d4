"""Where the optimizer update runs, and what it costs: the Llama-3.2-1B-shaped model
of `llama.py` (fp32 master, AdamW, batch 8 x 1024 tokens) with `offload_all`, its
update streamed through the device (`Policy(update="streamed")`, what `"auto"` does
on a TPU or GPU) and on the host's CPU (`update="host"`), on one tpu-v5e chip and
one H100: the bytes over the host link, the estimated step time and its host
share, and the host update again at half and twice the host's memory bandwidth.

    python benchmarks/host_update.py [--targets tpu-v5e gpu-h100] [--json FILE]

Only compiled (`memory_report`), never run: every time is an estimate from the
compiled program and `eo.Hardware.of(target)`, whose host figures are themselves
estimates until measured (docs/step-time.md).
"""

import dataclasses
import time

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import decoder
from _common import parser, table, write_json
from decoder import chunked_loss
from llama import LLAMA_3_2_1B, SEQ

import eqx_offload as eo


BATCH = 8
GB = 1e9


def row(target: str, update: str, bandwidth: float = 1.0) -> dict:
    """One compile of `offload_all` with the update `update`, priced with the
    host's memory bandwidth scaled by `bandwidth`."""
    start = time.perf_counter()
    hardware = eo.Hardware.of(target)
    hardware = dataclasses.replace(
        hardware,
        host_memory_bytes_per_second=hardware.host_memory_bytes_per_second * bandwidth,
    )
    policy = eo.Policy.offload_all(update=update)
    r = decoder.step_report(
        LLAMA_3_2_1B,
        policy,
        chunked_loss,
        target=target,
        batch=BATCH,
        seq=SEQ,
        hardware=hardware,
    )
    t = r.time
    assert t is not None
    return {
        "target": target,
        "update": update,
        "host bandwidth": f"x{bandwidth:g}",
        "fits": r.fits,
        "to device GB": r.transfer_bytes("host_to_device", compiled=True) / GB,
        "to host GB": r.transfer_bytes("device_to_host", compiled=True) / GB,
        "step s": t.seconds,
        "bound": t.bound,
        "compute s": t.compute_seconds,
        "link exposed s": t.exposed_transfer_seconds,
        "host compute s": t.host_compute_seconds,
        "host exposed s": t.exposed_host_compute_seconds,
        "host GB": t.host_compute_bytes / GB,
        "compile s": time.perf_counter() - start,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["tpu-v5e", "gpu-h100"])
    args = p.parse_args()
    rows = []
    for target in args.targets:
        rows.append(row(target, "streamed"))
        for bandwidth in (1.0, 0.5, 2.0):
            rows.append(row(target, "host", bandwidth))
        for r in rows[-4:]:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    headers = [k for k in rows[0] if k != "compile s"]
    print(table(headers, [[r[k] for k in headers] for r in rows]))
    write_json(args.json, "host_update", {"rows": rows})


if __name__ == "__main__":
    main()
