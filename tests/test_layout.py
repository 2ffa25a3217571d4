"""Layouts declared in a `Policy`: `shard=` patterns to `PartitionSpec`s, the `FSDP`
shorthand, the batch spec, abstract meshes, and the errors that name the leaf."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_offload as eo
from eqx_offload.internal import flat_arguments

from .helpers import CountCompiles, MLPBlock, StackedNet, unchecked
from .numerics import assert_close, excess, scaled, TRAINED


def make_net(*, key: PRNGKeyArray) -> StackedNet:
    """8 residual MLPs (16 wide) in a `Stacked`, then a head to 4 outputs."""
    return StackedNet(lambda k: MLPBlock(16, 24, key=k), 8, (16, 4), key=key)


def loss_fn(model: StackedNet, x: Float[Array, "n 16"]) -> Float[Array, ""]:
    return jnp.mean(jax.vmap(model)(x) ** 2)


X = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
TP = {
    "**": eo.FSDP("fsdp", min_size=0),
    "blocks.fc1.weight": P("tp", "fsdp"),
    "blocks.fc2.weight": P("fsdp", "tp"),
}


def _specs(tree) -> dict[str, tuple]:
    leaves = jax.tree.leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {
        jax.tree_util.keystr(k): (tuple(x.sharding.spec), x.sharding.memory_kind)
        for k, x in leaves
    }


def _mesh(shape=(4, 2), names=("fsdp", "tp"), axis_type=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def test_patterns_and_fsdp_shorthand():
    policy = eo.Policy.offload_all(shard=TP)
    with jax.set_mesh(_mesh()):
        model = eo.place(make_net(key=jax.random.key(0)), policy)
    specs = _specs(model)
    # A stacked leaf's spec describes one layer; the layer axis is never split.
    assert specs[".blocks.layers.fc1.weight"] == (
        (None, "tp", "fsdp"),
        "pinned_host",
    )
    assert specs[".blocks.layers.fc2.weight"] == ((None, "fsdp", "tp"), "pinned_host")
    # FSDP: the largest dimension the axis divides (24 of 8 × 24), not the layers.
    assert specs[".blocks.layers.fc1.bias"] == ((None, "fsdp"), "pinned_host")
    assert specs[".head.weight"] == ((None, "fsdp"), "pinned_host")
    assert specs[".head.bias"] == (("fsdp",), "pinned_host")


def test_fsdp_leaves_small_and_undivisible_leaves_replicated():
    mesh = _mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        # Below the default `min_size` of 4096 elements per layer: replicated.
        model = eo.place(make_net(key=jax.random.key(0)), eo.Policy(shard="data"))
        assert set(spec for spec, _ in _specs(model).values()) == {()}
        policy = eo.Policy(shard=eo.FSDP("data", min_size=300))
        specs = _specs(eo.place(make_net(key=jax.random.key(0)), policy))
        # 24 × 16 elements per layer: split along the 24 (8 divides 24 and 16).
        assert specs[".blocks.layers.fc1.weight"][0] == (None, "data")
        assert specs[".head.weight"][0] == ()  # 4 × 16 elements
        policy = eo.Policy(shard=eo.FSDP("data", min_size=0))
        with pytest.warns(UserWarning, match=r"'head\.bias \(4,\)' replicated"):
            model = eo.place(make_net(key=jax.random.key(0)), policy)
    assert _specs(model)[".head.bias"][0] == ()


def test_init_opt_state_lays_out_state_like_its_parameter():
    policy = eo.Policy.offload_all(shard=TP)
    with jax.set_mesh(_mesh()):
        model = eo.place(make_net(key=jax.random.key(0)), policy)
    state = eo.init_opt_state(optax.adam(1e-3), model, policy)
    mu = state[0].mu
    assert mu.blocks.layers.fc1.weight.sharding.spec == P(None, "tp", "fsdp")
    assert mu.blocks.layers.fc1.weight.sharding.memory_kind == "pinned_host"
    assert state[0].count.sharding.memory_kind == "device"


def test_abstract_mesh_lays_out_an_abstract_model():
    mesh = AbstractMesh((16, 8), ("fsdp", "tp"))
    shard = {"**": eo.FSDP("fsdp", min_size=0), "blocks.fc1.weight": P(None, "tp")}
    policy = eo.Policy.offload_all(shard=shard)
    abstract = eqx.filter_eval_shape(make_net, key=jax.random.key(0))
    with pytest.warns(UserWarning, match=r"'blocks.fc1.bias \(8, 24\)'"):
        model = eo.place(abstract, policy, mesh=mesh)  # 24 rows over 16
    weight = model.blocks.layers.fc1.weight
    assert isinstance(weight, jax.ShapeDtypeStruct)
    assert weight.sharding.mesh == mesh
    assert weight.sharding.spec == P(None, None, "tp")
    assert weight.sharding.memory_kind == "pinned_host"
    assert model.blocks.layers.fc2.weight.sharding.spec == P(None, "fsdp")
    with pytest.raises(ValueError, match="needs a concrete `jax.sharding.Mesh`"):
        eo.place(make_net(key=jax.random.key(0)), policy, mesh=mesh)


@pytest.mark.parametrize(
    "shard, match",
    [
        ({"blocks.fc1.weight": P("model")}, r"'blocks.fc1.weight'.*no axis 'model'"),
        ({"head.bias": P("tp", None)}, r"'head.bias' has shape \(4,\).*2 entries"),
        ({"blocks.fc1.weight": P(None, None, "fsdp")}, r"per layer.*drop the entry"),
        ({"head.weight": P(("fsdp", "tp"))}, r"'head.weight'.*into 8 parts"),
        ({"head.weight": P("tp", "tp")}, r"'head.weight'.*axis 'tp' twice"),
        ({"blocks.attn": P()}, r"'blocks.attn' match no leaf"),
        ({"head": eo.FSDP("data")}, r"'head.weight'.*no axis 'data'"),
        ({"head": 3}, r"must be a `jax.sharding.PartitionSpec`"),
    ],
)
def test_bad_specs_name_the_leaf(shard, match):
    with unchecked(), pytest.raises((ValueError, TypeError), match=match):
        with jax.set_mesh(_mesh()):
            eo.place(make_net(key=jax.random.key(0)), eo.Policy(shard=shard))


def test_no_mesh_is_an_error():
    with pytest.raises(ValueError, match=r"there is no mesh.*jax.set_mesh"):
        eo.place(make_net(key=jax.random.key(0)), eo.Policy(shard="fsdp"))


def test_batch_spec():
    policy = eo.Policy(shard=TP, batch="fsdp")
    optimizer = optax.sgd(0.1)
    with jax.set_mesh(_mesh()):
        model = eo.place(make_net(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy)
    dynamic, _ = flat_arguments(step, model, opt_state, np.asarray(X))
    assert dynamic[2][0].sharding.spec == P("fsdp")
    # Laid out by hand on the mesh: kept.
    by_hand = jax.device_put(X, NamedSharding(_mesh(), P("tp")))
    dynamic, _ = flat_arguments(step, model, opt_state, by_hand)
    assert dynamic[2][0].sharding.spec == P("tp")
    with pytest.raises(ValueError, match=r"batch leaf 'batch\[0\]'.*\(6, 16\)"):
        step(model, opt_state, X[:6])


def _replicated(x) -> bool:
    return all(entry is None for entry in x.sharding.spec)


def test_per_example_keys_are_laid_out_with_the_batch():
    """A PRNG key array with a leading axis is batch data (per-example keys, as the
    tutorial recommends): split like the inputs, so that a loss with `Explicit` axes
    can `jax.vmap` over both. A scalar key and the arguments passed whole to every
    micro-batch (`unsplit`) are replicated."""

    def noisy_loss(model: StackedNet, x: Float[Array, "n 16"], keys: PRNGKeyArray):
        def one(x, key):
            return model(x + 0.1 * jax.random.normal(key, x.shape))

        return jnp.mean(jax.vmap(one)(x, keys) ** 2)

    net, keys = make_net(key=jax.random.key(0)), jax.random.split(jax.random.key(1), 8)
    expected = eqx.filter_jit(noisy_loss)(net, X, keys)
    mesh = _mesh((8,), ("data",), AxisType.Explicit)
    policy = eo.Policy.offload_all(
        shard=eo.FSDP("data", min_size=300), batch="data", loss_axes="explicit"
    )
    model = eo.place(net, policy, mesh=mesh)
    optimizer = optax.sgd(0.1)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(noisy_loss, optimizer, policy)
    (_, _, batch), _ = flat_arguments(step, model, opt_state, np.asarray(X), keys)
    x, laid_out = batch
    assert x.sharding.spec[0] == laid_out.sharding.spec[0] == "data"
    _, _, loss, _ = step(model, opt_state, X, keys)
    assert_close(loss, expected)
    assert excess(scaled(loss, 1.01), expected) > 10

    def shared_loss(model: StackedNet, x, keys, scale, key) -> Float[Array, ""]:
        return noisy_loss(model, x * scale, keys) + jax.random.uniform(key)

    step = eo.train_step(shared_loss, optimizer, policy, microbatches=2, unsplit=(2, 3))
    batch = (np.ones((16, 16)), jax.random.split(keys[0], 16), np.ones(16), keys[0])
    (_, _, laid_out), _ = flat_arguments(step, model, opt_state, *batch)
    x, split_keys, scale, key = laid_out
    assert x.sharding.spec[0] == split_keys.sharding.spec[0] == "data"
    assert _replicated(scale) and _replicated(key) and key.sharding.mesh == mesh


def test_a_loss_closing_over_an_array_traced_on_explicit_axes():
    """`Policy(loss_axes="auto")` casts what enters the loss through its arguments
    onto `Auto` axes; an array the loss closes over, traced under `Explicit` axes
    (a batch captured by a `lambda` in a step of your own), cannot enter: JAX's
    error. Passed as an argument, it works."""
    net = make_net(key=jax.random.key(0))
    expected = eqx.filter_jit(loss_fn)(net, X)
    mesh = _mesh((8,), ("data",), AxisType.Explicit)
    policy = eo.Policy(shard=eo.FSDP("data", min_size=300), batch="data")
    model = eo.place(net, policy, mesh=mesh)
    x = jax.device_put(X, NamedSharding(mesh, P("data")))

    @eqx.filter_jit
    def closed_over(model: StackedNet, x: Float[Array, "n 16"]) -> Float[Array, ""]:
        return eo.filter_offload(lambda m: loss_fn(m, x), policy)(model)

    @eqx.filter_jit
    def passed(model: StackedNet, x: Float[Array, "n 16"]) -> Float[Array, ""]:
        return eo.filter_offload(loss_fn, policy)(model, x)

    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError, match=r"context mesh .*Auto.* should match the aval mesh"
        ):
            closed_over(model, x)
        loss = passed(model, x)
    assert_close(loss, expected)
    assert excess(scaled(loss, 1.01), expected) > 10


def test_train_step_refuses_a_model_not_laid_out_as_declared():
    policy = eo.Policy(shard=TP)
    optimizer = optax.sgd(0.1)
    with jax.set_mesh(_mesh()):
        model = eo.place(make_net(key=jax.random.key(0)), eo.Policy(shard="fsdp"))
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy)
    with pytest.raises(ValueError, match=r"'blocks.fc1.weight' is laid out as"):
        step(model, opt_state, X)


def _one_device(steps: int) -> tuple[StackedNet, list[float]]:
    """SGD on one device, plain Equinox + optax: the model after `steps` steps on
    `X`, and the losses."""
    optimizer = optax.sgd(0.1)

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, X)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    model = make_net(key=jax.random.key(0))
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    losses = []
    for _ in range(steps):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    return model, losses


def test_fsdp_trains_like_one_device_on_explicit_axes():
    """With `Policy(loss_axes="explicit")`, under `Explicit` axes the library
    gathers each FSDP-sharded layer before use (JAX would otherwise refuse the
    sharded contraction): the losses and the updates of the parameters are one
    device's to float32 rounding. (On `Auto` axes, where the partitioner
    gathers: `test_meshes_train_as_one_device.py`,
    `test_trains_like_one_device[declared-8-...]`.)"""
    optimizer = optax.sgd(0.1)
    policy = eo.Policy.offload_all(
        shard=eo.FSDP("data", min_size=0), batch="data", loss_axes="explicit"
    )
    with jax.set_mesh(_mesh((8,), ("data",), AxisType.Explicit)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # head.bias (4,): replicated
            model = eo.place(make_net(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = CountCompiles(eo.train_step(loss_fn, optimizer, policy))
    losses = []
    for _ in range(3):
        model, opt_state, loss, _ = step(model, opt_state, X)
        losses.append(float(loss))
    reference, expected = _one_device(3)
    assert_close(losses, expected)
    assert excess(scaled(losses, 1.01), expected) > 10
    start = make_net(key=jax.random.key(0))
    assert_close(model, reference, tol=TRAINED, origin=start, steps=3)
    assert step.compiled_on == [0]
    weight = model.blocks.layers.fc1.weight
    assert tuple(weight.sharding.spec)[:2] == (None, "data")


def test_verify_with_declared_layouts():
    """`verify` cuts the batch to a multiple of the parts the batch spec splits it
    into (4 here, not the default 2)."""
    policy = eo.Policy.offload_all(shard=TP, batch="fsdp")
    with jax.set_mesh(_mesh()):
        model = eo.place(make_net(key=jax.random.key(0)), policy)
    optimizer = optax.sgd(0.1)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy)
    report = eo.verify(step, model, opt_state, X)
    assert report.examples == 4 and not report.whole_batch


def test_a_loss_may_name_mesh_axes_under_auto_axes():
    """`train_step` and `memory_report` enter the model's mesh whatever its axis
    types, so a loss may constrain its activations with a bare `PartitionSpec`."""

    def pinned_loss(model: StackedNet, x: Float[Array, "n 16"]) -> Float[Array, ""]:
        y = jax.lax.with_sharding_constraint(jax.vmap(model)(x), P("data"))
        return jnp.mean(y**2)

    policy = eo.Policy.offload_all(shard=eo.FSDP("data", min_size=300), batch="data")
    with jax.set_mesh(_mesh((8,), ("data",))):
        model = eo.place(make_net(key=jax.random.key(0)), policy)
    optimizer = optax.sgd(0.1)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(pinned_loss, optimizer, policy)
    report = eo.memory_report(step, model, opt_state, X)
    assert report.host_bytes > 0
    _, _, loss, _ = step(model, opt_state, X)
    expected = eqx.filter_jit(loss_fn)(make_net(key=jax.random.key(0)), X)
    assert_close(loss, expected)
    assert excess(scaled(loss, 1.01), expected) > 10
