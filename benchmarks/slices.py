"""How many TPU v5e chips (or H100 GPUs) a GPT-style model of 7.8B parameters needs to
train, with and without offloading: its train step (AdamW, float32) compiled for v5e
slices of 4 to 256 chips, FSDP over every chip, one sequence of 2048 tokens per chip.

    python benchmarks/slices.py [--topologies 2x2 2x4 ...] [--json FILE]
    python benchmarks/slices.py --target gpu-h100 [--topologies 1 2 4 8 2x8] [--json F]

The model: token embedding (vocab 32768, dim 4096), 32 blocks of LayerNorm + causal
multi-head attention (32 heads) + LayerNorm + MLP (4096 -> 20480 -> 4096), a final
LayerNorm and a linear head: 7.79e9 parameters, 29 GiB in float32, 116 GiB with
AdamW's two moments and the gradient. Policies, each with `shard="fsdp"` (every
leaf split along the one mesh axis) and the batch split the same way:

- FSDP alone: `Policy.remat()`, the layers' activations recomputed (without remat
  they never fit, whatever the chip count);
- FSDP + `Policy.offload_residuals()`: the carry entering each layer on the host;
- FSDP + `Policy.offload_all()`: parameters and optimizer state on the host too.

The model pins its activations to the batch layout (`with_sharding_constraint`
after the embedding, the blocks and the head): left to itself, sharding
propagation replicated the batch's activations on every chip, and the device
bytes per chip grew with the chip count. `Auto` mesh axes (`--axis-type explicit`
needs the model's embedding lookup written for explicit sharding).

Host memory per host: a 2x2 slice runs on one 4-chip VM with 192 GB of RAM, larger
slices on 8-chip VMs with 384 GB (Cloud TPU's v5e VM types), so "host GiB/host" is
the per-chip host bytes times 4 or 8, and "fits" needs both the HBM and that RAM.

With `--target gpu-h100` the devices are H100 SXM GPUs: "8" is one host of eight,
"2x8" two such hosts, "1", "2", "4" part of one host; "fits" needs the device bytes
within the 75% of the GPU's memory JAX's allocator takes, and the host bytes of a
host's GPUs within its RAM: 2 TB for eight H100s (NVIDIA DGX H100 datasheet, "System
Memory 2TB"; AWS's p5.48xlarge has 2,048 GiB), whatever share of the host is used.

Nothing is allocated: the model is abstract (`eqx.filter_eval_shape`), laid out on
an `AbstractMesh` of the slice's shape, and only compiled with libtpu (the CUDA
plugin for GPUs).
"""

import time
from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import parser, table, write_json
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
from models.gpt_7b import GPT, loss_fn, SEQ

import eqx_offload as eo


TOPOLOGIES = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
POLICIES = ("remat", "offload_residuals", "offload_all")
GIB = 2**30
GB = 10**9
# Cloud TPU v5e VMs (Google's v5e page, "VM types"): a 2x2 slice runs on a 4-chip VM
# with 192 GB of RAM (ct5lp-hightpu-4t); larger training slices on 8-chip VMs with
# 384 GB (ct5lp-hightpu-8t), one per 8 chips. libtpu's compile models 4 chips per
# process either way; the host bytes of one chip are the same.
VM_CHIPS = {"2x2": 4}
VM_RAM = {4: 192 * GB, 8: 384 * GB}
GPU_TOPOLOGIES = ("1", "2", "4", "8", "2x8")
GPUS_PER_HOST = 8
GPU_HOST_RAM = 2 * 10**12  # DGX H100: 2 TB for its eight GPUs


def chips(topology: str) -> int:
    out = 1
    for n in topology.split("x"):
        out *= int(n)
    return out


def report(
    topology: str, preset: str, axis_type: AxisType, chip: str = "tpu-v5e"
) -> eo.MemoryReport:
    n = chips(topology)
    mesh = AbstractMesh((n,), ("fsdp",), axis_types=(axis_type,))
    if n == 1:  # one device: nothing to split
        policy = getattr(eo.Policy, preset)()
        return _report(policy, None, n, f"{chip}:{topology}")
    policy = getattr(eo.Policy, preset)(shard="fsdp", batch=P("fsdp"))
    return _report(policy, mesh, n, f"{chip}:{topology}")


def _report(policy: eo.Policy, mesh: Any, n: int, target: str) -> eo.MemoryReport:
    optimizer = optax.adamw(1e-4)
    abstract = eqx.filter_eval_shape(GPT, key=jax.random.key(0), split=n > 1)
    model = eo.place(abstract, policy, mesh=mesh)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy)
    tokens = jax.ShapeDtypeStruct((n, SEQ), jnp.int32)
    return eo.memory_report(step, model, opt_state, tokens, tokens, target=target)


def host(chip: str, topology: str) -> tuple[int, int]:
    """The devices one host serves, and its RAM in bytes."""
    if chip.startswith("gpu-"):
        return min(chips(topology), GPUS_PER_HOST), GPU_HOST_RAM
    vm = VM_CHIPS.get(topology, 8)
    return vm, VM_RAM[vm]


def main():
    p = parser(__doc__)
    p.add_argument("--target", choices=["tpu-v5e", "gpu-h100"], default="tpu-v5e")
    p.add_argument("--topologies", nargs="+")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--axis-type", choices=["explicit", "auto"], default="auto")
    args = p.parse_args()
    gpu = args.target.startswith("gpu-")
    topologies = args.topologies or list(GPU_TOPOLOGIES if gpu else TOPOLOGIES)
    axis_type = AxisType.Explicit if args.axis_type == "explicit" else AxisType.Auto
    params = sum(
        x.size
        for x in jax.tree.leaves(eqx.filter_eval_shape(GPT, key=jax.random.key(0)))
        if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    )
    print(f"{params / 1e9:.2f}e9 parameters")
    results: list[dict[str, Any]] = []
    for preset in args.policies:
        for topology in topologies:
            start = time.perf_counter()
            row: dict[str, Any] = {"policy": preset, "topology": topology}
            row["chips"] = chips(topology)
            try:
                r = report(topology, preset, axis_type, args.target)
            except eo.DoesNotFit as e:
                need = e.required_bytes
                row.update(
                    {
                        "device GiB/chip": None,
                        "host GiB/chip": None,
                        "host GiB/host": None,
                        "host RAM GiB": None,
                        "fits": False,
                        "note": f"needs {'?' if need is None else f'{need / GIB:.2f}G'}"
                        " of HBM",
                    }
                )
            else:
                per_host, ram = host(args.target, topology)
                on_host = r.host_bytes * per_host
                row.update(
                    {
                        "device GiB/chip": r.device_bytes / GIB,
                        "host GiB/chip": r.host_bytes / GIB,
                        "host GiB/host": on_host / GIB,
                        "host RAM GiB": ram / GIB,
                        "fits": bool(r.fits_device) and on_host <= ram,
                        "note": "",
                    }
                )
            row["compile s"] = round(time.perf_counter() - start, 1)
            results.append(row)
            print(row, flush=True)
    headers = list(results[0])
    print(f"\nTrain step compiled for {args.target} (FSDP over every device):")
    print(table(headers, [[r[h] for h in headers] for r in results]))
    data = {"target": args.target, "parameters": params, "rows": results}
    write_json(args.json, "slices", data)


if __name__ == "__main__":
    main()
