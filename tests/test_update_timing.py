"""`Policy(update_timing="next_forward")`: the stacked layers' update held over to
the next step. It trains as the plain step does (its pending update applied by
`apply_pending`), the update it holds over is optax's on the gradients it holds, it
keeps every leaf where the policy puts it, marks the `Stacked`s one update behind
(which then refuse to run outside the step), and refuses what it cannot do.

Training is compared through the updates of momentum SGD steps (`TRAINED`), against
one plain Equinox + optax run per loss; the held-over update's own arithmetic (AdamW
after a clip, whose update reads the gradients' global norm and the step count) one
step at a time against `optimizer.update` on the gradients the state holds (`F32`).
"""

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
from jaxtyping import Array, Float

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import (
    assert_trees_equal,
    batches,
    cross_entropy,
    memory_kind,
    table_lm,
    TableLM,
    TanhBlock,
    unchecked,
)
from .numerics import assert_close, excess, TRAINED


VOCAB, DIM, DEPTH = 32, 8, 3
LR, STEPS = 0.05, 4
# Momentum SGD on a decaying learning rate: the held-over update reads the step
# count (through the schedule) as well as its own gradients and momentum.
SGD = optax.sgd(optax.linear_schedule(LR, LR / 10, STEPS), momentum=0.9)


# The model every test starts from.
lm = functools.partial(table_lm, jax.random.key(0), VOCAB, DIM, DEPTH)


def _cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def flat(model: TableLM, tokens, targets):
    """The model applied to the whole batch at once: no `jax.vmap` around the
    `Stacked`'s scan (the `cross_entropy` of the others vmaps over examples)."""
    return _cross_entropy(model(tokens), targets)


def mapped(model: TableLM, tokens, targets):
    """The model applied one example at a time in a `jax.lax.map`: its `Stacked`'s
    scan is traced once and runs once per example."""
    return _cross_entropy(jax.lax.map(model, tokens), targets)


def twice(model: TableLM, tokens, targets):
    """The layers applied twice."""
    x = model.blocks(model.blocks(model.embed[tokens]))
    return _cross_entropy(x @ model.head.T, targets)


def frozen(model: TableLM, tokens, targets):
    """The layers' output not differentiated: their backward pass never runs."""
    x = jax.lax.stop_gradient(model.blocks(model.embed[tokens]))
    return _cross_entropy(x @ model.head.T, targets)


class Config(NamedTuple):
    policy: eo.Policy
    loss: Callable
    microbatches: int
    # The `Stacked`s whose forward scan applies the pending update.
    updating_scans: list[str]


NEXT_FORWARD = eo.Policy.offload_all(update_timing="next_forward")
NONE_NEXT_FORWARD = eo.Policy.none(update_timing="next_forward")
CONFIGS = {
    # Host-resident layers, the scan under `jax.vmap`: applied in the scan.
    "offload_all": Config(NEXT_FORWARD, cross_entropy, 1, ["blocks"]),
    # Device-resident layers, no `jax.vmap`: applied in the scan.
    "offload_residuals flat": Config(
        eo.Policy.offload_residuals(update_timing="next_forward"), flat, 1, ["blocks"]
    ),
    # Micro-batches run the loss in a loop: applied in a streamed loop before it.
    "micro-batches": Config(NEXT_FORWARD, cross_entropy, 2, []),
    # Where the forward scan cannot give the new values back once (they would be
    # added up, or zero), the step applies the update before the loss.
    "lax.map": Config(NONE_NEXT_FORWARD, mapped, 1, []),
    "twice": Config(NONE_NEXT_FORWARD, twice, 1, []),
    "frozen": Config(NONE_NEXT_FORWARD, frozen, 1, []),
}


@contextlib.contextmanager
def counting_updating_scans() -> Iterator[list[str]]:
    """The paths of the `Stacked`s whose forward scan applied a pending update,
    one per trace of the step that kept it (not one the step traced, then
    replaced by the update before the loss: `eoi.Record.applied_once`)."""
    paths: list[str] = []
    original = eoi.Record.applied_once

    def counted(record):
        once = original(record)
        if once:
            paths.extend(record.taken)
        return once

    with mock.patch.object(eoi.Record, "applied_once", counted):
        yield paths


def numpy(tree: Any) -> Any:
    """The arrays of `tree` read back (a step donates its inputs)."""
    return jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, tree)


def copy(tree: Any) -> Any:
    """`tree` with each array copied where it is (same sharding, memory kind)."""
    return jax.tree.map(
        lambda x: jax.device_put(np.asarray(x), x.sharding) if eqx.is_array(x) else x,
        tree,
    )


@functools.cache
def step(name: str) -> eo.TrainStep:
    """One step object per configuration, shared by the tests: each compiles its
    two programs (the first step's, and the steps' with an update pending) once."""
    config = CONFIGS[name]
    return eo.train_step(
        config.loss, SGD, config.policy, microbatches=config.microbatches
    )


class Run(NamedTuple):
    losses: list[float]
    # Before `apply_pending`: each leaf's memory kind, `PendingUpdate.ready`, and
    # the model (one update behind).
    model_kinds: Any
    state_kinds: Any
    ready: bool | None
    before: Any
    # The stacked layers that applied their pending update in the forward scan.
    updating_scans: list[str]
    # After `apply_pending`: the model and state, and their leaves' memory kinds.
    model: Any
    opt_state: Any
    kinds_after: Any


def _kinds(tree: Any) -> Any:
    return jax.tree.map(memory_kind, eqx.filter(tree, eqx.is_array))


@functools.cache
def run(name: str) -> Run:
    """`STEPS` steps of the configuration, then `apply_pending`."""
    policy = CONFIGS[name].policy
    model = eo.place(lm(), policy)
    state = eo.init_opt_state(SGD, model, policy)
    data = batches(batch=4)
    losses = []
    with counting_updating_scans() as paths:
        for _ in range(STEPS):
            model, state, value, _ = step(name)(model, state, *next(data))
            losses.append(float(value))
    model_kinds, state_kinds = _kinds(model), _kinds(state)
    ready = state.ready if isinstance(state, eo.PendingUpdate) else None
    before = numpy(model)
    model, state = eo.apply_pending(model, state, SGD, policy)
    after = (_kinds(model), _kinds(state))
    model, state = numpy((model, state))
    return Run(
        losses, model_kinds, state_kinds, ready, before, paths, model, state, after
    )


class Reference(NamedTuple):
    losses: list[float]
    model: Any
    opt_state: Any


@functools.cache
def reference(loss: Callable) -> Reference:
    """Plain Equinox and optax."""
    params, static = eqx.partition(lm(), eqx.is_array)
    state = SGD.init(params)

    @jax.jit
    def step(params, state, tokens, targets):
        value, grads = jax.value_and_grad(
            lambda p: loss(eqx.combine(p, static), tokens, targets)
        )(params)
        updates, state = SGD.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    data = batches(batch=4)
    losses = []
    for _ in range(STEPS):
        params, state, value = step(params, state, *next(data))
        losses.append(float(value))
    return Reference(losses, numpy(eqx.combine(params, static)), numpy(state))


def assert_same_training(ours: Run, theirs: Reference) -> None:
    assert_close(ours.losses, theirs.losses)
    assert_close(ours.model, theirs.model, tol=TRAINED, origin=lm(), steps=STEPS)
    # The momentum: a sum of the gradients, as the updates are.
    assert_close(ours.opt_state.inner, theirs.opt_state, tol=TRAINED)


@pytest.mark.parametrize("name", ["offload_all", "offload_residuals flat"])
def test_next_forward_trains_as_the_plain_step(name):
    """Every step's loss, and after `apply_pending` the parameters and the
    momentum, those of plain Equinox and optax; the update was held (`ready`) and
    applied by the forward scan of the one `Stacked`. Negative control: the
    model before `apply_pending` (the last update of the layers missing) is far
    from the reference."""
    ours = run(name)
    assert ours.ready is True
    assert ours.updating_scans == CONFIGS[name].updating_scans == ["blocks"]
    assert ours.opt_state.ready is False
    theirs = reference(cross_entropy)
    assert_same_training(ours, theirs)
    behind = excess(ours.before, theirs.model, tol=TRAINED, origin=lm(), steps=STEPS)
    assert behind > 10


@pytest.mark.parametrize("name", ["micro-batches", "lax.map", "twice", "frozen"])
def test_where_the_forward_scan_cannot_apply_it_the_step_does(name):
    """Micro-batches (the loss in a loop), a loss that runs the `Stacked` in a
    `jax.lax.map`, twice, or without differentiating it (as one that never runs
    it): its forward scan cannot give the new values back once, so the step
    applies the update in a streamed loop before the loss instead, with the
    numbers of plain training (the same loss)."""
    ours = run(name)
    assert ours.ready is True
    assert ours.updating_scans == CONFIGS[name].updating_scans == []
    loss = CONFIGS[name].loss
    assert_same_training(ours, reference(cross_entropy if loss is mapped else loss))
    assert eoi.pending_take("blocks") is None  # (nothing left owed)


def test_apply_pending():
    """Nothing pending: the arguments back. Pending: applied once (`ready`
    False after, a second call a no-op); training then goes on as plain
    training, the next step holding its update again."""
    policy = NEXT_FORWARD
    model = eo.place(lm(), policy)
    state = eo.init_opt_state(SGD, model, policy)
    assert isinstance(state, eo.PendingUpdate) and state.ready is False
    same = eo.apply_pending(model, state, SGD, policy)
    assert same[0] is model and same[1] is state

    data = batches(batch=4)
    losses = []
    for i in range(STEPS):
        model, state, loss, _ = step("offload_all")(model, state, *next(data))
        losses.append(float(loss))
        if i == 1:
            assert state.ready is True
            model, state = eo.apply_pending(model, state, SGD, policy)
            assert state.ready is False
            again = eo.apply_pending(model, state, SGD, policy)
            assert again[0] is model and again[1] is state
    assert state.ready is True
    model, state = eo.apply_pending(model, state, SGD, policy)
    theirs = reference(cross_entropy)
    assert_close(losses, theirs.losses)
    assert_close(numpy(model), theirs.model, tol=TRAINED, origin=lm(), steps=STEPS)


def test_placements():
    """Between steps and after `apply_pending`: `offload_all`'s parameters,
    optimizer state and waiting gradients in pinned host memory (the step
    counts and the held values on the device, as `init_opt_state` puts them);
    `offload_residuals`' all on the device."""
    ours = run("offload_all")
    assert set(jax.tree.leaves(ours.model_kinds)) == {"pinned_host"}
    state_kinds = ours.state_kinds
    assert set(jax.tree.leaves(state_kinds.grads)) == {"pinned_host"}
    assert set(jax.tree.leaves(state_kinds.held)) == {"device"}
    moments = [
        k
        for s, k in zip(
            jax.tree.leaves(ours.opt_state.inner), jax.tree.leaves(state_kinds.inner)
        )
        if s.ndim
    ]
    assert moments and set(moments) == {"pinned_host"}
    model_kinds, state_kinds = ours.kinds_after
    assert set(jax.tree.leaves(model_kinds)) == {"pinned_host"}
    after = [
        k
        for s, k in zip(jax.tree.leaves(ours.opt_state), jax.tree.leaves(state_kinds))
        if s.ndim
    ]
    assert set(after) == {"pinned_host"}

    device = run("offload_residuals flat")
    kinds = jax.tree.leaves((device.model_kinds, device.state_kinds))
    assert set(kinds) == {"device"}


# The held-over update's arithmetic, one step at a time: AdamW after a clip at
# 0.1 (the gradients' global norm is above it: `test_..._is_optax_update` checks
# it), with weight decay and a decaying learning rate.
ADAMW = optax.chain(
    optax.clip_by_global_norm(0.1),
    optax.adamw(optax.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.1),
)
# The gradient of `Held.shift`, exact whatever the order of the sums: it joins the
# global norm the stacked layers' update reads, without being held over itself.
SHIFT_GRAD = 0.5


class Held(eqx.Module):
    """Stacked layers, and one vector outside them whose gradient is `SHIFT_GRAD`
    exactly: every gradient of the step is then known from the ones that
    `PendingUpdate.grads` holds."""

    blocks: eo.Stacked[TanhBlock]
    shift: Float[Array, " dim"]


def held_loss(model: Held, x, y):
    out = jax.vmap(model.blocks)(x)
    return jnp.mean((out - y) ** 2) + jnp.sum(SHIFT_GRAD * model.shift)


def _held_model(dtype: Any) -> Held:
    blocks = eo.Stacked.from_fn(
        lambda k: TanhBlock(jax.random.normal(k, (DIM, DIM)) / DIM**0.5),
        DEPTH,
        key=jax.random.key(1),
    )
    model = Held(blocks, jnp.zeros(DIM))
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_array(x) else x, model)


def _held_batch(i: int) -> tuple[Array, Array]:
    x, y = jax.random.normal(jax.random.key(10 + i), (2, 4, DIM))
    return x, y


class HeldConfig(NamedTuple):
    policy: eo.Policy
    optimizer: Any
    dtype: Any
    updating_scans: list[str]


BF16 = jnp.bfloat16
HELD = {
    # Applied a layer at a time in the forward scan, and by `apply_pending`.
    "in the forward scan": HeldConfig(NEXT_FORWARD, ADAMW, jnp.float32, ["blocks"]),
    # Under a compute dtype, applied in a streamed loop before the loss.
    "bf16 compute": HeldConfig(
        eo.Policy.offload_all(update_timing="next_forward", compute_dtype=BF16),
        ADAMW,
        jnp.float32,
        [],
    ),
    # bfloat16 parameters, updated in the forward scan by SGD at a power of two:
    # `p - g / 2` is rounded to bfloat16 once however it is computed, so both
    # sides are the same bits.
    "bf16 masters": HeldConfig(NEXT_FORWARD, optax.sgd(0.5), BF16, ["blocks"]),
}


@functools.cache
def held_run(name: str) -> dict[str, Any]:
    """Three steps from a fresh state: the first holds `g0`, the second applies it
    and holds `g1`, the third applies `g1` (from a state with moments and a step
    count) before its loss; `apply_pending` applies `g1` to the same arguments.
    Returns what the checks read, as NumPy arrays."""
    config = HELD[name]
    policy, optimizer = config.policy, config.optimizer
    train = eo.train_step(held_loss, optimizer, policy)
    model = eo.place(_held_model(config.dtype), policy)
    state = eo.init_opt_state(optimizer, model, policy)
    model, state, _, _ = train(model, state, *_held_batch(0))
    # The parameters the second step's loss sees, and the state its update
    # starts from: `g0` applied, as `update_timing="now"` has them.
    model_copy, state_copy = copy((model, state))
    start = numpy(eo.apply_pending(model_copy, state_copy, optimizer, policy))
    with counting_updating_scans() as paths:
        model, state, _, _ = train(model, state, *_held_batch(1))
        held = numpy((model, state))
        model_copy, state_copy = copy((model, state))
        pending = eo.apply_pending(model_copy, state_copy, optimizer, policy)
        model, state, _, _ = train(model, state, *_held_batch(2))
    return {
        "start": start,
        "held": held,
        "apply_pending": numpy(pending),
        "next step": numpy((model, state)),
        "updating_scans": paths,
    }


@functools.partial(jax.jit, static_argnums=0)
def _optax_step(optimizer, grads, state, params):
    """Plain optax: the new parameters and state, and the gradients' norm."""
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, optax.tree.norm(grads)


def _own(state: Any) -> Any:
    """The wrapped optimizer's state, without the compute copies."""
    return state.inner if isinstance(state, eo.ComputeCopyState) else state


@pytest.mark.parametrize("name", HELD)
def test_the_held_over_update_is_optax_update_on_the_held_gradients(name):
    """The update the next step applies (in its forward scan, or before its loss)
    and the one `apply_pending` applies are `optimizer.update` on the gradients
    `PendingUpdate.grads` holds, from the state and parameters the step that
    computed them had (`g0` applied: moments and a step count), compared as one
    update (`F32`). Negative controls: the reference's state one step count
    ahead; one layer's update dropped."""
    config = HELD[name]
    out = held_run(name)
    assert out["updating_scans"] == config.updating_scans
    params, state = out["start"]
    held_model, held_state = out["held"]
    assert held_state.ready is True
    # Every gradient of the step: the held ones, and the known one.
    grads = eqx.tree_at(
        lambda g: g.shift, held_state.grads, jnp.full(DIM, SHIFT_GRAD, config.dtype)
    )
    inner = _own(state.inner)
    expected, new_inner, norm = numpy(
        _optax_step(config.optimizer, grads, inner, params)
    )
    if config.optimizer is ADAMW:
        assert norm > 0.1  # the clip clips
    applied, applied_state = out["apply_pending"]
    next_model, next_state = out["next step"]
    weight = applied.blocks.layers.weight.copy()
    weight[1] = params.blocks.layers.weight[1]
    dropped = eqx.tree_at(lambda m: m.blocks.layers.weight, applied, weight)

    if config.dtype == BF16:
        assert {x.dtype for x in jax.tree.leaves(applied)} == {jnp.dtype(BF16)}
        assert_trees_equal(held_model.shift, expected.shift)  # (updated at once)
        assert_trees_equal(applied, expected)
        assert_trees_equal(next_model.blocks, expected.blocks)
        with pytest.raises(AssertionError):
            assert_trees_equal(dropped, expected)
        return

    # The leaf outside the layers was updated at the end of the step, at once.
    assert_close(held_model.shift, expected.shift, origin=params.shift)
    assert_close(applied, expected, origin=params)
    assert_close(_own(applied_state.inner), new_inner)
    assert_close(next_model.blocks, expected.blocks, origin=params.blocks)
    assert_close(_layers(_own(next_state.inner)), _layers(new_inner))
    if name == "bf16 compute":
        # The compute copies written with the new masters.
        cast = jax.tree.map(lambda x: x.astype(BF16), applied)
        assert_trees_equal(applied_state.inner.copies, cast)

    # Negative controls: the state's step count one ahead (the bias correction
    # and the learning rate of the step after); layer 1's update dropped.
    ahead = jax.tree.map(
        lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.integer) else x, inner
    )
    wrong = _optax_step(config.optimizer, grads, ahead, params)[0]
    assert excess(applied, numpy(wrong), origin=params) > 10
    assert excess(dropped, expected, origin=params) > 10


def test_a_model_one_update_behind_runs_only_in_the_step():
    """The step marks the `Stacked` whose update it held over; the next step
    applies it (two compiled programs in all: the mark is static, as `ready`
    is); evaluating the marked model, through `filter_offload` or a plain
    call, is refused naming `apply_pending`, which clears the mark."""
    policy = NEXT_FORWARD
    model = eo.place(lm(), policy)
    state = eo.init_opt_state(SGD, model, policy)
    data = batches(batch=4)
    for _ in range(3):
        model, state, _, _ = step("offload_all")(model, state, *next(data))
        assert model.blocks.pending
    assert step("offload_all")._jitted._cache_size() == 2
    tokens, targets = next(data)
    evaluate = eqx.filter_jit(eo.filter_offload(cross_entropy, policy))
    with pytest.raises(ValueError, match="`blocks` is one .*apply_pending"):
        evaluate(model, tokens, targets)
    with pytest.raises(ValueError, match="`stacked` is one .*apply_pending"):
        model.blocks(jnp.zeros(DIM))
    model, state = eo.apply_pending(model, state, SGD, policy)
    assert not model.blocks.pending
    assert jnp.isfinite(evaluate(model, tokens, targets))


def _layers(state: Any) -> list[Any]:
    """The stacked layers' part of each parameter-shaped part of `state`."""
    is_held = lambda x: isinstance(x, Held)  # noqa: E731
    return [x.blocks for x in jax.tree.leaves(state, is_leaf=is_held) if is_held(x)]


def test_errors():
    with unchecked(), pytest.raises(ValueError, match="update_timing='bad'"):
        eo.Policy(update_timing="bad")  # pyright: ignore[reportArgumentType]
    with unchecked(), pytest.raises(ValueError, match="'delayed'.*removed.*'now'"):
        eo.Policy(update_timing="delayed")  # pyright: ignore[reportArgumentType]
    for update in ("host", "whole"):
        with pytest.raises(ValueError, match=f"update='{update}'.*'streamed'"):
            eo.Policy.offload_all(update=update, update_timing="next_forward")
    policy = NONE_NEXT_FORWARD
    with pytest.raises(ValueError, match=r"metrics=True.*update_timing='now'"):
        eo.train_step(cross_entropy, SGD, policy, metrics=True)

    model = lm()
    state = eo.init_opt_state(SGD, model, policy)
    plain_state = eo.init_opt_state(SGD, model, eo.Policy.none())

    @eqx.filter_jit
    def by_hand(model, state, tokens, targets):
        grads = eqx.filter_grad(eo.filter_offload(cross_entropy, policy))(
            model, tokens, targets
        )
        return eo.optimizer_update(SGD, grads, state, model, policy)

    with pytest.raises(ValueError, match=r"optimizer_update.*update_timing='now'"):
        by_hand(model, state, *next(batches()))

    with pytest.raises(ValueError, match="init_opt_state"):
        eo.apply_pending(model, plain_state, SGD, policy)
    with pytest.raises(ValueError, match="update_timing='now'"):
        eo.apply_pending(model, state, SGD, eo.Policy.none())

    # A state built under another `update_timing`, either way round.
    with pytest.raises(ValueError, match="does not have the structure"):
        step("lax.map")(model, plain_state, *next(batches()))
    plain_step = eo.train_step(mapped, SGD, eo.Policy.none())
    with pytest.raises(ValueError, match="does not have the structure"):
        plain_step(model, state, *next(batches()))
