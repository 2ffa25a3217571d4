"""`train_step(..., metrics=True)` and `optimizer_update`: gradient, update and
parameter norms as streamed reductions, equal to plain optax."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import batches, cross_entropy, Model


@eqx.filter_jit
def _reference(model, optimizer, batch):
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = eqx.filter_grad(cross_entropy)(model, *batch)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = eqx.apply_updates(params, updates)
    return {
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(new),
    }


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adamw+clip": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2)
    ),
}


@pytest.mark.parametrize(
    "update, name",
    [("streamed", "sgd"), ("streamed", "adamw+clip"), ("auto", "adamw+clip")],
)
def test_norms_equal_plain_optax(getkey, update, name):
    key = getkey()
    optimizer = OPTIMIZERS[name]()
    batch = next(batches(batch=4))
    expected = _reference(Model(key=key), optimizer, batch)
    policy = eo.Policy.offload_all(update=update)
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy, metrics=True)
    _, _, loss, metrics = step(model, opt_state, *batch)
    assert metrics is not None
    assert set(metrics) == set(expected)
    for k, v in expected.items():
        assert metrics[k].dtype == jnp.float32
        np.testing.assert_allclose(metrics[k], v, rtol=1e-5)
    np.testing.assert_allclose(loss, cross_entropy(Model(key=key), *batch), rtol=1e-5)


def test_with_aux_and_micro_batches(getkey):
    key = getkey()

    def loss_fn(model, tokens, targets):
        loss = cross_entropy(model, tokens, targets)
        return loss, {"loss": loss}

    optimizer = optax.sgd(0.1)
    batch = next(batches(batch=4))
    expected = _reference(Model(key=key), optimizer, batch)
    policy = eo.Policy.offload_all(update="streamed")
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(
        loss_fn, optimizer, policy, has_aux=True, microbatches=2, metrics=True
    )
    _, _, (loss, aux), metrics = step(model, opt_state, *batch)
    assert metrics is not None
    assert aux["loss"].shape == (2,)
    for k, v in expected.items():
        np.testing.assert_allclose(metrics[k], v, rtol=1e-5)


def test_own_step_with_optimizer_update(getkey):
    key = getkey()
    optimizer = optax.adamw(1e-2)
    batch = next(batches(batch=4))
    expected = _reference(Model(key=key), optimizer, batch)
    policy = eo.Policy.offload_all(compute_dtype=None)
    loss = eo.filter_offload(cross_entropy, policy)

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, *batch)
        model, opt_state, metrics = eo.optimizer_update(
            optimizer, grads, opt_state, model, policy, metrics=True
        )
        return value, model, opt_state, metrics

    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    _, model, opt_state, metrics = step(batch, model, opt_state)
    for k, v in expected.items():
        np.testing.assert_allclose(metrics[k], v, rtol=1e-5)
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    }
    assert kinds == {"pinned_host"}
    # Outside a jitted step, and with a model placed elsewhere: errors that say so.
    with pytest.raises(ValueError, match="outside a jitted function"):
        eo.optimizer_update(optimizer, None, opt_state, model, policy)
    device = eo.place(model, eo.Policy(params="device"))

    @eqx.filter_jit
    def wrong(model, opt_state):
        grads = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
        return eo.optimizer_update(optimizer, grads, opt_state, model, policy)

    with pytest.raises(ValueError, match=r"`optimizer_update`: model leaf .* place"):
        wrong(device, opt_state)


def test_one_return_shape_whatever_the_flags(getkey):
    """A step returns `(model, opt_state, loss, metrics)` and `optimizer_update`
    `(model, opt_state, metrics)`, `metrics` `None` without `metrics=True`."""
    optimizer = optax.sgd(0.1)
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    batch = next(batches(batch=4))
    step = eo.train_step(cross_entropy, optimizer, policy)
    model, opt_state, loss, metrics = step(model, opt_state, *batch)
    assert metrics is None and loss.shape == ()
    loss = eo.filter_offload(cross_entropy, policy)

    @eqx.filter_jit
    def update(model, opt_state):
        grads = eqx.filter_grad(loss)(model, *batch)
        return eo.optimizer_update(optimizer, grads, opt_state, model, policy)

    _, _, metrics = update(model, opt_state)
    assert metrics is None


@pytest.mark.parametrize("dim", [40])
def test_streamed_on_tpu_without_more_traffic(dim):
    """On `tpu-v5e`, metrics add no traffic: the norms are partial sums carried
    through the update's own loops. (The compiler then keeps a few more pieces
    on the device: +9% here, +6% on the GPT benchmark model; see
    `docs/benchmarks/microbatches-bf16-metrics.md`.)"""
    optimizer = optax.adamw(1e-3)
    policy = eo.Policy.offload_all()
    abstract = eqx.filter_eval_shape(Model, 64, dim, 4, key=jax.random.key(0))
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    reports = [
        eo.memory_report(
            eo.train_step(cross_entropy, optimizer, policy, metrics=on),
            model,
            opt_state,
            tokens,
            tokens,
            target="tpu-v5e",
        )
        for on in (False, True)
    ]
    off, on = reports
    assert on.host_to_device_bytes == off.host_to_device_bytes
    assert on.device_to_host_bytes == off.device_to_host_bytes
    assert on.device_bytes <= 1.2 * off.device_bytes
