"""Type-checked research code keeps working under the policies: none, everything
offloaded (as `remat()` and `offload_residuals()` do, and more) and named ones."""

from typing import Any, Literal

import beartype
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import optax
import pytest
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import Array, Float, Int, jaxtyped, PRNGKeyArray

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import batches, unchecked
from .runtime_typecheck import check


typechecked = jaxtyped(typechecker=beartype.beartype)


@typechecked
class TypedBlock(eqx.Module):
    w_in: Float[Array, "dim hidden"]
    w_out: Float[Array, "hidden dim"]
    norm: eqx.nn.LayerNorm

    def __init__(self, dim: int, hidden: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.w_in = jax.random.normal(k1, (dim, hidden)) / dim**0.5
        self.w_out = jax.random.normal(k2, (hidden, dim)) / hidden**0.5
        self.norm = eqx.nn.LayerNorm(dim)

    @typechecked
    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return x + jax.nn.gelu(jax.vmap(self.norm)(x) @ self.w_in) @ self.w_out


@typechecked
class TypedModel(eqx.Module):
    blocks: eo.Stacked[TypedBlock]
    head: Float[Array, "dim vocab"]
    embed: Float[Array, "vocab dim"] = eo.field(memory_kind="pinned_host")

    def __init__(self, vocab: int, dim: int, depth: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = jax.random.normal(k1, (vocab, dim))
        self.blocks = eo.Stacked.from_fn(
            lambda k: TypedBlock(dim, 2 * dim, key=k), depth, key=k2
        )
        self.head = jax.random.normal(k3, (dim, vocab)) / dim**0.5

    @typechecked
    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return self.blocks(self.embed[tokens]) @ self.head


@typechecked
def loss_fn(
    model: TypedModel, tokens: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
) -> Float[Array, ""]:
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize(
    "policy",
    [
        eo.Policy.none(),
        # The typed layers under `jax.checkpoint` in the scan, their residuals
        # offloaded and their parameters moved from the host a slice at a time
        # (what `remat()` and `offload_residuals()` do, and more).
        eo.Policy.offload_all(),
        eo.Policy(save=("blocks.norm",), offload=("blocks.input",)),  # named submodule
    ],
    ids=["none", "offload_all", "named"],
)
def test_typed_model_trains(policy, getkey):
    optimizer = optax.adam(1e-2)
    model = eo.place(TypedModel(32, 16, 3, key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy)
    data = batches()
    losses = []
    for _ in range(5):
        model, opt_state, loss, _ = step(model, opt_state, *next(data))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert isinstance(model, TypedModel) and isinstance(model.blocks, eo.Stacked)


def test_typechecking_catches_a_wrong_shape(getkey):
    model = TypedModel(32, 16, 3, key=getkey())
    with pytest.raises(jaxtyping.TypeCheckError):
        model(jnp.zeros((2, 8), dtype=jnp.int32))  # a batch, not one sequence


def test_library_functions_are_checked_at_run_time():
    # The tests run the library type-checked (`runtime_typecheck.py`); the
    # public signatures say the real types (a policy is a `Policy`), so the checker
    # names a wrong argument first. (Without it, the library's own check does, with
    # the fix: `test_mistakes.py::test_a_policy_that_is_not_a_policy`.)
    with pytest.raises(jaxtyping.TypeCheckError, match="policy"):
        eo.train_step(lambda m: m, optax.sgd(0.1), "offload_all")  # pyright: ignore
    with pytest.raises(jaxtyping.TypeCheckError, match="has_aux"):
        eo.train_step(
            lambda m: m,
            optax.sgd(0.1),
            eo.Policy.none(),
            has_aux="yes",  # pyright: ignore[reportArgumentType]
        )
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'n'"):
        eo.Stacked.from_fn(lambda k: k, 2.5, key=jax.random.key(0))  # pyright: ignore


def test_private_helpers_are_checked_too():
    """Beartype alone checks a signature without array shapes; the error is still
    jaxtyping's, naming the parameter."""

    assert eoi.paths_join("a", ("b",)) == "a.b"
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'prefix'"):
        eoi.paths_join(3, ("b",))  # pyright: ignore[reportArgumentType]


def test_named_dimensions_agree_across_arguments():
    """A signature with named dimensions keeps jaxtyping's memo: `dim` of `hidden`
    and of `weight` must agree (each argument alone is well formed)."""
    hidden, targets = jnp.zeros((4, 8)), jnp.zeros((4,), jnp.int32)
    eo.chunked_cross_entropy(hidden, jnp.zeros((16, 8)), targets)
    with pytest.raises(jaxtyping.TypeCheckError, match="dim"):
        eo.chunked_cross_entropy(hidden, jnp.zeros((16, 7)), targets)


def test_the_checker_reports_returns_and_passes_inner_errors_through():
    """`runtime_typecheck.check`, the decorator on every library function: a wrong
    return value is jaxtyping's error; the error of a function it calls (here a
    user's, checked by beartype alone) reaches the caller unchanged, and the outer
    function runs once; `unchecked()` turns it off."""
    calls = []

    @beartype.beartype
    def inner(x: int) -> int:
        return x

    @check
    def outer(x: int) -> int:
        calls.append(x)
        return inner("one")  # pyright: ignore[reportArgumentType]

    @check
    def wrong_return(x: int) -> int:
        return str(x)  # pyright: ignore[reportReturnType]

    with pytest.raises(jaxtyping.TypeCheckError, match="wrong_return"):
        wrong_return(1)
    with pytest.raises(BeartypeCallHintParamViolation, match="inner"):
        outer(1)
    assert calls == [1]
    with unchecked():
        assert wrong_return(1) == "1"


def test_a_nested_function_defined_again_is_checked_as_the_first():
    """A nested function's checker is made once and bound to each later function of
    the same code, annotations and defaults (`runtime_typecheck.check`), by
    beartype alone or with jaxtyping's named dimensions: each calls its own
    closure, and checks its arguments and its return; other annotations get a
    checker of their own."""

    def define(offset, hint: type = int, array: Any = Float):
        @check
        def add(x: hint, y: int | None = None) -> int:  # pyright: ignore
            return x + offset if offset >= 0 else str(x)  # pyright: ignore

        @check
        def scale(
            x: array[Array, " n"],  # pyright: ignore
            y: Float[Array, " n"],
        ) -> Float[Array, " n"]:
            return x * offset if offset >= 0 else x[1:]

        return add, scale

    (add, scale), (add2, scale2) = define(1), define(2)
    assert (add(1), add2(1)) == (2, 3)
    one = jnp.ones(3)
    assert (scale(one, one)[0], scale2(one, one)[0]) == (1.0, 2.0)
    for f, g in ((add, scale), (add2, scale2)):
        with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
            f("one")  # pyright: ignore[reportArgumentType]
        with pytest.raises(jaxtyping.TypeCheckError, match="scale"):
            g(one, jnp.ones(4))  # n differs
    add3, scale3 = define(-1)
    with pytest.raises(jaxtyping.TypeCheckError, match="add"):
        add3(1)  # the return
    with pytest.raises(jaxtyping.TypeCheckError, match="return value"):
        scale3(one, one)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
        define(1, hint=str)[0](1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
        define(1, array=Int)[1](one, one)
    assert define(3)[0](1, y=2) == 4  # (a default kept with the checker)


def test_a_literal_is_checked_by_beartype_alone():
    """A `Literal`'s strings are values, not names for jaxtyping to resolve: the
    signature is checked by beartype alone (the fast path), with jaxtyping's error."""

    @check
    def pick(mode: Literal["link", "device"], n: int) -> str:
        return mode * n

    assert pick.__code__.co_filename == "<@beartype(runtime_typecheck)>"
    assert pick("link", 2) == "linklink"
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'mode'"):
        pick("host", 1)  # pyright: ignore[reportArgumentType]
