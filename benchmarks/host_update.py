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

Two more models (`--model`):

- `mistral`: `gpu_models.py`'s Mistral-7B shape (batch 8 x 1024, plain loss) on
    one H100 and one H200, and `fewest.py`'s on a v5e slice (`tpu-v5e:2x2`, FSDP
    over its 4 chips, one sequence of 2048 tokens per chip): `offload_all`,
    streamed and on the host.
- `gpt`: `largest.py`'s GPT at 54 layers on one v5e chip with 48 GB of host
    (its step is 6.46 s planned before the host update, `offload_all`'s 7.03 s),
    planned again by `eo.plan`, which now also tries the update on the host.

    python benchmarks/host_update.py --model mistral [--targets gpu-h100 gpu-h200
        tpu-v5e:2x2] [--json FILE]
    python benchmarks/host_update.py --model gpt [--json FILE]
"""

import dataclasses
import time

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import fewest
import jax
import jax.numpy as jnp
import largest
import optax
from _common import parser, table, write_json
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
from models import decoder
from models.decoder import chunked_loss
from models.gpt_7b import SEQ as GPT_7B_SEQ
from models.shapes import GPU_MODELS, LLAMA_3_2_1B, SEQ

import eqx_offload as eo
import eqx_offload.internal as eoi


BATCH = 8
GB = 1e9
KEY = jax.random.key(0)


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
    return summary(r, target, update, bandwidth, start)


def summary(
    r: eo.MemoryReport, target: str, update: str, bandwidth: float, start: float
) -> dict:
    t = r.time
    assert t is not None
    return {
        "target": target,
        "update": update,
        "host bandwidth": f"x{bandwidth:g}",
        "fits": r.fits,
        "device GiB": r.device_bytes / 2**30,
        "host GiB": r.host_bytes / 2**30,
        "fits device": r.fits_device,
        "fits host": r.fits_host,
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


def mistral_row(target: str, update: str) -> dict:
    """`offload_all` of the Mistral-7B shape on `target`, the update `update`:
    one GPU as `gpu_models.py`, a v5e slice with FSDP as `fewest.py`."""
    start = time.perf_counter()
    optimizer = optax.adamw(1e-4)
    n = eoi.device_count(target)
    if n == 1:
        policy, mesh = eo.Policy.offload_all(update=update), None
        model = eqx.filter_eval_shape(
            decoder.Decoder, GPU_MODELS["Mistral-7B-shaped"], key=KEY
        )
        loss, tokens = decoder.plain_loss, jax.ShapeDtypeStruct((8, SEQ), jnp.int32)
    else:
        policy = eo.Policy.offload_all(shard="fsdp", batch=P("fsdp"), update=update)
        mesh = AbstractMesh((n,), ("fsdp",), axis_types=(AxisType.Auto,))
        make, loss = fewest.MODELS["Mistral-7B-shaped"]
        model = eqx.filter_eval_shape(make)
        tokens = jax.ShapeDtypeStruct((n, GPT_7B_SEQ), jnp.int32)
    model = eo.place(model, policy, mesh=mesh)
    state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss, optimizer, policy)
    r = eo.memory_report(step, model, state, tokens, tokens, target=target)
    return summary(r, target, update, 1.0, start)


def gpt_plan() -> list[dict]:
    """`eo.plan` of `largest.py`'s GPT at 54 layers on a v5e chip, with the host
    update's stage (experimental: `plan(experimental=("host_update",))`), and its
    table's rows that ran the update on the host."""
    start = time.perf_counter()
    p = largest.attempt(2048, 54, probe=False, experimental=("host_update",))
    assert isinstance(p, eo.Plan), p
    chosen = next(r for r in p.table.rows if r.status == "chosen")
    rows = [
        {
            "row": r.label,
            "status": r.status,
            "fits": r.fits,
            "step s": r.seconds,
        }
        for r in p.table.rows
        if r.status in ("chosen", "compiled") and r.fits
    ]
    print(p.table, flush=True)
    return [
        {
            "plan": chosen.label,
            "step s": p.report.time.seconds if p.report.time else None,
            "device GiB": p.report.device_bytes / 2**30,
            "host GiB": p.report.host_bytes / 2**30,
            "compiles": p.compiled,
            "seconds": time.perf_counter() - start,
        }
    ] + sorted(rows, key=lambda r: r["step s"] or 1e9)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", choices=("llama", "mistral", "gpt"), default="llama")
    p.add_argument("--targets", nargs="+")
    args = p.parse_args()
    rows = []
    if args.model == "gpt":
        rows = gpt_plan()
        for r in rows:
            print(r)
        write_json(args.json, "host_update_gpt", {"rows": rows})
        return
    if args.model == "mistral":
        for target in args.targets or ["gpu-h100", "gpu-h200", "tpu-v5e:2x2"]:
            for update in ("streamed", "host"):
                rows.append(mistral_row(target, update))
                print(rows[-1], flush=True)
    for target in (
        args.targets or ["tpu-v5e", "gpu-h100"] if args.model == "llama" else []
    ):
        rows.append(row(target, "streamed"))
        for bandwidth in (1.0, 0.5, 2.0):
            rows.append(row(target, "host", bandwidth))
        for r in rows[-4:]:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    headers = [k for k in rows[0] if k != "compile s"]
    print(table(headers, [[r[k] for k in headers] for r in rows]))
    write_json(args.json, f"host_update_{args.model}", {"rows": rows})


if __name__ == "__main__":
    main()
