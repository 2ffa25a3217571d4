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
    assert_trees_close,
    batches,
    CountCompiles,
    cross_entropy,
    memory_kind,
    Model,
    ProjectedStack,
    TanhBlock,
)


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _keeps(path: str) -> bool:
    """The leaves `keep_dtype=("**.norm*",)` keeps in fp32."""
    return ".norm" in path


def _reference(model, optimizer, steps, microbatches=1):
    """The same scheme by hand: each step computes the loss with a bf16 cast of the
    fp32 master (LayerNorm weights stay fp32), casts the gradients to fp32 (summed
    over micro-batches in fp32) and applies the optimizer to the master."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    paths = [
        jax.tree_util.keystr(k, simple=True, separator=".")
        for k, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    keep = jax.tree.unflatten(jax.tree.structure(params), [_keeps(p) for p in paths])
    state = optimizer.init(params)

    def cast(params):
        return jax.tree.map(
            lambda p, k: p if k else p.astype(jnp.bfloat16), params, keep
        )

    @jax.jit
    def step(params, state, tokens, targets):
        def loss(compute, tokens, targets):
            return cross_entropy(eqx.combine(compute, static), tokens, targets)

        k = microbatches
        grads, total = None, 0.0
        for i in range(k):
            value, g = jax.value_and_grad(loss)(
                cast(params), tokens[i::k], targets[i::k]
            )
            g = jax.tree.map(lambda x: x.astype(jnp.float32) / k, g)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            total = total + value.astype(jnp.float32)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, total / k

    losses = []
    for tokens, targets in steps:
        params, state, value = step(params, state, tokens, targets)
        losses.append(float(value))
    return eqx.combine(params, static), losses


def _train(model, optimizer, policy, steps, microbatches=1):
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = CountCompiles(
        eo.train_step(cross_entropy, optimizer, policy, microbatches=microbatches)
    )
    losses = []
    for batch in steps:
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        losses.append(float(loss))
    assert step.compiled_on == [0]
    return model, opt_state, losses


KEY = jax.random.key(29)


@functools.cache
def _by_hand(microbatches: int):
    """Ten batches of 4, and `_reference`'s AdamW steps of `Model(key=KEY)` on
    them: the same for every preset, so run once per micro-batch count."""
    steps = [b for _, b in zip(range(10), batches(batch=4))]
    return steps, _reference(Model(key=KEY), optax.adamw(3e-3), steps, microbatches)


@pytest.mark.parametrize(
    "preset, update, microbatches",
    [
        ("offload_all", "auto", 1),
        ("offload_all", "streamed", 2),
        ("remat", "auto", 1),
    ],
)
def test_master_equals_the_same_scheme_by_hand(preset, update, microbatches):
    optimizer = optax.adamw(3e-3)
    steps, (ref_model, ref_losses) = _by_hand(microbatches)
    policy = getattr(eo.Policy, preset)(
        update=update, compute_dtype=jnp.bfloat16, keep_dtype=("**.norm*",)
    )
    model, opt_state, losses = _train(
        Model(key=KEY), optimizer, policy, steps, microbatches
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert {x.dtype for x in _arrays(model)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(model, ref_model, after_adam=(3e-3, 10))
    kind = "pinned_host" if preset == "offload_all" else "device"
    assert {memory_kind(x) for x in _arrays(model)} == {kind}


def test_losses_track_the_fp32_run(getkey):
    """Within 1% over 10 AdamW steps on this model (bf16 keeps 8 bits of
    mantissa: the losses differ from the third significant digit)."""
    key = getkey()
    optimizer = optax.adamw(3e-3)
    steps = [b for _, b in zip(range(10), batches(batch=4))]
    _, _, fp32 = _train(Model(key=key), optimizer, eo.Policy.offload_all(), steps)
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
    _, _, bf16 = _train(Model(key=key), optimizer, policy, steps)
    np.testing.assert_allclose(bf16, fp32, rtol=1e-2)
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]


def test_where_the_copies_live_and_what_they_cost(getkey):
    key = getkey()
    optimizer = optax.adam(1e-3)
    policy = eo.Policy.offload_all(
        compute_dtype=jnp.bfloat16,
        keep_dtype=("**.norm*",),
        params={"**": "pinned_host", "head": "device"},
    )
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    assert isinstance(opt_state, eo.ComputeCopyState)
    copies = opt_state.copies
    # Host-resident, not kept: a bf16 copy on the host; the head (on the device)
    # is cast where it is used; LayerNorm weights stay fp32.
    assert copies.blocks.layers.mlp.layers[0].weight.dtype == jnp.bfloat16
    assert memory_kind(copies.blocks.layers.mlp.layers[0].weight) == "pinned_host"
    assert isinstance(copies.head.weight, optax.MaskedNode)
    assert isinstance(copies.blocks.layers.norm1.weight, optax.MaskedNode)
    np.testing.assert_array_equal(
        np.asarray(copies.embed.weight, np.float32),
        np.asarray(model.embed.weight.astype(jnp.bfloat16), np.float32),
    )
    # Abstract models get abstract copies, with their memory kind.
    abstract = eo.place(eqx.filter_eval_shape(Model, key=key), policy)
    state = eo.init_opt_state(optimizer, abstract, policy)
    leaf = state.copies.embed.weight
    assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert leaf.dtype == jnp.bfloat16 and leaf.sharding.memory_kind == "pinned_host"


def test_checkpoints_keep_the_copies(getkey, tmp_path):
    key = getkey()
    optimizer = optax.adamw(1e-3)
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    data = batches(batch=2)
    model, opt_state, _, _ = step(model, opt_state, *next(data))
    eo.save(tmp_path / "ckpt", model, opt_state, step=1)
    abstract = eqx.filter_eval_shape(Model, key=key)
    like = (abstract, eo.init_opt_state(optimizer, eo.place(abstract, policy), policy))
    restored = eo.load(tmp_path / "ckpt", like, policy, optimizer=optimizer)
    for a, b in zip(_arrays(opt_state), _arrays(restored.opt_state), strict=True):
        assert a.dtype == b.dtype and memory_kind(a) == memory_kind(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = next(data)
    _, _, expected, _ = step(model, opt_state, *batch)
    _, _, loss, _ = step(restored.model, restored.opt_state, *batch)
    assert float(loss) == float(expected)


def test_bad_arguments_name_the_fix(getkey):
    with pytest.raises(TypeError, match="floating-point dtype"):
        eo.Policy(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="no effect without `compute_dtype`"):
        eo.Policy(keep_dtype=("**.norm*",))
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16, keep_dtype=("nrm",))
    model = eo.place(Model(key=getkey()), policy)
    with pytest.raises(ValueError, match="'nrm', which matches no trainable leaf"):
        eo.init_opt_state(optax.sgd(0.1), model, policy)
    # A state built without the copies is named as such.
    plain = eo.init_opt_state(optax.sgd(0.1), model, eo.Policy.offload_all())
    good = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
    step = eo.train_step(cross_entropy, optax.sgd(0.1), good)
    with pytest.raises(ValueError, match="this state has none"):
        step(model, plain, *next(batches()))
    copies = eo.init_opt_state(optax.sgd(0.1), model, good)
    step = eo.train_step(cross_entropy, optax.sgd(0.1), eo.Policy.offload_all())
    with pytest.raises(ValueError, match="holds compute copies"):
        step(model, copies, *next(batches()))


def _small(key) -> ProjectedStack:
    k1, k2 = jax.random.split(key)
    w_in = jax.random.normal(k1, (16, 64)) / 4
    return ProjectedStack(
        w_in, eo.Stacked(TanhBlock(jax.random.normal(k2, (3, 64, 64)) / 8))
    )


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.mark.parametrize(
    "axis_type, preset",
    [
        (AxisType.Auto, "offload_all"),
        (AxisType.Explicit, "offload_all"),
        (AxisType.Explicit, "remat"),
    ],
)
def test_on_a_mesh_under_both_axis_types(getkey, axis_type, preset):
    """FSDP over 4 devices, the batch over the same axis, bf16 and 2 micro-batches:
    the losses and masters of the same policy on one device (bf16 sums in
    another order on the mesh; after Adam the masters are within 0.1 x lr x
    steps)."""
    key = getkey()
    x = jax.random.normal(getkey(), (8, 16))
    y = jax.random.normal(getkey(), (8, 64))
    optimizer = optax.adam(1e-2)

    def run(policy):
        model = eo.place(_small(key), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(_mse, optimizer, policy, microbatches=2)
        losses = []
        for _ in range(3):
            model, opt_state, loss, _ = step(model, opt_state, x, y)
            losses.append(float(loss))
        return model, losses

    make = getattr(eo.Policy, preset)
    one, one_losses = run(make(compute_dtype=jnp.bfloat16))
    mesh = jax.make_mesh(
        (4,), ("fsdp",), axis_types=(axis_type,), devices=jax.devices()[:4]
    )
    policy = make(
        shard=eo.FSDP("fsdp", min_size=64), batch="fsdp", compute_dtype=jnp.bfloat16
    )
    with jax.set_mesh(mesh):
        model, losses = run(policy)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-4)
    assert_trees_close(model, one, atol=0.1 * 1e-2 * 3)  # bf16 (see above)
    assert "fsdp" in str(model.blocks.layers.weight.sharding.spec)
    kind = "pinned_host" if preset == "offload_all" else "device"
    assert memory_kind(model.blocks.layers.weight) == kind
