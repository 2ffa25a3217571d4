"""`Policy(update_timing=...)`: the stacked layers' update held over to the next
step. `"next_forward"` trains exactly as the plain step does (its pending update
applied by `apply_pending`); `"delayed"` as a hand-written optax loop whose stacked
layers' matrices (the leaves streamed a layer at a time) take each update one step
late; both keep every leaf where the policy puts it, and refuse what
they cannot do."""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import (
    assert_trees_close,
    batches,
    cross_entropy,
    memory_kind,
    Model,
    unchecked,
)


LR, STEPS = 1e-2, 4
# Clipped at 0.1 (the gradients' global norm is above 1: `test_delayed_...` checks
# it), AdamW with weight decay and a decaying learning rate: the stacked layers'
# update reads the clip's norm over every gradient and the step count.
OPTIMIZER = optax.chain(
    optax.clip_by_global_norm(0.1),
    optax.adamw(optax.linear_schedule(LR, LR / 10, STEPS + 2), weight_decay=0.1),
)
# As `test_host_update.py` and `test_prefetch.py`: Adam turns the rounding of another
# order of summation into a fraction of `lr` where a gradient is near zero (design
# notes, "JAX facts relied on"). Measured: 1.3e-4 x lr x steps (the stacked layers'
# update a layer at a time inside the forward scan, against the plain step's).
ADAM_ATOL = 1e-3 * LR * STEPS


class Dense(eqx.Module):
    """A residual layer applied to a whole batch at once: no `jax.vmap` around the
    `Stacked`'s scan."""

    weight: Float[Array, "dim dim"]
    bias: Float[Array, " dim"]

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        self.weight = jax.random.normal(key, (dim, dim)) / dim**0.5
        self.bias = jnp.zeros(dim)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        return x + jnp.tanh(x @ self.weight.T + self.bias)


class Flat(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[Dense]
    head: eqx.nn.Linear

    def __init__(self, vocab: int = 32, dim: int = 16, depth: int = 3, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: Dense(dim, key=k), depth, key=k2)
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(
        self, tokens: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq vocab"]:
        x = self.blocks(self.embed.weight[tokens])
        return x @ self.head.weight.T + self.head.bias


def flat_loss(model: Flat, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _bf16(model):
    return jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model
    )


MODELS = {
    # `Model`'s loss vmaps over examples: the `Stacked`'s scan runs under `vmap`.
    "vmapped": (lambda: Model(key=jax.random.key(0)), cross_entropy),
    "flat": (lambda: Flat(key=jax.random.key(0)), flat_loss),
    "bf16 masters": (lambda: _bf16(Model(key=jax.random.key(0))), cross_entropy),
}

BF16 = jnp.bfloat16
POLICIES = {
    "none": eo.Policy.none(),
    "none next_forward": eo.Policy.none(update_timing="next_forward"),
    "offload_all": eo.Policy.offload_all(),
    "offload_all next_forward": eo.Policy.offload_all(update_timing="next_forward"),
    "offload_all delayed": eo.Policy.offload_all(update_timing="delayed"),
    "offload_residuals next_forward": eo.Policy.offload_residuals(
        update_timing="next_forward"
    ),
    "offload_all bf16": eo.Policy.offload_all(compute_dtype=BF16),
    "offload_all bf16 next_forward": eo.Policy.offload_all(
        compute_dtype=BF16, update_timing="next_forward"
    ),
}


@contextlib.contextmanager
def counting_updating_scans() -> Iterator[list[str]]:
    """The paths of the `Stacked`s whose forward scan applied a pending update,
    one per trace of the step that kept it (not one the step traced, then
    replaced by the update before the loss: `eoi.pending.Record.applied_once`)."""
    paths: list[str] = []
    original = eoi.pending.Record.applied_once

    def counted(record):
        once = original(record)
        if once:
            paths.extend(record.taken)
        return once

    with mock.patch.object(eoi.pending.Record, "applied_once", counted):
        yield paths


class Run(NamedTuple):
    losses: list[float]
    # Before `apply_pending`: each leaf's memory kind, and `PendingUpdate.ready`.
    model_kinds: Any
    state_kinds: Any
    ready: bool | None
    # The stacked layers that applied their pending update in the forward scan.
    updating_scans: list[str]
    # After `apply_pending` (donated: a run's arrays are read, never passed on).
    model: Any
    opt_state: Any


def _kinds(tree: Any) -> Any:
    return jax.tree.map(memory_kind, eqx.filter(tree, eqx.is_array))


@functools.cache
def run(policy: str, model: str = "vmapped", microbatches: int = 1) -> Run:
    """`STEPS` steps of `train_step` on the model and policy of these names,
    then `apply_pending` (shared by the tests: each step compiles once)."""
    make, loss = MODELS[model]
    p = POLICIES[policy]
    m = eo.place(make(), p)
    state = eo.init_opt_state(OPTIMIZER, m, p)
    step = eo.train_step(loss, OPTIMIZER, p, microbatches=microbatches)
    data = batches(batch=4)
    losses = []
    with counting_updating_scans() as paths:
        for _ in range(STEPS):
            m, state, value, _ = step(m, state, *next(data))
            losses.append(float(value))
    kinds = (_kinds(m), _kinds(state))
    ready = state.ready if isinstance(state, eo.PendingUpdate) else None
    m, state = eo.apply_pending(m, state, OPTIMIZER, p)
    return Run(losses, *kinds, ready, paths, m, state)


def inner(state: Any) -> Any:
    return state.inner if isinstance(state, eo.PendingUpdate) else state


def assert_same_training(ours: Run, reference: Run) -> None:
    np.testing.assert_allclose(ours.losses, reference.losses, rtol=1e-6)
    assert_trees_close(ours.model, reference.model, atol=ADAM_ATOL)
    assert_trees_close(inner(ours.opt_state), reference.opt_state, atol=ADAM_ATOL)


@pytest.mark.parametrize(
    "policy, model",
    [
        ("offload_all next_forward", "vmapped"),
        ("offload_residuals next_forward", "vmapped"),
        ("offload_all next_forward", "flat"),
    ],
)
def test_next_forward_trains_as_the_plain_step(policy, model):
    """Every step's loss, and after `apply_pending` the parameters and the
    optimizer state, those of `Policy.none()`; the update was held (`ready`) and
    applied by the forward scan of the one `Stacked`."""
    ours = run(policy, model)
    assert ours.ready is True
    assert ours.updating_scans == ["blocks"]
    assert ours.opt_state.ready is False
    assert_same_training(ours, run("none", model))


@pytest.mark.parametrize(
    "policy, microbatches, reference",
    [
        ("offload_all next_forward", 2, "none"),
        ("offload_all bf16 next_forward", 1, "offload_all bf16"),
    ],
    ids=["micro-batches", "bf16 compute"],
)
def test_applied_before_the_loss(policy, microbatches, reference):
    """Micro-batches, a compute dtype: the pending update applied in a streamed
    loop before the loss, not in the forward scan; the numbers are still the
    plain step's (with the same micro-batches, the same compute dtype)."""
    ours = run(policy, microbatches=microbatches)
    assert ours.ready is True
    assert ours.updating_scans == []
    assert_same_training(ours, run(reference, microbatches=microbatches))


def test_bf16_masters():
    """bfloat16 parameters, updated a layer at a time in the forward scan: as
    `update_timing="now"` updates them."""
    ours = run("offload_all next_forward", "bf16 masters")
    reference = run("offload_all", "bf16 masters")
    assert ours.updating_scans == ["blocks"]
    dtypes = {x.dtype for x in jax.tree.leaves(eqx.filter(ours.model, eqx.is_array))}
    assert dtypes == {jnp.dtype(BF16)}
    np.testing.assert_allclose(ours.losses, reference.losses, rtol=1e-6)
    assert_trees_close(ours.model, reference.model)
    assert_trees_close(inner(ours.opt_state), reference.opt_state)


def _select(mask: Any, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda m, x, y: x if m else y, mask, a, b)


def delayed_reference(late: Callable[[Any], Any]) -> tuple[list[float], Any, Any]:
    """DeepSpeed's delayed parameter update, in plain JAX and optax: at the end
    of each step the whole tree's update (`optimizer.update` on every gradient:
    one clip norm, one step count), of which the new values of the parameters
    `late(params)` marks (a parameter-shaped tree of bools), and their Adam
    moments, are taken only after the *next* step's loss and gradient (computed
    with the old ones); the rest at once. Nothing late: the plain step."""
    params, static = eqx.partition(Model(key=jax.random.key(0)), eqx.is_array)
    state = OPTIMIZER.init(params)
    p_mask = late(params)
    # Adam's moments: the parameter-shaped parts of the state.
    s_mask = jax.tree.map(
        lambda s: p_mask if isinstance(s, Model) else False,
        state,
        is_leaf=lambda s: isinstance(s, Model),
    )

    @jax.jit
    def value_and_grad(params, tokens, targets):
        return jax.value_and_grad(
            lambda p: cross_entropy(eqx.combine(p, static), tokens, targets)
        )(params)

    @jax.jit
    def update(grads, state, params):
        updates, state = OPTIMIZER.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    data = batches(batch=4)
    losses, pending, norms = [], None, []
    for _ in range(STEPS):
        loss, grads = value_and_grad(params, *next(data))
        losses.append(float(loss))
        norms.append(float(optax.tree.norm(grads)))
        if pending is not None:
            params = _select(p_mask, pending[0], params)
            state = _select(s_mask, pending[1], state)
        new_params, new_state = update(grads, state, params)
        pending = (new_params, new_state)
        params = _select(p_mask, params, new_params)
        state = _select(s_mask, state, new_state)
    assert pending is not None
    params = _select(p_mask, pending[0], params)
    state = _select(s_mask, pending[1], state)
    assert min(norms) > 1.0  # the clip at 0.1 clips every step
    return losses, eqx.combine(params, static), state


def _nothing(params: Any) -> Any:
    return jax.tree.map(lambda _: False, params)


def _every_stacked_leaf(params: Model) -> Any:
    return eqx.tree_at(
        lambda m: m.blocks,
        _nothing(params),
        jax.tree.map(lambda _: True, params.blocks),
    )


def _waiting(state: eo.PendingUpdate) -> Callable[[Any], Any]:
    """The parameters whose update `state` holds gradients for."""
    masked = lambda g: isinstance(g, optax.MaskedNode)  # noqa: E731
    mask = jax.tree.map(lambda g: not masked(g), state.grads, is_leaf=masked)
    return lambda params: mask


def assert_delayed_training(late: Callable[[Any], Any]) -> None:
    """`"delayed"` trains as `delayed_reference(late)`, and apart from the plain
    step (checked against `Policy.none()`'s, as `delayed_reference` is): from
    the second step on the layers compute with older parameters."""
    plain = delayed_reference(_nothing)
    np.testing.assert_allclose(plain[0], run("none").losses, rtol=1e-6)
    assert_trees_close(plain[1], run("none").model, atol=ADAM_ATOL)

    reference = delayed_reference(late)
    ours = run("offload_all delayed")
    assert ours.ready is True
    assert ours.updating_scans == ["blocks"]
    np.testing.assert_allclose(ours.losses, reference[0], rtol=1e-6)
    assert_trees_close(ours.model, reference[1], atol=ADAM_ATOL)
    assert_trees_close(ours.opt_state.inner, reference[2], atol=ADAM_ATOL)
    assert ours.losses[0] == pytest.approx(plain[0][0], rel=1e-6)
    for mine, theirs in zip(ours.losses[1:], plain[0][1:]):
        assert abs(mine - theirs) > 1e-4 * abs(theirs)
    blocks = jax.tree.leaves(eqx.filter(ours.model.blocks, eqx.is_inexact_array))
    plain_blocks = jax.tree.leaves(eqx.filter(plain[1].blocks, eqx.is_inexact_array))
    differences = [
        np.max(np.abs(np.asarray(a) - np.asarray(b)))
        for a, b in zip(blocks, plain_blocks)
    ]
    assert max(differences) > 100 * ADAM_ATOL


def test_delayed_trains_as_the_delayed_reference():
    """The stacked leaves whose update waits (those `PendingUpdate.grads` holds)
    take each update one step late, with the values of the step that computed
    it (clip norm, step count); the rest at once."""
    state = run("offload_all delayed").opt_state
    waiting = jax.tree.leaves(_waiting(state)(None))
    late_in_blocks = jax.tree.leaves(_waiting(state)(None).blocks)
    assert any(waiting) and sum(waiting) == sum(late_in_blocks)
    assert_delayed_training(_waiting(state))


def test_apply_pending():
    """Nothing pending: the arguments back. Pending: applied once (`ready`
    False after, a second call a no-op); training then goes on as the plain
    step's, the next step holding its update again."""
    policy = POLICIES["offload_all next_forward"]
    model = eo.place(Model(key=jax.random.key(0)), policy)
    state = eo.init_opt_state(OPTIMIZER, model, policy)
    assert isinstance(state, eo.PendingUpdate) and state.ready is False
    same = eo.apply_pending(model, state, OPTIMIZER, policy)
    assert same[0] is model and same[1] is state

    step = eo.train_step(cross_entropy, OPTIMIZER, policy)
    data = batches(batch=4)
    losses = []
    for i in range(STEPS):
        model, state, loss, _ = step(model, state, *next(data))
        losses.append(float(loss))
        if i == 1:
            assert state.ready is True
            model, state = eo.apply_pending(model, state, OPTIMIZER, policy)
            assert state.ready is False
            again = eo.apply_pending(model, state, OPTIMIZER, policy)
            assert again[0] is model and again[1] is state
    assert state.ready is True
    model, state = eo.apply_pending(model, state, OPTIMIZER, policy)
    reference = run("none")
    np.testing.assert_allclose(losses, reference.losses, rtol=1e-6)
    assert_trees_close(model, reference.model, atol=ADAM_ATOL)
    assert_trees_close(state.inner, reference.opt_state, atol=ADAM_ATOL)


def test_placements():
    """Between steps and after `apply_pending`: `offload_all`'s parameters,
    optimizer state and waiting gradients in pinned host memory (the step
    counts and the held values on the device, as `init_opt_state` puts them);
    `offload_residuals`' all on the device."""
    ours = run("offload_all next_forward")
    assert set(jax.tree.leaves(ours.model_kinds)) == {"pinned_host"}
    state_kinds = ours.state_kinds
    assert set(jax.tree.leaves(state_kinds.grads)) == {"pinned_host"}
    assert set(jax.tree.leaves(state_kinds.held)) == {"device"}
    moments = [
        k
        for s, k in zip(
            jax.tree.leaves(ours.opt_state.inner),
            jax.tree.leaves(state_kinds.inner),
        )
        if s.ndim
    ]
    assert moments and set(moments) == {"pinned_host"}
    after = [
        memory_kind(x) for x in jax.tree.leaves(eqx.filter(ours.model, eqx.is_array))
    ]
    assert set(after) == {"pinned_host"}
    after = [memory_kind(x) for x in jax.tree.leaves(ours.opt_state) if x.ndim]
    assert set(after) == {"pinned_host"}

    device = run("offload_residuals next_forward")
    kinds = jax.tree.leaves((device.model_kinds, device.state_kinds))
    assert set(kinds) == {"device"}


def test_errors():
    with unchecked(), pytest.raises(ValueError, match="update_timing='bad'"):
        eo.Policy(update_timing="bad")  # pyright: ignore[reportArgumentType]
    for update in ("host", "whole"):
        with pytest.raises(ValueError, match=f"update='{update}'.*'streamed'"):
            eo.Policy.offload_all(update=update, update_timing="next_forward")
    policy = POLICIES["none next_forward"]
    with pytest.raises(ValueError, match=r"metrics=True.*update_timing='now'"):
        eo.train_step(cross_entropy, OPTIMIZER, policy, metrics=True)

    model = Model(key=jax.random.key(0))
    state = eo.init_opt_state(OPTIMIZER, model, policy)
    plain_state = eo.init_opt_state(OPTIMIZER, model, POLICIES["none"])

    @eqx.filter_jit
    def by_hand(model, state, tokens, targets):
        grads = eqx.filter_grad(eo.filter_offload(cross_entropy, policy))(
            model, tokens, targets
        )
        return eo.optimizer_update(OPTIMIZER, grads, state, model, policy)

    with pytest.raises(ValueError, match=r"optimizer_update.*update_timing='now'"):
        by_hand(model, state, *next(batches()))

    with pytest.raises(ValueError, match="init_opt_state"):
        eo.apply_pending(model, plain_state, OPTIMIZER, policy)
    with pytest.raises(ValueError, match="update_timing='now'"):
        eo.apply_pending(model, state, OPTIMIZER, POLICIES["none"])

    # A state built under another `update_timing`, either way round.
    step = eo.train_step(cross_entropy, OPTIMIZER, policy)
    with pytest.raises(ValueError, match="does not have the structure"):
        step(model, plain_state, *next(batches()))
    plain_step = eo.train_step(cross_entropy, OPTIMIZER, POLICIES["none"])
    with pytest.raises(ValueError, match="does not have the structure"):
        plain_step(model, state, *next(batches()))


def _twice(model: Model, tokens, targets):
    def forward(tokens):
        x = jax.vmap(model.embed)(tokens)
        return jax.vmap(model.head)(model.blocks(model.blocks(x)))

    logits = jax.vmap(forward)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _mapped(model: Model, tokens, targets):
    """The model applied one example at a time in a `jax.lax.map`: its `Stacked`'s
    scan is traced once and runs once per example."""
    logits = jax.lax.map(model, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _frozen(model: Model, tokens, targets):
    """The layers' output not differentiated: their backward pass never runs."""

    def forward(tokens):
        x = jax.lax.stop_gradient(model.blocks(jax.vmap(model.embed)(tokens)))
        return jax.vmap(model.head)(x)

    logits = jax.vmap(forward)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize("loss", [_twice, _mapped, _frozen])
def test_where_the_forward_scan_cannot_apply_it_the_step_does(loss):
    """A loss that runs the `Stacked` twice, in a loop, or without
    differentiating it (as one that never runs it): its forward scan cannot give
    the new values back once (they would be added up, or zero), so the step
    applies the update before the loss instead, with the numbers of the plain
    step."""

    def train(policy: eo.Policy) -> tuple[list[float], Any]:
        model = eo.place(Model(key=jax.random.key(0)), policy)
        state = eo.init_opt_state(OPTIMIZER, model, policy)
        step = eo.train_step(loss, OPTIMIZER, policy)
        data = batches(batch=4)
        losses = []
        for _ in range(3):
            model, state, value, _ = step(model, state, *next(data))
            losses.append(float(value))
        return losses, eo.apply_pending(model, state, OPTIMIZER, policy)[0]

    ours, reference = train(POLICIES["none next_forward"]), train(POLICIES["none"])
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6)
    assert_trees_close(ours[1], reference[1], atol=ADAM_ATOL)
    assert eoi.pending.take("blocks") is None  # (nothing left owed)
