"""`init_opt_state` and `place_opt_state`: the optimizer state placed where
`Policy(opt_state=...)` says, parameter by parameter and state part by part
(`"mu:**"`), with each parameter's sharding, abstract for an abstract model; and the
mistakes, named."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import (
    batches,
    cross_entropy,
    memory_kind,
    Model,
    same_place,
    table_lm,
)
from .numerics import assert_close, excess


@pytest.mark.parametrize("kind", ["device", "pinned_host"])
def test_parameter_shaped_state_goes_where_the_policy_says(kind, getkey):
    policy = eo.Policy(params="pinned_host", opt_state=kind)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    model = eo.place(table_lm(getkey()), policy)
    state = eo.init_opt_state(optimizer, model, policy)
    adam = state[1][0]
    for tree in (adam.mu, adam.nu):
        leaves = jax.tree.leaves(tree)
        assert leaves and {memory_kind(x) for x in leaves} == {kind}
    assert memory_kind(adam.count) == "device"
    # The values are optax's own.
    expected = optimizer.init(eqx.filter(table_lm(getkey()), eqx.is_inexact_array))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_keeps_each_parameters_sharding(getkey):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
    model = table_lm(getkey())
    model = eqx.tree_at(
        lambda m: m.blocks.layers.weight,
        model,
        replace_fn=lambda w: jax.device_put(w, sharding),
    )
    policy = eo.Policy.remat(opt_state="pinned_host")
    state = eo.init_opt_state(optax.adam(1e-3), model, policy)
    mu = state[0].mu.blocks.layers.weight
    assert mu.sharding == sharding.with_memory_kind("pinned_host")


def test_a_factored_moment_is_not_given_its_parameters_sharding(getkey):
    # Adafactor's row and column statistics have fewer axes than their parameter:
    # they go to the policy's kind, replicated, not in the parameter's layout.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.P("x", None))
    model = eqx.tree_at(
        lambda m: m.embed,
        table_lm(getkey()),
        replace_fn=lambda w: jax.device_put(w, sharding),
    )
    policy = eo.Policy.remat(opt_state="pinned_host")
    optimizer = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    state = eo.init_opt_state(optimizer, model, policy)
    for stat in (state[0].v_row.embed, state[0].v_col.embed):
        # (16,) and (32,) of a (32, 16) table
        assert stat.ndim == 1 and memory_kind(stat) == "pinned_host"
        assert stat.sharding.is_fully_replicated


def test_abstract_model_gives_abstract_state(getkey):
    policy = eo.Policy.offload_all()
    optimizer = optax.adam(1e-3)
    abstract = eo.place(eqx.filter_eval_shape(table_lm, getkey()), policy)
    state = eo.init_opt_state(optimizer, abstract, policy)
    leaves = jax.tree.leaves(state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    concrete = eo.init_opt_state(
        optimizer, eo.place(table_lm(getkey()), policy), policy
    )
    for a, c in zip(leaves, jax.tree.leaves(concrete), strict=True):
        assert same_place(a, c)


def test_kind_missing_on_backend(monkeypatch, getkey):
    monkeypatch.setattr("eqx_offload._update._optim.backend_kinds", lambda: ("device",))
    with pytest.raises(
        ValueError,
        match=r"state of 'embed'.*'pinned_host'.*opt_state.*valid kinds here",
    ):
        eo.init_opt_state(
            optax.adam(1e-3),
            table_lm(getkey()),
            eo.Policy.remat(opt_state="pinned_host"),
        )


def test_opt_state_patterns_place_each_parameters_state(getkey):
    policy = eo.Policy.remat(opt_state={"blocks": "pinned_host"})
    optimizer = optax.adam(1e-3)
    model = eo.place(table_lm(getkey()), policy)
    state = eo.init_opt_state(optimizer, model, policy)
    mu = state[0].mu
    assert {x.sharding.memory_kind for x in jax.tree.leaves(mu.blocks)} == {
        "pinned_host"
    }
    assert mu.embed.sharding.memory_kind == "device"
    step = eo.train_step(cross_entropy, optimizer, policy)
    _, new_state, _, _ = step(model, state, *next(batches()))
    new_mu = new_state[0].mu
    assert new_mu.blocks.layers.weight.sharding.memory_kind == "pinned_host"
    assert new_mu.embed.sharding.memory_kind == "device"
    with pytest.raises(ValueError, match=r"'blokcs' match no leaf"):
        eo.init_opt_state(optimizer, model, eo.Policy(opt_state={"blokcs": "device"}))


def kinds_of(tree) -> set[str]:
    return {memory_kind(x) for x in jax.tree.leaves(tree)}


def test_state_parts_put_adams_moments_apart_and_update_as_optax(getkey):
    """Adam's first moment on the device, its second on the host (streamed): a
    step at a time from a state one step old, on the same gradients, the update
    is optax's whole one (the parameters' updates and the state within float32's
    tolerance), and each part stays in place. The negative control: the state of
    the gradients' sign flipped."""
    policy = eo.Policy.remat(opt_state={"nu:**": "pinned_host"}, update="streamed")
    optimizer = optax.adamw(1e-2)

    @eqx.filter_jit
    def ours(grads, opt_state, model):
        return eo.optimizer_update(optimizer, grads, opt_state, model, policy)[:2]

    @eqx.filter_jit
    def theirs(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def gradients():
        return jax.tree.map(lambda x: jax.random.normal(getkey(), x.shape), params)

    model = eo.place(table_lm(getkey()), policy)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = eo.init_opt_state(optimizer, model, policy)
    model, state = ours(gradients(), state, model)
    grads = gradients()
    start, before = jax.tree.map(np.asarray, (model, state))
    new, new_state = theirs(grads, before, start)
    model, state = ours(grads, state, model)
    assert_close(model, new, origin=start)
    assert_close(state, new_state)
    flipped = jax.tree.map(jnp.negative, grads)
    assert excess(state, theirs(flipped, before, start)[1]) > 10
    adam = state[0]
    assert kinds_of(adam.mu) == {"device"} and kinds_of(adam.nu) == {"pinned_host"}
    assert memory_kind(adam.count) == "device"


def test_state_parts_compile_for_a_tpu_at_an_odd_width(getkey):
    policy = eo.Policy.remat(params="pinned_host", opt_state={"nu:**": "pinned_host"})
    optimizer = optax.adam(1e-3)
    abstract = eqx.filter_eval_shape(Model, dim=24, depth=3, key=getkey())
    model = eo.place(abstract, policy)
    state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    report = eo.memory_report(step, model, state, *next(batches()), target="tpu-v5e")
    assert report.opt_state is not None
    # Half of the parameter-shaped state on each side (the count is on the device).
    host, device = report.opt_state["pinned_host"], report.opt_state["device"]
    assert host > 0 and device - 4 == host


@pytest.mark.parametrize(
    "opt_state, mu, nu",
    [
        # The part's pattern wins over one as precise that names no part...
        ({"**": "pinned_host", "mu:**": "device"}, "device", "pinned_host"),
        # ...and a pattern naming the parameter more precisely wins over it.
        ({"nu:**": "pinned_host", "head": "device"}, "device", "device"),
        ({"nu:head": "pinned_host", "**": "device"}, "device", "pinned_host"),
    ],
)
def test_which_pattern_places_a_state_part(opt_state, mu, nu, getkey):
    policy = eo.Policy.remat(opt_state=opt_state)
    state = eo.init_opt_state(optax.adam(1e-3), table_lm(getkey()), policy)
    assert kinds_of(state[0].mu.head) == {mu}
    assert kinds_of(state[0].nu.head) == {nu}
    assert kinds_of(state[0].mu.blocks) == {"device"}


def test_state_part_mistakes(getkey):
    model = table_lm(getkey())
    with pytest.raises(ValueError, match=r"'vu:\*\*'.*part 'vu'.*'mu', 'nu'"):
        eo.init_opt_state(
            optax.adam(1e-3), model, eo.Policy(opt_state={"vu:**": "pinned_host"})
        )
    with pytest.raises(ValueError, match=r"'nu:blokcs'.*match no leaf"):
        eo.init_opt_state(
            optax.adam(1e-3), model, eo.Policy(opt_state={"nu:blokcs": "device"})
        )
    with pytest.raises(ValueError, match=r"`Policy\(params=.*'nu:\*\*'.*opt_state"):
        eo.Policy(params={"nu:**": "pinned_host"})
    with pytest.raises(ValueError, match=r"':\*\*'.*'<part>:<parameter pattern>'"):
        eo.Policy(opt_state={":**": "pinned_host"})
