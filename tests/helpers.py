"""Models and references shared by the tests."""

import contextlib
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

import eqx_offload as eo


class Block(eqx.Module):
    """Pre-norm transformer block: LayerNorm + attention + LayerNorm + MLP."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(
            dim, dim, 2 * dim, depth=1, activation=jax.nn.gelu, key=k2
        )

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[Block]
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int = 32, dim: int = 16, depth: int = 4, *, key: PRNGKeyArray
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: Block(dim, 2, key=k), depth, key=k2)
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        x = self.blocks(x)
        return jax.vmap(self.head)(x)


class ReferenceModel(eqx.Module):
    """The same model written plainly: a Python list of blocks."""

    embed: eqx.nn.Embedding
    blocks: list[Block]
    head: eqx.nn.Linear

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def as_reference(model: Model) -> ReferenceModel:
    return ReferenceModel(model.embed, list(model.blocks), model.head)


class MLPBlock(eqx.Module):
    """Residual MLP on a vector: `x + fc2(gelu(fc1(x)))`."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(width, hidden, key=k1)
        self.fc2 = eqx.nn.Linear(hidden, width, key=k2)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " width"]:
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class StackedNet(eqx.Module):
    """`depth` layers made by `layer(key)` in a `Stacked`, then a linear head.

    With `head=(width, out)` the key is split between the layers and the head;
    with `head=None` the layers get the whole key and there is no head.
    """

    blocks: eo.Stacked
    head: eqx.nn.Linear | None

    def __init__(
        self,
        layer: Callable[[PRNGKeyArray], eqx.Module],
        depth: int,
        head: tuple[int, int] | None = None,
        *,
        key: PRNGKeyArray,
    ):
        if head is None:
            self.blocks = eo.Stacked.from_fn(layer, depth, key=key)
            self.head = None
        else:
            k1, k2 = jax.random.split(key)
            self.blocks = eo.Stacked.from_fn(layer, depth, key=k1)
            self.head = eqx.nn.Linear(*head, key=k2)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " out"]:
        x = self.blocks(x)
        return x if self.head is None else self.head(x)


class TanhBlock(eqx.Module):
    """Residual layer of one matrix: `x + tanh(x @ weight)`."""

    weight: jax.Array

    def __call__(self, x: Array) -> Array:
        return x + jnp.tanh(x @ self.weight)


class ProjectedStack(eqx.Module):
    """An input projection, then stacked `TanhBlock`s: `blocks(x @ w_in)`."""

    w_in: jax.Array
    blocks: eo.Stacked[TanhBlock]

    def __call__(self, x: Array) -> Array:
        return self.blocks(x @ self.w_in)


class TableLM(eqx.Module):
    """Bare tables around stacked `TanhBlock`s: `blocks(embed[tokens]) @ head.T`."""

    embed: jax.Array  # [vocab, dim]
    blocks: eo.Stacked[TanhBlock]
    head: jax.Array  # [vocab, dim]

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return self.blocks(self.embed[tokens]) @ self.head.T


def table_lm(
    key: PRNGKeyArray, vocab: int = 32, dim: int = 16, depth: int = 4
) -> TableLM:
    """A `TableLM`: `depth` stacked `TanhBlock`s of width `dim` between tables of
    `vocab` rows. The embedding is N(0, 1); the layers' weights and the head are
    N(0, 1/dim), so activations and logits stay of order one. Quick to trace and to
    compile (no LayerNorm, no bias): the model of the tests not about a model's
    parts. `eqx.filter_eval_shape(table_lm, key, ...)` gives it abstract."""
    k1, k2, k3 = jax.random.split(key, 3)
    scale = dim**-0.5
    blocks = eo.Stacked(TanhBlock(jax.random.normal(k2, (depth, dim, dim)) * scale))
    return TableLM(
        jax.random.normal(k1, (vocab, dim)),
        blocks,
        jax.random.normal(k3, (vocab, dim)) * scale,
    )


class Outer(eqx.Module):
    """A layer that holds a `Stacked` (field `inner`): a stack of stacks."""

    inner: eo.Stacked

    def __call__(self, x: Array) -> Array:
        return self.inner(x)


def cross_entropy(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def l2(model):
    params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    return 1e-3 * sum(jnp.sum(p**2) for p in params)


def loss_with_l2(model, tokens, targets):
    return cross_entropy(model, tokens, targets) + l2(model)


def batches(vocab: int = 32, batch: int = 2, seq: int = 8, seed: int = 0) -> Iterator:
    """Deterministic synthetic data: predict the next token of a shifted sequence."""
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(0, vocab, size=(batch, seq + 1))
        yield jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The names of the programs compiled for a backend inside the block, one per
    compilation, as JAX reports them through `jax.monitoring` (a program read back
    from the compilation cache counts too: it was lowered and handed to the
    backend again)."""
    names: list[str] = []

    def listen(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == _COMPILE_EVENT:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class CountCompiles:
    """`fn`, counting what each call compiles: `compiled_on` lists the calls (from
    0) during which anything was compiled. A jitted step that compiles once for N
    calls has `compiled_on == [0]`; one that compiles once per input shape, called
    with a second shape at call 3, has `[0, 3]`."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[list[str]] = []

    def __call__(self, *args, **kwargs):
        with compiles() as names:
            out = self.fn(*args, **kwargs)
        self.calls.append(names)
        return out

    @property
    def compiled_on(self) -> list[int]:
        return [i for i, names in enumerate(self.calls) if names]


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Calls as most users make them, without the runtime type checker these tests
    run the library under (`runtime_typecheck.py`, which honours jaxtyping's
    switch): an argument of the wrong type then meets the library's own check, whose
    error says the fix (with the checker on, the checker's error comes first)."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def bits(tree: PyTree) -> list[np.ndarray]:
    """The bytes of each array leaf, in order (a PRNG key's by its key data)."""
    out = []
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x).reshape(-1).view(np.uint8))
    return out


def assert_trees_equal(ours: PyTree, reference: PyTree) -> None:
    """`ours` equals `reference` bit for bit: as many array leaves, in order, each
    with the same shape, dtype and bytes. For copies: saved and loaded, ported,
    placed. (Values computed another way compare with `numerics.assert_close`.)"""
    ours_leaves = jax.tree.leaves_with_path(eqx.filter(ours, eqx.is_array))
    reference_leaves = jax.tree.leaves(eqx.filter(reference, eqx.is_array))
    assert len(ours_leaves) == len(reference_leaves), "not as many array leaves"
    for (path, x), y in zip(ours_leaves, reference_leaves):
        where = f"leaf {jax.tree_util.keystr(path)}"
        assert (x.shape, x.dtype) == (y.shape, y.dtype), where
        np.testing.assert_array_equal(bits(x)[0], bits(y)[0], err_msg=where)


def memory_kind(x) -> str:
    return x.sharding.memory_kind


def all_eqns(jaxpr) -> Iterator:
    """Every equation of a jaxpr, nested jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def primitive_names(jaxpr) -> set[str]:
    return {eqn.primitive.name for eqn in all_eqns(jaxpr)}


def same_place(abstract, concrete) -> bool:
    """An abstract leaf describes a concrete one: shape, dtype, devices, memory kind.
    (Abstract leaves on one device use a one-device mesh; see `abstract_sharding`.)"""
    a, c = abstract.sharding, concrete.sharding
    return (abstract.shape, abstract.dtype, a.device_set, a.memory_kind) == (
        concrete.shape,
        concrete.dtype,
        c.device_set,
        c.memory_kind,
    )


def plan_factory():
    """For `python -m eqx_offload plan tests.helpers:plan_factory`: a train step of
    the test model, the model (abstract), its optimizer state and a batch of token
    ids, as `memory_report(step, model, opt_state, *batch)` takes them."""
    optimizer, policy = optax.adam(1e-3), eo.Policy.none()
    model = eqx.filter_eval_shape(Model, 256, 256, 4, key=jax.random.key(0))
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    step = eo.train_step(cross_entropy, optimizer, policy)
    return step, model, opt_state, (tokens, tokens)


def old_plan_factory():
    """The command line's old factory, `(loss_fn, optimizer, model, batch)`."""
    model = eqx.filter_eval_shape(Model, 256, 256, 4, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    return cross_entropy, optax.adam(1e-3), model, (tokens, tokens)
