"""Offloading at the batch people train: the step of a model whose masters and Adam
moments live on the host and whose bf16 compute copies and gradient accumulators
live on the device, at 8K to 512K tokens per update (micro-batches), by the
calibrated estimate, against the same step with the host priced at zero.

    python benchmarks/at_scale.py [--cases 8b-h100 ...] [--quick] [--json FILE]

The placement (`PLACEMENT`): `Policy.remat(params="pinned_host", opt_state={"**":
"pinned_host", "copies:**": "device"}, compute_dtype=jnp.bfloat16)`, AdamW with
fp32 state, `train_step(..., microbatches=k)`: the gradients add up on the device
(fp32 accumulators) and only the update crosses the link, once per step. Cases:

- `8b-h100`, `8b-h200`: a Llama-3-8B-shaped decoder (`models/shapes.py`), 4096-token
  sequences, 64K, 256K and 512K tokens per update, on one H100 or H200;
- `1b-v5e`: Llama-3.2-1B-shaped on one TPU v5e chip, 64K and 256K tokens, 4096-token
  sequences, else 2048 where those do not fit;
- `1b-v5e-2x2`: the same on a `tpu-v5e:2x2` slice, FSDP over its four chips
  (`shard=eo.FSDP("fsdp"), batch="fsdp"`, an abstract mesh);
- `gpt-12gib`, `gpt-remat`, `gpt-12gib-mlp`: the 0.9B GPT of `gpu_check.py` (vocab
  32768, dim 2048, 24 blocks, 1024-token sequences, bf16 compute) on one H100 within
  12 GiB of device memory at 8K, 64K and 256K tokens, and
  `Policy.remat(compute_dtype=bf16)` (all on the device) at the same tokens, within
  the whole H100, and the 12 GiB step with the second MLP matrix's master and
  moments on the device.

Each row is the largest micro-batch (in sequences, of the case's candidates) whose
step fits, found by compiling: a micro-batch too large at some k >= 2 is too large
at every k >= 2 (the step's memory does not grow with k), so each is tried once.
Nothing runs: `memory_report(..., target=...)` on abstract models. A row gives the
device and host bytes, the host-link bytes of the step each way, the estimated step
(`StepTime.seconds`), its compute-bound step (`compute_bound_seconds`: host link
and host compute free), their ratio and the MFU. The bytes per micro-batch and per
update come from two compiles of the same micro-batch at different k: what grows
with k, per micro-batch, and the rest. A case none of whose micro-batches fit
records the bytes it needs; `8b-h100` then also prices gpu-h200's compile (the same
program, with room) at the H100's rates: the step it would take if it fit.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import GIB, parser, table, write_json
from jax.sharding import AbstractMesh, AxisType
from models import decoder
from models.gpt import GPT, loss_fn as gpt_loss
from models.shapes import LLAMA_3_2_1B, LLAMA_3_8B

import eqx_offload as eo


GB = 10**9
K = 1024
PLACEMENT = {
    "params": "pinned_host",
    "opt_state": {"**": "pinned_host", "copies:**": "device"},
    "compute_dtype": jnp.bfloat16,
}
GPT_0_9B = (32768, 2048, 24)  # `gpu_check.py`'s SIZES["GPT 0.9B"]: vocab, dim, layers


# What an attempt that did not fit keeps for another k (the rest depends on k).
MEMORY = ("sequence", "micro-batch", "fits", "device GiB", "budget GiB", "host GiB")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    make: Callable[[], Any]
    loss: Callable[..., Any]
    target: str
    tokens: tuple[int, ...]  # per update
    seqs: tuple[int, ...]  # sequence lengths to try, longest first
    micro: tuple[int, ...]  # sequences per micro-batch to try, largest first
    policy: str = "offload"  # or "remat"
    chips: int = 1  # FSDP over this many chips
    budget: float | None = None  # device bytes, where smaller than the target's
    on_device: tuple[str, ...] = ()  # fields kept on the device, state and all
    priced_as: str | None = None  # compile for this target if nothing fits


def _llama(shape: decoder.Shape) -> Callable[[], Any]:
    return lambda: decoder.Decoder(shape, key=jax.random.key(0))


def _gpt() -> Any:
    return GPT(*GPT_0_9B, key=jax.random.key(0))


LLAMA_8B_TOKENS = (64 * K, 256 * K, 512 * K)
GPT_TOKENS = (8 * K, 64 * K, 256 * K)
CASES = {
    "8b-h100": Case(
        "Llama-3-8B",
        _llama(LLAMA_3_8B),
        decoder.chunked_loss,
        "gpu-h100",
        LLAMA_8B_TOKENS,
        (4096,),
        (4, 2, 1),
        priced_as="gpu-h200",
    ),
    "8b-h200": Case(
        "Llama-3-8B",
        _llama(LLAMA_3_8B),
        decoder.chunked_loss,
        "gpu-h200",
        LLAMA_8B_TOKENS,
        (4096,),
        (4, 2, 1),
    ),
    "1b-v5e": Case(
        "Llama-3.2-1B",
        _llama(LLAMA_3_2_1B),
        decoder.chunked_loss,
        "tpu-v5e",
        (64 * K, 256 * K),
        (4096, 2048),
        (4, 2, 1),
    ),
    "1b-v5e-2x2": Case(
        "Llama-3.2-1B",
        _llama(LLAMA_3_2_1B),
        decoder.chunked_loss,
        "tpu-v5e:2x2",
        (64 * K, 256 * K),
        (4096,),
        (8, 4),
        chips=4,
    ),
    "gpt-12gib": Case(
        "GPT 0.9B",
        _gpt,
        gpt_loss,
        "gpu-h100",
        GPT_TOKENS,
        (1024,),
        (16, 8, 4, 2, 1),
        budget=12 * GIB,
    ),
}
# `remat` on the whole H100, beside the 12 GiB step.
_GPT = CASES["gpt-12gib"]
CASES["gpt-remat"] = dataclasses.replace(_GPT, policy="remat", budget=None)
# The GPT's second MLP matrix with its master and moments on the device: of the
# fields and matrices tried, what keeps the most update bytes off the link in 12 GiB.
CASES["gpt-12gib-mlp"] = dataclasses.replace(_GPT, on_device=("blocks.mlp.layers[1]",))
# Published figures of the nearest settings (../shared/research/host_update_anchors.md,
# which cites each): what other systems' host-resident optimizers cost.
PUBLISHED = [
    {
        "system": "DeepSpeed ZeRO-Offload (synchronous CPU-Adam)",
        "setting": "Llama-2-7B, 4x A100",
        "tokens per step": None,
        "step s, no offload": 0.5,
        "step s, offloaded": 7.0,
        "overhead x": 14.0,
        "source": "deepspeedai/DeepSpeed blogs/deepspeed-zenflow/README.md "
        "(0.5 -> >7 s)",
    },
    {
        "system": "DeepSpeed ZeRO-Offload (synchronous CPU-Adam)",
        "setting": "Qwen2.5-1.5B, 2x A100-40GB, bf16, ZeRO-2",
        "tokens per step": None,
        "step s, no offload": 0.240,
        "step s, offloaded": 1.365,
        "overhead x": 5.7,
        "source": "deepspeedai/DeepSpeed blogs/zenflow-corebinding/README.md",
    },
    {
        "system": "DeepSpeed ZeRO-Offload CPU-Adam alone (paper)",
        "setting": "10B parameters, DGX-2 host CPUs",
        "tokens per step": None,
        "step s, no offload": None,
        "step s, offloaded": 2.57,
        "overhead x": None,
        "source": "arXiv 2101.06840, CPU-Adam latency table (via the research "
        "file's secondary transcription)",
    },
    {
        "system": "torchao CPUOffloadOptimizer (full bf16)",
        "setting": "ViT-g/14 1.1B, 4070 Ti SUPER, PCIe 4, batch 32",
        "tokens per step": 8200,
        "step s, no offload": 1.27,
        "step s, offloaded": 1.52,
        "overhead x": 1.2,
        "source": "pytorch/ao torchao/optim/README.md",
    },
]


def _policy(case: Case) -> eo.Policy:
    fsdp = {"shard": eo.FSDP("fsdp"), "batch": "fsdp"} if case.chips > 1 else {}
    if case.policy == "remat":
        return eo.Policy.remat(compute_dtype=jnp.bfloat16, **fsdp)
    if not case.on_device:
        return eo.Policy.remat(**PLACEMENT, **fsdp)
    device = dict.fromkeys(case.on_device, "device")
    params = {"**": "pinned_host", **device}
    opt_state = {**PLACEMENT["opt_state"], **device}
    dtype = PLACEMENT["compute_dtype"]
    return eo.Policy.remat(params=params, opt_state=opt_state, compute_dtype=dtype)


def compile_step(
    case: Case,
    seq: int,
    micro: int,
    k: int,
    target: str | None = None,
    hardware: eo.Hardware | None = None,
) -> eo.MemoryReport:
    """The report of `case`'s step on `micro * k` sequences of `seq` tokens, `k`
    micro-batches, compiled for `target` (the case's by default)."""
    policy = _policy(case)
    optimizer = optax.adamw(1e-4)
    mesh = None
    if case.chips > 1:
        mesh = AbstractMesh((case.chips,), ("fsdp",), axis_types=(AxisType.Auto,))
    model = eo.place(eqx.filter_eval_shape(case.make), policy, mesh=mesh)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((micro * k, seq), jnp.int32)
    step = eo.train_step(case.loss, optimizer, policy, microbatches=k)
    return eo.memory_report(
        step,
        model,
        opt_state,
        tokens,
        tokens,
        target=target or case.target,
        hardware=hardware,
    )


def _times(r: eo.MemoryReport) -> dict[str, Any]:
    """The report's step-time figures (`None` where it has none)."""
    t = r.time
    if t is None:
        return {}
    bound = getattr(t, "compute_bound_seconds", None) or None  # (0: not known)
    return {
        "step s": t.seconds,
        "compute-bound s": bound,
        "step / compute-bound": bound and t.seconds / bound,
        "MFU": getattr(t, "mfu", None),
        "bound": t.bound,
        "compute s": t.compute_seconds,
        "HBM s": t.hbm_seconds,
        "transfers not hidden s": t.exposed_transfer_seconds,
        "host compute s": t.host_compute_seconds,
        "error": t.error,
    }


def _figures(r: eo.MemoryReport, case: Case) -> dict[str, Any]:
    capacity = r.capacity or 0
    budget = min(capacity, case.budget) if case.budget else capacity
    return {
        "device GiB": r.device_bytes / GIB,
        "host GiB": r.host_bytes / GIB,
        "budget GiB": budget / GIB,
        "fits": r.device_bytes <= budget,
        "fits host": r.fits_host,
        "within 12 GiB": r.device_bytes <= 12 * GIB,
        "H2D GB": r.host_to_device_bytes / GB,
        "D2H GB": r.device_to_host_bytes / GB,
        **_times(r),
    }


def attempt(case: Case, seq: int, micro: int, k: int) -> dict[str, Any]:
    """One compile of `case`: its figures, or what it needs where it does not fit."""
    start = time.perf_counter()
    out: dict[str, Any] = {"sequence": seq, "micro-batch": micro, "k": k}
    try:
        r = compile_step(case, seq, micro, k)
    except eo.DoesNotFit as e:
        need = e.required_bytes or 0
        out |= {"fits": False, "device GiB": need / GIB}
        out["budget GiB"] = (e.available_bytes or 0) / GIB
    else:
        out |= _figures(r, case)
    out["compile s"] = round(time.perf_counter() - start, 1)
    print(f"  tried {out}", flush=True)
    return out


def search(case: Case, n: int, too_big: dict[tuple, dict]) -> list[dict[str, Any]]:
    """The attempts at `n` tokens an update, largest micro-batch first, up to the
    first that fits. `too_big`: the attempts that did not fit at k >= 2, by
    (sequence, micro-batch), not compiled again (but the smallest, for its time)."""
    tried = []
    for seq in case.seqs:
        for micro in case.micro:
            batch, k = n // seq, n // seq // micro
            if batch % micro:
                continue
            last = (seq, micro) == (case.seqs[-1], case.micro[-1])
            if k >= 2 and (seq, micro) in too_big and not last:
                known = too_big[seq, micro].items()
                tried.append({x: v for x, v in known if x in MEMORY} | {"k": k})
                continue
            tried.append(attempt(case, seq, micro, k))
            if tried[-1]["fits"]:
                return tried
            if k >= 2:
                too_big[seq, micro] = tried[-1]
    return tried


def rows_of(name: str, case: Case, tokens: tuple[int, ...]) -> list[dict[str, Any]]:
    """A row per tokens-per-update count: the largest micro-batch that fits."""
    too_big: dict[tuple, dict] = {}
    rows = []
    for n in tokens:
        row: dict[str, Any] = {"case": name, "model": case.model}
        row |= {"target": case.target, "policy": case.policy, "tokens": n}
        tried = search(case, n, too_big)
        row |= tried[-1] if tried else {"fits": False}
        row["tried"] = [
            {x: t.get(x) for x in ("sequence", "micro-batch", "k", "device GiB")}
            for t in tried[:-1]
        ]
        if not row["fits"] and case.priced_as:
            try:
                row["if it fit"] = priced_as(case, row["sequence"], row["k"])
            except eo.DoesNotFit as e:
                row["if it fit"] = {"error": str(e).splitlines()[0]}
        rows.append(row)
        print(row, flush=True)
    return rows


def priced_as(case: Case, seq: int, k: int) -> dict[str, Any]:
    """`case`'s step (one sequence a micro-batch) compiled for `case.priced_as`, a
    target with more memory, priced at `case.target`'s rates."""
    assert case.priced_as is not None
    hardware = eo.Hardware.of(case.target)
    r = compile_step(case, seq, 1, k, target=case.priced_as, hardware=hardware)
    return {"compiled for": case.priced_as, **_figures(r, case)}


def per_microbatch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and micro-batch, from two of its rows at k >= 2: the link bytes that
    grow with k (per micro-batch) and the rest (per update), each way."""
    out = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("fits") and r.get("k", 0) >= 2 and "H2D GB" in r:
            key = (r["case"], r["sequence"], r["micro-batch"])
            groups.setdefault(key, []).append(r)
    for (case, seq, micro), group in groups.items():
        if len(group) < 2:
            continue
        a, b = group[0], group[-1]
        entry: dict[str, Any] = {"case": case, "sequence": seq, "micro-batch": micro}
        entry["k"] = (a["k"], b["k"])
        for way in ("H2D GB", "D2H GB"):
            grows = (b[way] - a[way]) / (b["k"] - a["k"])
            entry[f"{way} per micro-batch"] = grows
            entry[f"{way} per update"] = a[way] - a["k"] * grows
        out.append(entry)
    return out


def _row(rows: list[dict[str, Any]], case: str, tokens: int) -> dict[str, Any]:
    return next((r for r in rows if r["case"] == case and r["tokens"] == tokens), {})


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 54's targets (point 5), each with its value, its goal and whether the
    estimate meets it."""
    out = []
    for case, tokens, goal in (
        ("8b-h100", 256 * K, 1.2),
        ("8b-h100", 512 * K, 1.1),
        ("1b-v5e", 256 * K, 1.2),
    ):
        r = _row(rows, case, tokens)
        value = r.get("step / compute-bound")
        out.append(
            {
                "target": f"{case}, {tokens // K}K tokens: step / compute-bound",
                "goal": goal,
                "value": value,
                "fits": r.get("fits"),
                "met": bool(r.get("fits") and value is not None and value <= goal),
            }
        )
    ours, remat = _row(rows, "gpt-12gib", 64 * K), _row(rows, "gpt-remat", 64 * K)
    value = None
    if ours.get("step s") and remat.get("step s"):
        value = ours["step s"] / remat["step s"]
    out.append(
        {
            "target": "gpt-12gib / gpt-remat, 64K tokens: step / remat's step",
            "goal": 1.2,
            "value": value,
            "fits": ours.get("fits"),
            "met": bool(ours.get("fits") and value is not None and value <= 1.2),
        }
    )
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument(
        "--quick", action="store_true", help="the first tokens count of each case"
    )
    args = p.parse_args()
    start = time.perf_counter()
    parameters = {}
    rows: list[dict[str, Any]] = []
    for name in args.cases:
        case = CASES[name]
        abstract = eqx.filter_eval_shape(case.make)
        leaves = jax.tree.leaves(abstract)
        parameters[case.model] = sum(x.size for x in leaves if hasattr(x, "size"))
        print(f"{name}: {case.model}, {parameters[case.model] / 1e9:.2f}e9 parameters")
        tokens = case.tokens[:1] if args.quick else case.tokens
        rows += rows_of(name, case, tokens)
    headers = ["case", "tokens", "micro-batch", "k", "device GiB", "host GiB"]
    headers += ["fits", "step s", "compute-bound s", "step / compute-bound", "MFU"]
    print(table(headers, [[r.get(h) for h in headers] for r in rows]))
    results = {
        "placement": "Policy.remat(params='pinned_host', opt_state={'**': "
        "'pinned_host', 'copies:**': 'device'}, compute_dtype=jnp.bfloat16)",
        "parameters": parameters,
        "rows": rows,
        "bytes": per_microbatch(rows),
        "targets": targets(rows),
        "published": PUBLISHED,
        "seconds": round(time.perf_counter() - start, 1),
    }
    for t in results["targets"]:
        print(t)
    print(f"done in {results['seconds']} s")
    write_json(args.json, "at_scale", results)


if __name__ == "__main__":
    main()
