"""The streamed optimizer update: same result as optax, one piece at a time."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import (
    all_eqns,
    assert_trees_close,
    batches,
    cross_entropy,
    Model,
    unchecked,
)


BASE = {
    "sgd (momentum)": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
}
OPTIMIZERS = {name: make for name, make in BASE.items()}
OPTIMIZERS.update(
    {
        f"clip + {name}": (
            lambda make=make: optax.chain(optax.clip_by_global_norm(1.0), make())
        )
        for name, make in BASE.items()
    }
)
# LAMB's trust ratio is a norm over each whole leaf: over all layers of a stacked
# leaf. Streamed, it is computed from every layer's partial sums: the same result.
OPTIMIZERS["lamb"] = lambda: optax.lamb(1e-2)
OPTIMIZERS["clip + lamb"] = lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.lamb(1e-2)
)


def random_tree(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "layers": jax.random.normal(k1, (4, 8, 16)),  # stacked: 4 layers
        "large": jax.random.normal(k2, (64, 128)),  # streamed in blocks of rows
        "small": jax.random.normal(k3, (16,)),  # updated whole
        "scale": 3.0 + jax.random.normal(k4, ()),
    }


LAYERS = {"layers": 4, "large": None, "scale": None, "small": None}


def host(tree):
    return jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), tree
    )


def streamed_steps(optimizer, params, grads, steps=3):
    state = optimizer.init(params)
    layers = [LAYERS[k] for k in sorted(params)]
    n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
    kinds = (["pinned_host"] * n_params, ["pinned_host"] * n_state)

    @jax.jit
    def step(params, state, grads):
        paths = sorted(params)
        new = eoi.streaming.update(
            optimizer, grads, state, params, layers, kinds, paths
        )
        return new[:2]

    params, state, grads = host(params), host(state), host(grads)
    for _ in range(steps):
        params, state = step(params, state, grads)
    return params, state


def optax_steps(optimizer, params, grads, steps=3):
    state = optimizer.init(params)
    for _ in range(steps):
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def assert_streamed_equals_optax(make_optimizer, getkey, steps=3, lamb=False):
    """Streamed steps on random trees equal optax's own; returns the streamed."""
    params, grads = random_tree(getkey()), random_tree(getkey())
    ours = streamed_steps(make_optimizer(), params, grads, steps)
    theirs = optax_steps(make_optimizer(), params, grads, steps)
    # The same operations on the same gradients, piece by piece: rtol 1e-6. LAMB's
    # per-leaf norms are sums of per-piece partial sums: the same sum in another
    # order, which its ratio of norms turns into ~1e-7 absolute noise.
    if lamb:
        assert_trees_close(ours, theirs, atol=1e-6)
    else:
        assert_trees_close(ours, theirs, rtol=1e-6)
    return ours


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_streamed_update_equals_optax(name, monkeypatch, getkey):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)  # "large" is 32 KiB
    ours = assert_streamed_equals_optax(OPTIMIZERS[name], getkey, lamb="lamb" in name)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(ours)} == {"pinned_host"}


@pytest.mark.parametrize("name", ["clip + adam", "clip + lion", "lamb"])
def test_the_tpu_loop_equals_optax_too(name, monkeypatch, getkey):
    # On the CPU the streamed loops read one piece ahead; this runs the loop a TPU
    # compiles (each step reads its own piece) here.
    monkeypatch.setattr(eoi.streaming, "READ_IN_STEP", ("cpu",))
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)
    assert_streamed_equals_optax(OPTIMIZERS[name], getkey, lamb="lamb" in name)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(optax.zero_nans(), optax.adam(1e-2)),  # scalar per leaf
        lambda: optax.adafactor(1e-2),  # (1,)-shaped placeholders per leaf
    ],
    ids=["zero_nans + adam", "adafactor"],
)
def test_state_not_shaped_like_its_parameter_is_shared(make, monkeypatch, getkey):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)
    assert_streamed_equals_optax(make, getkey)


def fresh_state():
    """New state made afresh, of each parameter's shape (zeros, then ones):
    piece-shaped values that come from no input's pieces."""

    def update(updates, state, params=None):
        return updates, jax.tree.map(jnp.ones_like, state)

    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params), update
    )


def test_state_made_afresh_is_written_in_its_leafs_loop(monkeypatch, getkey):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)
    make = lambda: optax.chain(fresh_state(), optax.adam(1e-2))  # noqa: E731
    assert_streamed_equals_optax(make, getkey)


@pytest.mark.parametrize(
    "make, why",
    [
        # Factored second moments: a per-row moment is not cut with its parameter.
        (
            lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
            r"traced on one piece of each leaf, it fails \(TypeError",
        ),
    ],
    ids=["factored adafactor"],
)
def test_other_unstreamable_updates_are_refused(make, why, monkeypatch, getkey):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)
    params, grads = random_tree(getkey()), random_tree(getkey())
    with pytest.raises(eoi.streaming.NotStreamable, match=why):
        streamed_steps(make(), params, grads, 1)


CONDS = {
    # Gradient accumulation: a `cond` over the whole update, the global norm of
    # the clip inside one branch.
    "MultiSteps(clip + adam)": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        every_k_schedule=2,
    ).gradient_transformation(),
    "apply_if_finite(adam)": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "novograd": lambda: optax.novograd(1e-2),
}


@pytest.mark.parametrize("name", CONDS)
def test_conds_over_several_groups_of_pieces(name, monkeypatch, getkey):
    # "layers" and "large" are streamed in different groups; a `cond` over every
    # leaf is computed as both branches and a select, piece by piece.
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)
    assert_streamed_equals_optax(CONDS[name], getkey, steps=5)


def test_a_skipped_step_is_skipped_when_streamed(monkeypatch, getkey):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 8192)
    params, grads = random_tree(getkey()), random_tree(getkey())
    grads["large"] = grads["large"].at[3, 5].set(jnp.nan)  # not finite: no update
    ours = streamed_steps(CONDS["apply_if_finite(adam)"](), params, grads, 2)
    theirs = optax_steps(CONDS["apply_if_finite(adam)"](), params, grads, 2)
    assert_trees_close(ours, theirs, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours[0]["layers"]), params["layers"])


def test_clipping_is_active_in_the_test(getkey):
    grads = random_tree(getkey())
    assert float(optax.tree.norm(grads)) > 1.0  # so `clip + ...` does clip


def layer_mixing():
    """A transformation whose result changes when applied to one layer at a time."""

    def update(updates, state, params=None):
        return jax.tree.map(
            lambda u: jnp.cumsum(u, axis=0) if u.ndim else u, updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def size_dependent():
    """Scales each leaf by its number of rows: a constant that depends on the piece."""

    def update(updates, state, params=None):
        return jax.tree.map(
            lambda u: u / max(u.shape[0], 1) if u.ndim else u, updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize(
    "transformation, why",
    [
        (layer_mixing, r"`cumsum` mixes the pieces of a leaf"),
        (size_dependent, r"constant that depends on the piece size"),
    ],
)
def test_an_update_that_changes_piece_by_piece_is_refused(transformation, why, getkey):
    params, grads = random_tree(getkey()), random_tree(getkey())
    with pytest.raises(eoi.streaming.NotStreamable, match=why):
        streamed_steps(optax.chain(transformation(), optax.sgd(0.1)), params, grads, 1)
    # ...and in a train step, with the way out.
    policy = eo.Policy.remat(opt_state="pinned_host")
    optimizer = optax.chain(transformation(), optax.adam(1e-3))
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(ValueError, match=rf"cannot be streamed.*{why}.*update='whole'"):
        step(model, opt_state, *next(batches()))
    whole = eo.Policy.remat(opt_state="pinned_host", update="whole")
    step = eo.train_step(cross_entropy, optimizer, whole)
    step(model, opt_state, *next(batches()))


def update_jaxpr(policy, key):
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    model = eo.place(Model(depth=4, key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    return step.trace(model, opt_state, *next(batches())).jaxpr, model, opt_state


def test_one_layer_of_state_on_the_device_at_a_time(getkey):
    policy = eo.Policy.offload_all(update="streamed")  # not the CPU's whole update
    jaxpr, model, opt_state = update_jaxpr(policy, getkey())
    mu = opt_state[1][0].mu.blocks.layers
    # Weights stream a layer at a time; biases and LayerNorm scales (one row per
    # layer, which a TPU cannot slice from the host: `_tiling.py`) move whole.
    stacked_shapes = {x.shape for x in jax.tree.leaves(mu) if x.ndim >= 3}
    assert len(stacked_shapes) >= 3
    layer_shapes = {s[1:] for s in stacked_shapes}  # a layer, without its axis
    moved = set()
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name == "device_put":
            for var, dst in zip(eqn.invars, eqn.params["devices"]):
                if dst == jax.memory.Space.Device:
                    assert var.aval.shape not in stacked_shapes  # never a whole leaf
                    moved.add(var.aval.shape)
    assert layer_shapes <= moved  # one layer at a time, inside the update's scans


def assert_streamed_equals_whole(make_optimizer, key, steps):
    """`train_step` under `Policy.offload_all()`, streamed and whole: the same."""
    results = []
    for update in ("streamed", "whole"):
        policy = eo.Policy.offload_all(update=update)
        optimizer = make_optimizer()
        model = eo.place(Model(key=key), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(cross_entropy, optimizer, policy)
        data = batches()
        for _ in range(steps):
            model, opt_state, loss, _ = step(model, opt_state, *next(data))
        results.append(eqx.filter((model, opt_state, loss), eqx.is_array))
    assert_trees_close(*results)


def test_streamed_and_whole_updates_agree_in_a_train_step(getkey):
    assert_streamed_equals_whole(
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
        getkey(),
        steps=3,
    )


def test_gradient_accumulation_streams_in_a_train_step(monkeypatch, getkey):
    # With small pieces the embedding is streamed in row blocks besides the layers.
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 1024)
    assert_streamed_equals_whole(
        lambda: optax.MultiSteps(
            optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
            every_k_schedule=2,
        ),
        getkey(),
        steps=4,
    )


def test_host_state_is_updated_in_place_on_a_tpu(getkey):
    policy = eo.Policy.remat(opt_state="pinned_host")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    model = eo.place(Model(depth=4, key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    report = eo.memory_report(
        step, model, opt_state, *next(batches()), target="tpu-v5e"
    )
    assert report.opt_state is not None
    # Every host buffer (the state: the parameters are on the device) is donated and
    # updated in place. (The TPU pads small arrays, so its bytes exceed the
    # logical ones; benchmarks/optimizer.py shows equality for large weights.)
    assert report.host["alias"] == report.host["argument"] == report.host["output"]
    assert report.host["argument"] >= report.opt_state["pinned_host"] > 0
    assert report.host["temp"] == 0


def test_update_must_be_known():
    with unchecked(), pytest.raises(ValueError, match=r"Policy\(update='stream'\)"):
        eo.Policy(update="stream")  # pyright: ignore[reportArgumentType]


def test_bfloat16_layers_stream_and_match_the_device_step(getkey):
    # A bfloat16 stacked bias or LayerNorm scale (one packed row per layer) cannot
    # be sliced on the host by a TPU: it goes to the device whole, and is updated
    # whole; the rest streams. The result is the plain step's.
    model = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x,
        Model(key=getkey()),
    )
    results = []
    for policy in (eo.Policy.none(), eo.Policy.offload_all()):
        # A copy: `place` keeps the caller's buffers where nothing moves, and the
        # step donates them.
        copy = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
        placed = eo.place(copy, policy)
        optimizer = optax.sgd(0.1)
        opt_state = eo.init_opt_state(optimizer, placed, policy)
        step = eo.train_step(cross_entropy, optimizer, policy)
        data = batches()
        for _ in range(2):
            placed, opt_state, loss, _ = step(placed, opt_state, *next(data))
        results.append(placed)
    bias = results[1].blocks.layers.norm1.weight
    assert bias.dtype == jnp.bfloat16 and bias.sharding.memory_kind == "pinned_host"
    assert_trees_close(*results, rtol=1e-2, atol=1e-2)  # bfloat16's rounding


def test_each_leafs_transfers_are_named_after_it(getkey):
    policy = eo.Policy.offload_all(update="streamed")  # not the CPU's whole update
    step = eo.train_step(cross_entropy, optax.adam(1e-3), policy)
    model = eo.place(Model(depth=4, key=getkey()), policy)
    opt_state = eo.init_opt_state(optax.adam(1e-3), model, policy)
    traced = step.trace(model, opt_state, *next(batches()))
    text = traced.lower().as_text(debug_info=True)
    for name in ("blocks.mlp.layers[0].weight", "opt_state.blocks.attn"):
        assert name in text
