"""`train_step(..., microbatches=k)`: the batch split in `k`, gradients accumulated
inside the one compiled step, equal to the whole batch's step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import eqx_offload as eo

from .helpers import (
    assert_trees_close,
    batches,
    CountCompiles,
    cross_entropy,
    memory_kind,
    Model,
)


def _reference(model, optimizer, steps, loss_fn=cross_entropy):
    """Plain Equinox + optax on the device, the whole batch at once."""
    params = eqx.filter(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    @eqx.filter_jit
    def step(model, state, *batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        updates, state = optimizer.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for batch in steps:
        model, state, loss = step(model, state, *batch)
        losses.append(float(loss))
    return model, losses


def _offloaded(model, optimizer, policy, steps, k):
    """`train_step` with `k` micro-batches over `steps`, from `model` placed by
    `policy`: the trained model, the losses and the step (its compiles counted)."""
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = CountCompiles(
        eo.train_step(cross_entropy, optimizer, policy, microbatches=k)
    )
    losses = []
    for batch in steps:
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        losses.append(float(loss))
    return model, losses, step


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


KEY = jax.random.key(17)


@pytest.fixture(scope="module")
def whole_batch():
    """Three batches of 8, and plain Equinox's SGD steps of `Model(key=KEY)` on
    them, each batch whole: the same for every preset, so run once."""
    steps = [b for _, b in zip(range(3), batches(batch=8))]
    return steps, _reference(Model(key=KEY), optax.sgd(0.1), steps)


@pytest.mark.parametrize(
    "preset, update",
    [
        ("none", "auto"),
        ("offload_residuals", "auto"),
        ("offload_all", "streamed"),
    ],
)
def test_equals_the_whole_batch_step(whole_batch, preset, update):
    optimizer = optax.sgd(0.1)
    steps, (ref_model, ref_losses) = whole_batch

    policy = getattr(eo.Policy, preset)(update=update)
    model, losses, step = _offloaded(Model(key=KEY), optimizer, policy, steps, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(eo.place(model, eo.Policy(params="device")), ref_model)
    assert step.compiled_on == [0]
    kind = "pinned_host" if preset == "offload_all" else "device"
    assert {memory_kind(x) for x in _arrays(model)} == {kind}


@pytest.mark.parametrize("dim", [16, 128])
def test_host_leaves_outside_the_layers_accumulate_where_they_can(dim):
    """The embedding and head outside the `Stacked`, host-resident: at width 128
    (whole TPU tiles) their accumulators stay on the host and are added to in the
    backward pass; at width 16 they are summed on the device
    (`_tiling.whole_tiles`). Either way, the whole batch's step, and the
    parameters on the host."""
    steps = [b for _, b in zip(range(2), batches(vocab=64, batch=4))]
    model = Model(vocab=64, dim=dim, depth=2, key=KEY)
    ref_model, ref_losses = _reference(model, optax.sgd(0.1), steps)
    policy = eo.Policy.offload_all()
    ours, losses, _ = _offloaded(model, optax.sgd(0.1), policy, steps, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(eo.place(ours, eo.Policy(params="device")), ref_model)
    assert memory_kind(ours.head.weight) == "pinned_host"


def test_adamw_state_and_parameters_follow_the_whole_batch(getkey):
    key = getkey()
    optimizer = optax.adamw(1e-2)
    steps = [b for _, b in zip(range(3), batches(batch=6))]
    ref_model, ref_losses = _reference(Model(key=key), optimizer, steps)
    policy = eo.Policy.offload_all(update="streamed")
    model, losses, _ = _offloaded(Model(key=key), optimizer, policy, steps, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(
        eo.place(model, eo.Policy(params="device")), ref_model, after_adam=(1e-2, 3)
    )


def test_aux_comes_back_per_micro_batch_and_unsplit_arguments_are_whole(getkey):
    key = getkey()
    tokens, targets = next(batches(batch=4))
    weights = jnp.linspace(0.5, 1.5, tokens.shape[1])

    def loss_fn(model, tokens, targets, weights):
        logits = jax.vmap(model)(tokens)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        loss = jnp.mean(per_token * weights)
        return loss, {"first": tokens[:, 0], "loss": loss}

    optimizer = optax.sgd(0.1)
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(
        loss_fn, optimizer, policy, has_aux=True, microbatches=2, unsplit=(2,)
    )
    _, _, (loss, aux), _ = step(model, opt_state, tokens, targets, weights)
    # Micro-batch i holds examples i, i + 2.
    np.testing.assert_array_equal(aux["first"], tokens[jnp.array([[0, 2], [1, 3]]), 0])
    assert aux["loss"].shape == (2,)
    np.testing.assert_allclose(loss, aux["loss"].mean(), rtol=1e-6)
    ref = loss_fn(Model(key=key), tokens, targets, weights)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_bad_arguments_name_the_fix(getkey):
    optimizer = optax.sgd(0.1)
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens, targets = next(batches(batch=6))
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=4)
    with pytest.raises(ValueError, match=r"leading axis 6.*multiple of 4"):
        step(model, opt_state, tokens, targets)

    def with_key(model, tokens, targets, key):
        del key
        return cross_entropy(model, tokens, targets)

    step = eo.train_step(with_key, optimizer, policy, microbatches=2)
    with pytest.raises(
        ValueError, match=r"batch argument 2 is a scalar.*unsplit=\(2,\)"
    ):
        step(model, opt_state, tokens, targets, jax.random.key(0))
    step = eo.train_step(with_key, optimizer, policy, microbatches=2, unsplit=(5,))
    with pytest.raises(ValueError, match="`unsplit` names batch argument 5"):
        step(model, opt_state, tokens, targets, jax.random.key(0))
    with pytest.raises(ValueError, match="no effect without `microbatches`"):
        eo.train_step(with_key, optimizer, policy, unsplit=(2,))
    with pytest.raises(ValueError, match="must be >= 1"):
        eo.train_step(with_key, optimizer, policy, microbatches=0)
    with pytest.raises(TypeError, match="microbatches"):
        eo.train_step(with_key, optimizer, policy, microbatches=2.0)  # pyright: ignore


def test_a_layer_taken_out_of_its_stack(getkey):
    """Host-resident layers get their gradients where the `Stacked` applies them:
    one taken out is an error; on the device it trains like the whole batch."""

    def by_hand(model, tokens, targets):
        first = model.blocks[0]
        x = jax.vmap(lambda t: first(jax.vmap(model.embed)(t)))(tokens)
        return jnp.mean(x**2)

    optimizer = optax.sgd(0.1)
    tokens, targets = next(batches(batch=2))
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(by_hand, optimizer, policy, microbatches=2)
    with pytest.raises(ValueError, match=r"Apply the layers with `blocks\(x\)`"):
        step(model, opt_state, tokens, targets)

    key = getkey()
    ref_model, _ = _reference(Model(key=key), optimizer, [(tokens, targets)], by_hand)
    policy = eo.Policy.remat()
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(by_hand, optimizer, policy, microbatches=2)
    with pytest.warns(UserWarning, match="outside its scan"):
        model, _, _, _ = step(model, opt_state, tokens, targets)
    assert_trees_close(model, ref_model)


def test_on_a_mesh_with_a_laid_out_batch(getkey):
    """FSDP over 4 devices, the batch over the same axis, 2 micro-batches: the
    same losses and parameters as one device and the whole batch."""
    key = getkey()
    optimizer = optax.sgd(0.1)
    steps = [b for _, b in zip(range(2), batches(batch=8))]
    ref_model, ref_losses = _reference(Model(key=key), optimizer, steps)
    mesh = jax.make_mesh(
        (4,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4]
    )
    policy = eo.Policy.offload_all(shard=eo.FSDP("fsdp", min_size=64), batch="fsdp")
    with jax.set_mesh(mesh):
        model = eo.place(Model(key=key), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
        losses = []
        for batch in steps:
            model, opt_state, loss, _ = step(model, opt_state, *batch)
            losses.append(float(loss))
        with pytest.raises(ValueError, match=r"laid out in 4 blocks.*multiple of 8"):
            step(model, opt_state, *next(batches(batch=4)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(model, ref_model)
    specs = {x.sharding.spec for x in _arrays(model)}
    assert any("fsdp" in str(s) for s in specs)


@pytest.mark.parametrize("dim", [72])
def test_compiles_for_tpu_at_small_and_odd_widths(dim):
    """On `tpu-v5e`, at small and odd widths, the micro-batched `offload_all` step
    compiles, with and without a compute dtype; the compute copies are on the
    host. (How device memory falls with `k` is in `benchmarks/microbatch.py`.)"""
    optimizer = optax.adamw(1e-3)
    abstract = eqx.filter_eval_shape(Model, 64, dim, 3, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    host = {}
    for dtype in (None, jnp.bfloat16):
        policy = eo.Policy.offload_all(compute_dtype=dtype)
        model = eo.place(abstract, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(cross_entropy, optimizer, policy, microbatches=4)
        report = eo.memory_report(
            step, model, opt_state, tokens, tokens, target="tpu-v5e"
        )
        host[dtype] = report.opt_state["pinned_host"]  # pyright: ignore
    params = sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves(abstract)
        if isinstance(x, jax.ShapeDtypeStruct)
    )
    # The bf16 copy of every parameter (all are on the host) is optimizer state.
    assert host[jnp.bfloat16] - host[None] == params // 2
