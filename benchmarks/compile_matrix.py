"""Does every offloaded train step compile for a TPU? A matrix of models, widths,
depths, parameter dtypes and policies, each train step (`clip_by_global_norm` +
AdamW, the default streamed update) compiled with
`eo.memory_report(..., target=...)` from an abstract model.

    python benchmarks/compile_matrix.py [--targets tpu-v5e ...] [--quick] [--json FILE]

Architectures: `mlp` (a `Stacked` of LayerNorm + MLP blocks), `attention`
(LayerNorm + multi-head attention + LayerNorm + MLP blocks), `gpt` (an embedding and
a head around a `Stacked` of MLP blocks) and `dict` (a dict of four large leaves
and a Python loop, no `Stacked`). Policies: every preset, plus host parameters
(`remat(params={"blocks": "pinned_host"})`) and host optimizer state
(`offload_residuals(opt_state="pinned_host")`). A case passes if it compiles; a
case the compiler rejects, with `eo.DoesNotCompile` naming the leaves and a way
out, is listed as refused. `tests/test_tpu_compile.py` compiles a covering subset.
"""

import itertools
import time
from typing import Any, NamedTuple

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import parser, table, write_json
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo


class MLPBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        self.norm = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, depth=1, key=key)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm)(x)
        return x + jax.vmap(self.mlp)(h).astype(x.dtype)


class AttentionBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        heads = 4 if dim % 4 == 0 else 1
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, depth=1, key=k2)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h).astype(x.dtype)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x)).astype(x.dtype)


class Stack(eqx.Module):
    blocks: eo.Stacked[Any]

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return self.blocks(x)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[MLPBlock]
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, depth: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: MLPBlock(dim, key=k), depth, key=k2)
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return jax.vmap(self.head)(self.blocks(jax.vmap(self.embed)(tokens)))


SEQ, BATCH, VOCAB = 8, 2, 256


def regression_loss(model, x):
    y = jax.vmap(model)(x)
    return jnp.mean(y.astype(jnp.float32) ** 2)


def token_loss(model, tokens, targets):
    logits = jax.vmap(model)(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def dict_loss(params, x):
    for i in range(len(params)):
        x = jax.nn.gelu(x @ params[f"w{i}"])
    return jnp.mean(x.astype(jnp.float32) ** 2)


def cast(tree, dtype):
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(
            x.dtype, jnp.floating
        ):
            return jax.ShapeDtypeStruct(x.shape, dtype)
        return x

    return jax.tree.map(leaf, tree)


def case(arch: str, width: int, depth: int, dtype: Any) -> tuple[Any, Any, tuple]:
    """An abstract model, its loss and an abstract batch."""
    key = jax.random.key(0)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, width), dtype)
    if arch == "dict":
        params = {
            f"w{i}": jax.ShapeDtypeStruct((width, width), dtype) for i in range(4)
        }
        return params, dict_loss, (jax.ShapeDtypeStruct((SEQ, width), dtype),)
    if arch == "gpt":
        model = eqx.filter_eval_shape(GPT, VOCAB, width, depth, key=key)
        tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
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
    "host state": ("offload_residuals", {"opt_state": "pinned_host"}),
}


def policy_for(arch: str, name: str) -> eo.Policy:
    preset, overrides = POLICIES[name]
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


def compile_case(
    arch: str, width: int, depth: int, dtype: Any, policy: str, target: str
) -> Result:
    start = time.perf_counter()
    model, loss, batch = case(arch, width, depth, dtype)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    try:
        p = policy_for(arch, policy)
        model = eo.place(model, p)
        opt_state = eo.init_opt_state(optimizer, model, p)
        step = eo.train_step(loss, optimizer, p)
        eo.memory_report(step, model, opt_state, *batch, target=target)  # pyright: ignore[reportArgumentType]
    except eo.DoesNotCompile as e:
        return Result("refused", str(e), time.perf_counter() - start)
    except Exception as e:
        return Result("FAILS", f"{type(e).__name__}: {e}", time.perf_counter() - start)
    return Result("compiles", "", time.perf_counter() - start)


ARCHS = ("mlp", "attention", "gpt", "dict")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def main():
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["tpu-v5e"])
    p.add_argument("--archs", nargs="+", default=list(ARCHS))
    p.add_argument(
        "--widths", type=int, nargs="+", default=[32, 64, 96, 97, 128, 200, 256]
    )
    p.add_argument("--depths", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = p.parse_args()
    rows, results = [], []
    for target, arch, dtype, width, depth, policy in itertools.product(
        args.targets, args.archs, args.dtypes, args.widths, args.depths, args.policies
    ):
        if arch == "dict" and depth != args.depths[0]:
            continue  # no depth
        r = compile_case(arch, width, depth, DTYPES[dtype], policy, target)
        row = [
            target,
            arch,
            dtype,
            width,
            depth,
            policy,
            r.outcome,
            r.message.split("\n")[0][:160],
        ]
        print(" | ".join(map(str, row)), flush=True)
        rows.append(row)
        results.append(dict(zip(HEADERS, row)) | {"seconds": round(r.seconds, 2)})
    counts = {o: sum(r[6] == o for r in rows) for o in ("compiles", "refused", "FAILS")}
    print()
    print(
        table(HEADERS, [r for r in rows if r[6] != "compiles"])
        if counts["refused"] + counts["FAILS"]
        else "(every case compiles)"
    )
    print(f"\n{len(rows)} cases: {counts}")
    write_json(args.json, "compile_matrix", {"counts": counts, "cases": results})


HEADERS = ["target", "arch", "dtype", "width", "depth", "policy", "outcome", "message"]

if __name__ == "__main__":
    main()
