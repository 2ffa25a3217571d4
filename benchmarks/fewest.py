"""The fewest chips for a 7.8B-parameter GPT and a Mistral-7B-shaped model: FSDP
alone (`Policy.remat()` laid out over every chip) against `eo.fewest_chips` (FSDP
and the best plan on each slice), one sequence of 2048 tokens per chip, AdamW,
float32; and what planning costs.

    python benchmarks/fewest.py [--chips tpu-v5e gpu-h100] [--models ...] [--json F]

The models: `slices.py`'s GPT (token embedding, 32 blocks of LayerNorm + causal
attention + MLP 4096 -> 20480, a head: 7.79e9 parameters) and `gpu_models.py`'s
Mistral-7B shape (32 blocks of RMSNorm, grouped-query attention, SwiGLU 14336, an
untied head: 7.24e9), with the plain loss (the full logits). Their activations are
pinned to the batch layout on a slice (on one chip there is nothing to pin). FSDP
alone:
the targets from one chip up, in order, until `Policy.remat(shard="fsdp",
batch="fsdp")` fits (without remat the activations never fit); its host memory is
none. `fewest_chips`: the default budgets (the chip's capacity; its host's RAM per
chip: 48 GB a v5e chip, 250 GB an H100 of an eight-GPU host), bisecting the
targets, each planned in full. Only compiled (libtpu, JAX's CUDA plugin), never
run.
"""

import time
from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import GIB, parser, table, write_json
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
from jaxtyping import Array
from models import decoder
from models.gpt_7b import loss_fn, PinnedGPT, SEQ
from models.shapes import GPU_MODELS as SHAPES

import eqx_offload as eo
import eqx_offload.internal as eoi


def _pinned(x: Array) -> Array:
    if "fsdp" not in jax.sharding.get_abstract_mesh().axis_names:
        return x
    return jax.lax.with_sharding_constraint(x, P("fsdp"))


def mistral_loss(model: decoder.Decoder, tokens, targets):
    """`decoder.plain_loss`, the activations pinned to the batch layout."""
    x = _pinned(model.embed[tokens])
    x = _pinned(jax.vmap(model.trunk)(x))
    logits = _pinned(x @ model.table.T)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


MODELS = {
    # (`GPT.__init__`, inherited: Equinox makes no dataclass `__init__`)
    "GPT 7.8B": (
        lambda: PinnedGPT(key=jax.random.key(0)),  # pyright: ignore[reportCallIssue]
        loss_fn,
    ),
    "Mistral-7B-shaped": (
        lambda: decoder.Decoder(SHAPES["Mistral-7B-shaped"], key=jax.random.key(0)),
        mistral_loss,
    ),
}


def fsdp_alone(chip: str, name: str) -> dict[str, Any]:
    """The fewest devices on which `Policy.remat()` with FSDP fits."""
    start = time.perf_counter()
    optimizer = optax.adamw(1e-4)
    make, loss_fn = MODELS[name]
    abstract = eqx.filter_eval_shape(make)
    compiles = 0
    for target in eoi.target_sizes(chip):
        n = eoi.device_count(target)
        if n == 1:
            policy, mesh = eo.Policy.remat(), None
        else:
            policy = eo.Policy.remat(shard="fsdp", batch=P("fsdp"))
            mesh = AbstractMesh((n,), ("fsdp",), axis_types=(AxisType.Auto,))
        model = eo.place(abstract, policy, mesh=mesh)
        state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(loss_fn, optimizer, policy)
        tokens = jax.ShapeDtypeStruct((n, SEQ), jnp.int32)
        compiles += 1
        try:
            r = eo.memory_report(step, model, state, tokens, tokens, target=target)
        except eo.DoesNotFit:
            continue
        if r.fits:
            return {
                "target": target,
                "devices": n,
                "device GiB": r.device_bytes / GIB,
                "host GiB": r.host_bytes / GIB,
                "step s": None if r.time is None else r.time.seconds,
                "compiles": compiles,
                "seconds": time.perf_counter() - start,
            }
    return {"target": None, "compiles": compiles}


def planned(chip: str, name: str) -> dict[str, Any]:
    start = time.perf_counter()
    make, loss_fn = MODELS[name]
    abstract = eqx.filter_eval_shape(make)
    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    p = eo.fewest_chips(
        loss_fn,
        optax.adamw(1e-4),
        abstract,
        tokens,
        tokens,
        chip=chip,
        batch_per_device=True,
        progress=True,
    )
    print(p, flush=True)
    assert p.target is not None
    return {
        "target": p.target,
        "devices": eoi.device_count(p.target),
        "device GiB": p.report.device_bytes / GIB,
        "host GiB": p.report.host_bytes / GIB,
        "step s": None if p.report.time is None else p.report.time.seconds,
        "plan": next(r.label for r in p.table.rows if r.status == "chosen"),
        "tried": [list(t) for t in p.tried],
        "compiles": p.compiled,
        "seconds": time.perf_counter() - start,
    }


def main():
    p = parser(__doc__)
    p.add_argument("--chips", nargs="+", default=["tpu-v5e", "gpu-h100"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    rows = []
    for name in args.models:
        for chip in args.chips:
            for how, run in (("FSDP alone", fsdp_alone), ("fewest_chips", planned)):
                row = {"model": name, "chip": chip, "how": how, **run(chip, name)}
                print(row, flush=True)
                rows.append(row)
    headers = ["model", "chip", "how", "target", "device GiB", "host GiB", "step s"]
    headers += ["compiles", "seconds"]
    print(table(headers, [[r.get(h) for h in headers] for r in rows]))
    write_json(args.json, "fewest", {"rows": rows})


if __name__ == "__main__":
    main()
