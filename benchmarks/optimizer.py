"""Optimizer-state offload: the device footprint of a whole train step, compiled
for one TPU v5e chip (or `--target gpu-h100`), with the optimizer state on the
device, on pinned host memory updated all at once (`Policy(update="whole")`, the
tutorial's recipe), and on pinned host memory with the streamed update (the
default).

    python benchmarks/optimizer.py [--depths 4 32] [--target tpu-v5e] [--json FILE]

Three models, all with `optax.chain(optax.clip_by_global_norm(1.0), adam)`:

- the tutorial's dict of four 7168x7168 weights (Python loop, no `Stacked`), with
  its L2 penalty;
- the same four layers stacked and scanned (`Stacked`); under `offload_all` its
  L2 penalty is summed layer by layer inside the scan (`stacked_loss_in_scan`),
  since host-resident layers are on the device only there;
- the GPT-style stack of `depth.py` (dim 1024, seq 1024, batch 8, vocab 32768).
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
from _common import MIB, parser, table, write_json
from models.gpt import GPT, loss_fn as gpt_loss
from models.layers import GeluLayer
from tutorial import compute_loss, DIM, optimizer

import eqx_offload as eo


PRESETS = ("none", "remat", "offload_residuals", "offload_all")


def stacked_loss(model: eo.Stacked[GeluLayer], inputs):
    outputs = model(inputs)
    l2_reg = 0.001 * sum(jnp.sum(w**2) for w in jax.tree.leaves(model))
    return jnp.mean((outputs - inputs) ** 2) + l2_reg


def stacked_loss_in_scan(model: eo.Stacked[GeluLayer], inputs):
    """`stacked_loss` with the penalty summed layer by layer inside the scan, as
    host-resident layers (`offload_all`) require: each is on the device only there."""

    def body(layer: GeluLayer, carry, _):
        x, l2 = carry
        return (layer(x), l2 + 0.001 * jnp.sum(layer.w**2)), None

    (outputs, l2_reg), _ = model.scan(body, (inputs, jnp.zeros((), inputs.dtype)))
    return jnp.mean((outputs - inputs) ** 2) + l2_reg


def dict_case():
    params = {
        f"w{i}": jax.ShapeDtypeStruct((DIM, DIM), jnp.float32) for i in range(1, 5)
    }
    inputs = jax.ShapeDtypeStruct((DIM, DIM), jnp.float32)
    return params, compute_loss, (inputs,)


def stacked_case():
    model = jax.eval_shape(lambda: eo.Stacked(GeluLayer(jnp.zeros((4, DIM, DIM)))))
    inputs = jax.ShapeDtypeStruct((DIM, DIM), jnp.float32)
    return model, stacked_loss, (inputs,)


def gpt_case(depth: int):
    model = eqx.filter_eval_shape(GPT, 32768, 1024, depth, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, 1024), jnp.int32)
    return model, gpt_loss, (tokens, tokens)


def report(case, policy: eo.Policy, target: str) -> eo.MemoryReport:
    model, loss, batch = case
    if loss is stacked_loss and policy.params == "pinned_host":
        loss = stacked_loss_in_scan
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss, optimizer, policy)
    return eo.memory_report(step, model, opt_state, *batch, target=target)


def main():
    p = parser(__doc__)
    p.add_argument("--depths", type=int, nargs="+", default=[4, 32])
    p.add_argument("--target", default="tpu-v5e")
    args = p.parse_args()
    cases = {"dict of 4 weights": dict_case(), "4 stacked layers": stacked_case()}
    cases.update({f"GPT, {d} layers": gpt_case(d) for d in args.depths})
    results = []
    for name, case in cases.items():
        for preset in PRESETS:
            # Without a `Stacked` there is no checkpoint name to offload.
            extra = {"offload": ()} if name.startswith("dict") else {}
            row: dict[str, object] = {"model": name, "preset": preset, "note": ""}
            for label, overrides in (
                ("device, state on device", {"opt_state": "device"}),
                (
                    "device, state on host, whole",
                    {"opt_state": "pinned_host", "update": "whole"},
                ),
                (
                    "device, state on host, streamed",
                    {"opt_state": "pinned_host", "update": "streamed"},
                ),
            ):
                policy = getattr(eo.Policy, preset)(**{**extra, **overrides})
                try:
                    r = report(case, policy, args.target)
                except eo.DoesNotFit:
                    row[f"{label} GiB"], row["note"] = None, "does not fit in HBM"
                    continue
                row[f"{label} GiB"] = r.device_bytes / MIB / 1024
                if label == "device, state on host, streamed":
                    host_state = (r.opt_state or {}).get("pinned_host", 0)
                    host_params = (r.params or {}).get("pinned_host", 0)
                    row["host alias GiB"] = r.host["alias"] / MIB / 1024
                    row["host state GiB"] = host_state / MIB / 1024
                    row["host params GiB"] = host_params / MIB / 1024
                    row["host temporaries GiB"] = r.host["temp"] / MIB / 1024
            results.append(row)
            print(f"  {name}, {preset} done", flush=True)
    headers = list(results[0])
    print(f"\nTrain step device footprint, compiled for {args.target} (GiB):")
    print(table(headers, [[r.get(h) for h in headers] for r in results]))
    write_json(args.json, "optimizer", results)


if __name__ == "__main__":
    main()
