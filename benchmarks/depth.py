"""Depth scaling of the gradient computation (`filter_offload` + value_and_grad, no
optimizer) of a GPT-style stack under each preset, compiled for one TPU v5e chip
(or another target: `--target gpu-h100`).

    python benchmarks/depth.py [--depths 4 8 16 32] [--target tpu-v5e] [--json FILE]

The stack: token embedding (vocab 32768, dim 1024), N blocks of LayerNorm + MLP
(1024 -> 4096 -> 1024, residual), a final LayerNorm and a linear head; sequence 1024,
batch 8, float32. Nothing is allocated: the model is abstract
(`eqx.filter_eval_shape`) and only compiled.
"""

from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
from _common import GIB, MIB, parser, table, write_json
from models.gpt import GPT, loss_fn

import eqx_offload as eo


VOCAB, DIM, SEQ, BATCH = 32768, 1024, 1024, 8
PRESETS = ("none", "remat", "offload_residuals", "offload_all")


def gradient_report(depth: int, preset: str, target: Any) -> eo.MemoryReport:
    policy = getattr(eo.Policy, preset)()
    abstract = eqx.filter_eval_shape(GPT, VOCAB, DIM, depth, key=jax.random.key(0))
    model = eo.place(abstract, policy)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    # A `filter_offload` function is reported as its gradient (value_and_grad).
    loss = eo.filter_offload(loss_fn, policy)
    return eo.memory_report(loss, model, tokens, tokens, target=target)


def _does_not_fit(e: eo.DoesNotFit) -> str:
    need, have = e.required_bytes, e.available_bytes
    if need is None or have is None:
        return "does not fit"
    if e.target.startswith("gpu-"):  # the compiled footprint against the allocator's
        return f"does not fit: needs {need / GIB:.2f}G of {have / GIB:.2f}G"
    return f"does not compile: {need / GIB:.2f}G of temporaries > {have / GIB:.2f}G HBM"


def main():
    p = parser(__doc__)
    p.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--target", default="tpu-v5e")
    args = p.parse_args()
    target = None if args.target == "cpu" else args.target
    results = []
    for preset in args.presets:
        for depth in args.depths:
            row = {"preset": preset, "layers": depth}
            try:
                report = gradient_report(depth, preset, target)
            except eo.DoesNotFit as e:
                row["device MiB"] = row["host MiB"] = None
                row["note"] = _does_not_fit(e)
            else:
                row["device MiB"] = report.device_bytes / MIB
                row["host MiB"] = report.host_bytes / MIB
                row["note"] = (
                    f"exceeds the {report.capacity / GIB:.2f} GiB of HBM"
                    if report.fits_device is False and report.capacity is not None
                    else ""
                )
                row["report"] = report.to_dict()  # for `benchmarks/plot.py`
            results.append(row)
            print(f"  {preset}, {depth} layers done", flush=True)
    headers = ["preset", "layers", "device MiB", "host MiB", "note"]
    print(f"\nGradient computation compiled for {args.target}:")
    print(table(headers, [[r[h] for h in headers] for r in results]))
    growth = []
    for preset in args.presets:
        rows = [r for r in results if r["preset"] == preset]
        first, last = rows[0], rows[-1]
        change = "n/a (does not fit)"
        if first["device MiB"] and last["device MiB"]:
            change = f"{100 * (last['device MiB'] / first['device MiB'] - 1):+.1f}%"
        growth.append([preset, f"{first['layers']} -> {last['layers']}", change])
    print("\nDevice footprint growth:")
    print(table(["preset", "layers", "device growth"], growth))
    write_json(args.json, "depth", results)


if __name__ == "__main__":
    main()
