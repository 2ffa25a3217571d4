"""`train_step(..., metrics=True)` and `optimizer_update`: gradient, update and
parameter norms as streamed reductions, equal to plain optax."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import batches, cross_entropy, table_lm
from .numerics import assert_close, excess


def norms(grads, updates, new) -> dict:
    return {
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(new),
    }


def without_first_layer(tree):
    """`tree` with the first layer of its stacked leaves zeroed: norms that leave
    a layer out, the negative control of a comparison of norms."""
    return eqx.tree_at(
        lambda t: t.blocks.layers.weight, tree, replace_fn=lambda w: w.at[0].set(0)
    )


@eqx.filter_jit
def reference(optimizer, grads, opt_state, params):
    """optax's update of `params` on `grads`: the new parameters and state, the
    norms, and the norms without the first layer."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    trees = (grads, updates, new)
    return new, opt_state, norms(*trees), norms(*map(without_first_layer, trees))


# The first step, from a fresh state: SGD's update is the gradient's (Lipschitz:
# within `F32`, as the gradient is). Adam's is compared on the same gradients
# (`test_own_step_with_optimizer_update`).
SGD = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))


@pytest.mark.parametrize(
    "update, microbatches", [("streamed", 2), ("auto", 1)], ids=["streamed", "auto"]
)
def test_norms_equal_plain_optax(getkey, update, microbatches):
    """Streamed (a loss with aux over two micro-batches) and the CPU's whole update:
    the norms and the loss at float32's tolerance, against plain optax on the
    whole batch's gradients; norms that leave a layer out are more than ten times
    off."""
    key = getkey()
    batch = next(batches(batch=4))

    def loss_fn(model, tokens, targets):
        loss = cross_entropy(model, tokens, targets)
        return loss, {"loss": loss}

    params = table_lm(key)
    grads = eqx.filter_grad(cross_entropy)(params, *batch)
    state = SGD.init(eqx.filter(params, eqx.is_inexact_array))
    _, _, expected, dropped = reference(SGD, grads, state, params)
    policy = eo.Policy.offload_all(update=update)
    model = eo.place(table_lm(key), policy)
    opt_state = eo.init_opt_state(SGD, model, policy)
    step = eo.train_step(
        loss_fn, SGD, policy, has_aux=True, microbatches=microbatches, metrics=True
    )
    _, _, (loss, aux), metrics = step(model, opt_state, *batch)
    assert metrics is not None
    assert set(metrics) == set(expected)
    assert {x.dtype for x in metrics.values()} == {jnp.dtype(jnp.float32)}
    assert aux["loss"].shape == ((2,) if microbatches == 2 else ())
    assert_close(metrics, expected)
    assert_close(loss, cross_entropy(table_lm(key), *batch))
    for name in expected:
        assert excess(metrics[name], dropped[name]) > 10, name


def test_own_step_with_optimizer_update(getkey):
    """Adam's norms, parameters and state, a step at a time on the same gradients
    as optax, from a state one step old (moments, a count). Negative controls:
    norms that leave a layer out, the state of the gradients' sign flipped."""
    key = getkey()
    optimizer = optax.adamw(1e-2)
    policy = eo.Policy.offload_all(compute_dtype=None)
    loss = eo.filter_offload(cross_entropy, policy)

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, *batch)
        model, opt_state, metrics = eo.optimizer_update(
            optimizer, grads, opt_state, model, policy, metrics=True
        )
        return grads, model, opt_state, metrics

    model = eo.place(table_lm(key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    data = batches(batch=4)
    _, model, opt_state, _ = step(next(data), model, opt_state)
    start, state = jax.tree.map(np.asarray, (model, opt_state))  # (donated)
    grads, model, opt_state, metrics = step(next(data), model, opt_state)
    grads = jax.tree.map(np.asarray, grads)  # (on the host)
    new, new_state, expected, dropped = reference(optimizer, grads, state, start)
    assert_close(metrics, expected)
    assert_close(model, new, origin=start)
    assert_close(opt_state, new_state)
    flipped = jax.tree.map(np.negative, grads)  # the state of a wrong sign
    assert excess(opt_state, reference(optimizer, flipped, state, start)[1]) > 10
    for name in expected:
        assert excess(metrics[name], dropped[name]) > 10, name
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
    model = eo.place(table_lm(getkey()), policy)
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
    on the device: +19% here, +6% on the GPT benchmark model; see
    `docs/benchmarks/microbatches-bf16-metrics.md`.)"""
    optimizer = optax.adamw(1e-3)
    policy = eo.Policy.offload_all()
    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), 64, dim)
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
