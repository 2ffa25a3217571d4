"""`Policy(compute_dtype=...)`: fp32 master parameters and optimizer state where the
policy puts them, bf16 compute through persistent host copies."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import eqx_offload as eo

from .helpers import (
    CountCompiles,
    memory_kind,
    MLPBlock,
    ProjectedStack,
    StackedNet,
    TanhBlock,
)
from .numerics import assert_close, BF16_COMPUTE, excess, scaled_update


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _net(key=jax.random.key(29)) -> StackedNet:
    """Three residual MLP layers in a `Stacked` and a linear head."""
    return StackedNet(lambda k: MLPBlock(16, 32, key=k), 3, (16, 8), key=key)


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _batches(n: int) -> list:
    """`n` batches of 4 regression examples."""
    keys = jax.random.split(jax.random.key(7), 2 * n)
    return [
        (jax.random.normal(a, (4, 16)), jax.random.normal(b, (4, 8)))
        for a, b in zip(keys[::2], keys[1::2])
    ]


# The biases stay fp32 (`keep_dtype`): inside the `Stacked`, beside its bf16
# weights, as LayerNorm weights would, and the head's.
KEEP = ("**.bias",)


def _keeps(path: str) -> bool:
    """The leaves `keep_dtype=KEEP` keeps in fp32."""
    return path.endswith(".bias")


def _reference(model, optimizer, steps, microbatches=1):
    """The same scheme by hand: each step computes the loss with a bf16 cast of the
    fp32 master (the biases stay fp32), casts the gradients to fp32 (summed over
    micro-batches in fp32) and applies the optimizer to the master."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    paths = [
        jax.tree_util.keystr(k, simple=True, separator=".")
        for k, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    keep = jax.tree.unflatten(jax.tree.structure(params), [_keeps(p) for p in paths])
    assert any(jax.tree.leaves(keep)) and not all(jax.tree.leaves(keep))
    state = optimizer.init(params)

    def cast(params):
        return jax.tree.map(
            lambda p, k: p if k else p.astype(jnp.bfloat16), params, keep
        )

    @jax.jit
    def step(params, state, x, y):
        def loss(compute, x, y):
            return _mse(eqx.combine(compute, static), x, y)

        k = microbatches
        grads, total = None, 0.0
        for i in range(k):
            value, g = jax.value_and_grad(loss)(cast(params), x[i::k], y[i::k])
            g = jax.tree.map(lambda x: x.astype(jnp.float32) / k, g)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            total = total + value.astype(jnp.float32)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, total / k

    losses = []
    for x, y in steps:
        params, state, value = step(params, state, x, y)
        losses.append(float(value))
    return eqx.combine(params, static), losses


def _updates(tree, origin) -> list[np.ndarray]:
    """`tree - origin`, leaf by leaf, in float64. bf16-compute runs are compared
    through their updates at `BF16_COMPUTE`, which `assert_close(origin=...)`
    refuses (it cannot see an update 1% too large); the fp32 masters round to
    `1e-7` of themselves, far inside."""
    pairs = zip(
        jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(origin, eqx.is_inexact_array)),
    )
    return [np.asarray(x, np.float64) - np.asarray(o, np.float64) for x, o in pairs]


def _first_layer_dropped(tree, origin):
    """`tree` with the first layer of its `Stacked` back at `origin`'s: that
    layer's update dropped."""

    def drop(x, o):
        if not eqx.is_inexact_array(x):
            return x
        x = np.array(x)
        x[0] = np.asarray(o)[0]
        return x

    layers = lambda t: t.blocks.layers  # noqa: E731
    dropped = jax.tree.map(drop, layers(tree), layers(origin))
    return eqx.tree_at(layers, tree, dropped)


def assert_same_updates(ours, reference, origin) -> None:
    """The updates from `origin` within `BF16_COMPUTE`. The negative controls, the
    update of the wrong sign and one with the first layer's dropped, are more
    than ten times beyond it."""
    theirs = _updates(reference, origin)
    assert_close(_updates(ours, origin), theirs, tol=BF16_COMPUTE)
    wrong = _updates(scaled_update(ours, origin, -1.0), origin)
    assert excess(wrong, theirs, tol=BF16_COMPUTE) > 10
    dropped = _updates(_first_layer_dropped(ours, origin), origin)
    assert excess(dropped, theirs, tol=BF16_COMPUTE) > 10


def sgd(lr: float) -> optax.GradientTransformation:
    """SGD with momentum, its learning rate in the state (`with_lr`)."""
    return optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=0.9)


def with_lr(opt_state, lr: float):
    """`opt_state` (a `ComputeCopyState` or not) with another learning rate, of the
    same type and placement: the same compiled step takes it."""
    inner = getattr(opt_state, "inner", opt_state)
    old = inner.hyperparams["learning_rate"]
    new = jax.device_put(jnp.asarray(lr, old.dtype), old.sharding)
    inner = inner._replace(hyperparams={**inner.hyperparams, "learning_rate": new})
    return opt_state._replace(inner=inner) if inner is not opt_state else inner


LR, STEPS = 0.1, 3
OPTIMIZER = sgd(LR)


@functools.cache
def _step(policy: eo.Policy, microbatches: int = 1) -> CountCompiles:
    """One compiled step per policy, shared by the tests."""
    step = eo.train_step(_mse, OPTIMIZER, policy, microbatches=microbatches)
    return CountCompiles(step)


def _train(model, policy, steps, microbatches=1, lr=None):
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    if lr is not None:
        opt_state = with_lr(opt_state, lr)
    step = _step(policy, microbatches)
    losses = []
    for batch in steps:
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        losses.append(float(loss))
    assert step.compiled_on == [0]
    return model, opt_state, losses


@functools.cache
def _by_hand(microbatches: int):
    """Three batches, and `_reference`'s steps of `_net()` on them: the same for
    every preset, so run once per micro-batch count."""
    steps = _batches(STEPS)
    return steps, _reference(_net(), OPTIMIZER, steps, microbatches)


def _bf16(preset: str, update: str = "auto") -> eo.Policy:
    """The preset in bf16; `"copies_on_device"`: `offload_all`'s, with the compute
    copies kept on the device (the gradients then add up there)."""
    copies = {"opt_state": {"**": "pinned_host", "copies:**": "device"}}
    return getattr(eo.Policy, preset.replace("copies_on_device", "offload_all"))(
        update=update,
        compute_dtype=jnp.bfloat16,
        keep_dtype=KEEP,
        **(copies if preset == "copies_on_device" else {}),
    )


@pytest.mark.parametrize(
    "preset, update, microbatches",
    [
        ("offload_all", "auto", 1),
        ("offload_all", "streamed", 2),
        ("copies_on_device", "streamed", 2),
        ("remat", "auto", 1),
    ],
)
def test_master_equals_the_same_scheme_by_hand(preset, update, microbatches):
    """Three SGD steps (the compute copies refreshed from the updated masters in
    between): the losses and the masters' updates within `BF16_COMPUTE` of the
    scheme by hand."""
    steps, (ref_model, ref_losses) = _by_hand(microbatches)
    policy = _bf16(preset, update)
    model, opt_state, losses = _train(_net(), policy, steps, microbatches)
    assert_close(losses, ref_losses, tol=BF16_COMPUTE)
    assert {x.dtype for x in _arrays(model)} == {jnp.dtype(jnp.float32)}
    assert_same_updates(model, ref_model, _net())
    kind = "device" if preset == "remat" else "pinned_host"
    assert {memory_kind(x) for x in _arrays(model)} == {kind}


def test_losses_track_the_fp32_run():
    """bf16 training makes the progress fp32 training makes: on one batch, each
    step lowers the loss in both runs, and each run ends below where the other
    started (bf16 keeps 8 bits of mantissa: the two differ from the third
    significant digit, far less than three steps descend). The negative control:
    the bf16 run with the gradients' sign flipped climbs."""
    steps = _batches(1) * STEPS
    _, _, fp32 = _train(_net(), eo.Policy.offload_all(), steps)
    policy = _bf16("offload_all")
    _, _, bf16 = _train(_net(), policy, steps)
    for losses in (fp32, bf16):
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert bf16[-1] < fp32[0] and fp32[-1] < bf16[0]
    _, _, wrong = _train(_net(), policy, steps, lr=-LR)
    assert all(b > a for a, b in zip(wrong, wrong[1:])), wrong


def test_where_the_copies_live_and_what_they_cost():
    optimizer = optax.adam(1e-3)
    policy = eo.Policy.offload_all(
        compute_dtype=jnp.bfloat16,
        keep_dtype=KEEP,
        params={"**": "pinned_host", "head": "device"},
    )
    model = eo.place(_net(), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    assert isinstance(opt_state, eo.ComputeCopyState)
    copies = opt_state.copies
    # Host-resident, not kept: a bf16 copy on the host; the head (on the device)
    # is cast where it is used; the biases stay fp32.
    weight = copies.blocks.layers.fc1.weight
    assert weight.dtype == jnp.bfloat16 and memory_kind(weight) == "pinned_host"
    assert isinstance(copies.head.weight, optax.MaskedNode)
    assert isinstance(copies.blocks.layers.fc1.bias, optax.MaskedNode)
    np.testing.assert_array_equal(
        np.asarray(weight, np.float32),
        np.asarray(model.blocks.layers.fc1.weight.astype(jnp.bfloat16), np.float32),
    )
    # Abstract models get abstract copies, with their memory kind.
    abstract = eo.place(eqx.filter_eval_shape(_net), policy)
    state = eo.init_opt_state(optimizer, abstract, policy)
    leaf = state.copies.blocks.layers.fc2.weight
    assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert leaf.dtype == jnp.bfloat16 and leaf.sharding.memory_kind == "pinned_host"


def test_checkpoints_keep_the_copies(tmp_path):
    policy = _bf16("offload_all")
    step = _step(policy)  # (shared: compiled once)
    model = eo.place(_net(), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    data = iter(_batches(2))
    model, opt_state, _, _ = step(model, opt_state, *next(data))
    eo.save(tmp_path / "ckpt", model, opt_state, step=1)
    abstract = eqx.filter_eval_shape(_net)
    like = (abstract, eo.init_opt_state(OPTIMIZER, eo.place(abstract, policy), policy))
    restored = eo.load(tmp_path / "ckpt", like, policy, optimizer=OPTIMIZER)
    for a, b in zip(_arrays(opt_state), _arrays(restored.opt_state), strict=True):
        assert a.dtype == b.dtype and memory_kind(a) == memory_kind(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = next(data)
    _, _, expected, _ = step(model, opt_state, *batch)
    _, _, loss, _ = step(restored.model, restored.opt_state, *batch)
    assert float(loss) == float(expected)
    assert step.compiled_on in ([], [0])  # the restored state: the same program


def test_bad_arguments_name_the_fix():
    with pytest.raises(TypeError, match="floating-point dtype"):
        eo.Policy(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="no effect without `compute_dtype`"):
        eo.Policy(keep_dtype=("**.norm*",))
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16, keep_dtype=("nrm",))
    model = eo.place(_net(), policy)
    with pytest.raises(ValueError, match="'nrm', which matches no trainable leaf"):
        eo.init_opt_state(optax.sgd(0.1), model, policy)
    # A state built without the copies is named as such.
    batch = _batches(1)[0]
    plain = eo.init_opt_state(optax.sgd(0.1), model, eo.Policy.offload_all())
    good = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
    step = eo.train_step(_mse, optax.sgd(0.1), good)
    with pytest.raises(ValueError, match="this state has none"):
        step(model, plain, *batch)
    copies = eo.init_opt_state(optax.sgd(0.1), model, good)
    step = eo.train_step(_mse, optax.sgd(0.1), eo.Policy.offload_all())
    with pytest.raises(ValueError, match="holds compute copies"):
        step(model, copies, *batch)


def _small(key) -> ProjectedStack:
    k1, k2 = jax.random.split(key)
    w_in = jax.random.normal(k1, (16, 64)) / 4
    return ProjectedStack(
        w_in, eo.Stacked(TanhBlock(jax.random.normal(k2, (3, 64, 64)) / 8))
    )


MESH_KEY = jax.random.key(31)


def _mesh_run(policy) -> tuple:
    """Three SGD steps of `_small` on one batch, two micro-batches."""
    k1, k2, k3 = jax.random.split(MESH_KEY, 3)
    x, y = jax.random.normal(k2, (8, 16)), jax.random.normal(k3, (8, 64))
    model = eo.place(_small(k1), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    step = eo.train_step(_mse, OPTIMIZER, policy, microbatches=2)
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss, _ = step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, losses


@functools.cache
def _on_one_device(preset: str) -> tuple:
    return _mesh_run(getattr(eo.Policy, preset)(compute_dtype=jnp.bfloat16))


@pytest.mark.parametrize(
    "axis_type, preset",
    [
        (AxisType.Auto, "offload_all"),
        (AxisType.Explicit, "offload_all"),
        (AxisType.Explicit, "remat"),
    ],
)
def test_on_a_mesh_under_both_axis_types(axis_type, preset):
    """FSDP over 4 devices, the batch over the same axis, bf16 and 2 micro-batches:
    the losses and the masters' updates of the same policy on one device, within
    `BF16_COMPUTE` (the same bf16 scheme, its sums in another order on the
    mesh)."""
    one, one_losses = _on_one_device(preset)
    mesh = jax.make_mesh(
        (4,), ("fsdp",), axis_types=(axis_type,), devices=jax.devices()[:4]
    )
    policy = getattr(eo.Policy, preset)(
        shard=eo.FSDP("fsdp", min_size=64), batch="fsdp", compute_dtype=jnp.bfloat16
    )
    with jax.set_mesh(mesh):
        model, losses = _mesh_run(policy)
    assert_close(losses, one_losses, tol=BF16_COMPUTE)
    assert_same_updates(model, one, _small(jax.random.split(MESH_KEY, 3)[0]))
    assert "fsdp" in str(model.blocks.layers.weight.sharding.spec)
    kind = "pinned_host" if preset == "offload_all" else "device"
    assert memory_kind(model.blocks.layers.weight) == kind
