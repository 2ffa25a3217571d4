"""Does every offloaded train step compile for a TPU? A matrix of models, widths,
depths, parameter dtypes and policies, each train step (`clip_by_global_norm` +
AdamW, the default streamed update) compiled with
`eo.memory_report(..., target=...)` from an abstract model.

    python benchmarks/compile_matrix.py [--targets tpu-v5e ...] [--json FILE]
    python benchmarks/compile_matrix.py --spot [--json FILE]

Architectures: `mlp` (a `Stacked` of LayerNorm + MLP blocks), `attention`
(LayerNorm + multi-head attention + LayerNorm + MLP blocks), `gpt` (an embedding and
a head around a `Stacked` of MLP blocks), `llama` (an embedding, a `Stacked` of
Llama-style blocks: RMSNorm, RoPE, grouped-query attention through
`jax.nn.dot_product_attention`, a SwiGLU MLP of `--mlp` units, and an untied head)
`dict` (a dict of four large leaves and a Python loop, no `Stacked`) and `gpt-matmul`
(`gpt` with its head a bare `(width, vocab)` matrix applied as `h @ head`, as
hand-written GPTs do: like `dict`'s leaves, a leaf outside every `Stacked` whose
gradient is a transposed product). Dtypes:
`float32`, `bfloat16` (the parameters themselves) and `bf16-compute` (float32
parameters, `Policy(compute_dtype=jnp.bfloat16)`). Policies: every preset, plus host
parameters (`remat(params={"blocks": "pinned_host"})`) and host optimizer state
(`offload_residuals(opt_state="pinned_host")`); `--microbatches 2 4` compiles each
case with `train_step(microbatches=k)` too. A case passes if it compiles; a case the
compiler rejects, with `eo.DoesNotCompile` naming the leaves and a way out, is
listed as refused. Each case that compiles records the bytes its program moves
each way between host and device memory next to the fewest it must move
(oracle: `tests/minimum_traffic.py`). `--optimizer adamw` drops the clip (whose global
norm makes the streamed update read each gradient twice); `--piece-bytes N` patches
`_tiling.PIECE_BYTES` down, so that small layers take the path of large ones (read
and written in pieces). `--spot` compiles `SPOT` instead of a product: a spread of
cases over every architecture, dtype, policy, TPU generation and the GPU, at widths
the full runs leave out. `tests/test_tpu_compile.py` and `tests/test_gpu_targets.py`
compile a covering few. `--host-2048` compiles `HOST_2048`: the update on the host's
CPU at width 2048 (a layer's `8192 x 2048` weight is twice `_tiling.PIECE_BYTES`)
and, for the pattern XLA:GPU once rejected there, at widths 32 and 97, on
`gpu-h100` and `tpu-v5e`. `--vocab`, `--seq` and `--batch` set the token models'
vocabulary and batch (default 256 and 2 x 8 tokens): the GPT of the host update at
the size people train (16 layers, width 2048, 32000 tokens, 8 x 1024 tokens) is

    python benchmarks/compile_matrix.py --targets gpu-h100 tpu-v5e \
        --archs gpt gpt-matmul --widths 2048 --depths 16 --dtypes float32 \
        --policies "host update" --vocab 32000 --seq 1024 --batch 8

    python benchmarks/compile_matrix.py --targets tpu-v5e gpu-h100 --archs llama \
        --widths 2048 4096 --depths 2 --microbatches 2 4 \
        --policies offload_all offload_residuals --dtypes float32 bf16-compute
"""

import itertools
import sys
import time
from pathlib import Path
from typing import Any, Literal, NamedTuple
from unittest import mock

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import parser, table, write_json
from models.matrix import (
    AttentionBlock,
    BATCH,
    dict_loss,
    GPT,
    Llama,
    MLPBlock,
    regression_loss,
    SEQ,
    Stack,
    token_loss,
    VOCAB,
)

import eqx_offload as eo
import eqx_offload.internal as eoi


sys.path.insert(0, str(Path(__file__).parents[1]))  # the repository, for `tests`
from tests.minimum_traffic import (  # noqa: E402
    minimum_traffic,
    MinimumTraffic,
    offloaded_bytes,
)


def matmul_head_gpt(vocab: int, dim: int, depth: int, *, key: Any) -> dict:
    """`GPT` with its head a bare `(dim, vocab)` matrix, as a dict (the models
    live in `models/`; this one is `GPT`'s parts): see `matmul_head_loss`."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": eqx.nn.Embedding(vocab, dim, key=k1),
        "blocks": eo.Stacked.from_fn(lambda k: MLPBlock(dim, key=k), depth, key=k2),
        "head": jax.random.normal(k3, (dim, vocab)) * dim**-0.5,
    }


def matmul_head_loss(model: dict, tokens: Any, targets: Any) -> Any:
    """`token_loss` of `matmul_head_gpt`, its head applied as `h @ head`."""

    def logits(tokens: Any) -> Any:
        return model["blocks"](jax.vmap(model["embed"])(tokens)) @ model["head"]

    out = jax.vmap(logits)(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean()


def cast(tree, dtype):
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(
            x.dtype, jnp.floating
        ):
            return jax.ShapeDtypeStruct(x.shape, dtype)
        return x

    return jax.tree.map(leaf, tree)


def mlp_width(width: int) -> int:
    """The `llama` architecture's MLP width when `--mlp` is not given: Llama 3.2
    1B's 8192 at width 2048, Llama 3 8B's 14336 at 4096, else four times the
    width."""
    return {2048: 8192, 4096: 14336}.get(width, 4 * width)


def case(
    arch: str,
    width: int,
    depth: int,
    dtype: Any,
    *,
    batch: int = BATCH,
    mlp: int | None = None,
    seq: int = SEQ,
    vocab: int = VOCAB,
) -> tuple[Any, Any, tuple]:
    """An abstract model, its loss and an abstract batch (`batch` examples of
    `seq` tokens or vectors)."""
    key = jax.random.key(0)
    x = jax.ShapeDtypeStruct((batch, seq, width), dtype)
    if arch == "dict":
        params = {
            f"w{i}": jax.ShapeDtypeStruct((width, width), dtype) for i in range(4)
        }
        return params, dict_loss, (jax.ShapeDtypeStruct((seq, width), dtype),)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    if arch == "gpt":
        model = eqx.filter_eval_shape(GPT, vocab, width, depth, key=key)
        return cast(model, dtype), token_loss, (tokens, tokens)
    if arch == "gpt-matmul":
        model = eqx.filter_eval_shape(matmul_head_gpt, vocab, width, depth, key=key)
        return cast(model, dtype), matmul_head_loss, (tokens, tokens)
    if arch == "llama":
        hidden = mlp_width(width) if mlp is None else mlp
        model = eqx.filter_eval_shape(Llama, vocab, width, hidden, depth, key=key)
        return cast(model, dtype), token_loss, (tokens, tokens)
    block = {"mlp": MLPBlock, "attention": AttentionBlock}[arch]

    def make():
        return Stack(eo.Stacked.from_fn(lambda k: block(width, key=k), depth, key=key))

    return cast(eqx.filter_eval_shape(make), dtype), regression_loss, (x,)


# name -> (preset, overrides)
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "remat": ("remat", {}),
    "offload_residuals": ("offload_residuals", {}),
    "offload_all": ("offload_all", {}),
    "host params": ("remat", {"params": {"blocks": "pinned_host"}}),
    # bf16 compute copies on the device, masters and moments on the host (issue 54).
    "copies on device": (
        "remat",
        {
            "params": "pinned_host",
            "opt_state": {"**": "pinned_host", "copies:**": "device"},
        },
    ),
    "host state": ("offload_residuals", {"opt_state": "pinned_host"}),
    "whole update": ("offload_all", {"update": "whole"}),
    "host state, whole update": (
        "offload_residuals",
        {"opt_state": "pinned_host", "update": "whole"},
    ),
    "host update": ("offload_all", {"update": "host"}),
    "host state, host update": (
        "offload_residuals",
        {"opt_state": "pinned_host", "update": "host"},
    ),
    "prefetch": ("offload_all", {"prefetch": 1}),
    "prefetch, host update": ("offload_all", {"prefetch": 1, "update": "host"}),
    "prefetch, residuals": ("offload_residuals", {"prefetch": 1}),
    "next forward": ("offload_all", {"update_timing": "next_forward"}),
    "next forward, prefetch": (
        "offload_all",
        {"update_timing": "next_forward", "prefetch": 1},
    ),
    "next forward, state on host": (
        "offload_residuals",
        {"opt_state": "pinned_host", "update_timing": "next_forward"},
    ),
}


def policy_for(arch: str, name: str, **extra: Any) -> eo.Policy:
    """The policy `name` of `POLICIES` for `arch`, with the `Policy` fields in
    `extra` too."""
    preset, overrides = POLICIES[name]
    overrides = overrides | extra
    if arch == "dict":  # no `Stacked`: no checkpoint name, no "blocks"
        overrides = dict(overrides)
        if "params" in overrides or preset == "offload_all":
            overrides["params"] = "pinned_host"
        if preset == "offload_all":
            overrides["opt_state"] = "pinned_host"
        if preset in ("offload_residuals", "offload_all"):
            preset = "remat"  # the presets without their `offload=("**.input",)`
    return getattr(eo.Policy, preset)(**overrides)


class Result(NamedTuple):
    outcome: str  # "compiles", "refused" or "FAILS"
    message: str
    seconds: float
    report: eo.MemoryReport | None = None  # where it compiles
    minimum: MinimumTraffic | None = None  # the fewest bytes it must move


OPTIMIZERS = {
    "clip+adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
    "adamw": lambda: optax.adamw(1e-3),
}


def compile_case(
    arch: str,
    width: int,
    depth: int,
    dtype: Any,
    policy: str,
    target: str,
    *,
    microbatches: int = 1,
    mlp: int | None = None,
    optimizer: str = "clip+adamw",
    tokens: tuple[int, int, int] = (BATCH, SEQ, VOCAB),
) -> Result:
    """Compiles one case's train step; `dtype` is a parameter dtype, or
    `COMPUTE_BF16` for float32 parameters under `Policy(compute_dtype=bf16)`;
    `optimizer` one of `OPTIMIZERS`; `tokens`: the examples per micro-batch, their
    length and the vocabulary."""
    start = time.perf_counter()
    compute = dtype is COMPUTE_BF16
    batch, seq, vocab = tokens
    model, loss, batch = case(
        arch,
        width,
        depth,
        jnp.float32 if compute else dtype,
        batch=batch * microbatches,
        mlp=mlp,
        seq=seq,
        vocab=vocab,
    )
    transform = OPTIMIZERS[optimizer]()
    try:
        p = policy_for(
            arch, policy, **({"compute_dtype": jnp.bfloat16} if compute else {})
        )
        model = eo.place(model, p)
        opt_state = eo.init_opt_state(transform, model, p)
        step = eo.train_step(loss, transform, p, microbatches=microbatches)
        report = eo.memory_report(step, model, opt_state, *batch, target=target)  # pyright: ignore[reportArgumentType]
        minimum = minimum_traffic(
            model,
            opt_state,
            p,
            transform,
            microbatches=microbatches,
            residual_bytes=offloaded_bytes(report),
            platform=eoi.targets_platform(target),
        )
    except eo.DoesNotCompile as e:
        return Result("refused", str(e), time.perf_counter() - start)
    except Exception as e:
        return Result("FAILS", f"{type(e).__name__}: {e}", time.perf_counter() - start)
    return Result("compiles", "", time.perf_counter() - start, report, minimum)


def moved(r: Result) -> dict[str, int]:
    """What a compiled case's program moves each way, and the fewest bytes it must
    (both with the offloaded residuals)."""
    report, minimum = r.report, r.minimum
    if report is None or minimum is None:
        return {}
    out = {}
    ways: tuple[tuple[Literal["host_to_device", "device_to_host"], str], ...] = (
        ("host_to_device", "to device"),
        ("device_to_host", "to host"),
    )
    for direction, label in ways:
        out[label] = report.transfer_bytes(direction, compiled=True)
        out[f"minimum {label}"] = minimum.bytes(direction)
    return out


ARCHS = ("mlp", "attention", "gpt", "llama", "dict", "gpt-matmul")
COMPUTE_BF16 = "bf16-compute"
DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    COMPUTE_BF16: COMPUTE_BF16,
}

# (target, arch, dtype, width, depth, policy, microbatches): what `--spot` compiles,
# with `_tiling.PIECE_BYTES` at 32 KiB. Every architecture, widths 64, 96, 128 and
# 256 (and 32, 97, 200), depths 1 to 8, both dtypes and bf16 compute, every preset
# plus host parameters and host state, every TPU generation and the GPU, micro-
# batches: the cases `tests/test_tpu_compile.py` and `tests/test_gpu_targets.py`
# compiled before they kept a covering few.
SPOT = [
    ("tpu-v5e", "mlp", "float32", 32, 1, "offload_all", 1),
    ("tpu-v5e", "mlp", "float32", 200, 8, "host state", 1),
    ("tpu-v5e", "mlp", "bfloat16", 128, 4, "offload_all", 1),
    ("tpu-v5e", "mlp", "bfloat16", 96, 4, "host params", 1),
    ("tpu-v5e", "attention", "float32", 64, 4, "offload_all", 1),
    ("tpu-v5e", "attention", "bfloat16", 200, 2, "host state", 1),
    ("tpu-v5e", "attention", "float32", 96, 3, "remat", 1),
    ("tpu-v5e", "gpt", "float32", 64, 4, "offload_all", 1),
    ("tpu-v5e", "gpt", "bfloat16", 128, 8, "offload_residuals", 1),
    ("tpu-v5e", "gpt", "float32", 200, 1, "none", 1),
    ("tpu-v5e", "dict", "float32", 256, 1, "offload_all", 1),
    ("tpu-v5e", "dict", "bfloat16", 256, 1, "host state", 1),
    ("tpu-v6e", "mlp", "float32", 64, 4, "offload_all", 1),
    ("tpu-v6e", "gpt", "bfloat16", 128, 4, "offload_all", 1),
    ("tpu-v5p", "attention", "bfloat16", 64, 4, "host params", 1),
    ("tpu-v4", "mlp", "float32", 200, 2, "host state", 1),
    ("tpu-v4", "gpt", "bfloat16", 64, 4, "offload_all", 1),
    ("tpu-v5e", "llama", "float32", 128, 2, "offload_all", 2),
    ("tpu-v5e", "gpt", COMPUTE_BF16, 96, 2, "offload_all", 4),
    ("gpu-h100", "mlp", "float32", 97, 4, "offload_all", 1),
    ("gpu-h100", "mlp", "bfloat16", 200, 2, "host state", 1),
    ("gpu-h100", "attention", "float32", 64, 3, "offload_residuals", 1),
    ("gpu-h100", "attention", "bfloat16", 96, 2, "host params", 1),
    ("gpu-h100", "gpt", "bfloat16", 128, 4, "offload_all", 1),
    ("gpu-h100", "gpt", "float32", 32, 1, "remat", 1),
    ("gpu-h100", "dict", "float32", 256, 1, "none", 1),
    ("gpu-h100", "dict", "bfloat16", 200, 1, "offload_all", 1),
    ("gpu-h100", "mlp", COMPUTE_BF16, 128, 2, "offload_all", 2),
    ("gpu-h100", "gpt", "float32", 96, 2, "offload_residuals", 4),
    ("tpu-v5e", "llama", COMPUTE_BF16, 200, 2, "copies on device", 4),
    ("gpu-h100", "gpt", COMPUTE_BF16, 97, 3, "copies on device", 4),
]

# (target, arch, dtype, width, depth, policy, microbatches): what `--host-2048`
# compiles, at the default `_tiling.PIECE_BYTES`. Every architecture at width 2048
# with the update on the host's CPU, with the parameters there too and on the
# device; bf16 compute and two micro-batches for the GPT; and the leaves outside a
# `Stacked` whose gradient is a transposed product (`dict`, `gpt-matmul`), which
# XLA:GPU rejected at every width until `_update/_host.py` gave them the default
# layout, at widths 32 and 97 too.
HOST_2048 = [
    (target, arch, "float32", 2048, 2, policy, 1)
    for target in ("gpu-h100", "tpu-v5e")
    for arch in ("gpt", "gpt-matmul", "llama", "mlp", "attention", "dict")
    for policy in ("host update", "host state, host update")
]
HOST_2048 += [
    (target, arch, dtype, 2048, 2, "host update", k)
    for target in ("gpu-h100", "tpu-v5e")
    for arch, dtype, k in (
        ("gpt", COMPUTE_BF16, 1),
        ("gpt", "float32", 2),
        ("gpt-matmul", COMPUTE_BF16, 2),
        ("dict", COMPUTE_BF16, 1),
    )
]
HOST_2048 += [
    (target, arch, "float32", width, 2, "host update", 1)
    for target in ("gpu-h100", "tpu-v5e")
    for arch in ("dict", "gpt-matmul")
    for width in (32, 97)
]


def main():
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["tpu-v5e"])
    p.add_argument(
        "--archs",
        nargs="+",
        default=[a for a in ARCHS if a not in ("llama", "gpt-matmul")],
    )
    p.add_argument(
        "--widths", type=int, nargs="+", default=[32, 64, 96, 97, 128, 200, 256]
    )
    p.add_argument("--depths", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES)
    )
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--microbatches", type=int, nargs="+", default=[1])
    p.add_argument("--mlp", type=int, help="the llama MLP width (default: by width)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="clip+adamw")
    p.add_argument(
        "--piece-bytes", type=int, help="`_tiling.PIECE_BYTES` (default: 32 MiB)"
    )
    p.add_argument(
        "--spot", action="store_true", help="compile `SPOT` instead of a product"
    )
    p.add_argument(
        "--host-2048",
        action="store_true",
        help="compile `HOST_2048` (the update on the host at width 2048)",
    )
    p.add_argument("--vocab", type=int, default=VOCAB, help="the token vocabulary")
    p.add_argument("--seq", type=int, default=SEQ, help="tokens (vectors) per example")
    p.add_argument("--batch", type=int, default=BATCH, help="examples per micro-batch")
    args = p.parse_args()
    if args.spot:
        args.piece_bytes = args.piece_bytes or 32 * 1024
        cases = SPOT
    elif args.host_2048:
        cases = HOST_2048
    else:
        cases = [
            c
            for c in itertools.product(
                args.targets,
                args.archs,
                args.dtypes,
                args.widths,
                args.depths,
                args.policies,
                args.microbatches,
            )
            if c[1] != "dict" or c[4] == args.depths[0]  # no depth
        ]
    if args.piece_bytes:  # the module's global, by its path (`eqx_offload.internal`)
        mock.patch("eqx_offload._tiling.PIECE_BYTES", args.piece_bytes).start()
    rows, results = [], []
    for target, arch, dtype, width, depth, policy, k in cases:
        r = compile_case(
            arch,
            width,
            depth,
            DTYPES[dtype],
            policy,
            target,
            microbatches=k,
            mlp=args.mlp,
            optimizer=args.optimizer,
            tokens=(args.batch, args.seq, args.vocab),
        )
        row = [
            target,
            arch,
            dtype,
            width,
            depth,
            policy,
            k,
            r.outcome,
            r.message.split("\n")[0][:160],
        ]
        print(" | ".join(map(str, row)), flush=True)
        rows.append(row)
        record = dict(zip(HEADERS, row)) | {"seconds": round(r.seconds, 2)}
        results.append(record | moved(r))
    outcome = HEADERS.index("outcome")
    counts = {
        o: sum(r[outcome] == o for r in rows) for o in ("compiles", "refused", "FAILS")
    }
    print()
    print(
        table(HEADERS, [r for r in rows if r[outcome] != "compiles"])
        if counts["refused"] + counts["FAILS"]
        else "(every case compiles)"
    )
    print(f"\n{len(rows)} cases: {counts}")
    write_json(args.json, "compile_matrix", {"counts": counts, "cases": results})


HEADERS = [
    "target",
    "arch",
    "dtype",
    "width",
    "depth",
    "policy",
    "microbatches",
    "outcome",
    "message",
]

if __name__ == "__main__":
    main()
