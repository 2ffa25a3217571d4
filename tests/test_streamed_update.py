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
    assert_trees_equal,
    batches,
    cross_entropy,
    MLPBlock,
    Model,
    StackedNet,
    table_lm,
    unchecked,
)
from .numerics import assert_close, excess, TRAINED


# The optimizer changes only the arithmetic inside each piece; what the streaming
# does differs by what the update reads across pieces: nothing (one pass: `adamw`),
# a global norm (two passes: the clip) or a norm of each whole leaf (`lamb`, whose
# trust ratio is a norm over all layers of a stacked leaf, computed from every
# layer's partial sums), or both.
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2),
    "clip + sgd (momentum)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)
    ),
    "clip + lion": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.lion(1e-3, weight_decay=0.1)
    ),
    "clip + lamb": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.lamb(1e-2)
    ),
}


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


def device(tree):
    return jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), tree
    )


def streamed_step(optimizer, params, state):
    """`(params, state, grads) -> (params, state)`, streamed, all of it on the
    host."""
    layers = [LAYERS[k] for k in sorted(params)]
    n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
    kinds = (["pinned_host"] * n_params, ["pinned_host"] * n_state)

    @jax.jit
    def step(params, state, grads):
        paths = sorted(params)
        new = eoi.streaming_update(
            optimizer, grads, state, params, layers, kinds, paths
        )
        return new[:2]

    return lambda *args: step(*map(host, args))


def optax_step(optimizer):
    @jax.jit
    def step(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return lambda *args: step(*map(device, args))


def streamed_once(optimizer, params, grads):
    state = optimizer.init(params)
    return streamed_step(optimizer, params, state)(params, state, grads)


def unchanged(new, old) -> bool:
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(old))
    )


def assert_streamed_equals_optax(make_optimizer, getkey, steps=1, nan_at=None):
    """Streamed steps on random trees, one at a time from the state of two optax
    steps (moments, a count), each against optax's whole update on the same
    gradients: the parameters' updates and the new state within float32's
    tolerance (`F32`: the same elementwise arithmetic; LAMB's and the clip's norms
    are the same sums in another order). The step at `nan_at` has a gradient that
    is not finite. Returns the streamed result.

    The negative control, on the same compiled update: the gradients' sign
    flipped is more than ten times beyond the tolerance."""
    optimizer = make_optimizer()
    theirs = optax_step(optimizer)
    params = random_tree(getkey())
    state = optimizer.init(params)
    for _ in range(2):
        params, state = theirs(params, state, random_tree(getkey()))
    ours = streamed_step(optimizer, params, state)
    for i in range(steps):
        grads = random_tree(getkey())
        if i == nan_at:
            grads["large"] = grads["large"].at[3, 5].set(jnp.nan)
        ref_params, ref_state = theirs(params, state, grads)
        new_params, new_state = ours(params, state, grads)
        applied = not unchanged(ref_params, params)
        assert not (applied and i == nan_at)  # a gradient not finite: skipped
        if applied:
            assert_close(new_params, ref_params, origin=params)
        else:  # skipped, or accumulated: nothing changes
            assert_trees_equal(new_params, params)
        assert_close(new_state, ref_state)
        if i != nan_at:
            wrong_params, wrong_state = ours(
                params, state, jax.tree.map(jnp.negative, grads)
            )
            wrong = excess(wrong_state, ref_state)
            if applied:
                wrong = max(wrong, excess(wrong_params, ref_params, origin=params))
            assert wrong > 10
        params, state = new_params, new_state
    return params, state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_streamed_update_equals_optax(name, monkeypatch, getkey):
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 8192)  # "large" is 32 KiB
    ours = assert_streamed_equals_optax(OPTIMIZERS[name], getkey)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(ours)} == {"pinned_host"}


TPU_LOOP = {
    "clip + adam": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-2)
    ),
    "lamb": OPTIMIZERS["lamb"],
}


@pytest.mark.parametrize("name", TPU_LOOP)
def test_the_tpu_loop_equals_optax_too(name, monkeypatch, getkey):
    # On the CPU the streamed loops read one piece ahead; this runs the loop a TPU
    # compiles (each step reads its own piece) here: after a global norm, and
    # with each leaf's norm.
    monkeypatch.setattr("eqx_offload._update._streaming.READ_IN_STEP", ("cpu",))
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 8192)
    assert_streamed_equals_optax(TPU_LOOP[name], getkey)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(optax.zero_nans(), optax.adam(1e-2)),  # scalar per leaf
        lambda: optax.adafactor(1e-2),  # (1,)-shaped placeholders per leaf
    ],
    ids=["zero_nans + adam", "adafactor"],
)
def test_state_not_shaped_like_its_parameter_is_shared(make, monkeypatch, getkey):
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 8192)
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
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 8192)
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
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 8192)
    params, grads = random_tree(getkey()), random_tree(getkey())
    with pytest.raises(eoi.NotStreamable, match=why):
        streamed_once(make(), params, grads)


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
    # leaf is computed as both branches and a select, piece by piece. Three steps:
    # `MultiSteps` accumulates, applies and accumulates; `apply_if_finite` skips
    # the second, whose gradients are not finite (the parameters stay as they
    # are, bit for bit).
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 8192)
    nan_at = 1 if name == "apply_if_finite(adam)" else None
    assert_streamed_equals_optax(CONDS[name], getkey, steps=3, nan_at=nan_at)


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
    with pytest.raises(eoi.NotStreamable, match=why):
        streamed_once(optax.chain(transformation(), optax.sgd(0.1)), params, grads)
    # ...and in a train step, with the way out.
    policy = eo.Policy.remat(opt_state="pinned_host")
    optimizer = optax.chain(transformation(), optax.adam(1e-3))
    model = eo.place(table_lm(getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(ValueError, match=rf"cannot be streamed.*{why}.*update='whole'"):
        step(model, opt_state, *next(batches()))
    whole = eo.Policy.remat(opt_state="pinned_host", update="whole")
    step = eo.train_step(cross_entropy, optimizer, whole)
    step(model, opt_state, *next(batches()))


@pytest.fixture(scope="module")
def streamed_trace():
    """A train step of `Model` under `offload_all` with the streamed update (not
    the CPU's whole one), traced once: `(traced, opt_state)`."""
    policy = eo.Policy.offload_all(update="streamed")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    model = eo.place(Model(depth=4, key=jax.random.key(3)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    return step.trace(model, opt_state, *next(batches())), opt_state


def test_one_layer_of_state_on_the_device_at_a_time(streamed_trace):
    traced, opt_state = streamed_trace
    mu = opt_state[1][0].mu.blocks.layers
    # Weights stream a layer at a time; biases and LayerNorm scales (one row per
    # layer, which a TPU cannot slice from the host: `_tiling.py`) move whole.
    stacked_shapes = {x.shape for x in jax.tree.leaves(mu) if x.ndim >= 3}
    assert len(stacked_shapes) >= 3
    layer_shapes = {s[1:] for s in stacked_shapes}  # a layer, without its axis
    moved = set()
    for eqn in all_eqns(traced.jaxpr):
        if eqn.primitive.name == "device_put":
            for var, dst in zip(eqn.invars, eqn.params["devices"]):
                if dst == jax.memory.Space.Device:
                    assert var.aval.shape not in stacked_shapes  # never a whole leaf
                    moved.add(var.aval.shape)
    assert layer_shapes <= moved  # one layer at a time, inside the update's scans


def test_each_leafs_transfers_are_named_after_it(streamed_trace):
    traced, _ = streamed_trace
    text = traced.lower().as_text(debug_info=True)
    for name in ("blocks.mlp.layers[0].weight", "opt_state.blocks.attn"):
        assert name in text


def accumulated_sgd(learning_rate):
    return optax.MultiSteps(
        optax.chain(
            optax.clip_by_global_norm(0.5), optax.sgd(learning_rate, momentum=0.9)
        ),
        every_k_schedule=2,
    )


def test_streamed_and_whole_updates_agree_in_a_train_step(monkeypatch, getkey):
    """`train_step` under `Policy.offload_all()`, streamed and whole, four steps of
    SGD behind a clip, accumulated over two: the updates within `TRAINED`, the
    losses and state too (the momentum is a sum of gradients, as the updates
    are). With small pieces the tables are streamed in row blocks besides the
    layers. The negative control: the first layer's update dropped."""
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 1024)
    key, steps = getkey(), 4
    results = []
    for update in ("streamed", "whole"):
        policy = eo.Policy.offload_all(update=update)
        optimizer = accumulated_sgd(0.1)
        model = eo.place(table_lm(key), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(cross_entropy, optimizer, policy)
        data, losses = batches(), []
        for _ in range(steps):
            model, opt_state, loss, _ = step(model, opt_state, *next(data))
            losses.append(float(loss))
        results.append((model, opt_state, losses))
    (model, opt_state, losses), (ref_model, ref_state, ref_losses) = results
    start = table_lm(key)
    assert_close(losses, ref_losses)
    assert_close(model, ref_model, tol=TRAINED, origin=start, steps=steps)
    assert_close(opt_state, ref_state, tol=TRAINED)
    layers = lambda m: m.blocks.layers  # noqa: E731
    first = jax.tree.map(
        lambda x, o: x.at[0].set(o[0]) if eqx.is_inexact_array(x) else x,
        layers(model),
        layers(start),
    )
    dropped = eqx.tree_at(layers, model, first)
    assert excess(dropped, ref_model, tol=TRAINED, origin=start, steps=steps) > 10


def test_host_state_is_updated_in_place_on_a_tpu(getkey):
    policy = eo.Policy.remat(opt_state="pinned_host")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    model = eo.place(eqx.filter_eval_shape(table_lm, getkey()), policy)
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


def test_bfloat16_layers_stream_and_match_optax(getkey):
    """A bfloat16 stacked bias or LayerNorm scale (one packed row per layer) cannot
    be sliced on the host by a TPU: it goes to the device whole, and is updated
    whole; the rest streams. On the same gradients the result is optax's, bit for
    bit: SGD at a power of two scales each gradient exactly, and adds it to its
    parameter with one rounding, whatever the order. (`test_verify.py` trains a
    bfloat16 model under `offload_all`.) The negative control: another learning
    rate, in the state (the same compiled update)."""
    mlp = StackedNet(lambda k: MLPBlock(16, 32, key=k), 4, (16, 4), key=getkey())
    model = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, mlp
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(
        lambda x: jax.random.normal(getkey(), x.shape, x.dtype), params
    )
    policy = eo.Policy.offload_all(update="streamed")  # not the CPU's whole update
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.125)

    @eqx.filter_jit
    def ours(grads, opt_state, model):
        return eo.optimizer_update(optimizer, grads, opt_state, model, policy)

    updates, _ = optimizer.update(grads, optimizer.init(params))
    expected = optax.apply_updates(params, updates)
    placed = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, placed, policy)
    new, _, _ = ours(grads, opt_state, placed)
    assert_trees_equal(eqx.filter(new, eqx.is_inexact_array), expected)
    bias = new.blocks.layers.fc1.bias
    assert bias.dtype == jnp.bfloat16 and bias.sharding.memory_kind == "pinned_host"
    lr = opt_state.hyperparams["learning_rate"]
    hyperparams = {
        "learning_rate": jax.device_put(jnp.asarray(0.25, lr.dtype), lr.sharding)
    }
    other, _, _ = ours(grads, opt_state._replace(hyperparams=hyperparams), placed)
    with pytest.raises(AssertionError):
        assert_trees_equal(eqx.filter(other, eqx.is_inexact_array), expected)
