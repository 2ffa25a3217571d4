"""Models laid out on a device mesh by hand: partly sharded models, `Explicit` and
`Auto` meshes, leaves on other devices, reports with a PRNG key. (Spec spellings:
`test_meshes_train_as_one_device.py`.)"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_offload as eo

from .helpers import CountCompiles, StackedNet
from .numerics import assert_close, excess, scaled, TRAINED


def make_net(*, key: PRNGKeyArray) -> StackedNet:
    """3 `Linear` layers (16 wide) in a `Stacked`, then a head to 4 outputs."""
    return StackedNet(lambda k: eqx.nn.Linear(16, 16, key=k), 3, (16, 4), key=key)


def loss_fn(model: StackedNet, x: Float[Array, "n 16"]) -> Float[Array, ""]:
    return jnp.mean(jax.vmap(model)(x) ** 2)


# Its update is Lipschitz in the gradient (`numerics.TRAINED`), and it has state.
OPTIMIZER = optax.sgd(0.1, momentum=0.9)
STEPS = 3
X = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)


def _mesh(axis_type: AxisType):
    return jax.make_mesh((8,), ("x",), axis_types=(axis_type,))


def _fsdp(model: StackedNet, mesh, spec=P(None, "x")) -> StackedNet:
    """The stacked weights sharded over `x`, everything else left as it is."""
    weight = jax.device_put(model.blocks.layers.weight, NamedSharding(mesh, spec))
    return eqx.tree_at(lambda m: m.blocks.layers.weight, model, weight)


@functools.cache
def _reference() -> tuple[StackedNet, list[float]]:
    """Plain Equinox + optax on one device: the model after `STEPS` steps, and the
    losses."""
    model = make_net(key=jax.random.key(0))
    state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, X)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = OPTIMIZER.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(STEPS):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    return model, losses


@pytest.mark.parametrize(
    "preset, axis_type",
    [
        ("none", AxisType.Explicit),
        ("offload_all", AxisType.Auto),
        ("offload_all host", AxisType.Explicit),
    ],
)
def test_a_partly_sharded_model_trains_like_one_device(preset, axis_type):
    mesh = _mesh(axis_type)
    preset, _, update = preset.partition(" ")
    # `update="host"`: each device's shards of the parameters and state are
    # updated on the host where they live.
    policy = getattr(eo.Policy, preset)(**({"update": update} if update else {}))
    # Only the stacked weight is laid out on the mesh; the biases and the head are
    # plain arrays, which `place` replicates over the mesh (as a jit would).
    model = eo.place(_fsdp(make_net(key=jax.random.key(0)), mesh), policy)
    shardings = [x.sharding for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    assert all(len(s.device_set) == 8 for s in shardings)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    step = CountCompiles(eo.train_step(loss_fn, OPTIMIZER, policy))
    batch = jax.device_put(X, NamedSharding(mesh, P()))
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss, _ = step(model, opt_state, batch)
        losses.append(float(loss))
    ref_model, ref_losses = _reference()
    assert_close(losses, ref_losses)
    assert excess(scaled(losses, 1.01), ref_losses) > 10
    start = make_net(key=jax.random.key(0))
    assert_close(model, ref_model, tol=TRAINED, origin=start, steps=STEPS)
    assert step.compiled_on == [0]  # outputs feed the next call as they are
    weight = model.blocks.layers.weight
    assert weight.sharding.spec[:2] == (None, "x")
    kind = "pinned_host" if preset == "offload_all" else "device"
    assert weight.sharding.memory_kind == kind


def test_a_leaf_committed_elsewhere_is_named():
    mesh = _mesh(AxisType.Auto)
    policy = eo.Policy.none()
    model = eo.place(_fsdp(make_net(key=jax.random.key(0)), mesh), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    bias = jax.device_put(model.head.bias, jax.devices()[3])
    moved = eqx.tree_at(lambda m: m.head.bias, model, bias)
    step = eo.train_step(loss_fn, OPTIMIZER, policy)
    with pytest.raises(
        ValueError, match=r"`train_step`: leaf 'model\.head\.bias' is on devices \[3\]"
    ):
        step(moved, opt_state, X)
    with pytest.raises(ValueError, match=r"leaf 'model\.head\.bias' is on devices"):
        eo.init_opt_state(OPTIMIZER, moved, policy)


def test_leaves_on_two_meshes_are_named():
    one = _mesh(AxisType.Auto)
    two = jax.make_mesh((2,), ("y",), devices=jax.devices()[:2])
    model = _fsdp(make_net(key=jax.random.key(0)), one)
    assert model.head is not None
    bias = jax.device_put(model.head.bias, NamedSharding(two, P()))
    model = eqx.tree_at(lambda m: m.head.bias, model, bias)
    with pytest.raises(
        ValueError, match=r"'blocks\.weight' and 'head\.bias' are laid out on two"
    ):
        eo.place(model, eo.Policy.none())


def test_report_of_a_sharded_step_with_a_prng_key():
    mesh = _mesh(AxisType.Auto)
    policy = eo.Policy.offload_all()
    model = eo.place(_fsdp(make_net(key=jax.random.key(0)), mesh), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)

    def noisy(model, x, key):
        return loss_fn(model, x + 0.01 * jax.random.normal(key, x.shape))

    step = eo.train_step(noisy, OPTIMIZER, policy)
    report = eo.memory_report(step, model, opt_state, X, jax.random.key(1))
    # Every argument is found in the compiled signature, the key included.
    assert report.arguments["batch"] == {"device": X.nbytes + 8}
    assert report.host["argument"] > 0
    # Donated buffers of a program over a mesh (`jax.buffer_donor`) count as
    # aliased, as on one device: every host leaf is updated in place.
    assert report.host["alias"] == report.host["argument"]
    step(model, opt_state, X, jax.random.key(1))  # and the step accepts it too
