import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import batches, cross_entropy, memory_kind, Model, same_place


@pytest.mark.parametrize("kind", ["device", "pinned_host"])
def test_parameter_shaped_state_goes_where_the_policy_says(kind, getkey):
    policy = eo.Policy(params="pinned_host", opt_state=kind)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    model = eo.place(Model(key=getkey()), policy)
    state = eo.init_opt_state(optimizer, model, policy)
    adam = state[1][0]
    for tree in (adam.mu, adam.nu):
        leaves = jax.tree.leaves(tree)
        assert leaves and {memory_kind(x) for x in leaves} == {kind}
    assert memory_kind(adam.count) == "device"
    # The values are optax's own.
    expected = optimizer.init(eqx.filter(Model(key=getkey()), eqx.is_inexact_array))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_keeps_each_parameters_sharding(getkey):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
    model = Model(key=getkey())
    model = eqx.tree_at(
        lambda m: m.blocks.layers.mlp.layers[0].weight,
        model,
        replace_fn=lambda w: jax.device_put(w, sharding),
    )
    policy = eo.Policy.remat(opt_state="pinned_host")
    state = eo.init_opt_state(optax.adam(1e-3), model, policy)
    mu = state[0].mu.blocks.layers.mlp.layers[0].weight
    assert mu.sharding == sharding.with_memory_kind("pinned_host")


def test_abstract_model_gives_abstract_state(getkey):
    policy = eo.Policy.offload_all()
    optimizer = optax.adam(1e-3)
    abstract = eo.place(eqx.filter_eval_shape(Model, key=getkey()), policy)
    state = eo.init_opt_state(optimizer, abstract, policy)
    leaves = jax.tree.leaves(state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    concrete = eo.init_opt_state(
        optimizer, eo.place(Model(key=getkey()), policy), policy
    )
    for a, c in zip(leaves, jax.tree.leaves(concrete), strict=True):
        assert same_place(a, c)


def test_kind_missing_on_backend(monkeypatch, getkey):
    monkeypatch.setattr(eo._update._optim, "backend_kinds", lambda: ("device",))
    with pytest.raises(
        ValueError,
        match=r"state of 'embed.weight'.*'pinned_host'.*opt_state.*valid kinds here",
    ):
        eo.init_opt_state(
            optax.adam(1e-3),
            Model(key=getkey()),
            eo.Policy.remat(opt_state="pinned_host"),
        )


def test_opt_state_patterns_place_each_parameters_state(getkey):
    policy = eo.Policy.remat(opt_state={"blocks": "pinned_host"})
    optimizer = optax.adam(1e-3)
    model = eo.place(Model(key=getkey()), policy)
    state = eo.init_opt_state(optimizer, model, policy)
    mu = state[0].mu
    assert {x.sharding.memory_kind for x in jax.tree.leaves(mu.blocks)} == {
        "pinned_host"
    }
    assert mu.embed.weight.sharding.memory_kind == "device"
    step = eo.train_step(cross_entropy, optimizer, policy)
    _, new_state, _ = step(model, state, *next(batches()))
    assert new_state[0].mu.blocks.layers.mlp.layers[0].weight.sharding.memory_kind == (
        "pinned_host"
    )
    with pytest.raises(ValueError, match=r"'blokcs' match no leaf"):
        eo.init_opt_state(optimizer, model, eo.Policy(opt_state={"blokcs": "device"}))
