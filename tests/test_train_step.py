"""`eo.train_step`: the compiled step trains as the plain Equinox + optax step does,
compared through SGD updates (`tests/numerics.py`) with a changed learning rate and
a wrong sign caught; it compiles once per input shape, donates, keeps outputs where
the policy puts them, and refuses misplaced or malformed input with the argument
named."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import (
    as_reference,
    batches,
    CountCompiles,
    cross_entropy,
    loss_with_l2,
    memory_kind,
    Model,
)
from .numerics import assert_close, excess, TRAINED


DEVICE_PARAM_PRESETS = {
    "none": eo.Policy.none(),
    "remat": eo.Policy.remat(),
    "offload_residuals": eo.Policy.offload_residuals(),
    "offload_residuals+host_opt_state": eo.Policy.offload_residuals(
        opt_state="pinned_host"
    ),
}


def sgd(lr: float, **kwargs) -> optax.GradientTransformation:
    """SGD with its learning rate in the optimizer state
    (`opt_state.hyperparams["learning_rate"]`), so that a negative control changes
    it without compiling the step again."""
    return optax.inject_hyperparams(optax.sgd)(learning_rate=lr, **kwargs)


def with_lr(opt_state, lr: float):
    old = opt_state.hyperparams["learning_rate"]
    # Of the old one's dtype and placement: a weakly typed or uncommitted array would
    # compile the step again.
    new = jax.device_put(jnp.asarray(lr, old.dtype), old.sharding)
    hyperparams = {**opt_state.hyperparams, "learning_rate": new}
    return opt_state._replace(hyperparams=hyperparams)


def reference_run(model, loss_fn, optimizer, steps):
    """Plain Equinox + optax: a Python loop over blocks, no eqx_offload at all."""
    ref = as_reference(model)
    opt_state = optimizer.init(eqx.filter(ref, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(ref, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(ref, tokens, targets)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(ref, eqx.is_inexact_array)
        )
        return eqx.apply_updates(ref, updates), opt_state, loss

    losses = []
    data = batches()
    for _ in range(steps):
        ref, opt_state, loss = step(ref, opt_state, *next(data))
        losses.append(float(loss))
    return ref, losses


def offload_run(model, loss_fn, optimizer, policy, steps, step=None, lr=None):
    """`steps` steps of `eo.train_step` from `model`; `step` reuses a step built
    before, `lr` replaces the learning rate of a `sgd(...)` optimizer's state."""
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    if lr is not None:
        opt_state = with_lr(opt_state, lr)
    step = step or eo.train_step(loss_fn, optimizer, policy)
    losses = []
    data = batches()
    for _ in range(steps):
        model, opt_state, loss, _ = step(model, opt_state, *next(data))
        losses.append(float(loss))
    return model, opt_state, losses


def stacked(ref):
    """The reference's parameters in our model's order: its blocks stacked."""
    return ref.embed, eo.Stacked.from_layers(ref.blocks), ref.head


def params(model):
    return model.embed, model.blocks, model.head


L2_KEY = jax.random.key(76)
LR, N = 0.05, 5


@pytest.fixture(scope="module")
def l2_reference():
    """Plain Equinox's SGD steps of `Model(key=L2_KEY)` with the L2 penalty: the
    same for every preset, so run once."""
    return reference_run(Model(key=L2_KEY), loss_with_l2, sgd(LR), N)


@pytest.fixture(scope="module")
def remat_step():
    return eo.train_step(loss_with_l2, sgd(LR), eo.Policy.remat())


@pytest.mark.parametrize("name", DEVICE_PARAM_PRESETS)
def test_matches_reference_with_l2_penalty(name, l2_reference, remat_step):
    ref, ref_losses = l2_reference
    policy = DEVICE_PARAM_PRESETS[name]
    step = remat_step if name == "remat" else None
    ours, _, losses = offload_run(
        Model(key=L2_KEY), loss_with_l2, sgd(LR), policy, N, step
    )
    assert losses[-1] < losses[0]
    assert_close(losses, ref_losses)
    start = params(Model(key=L2_KEY))
    assert_close(params(ours), stacked(ref), tol=TRAINED, origin=start, steps=N)


def test_a_changed_learning_rate_or_a_wrong_sign_is_caught(l2_reference, remat_step):
    """The negative controls of the comparisons above, with the same compiled step:
    at `lr x 1.01` the updates are more than ten times beyond their tolerance; at
    `-lr` (a wrong gradient sign) the losses are."""
    ref, ref_losses = l2_reference
    start = params(Model(key=L2_KEY))
    policy = eo.Policy.remat()
    step = CountCompiles(remat_step)
    for lr, losses_too in ((1.01 * LR, False), (-LR, True)):
        ours, _, losses = offload_run(
            Model(key=L2_KEY), loss_with_l2, sgd(LR), policy, N, step, lr
        )
        updates = excess(params(ours), stacked(ref), tol=TRAINED, origin=start, steps=N)
        assert updates > 10
        if losses_too:
            assert excess(losses, ref_losses) > 10
    # Compiled once at most (by `test_matches_reference_with_l2_penalty[remat]` if
    # it ran first): a learning rate in the state changes no program.
    assert step.compiled_on in ([], [0])


def test_offload_all_rejects_l2_penalty_over_stacked_leaves(getkey):
    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(1e-2)
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_with_l2, optimizer, policy)
    with pytest.raises(
        ValueError, match=r"'blocks\.norm1\.weight'.*add_decayed_weights"
    ):
        step(model, opt_state, *next(batches()))


def test_outputs_stay_where_the_policy_puts_them(getkey):
    policy = eo.Policy(
        params={"blocks": "pinned_host", "blocks.norm1": "device"},
        offload=("blocks.input",),
        opt_state="pinned_host",
    )
    optimizer = optax.adam(1e-3)
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    data = batches()
    for _ in range(2):
        model, opt_state, _, _ = step(model, opt_state, *next(data))
    assert memory_kind(model.embed.weight) == "device"
    assert memory_kind(model.blocks.layers.norm1.weight) == "device"
    assert memory_kind(model.blocks.layers.mlp.layers[0].weight) == "pinned_host"
    assert memory_kind(opt_state[0].nu.blocks.layers.attn.query_proj.weight) == (
        "pinned_host"
    )


def test_unplaced_model_is_an_error(getkey):
    policy = eo.Policy.offload_all()
    optimizer = optax.adam(1e-3)
    model = Model(key=getkey())
    opt_state = eo.init_opt_state(optimizer, eo.place(model, policy), policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(
        ValueError, match=r"model leaf 'embed\.weight'.*eqx_offload\.place"
    ):
        step(model, opt_state, *next(batches()))


def test_misplaced_opt_state_is_an_error(getkey):
    policy = eo.Policy.remat(opt_state="pinned_host")
    optimizer = optax.adam(1e-3)
    model = eo.place(Model(key=getkey()), policy)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(ValueError, match=r"optimizer state leaf .*init_opt_state"):
        step(model, opt_state, *next(batches()))


def test_unpinned_host_is_refused_in_a_step(getkey):
    policy = eo.Policy(params={"head": "unpinned_host"})
    optimizer = optax.sgd(1e-3)
    model = eo.place(Model(key=getkey()), policy)
    assert memory_kind(model.head.weight) == "unpinned_host"
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(ValueError, match=r"'head\.weight'.*'pinned_host' instead"):
        step(model, opt_state, *next(batches()))


def test_non_trainable_leaves_pass_through_and_aux_comes_back(getkey):
    """A non-trainable leaf (an int buffer) comes back as it was; with
    `has_aux=True` the loss's aux comes back beside the loss. (One step for both:
    each new step compiles.)"""

    class WithBuffer(eqx.Module):
        model: Model
        step_count: jax.Array

        def __call__(self, tokens):
            return self.model(tokens)

    def loss_fn(m, tokens, targets):
        loss = cross_entropy(m, tokens, targets) + 0.0 * m.step_count
        return loss, {"twice": 2 * loss}

    policy = eo.Policy.offload_residuals()
    optimizer = optax.sgd(1e-2)
    model = eo.place(WithBuffer(Model(key=getkey()), jnp.array(3)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss_fn, optimizer, policy, has_aux=True)
    model, _, (loss, aux), _ = step(model, opt_state, *next(batches()))
    assert int(model.step_count) == 3
    assert aux["twice"] == 2 * loss  # exact: a doubling


def test_model_sharded_over_a_mesh_is_traced_once_per_input_shape(getkey):
    """A model laid out over a mesh by hand: the step traces and compiles once per
    input shape (once for three steps, once more for a new batch size), and its
    outputs keep the inputs' shardings."""
    traces = []

    def loss_fn(model, tokens, targets):
        traces.append(tokens.shape)
        return cross_entropy(model, tokens, targets)

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
    replicate = jax.sharding.NamedSharding(mesh, jax.P())
    model = Model(dim=16, key=getkey())
    model = jax.tree.map(
        lambda x: (
            jax.device_put(x, shard if x.ndim == 3 else replicate)
            if eqx.is_array(x)
            else x
        ),
        model,
    )
    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(1e-2)
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    assert opt_state[0].count.sharding == replicate
    inputs = [x.sharding for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    step = CountCompiles(eo.train_step(loss_fn, optimizer, policy))
    data = batches()
    for _ in range(3):
        model, opt_state, _, _ = step(model, opt_state, *next(data))
    assert step.compiled_on == [0] and traces == [(2, 8)]
    outputs = [x.sharding for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    assert outputs == inputs
    data = batches(batch=3)
    for _ in range(2):
        model, opt_state, _, _ = step(model, opt_state, *next(data))
    assert traces == [(2, 8), (3, 8)]
    assert step.compiled_on == [0, 3]


def test_prng_keys_in_the_model_stay_on_the_device(getkey):
    class WithKey(eqx.Module):
        model: Model
        key: jax.Array

        def __call__(self, tokens):
            return self.model(tokens)

    policy = eo.Policy.offload_all()
    optimizer = optax.adam(1e-3)
    model = eo.place(WithKey(Model(key=getkey()), getkey()), policy)
    assert memory_kind(model.key) == "device"
    assert memory_kind(model.model.head.weight) == "pinned_host"
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    model, _, _, _ = step(model, opt_state, *next(batches()))
    assert memory_kind(model.key) == "device"

    class HostKey(eqx.Module):
        key: jax.Array = eo.field(memory_kind="pinned_host")

    with pytest.raises(ValueError, match=r"leaf 'key' is a PRNG key array"):
        eo.place(HostKey(getkey()))


def test_weak_typed_leaves_do_not_cause_a_recompile_and_inputs_are_donated(getkey):
    """A weakly typed leaf (`jnp.array(1.0)`) compiles the step once for all its
    steps; each step donates the model it was given (its buffers deleted), not
    the batch. (One step for both: each new step compiles.)"""

    class Scaled(eqx.Module):
        model: Model
        scale: jax.Array

        def __call__(self, tokens):
            return self.scale * self.model(tokens)

    policy = eo.Policy.remat()
    optimizer = optax.sgd(1e-2)
    model = eo.place(Scaled(Model(key=getkey()), jnp.array(1.0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = CountCompiles(eo.train_step(cross_entropy, optimizer, policy))
    data = batches()
    for _ in range(3):
        tokens, targets = next(data)
        given = model
        model, opt_state, _, _ = step(model, opt_state, tokens, targets)
        assert given.model.head.weight.is_deleted()
        assert not model.model.head.weight.is_deleted()
        assert not tokens.is_deleted()
    assert step.compiled_on == [0]


def all_but_embedding(params):
    # A structural mask: the same for the stacked model and the reference.
    mask = jax.tree.map(lambda _: True, params)
    return eqx.tree_at(lambda m: m.embed.weight, mask, False)


def only_embedding(params):
    return jax.tree.map(lambda keep: not keep, all_but_embedding(params))


def test_offload_all_matches_reference_with_optimizer_wrappers(getkey):
    """`offload_all` (parameters, residuals and optimizer state on the host) trains
    as plain Equinox does, with optax's wrappers around a stateful (momentum) SGD,
    all in one optimizer: `MultiSteps` (its accumulated gradients and a `cond` on
    the step count), `clip_by_global_norm` (a norm over every leaf) and `masked` (a
    structural mask, the same for the stacked model and the reference)."""
    optimizer = optax.MultiSteps(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.masked(optax.sgd(LR, momentum=0.9), all_but_embedding),
            # What `masked` leaves out passes through as the gradient itself.
            optax.masked(optax.scale(-LR), only_embedding),
        ),
        every_k_schedule=2,
    )
    key = getkey()
    ref, ref_losses = reference_run(Model(key=key), cross_entropy, optimizer, 4)
    ours, opt_state, losses = offload_run(
        Model(key=key), cross_entropy, optimizer, eo.Policy.offload_all(), 4
    )
    assert_close(losses, ref_losses)
    start = params(Model(key=key))
    assert_close(params(ours), stacked(ref), tol=TRAINED, origin=start, steps=4)
    arrays = jax.tree.leaves(eqx.filter(ours, eqx.is_array))
    assert {memory_kind(x) for x in arrays} == {"pinned_host"}
    momentum = opt_state.inner_opt_state[1].inner_state[0].trace
    for state in (opt_state.acc_grads, momentum):
        assert {memory_kind(x) for x in jax.tree.leaves(state)} == {"pinned_host"}
    assert memory_kind(opt_state.mini_step) == "device"


# --- Equinox code as people write it ------------------------------------------------


def _maybe(decorator, apply: bool):
    return decorator if apply else (lambda f: f)


def _jitted_model_class(jit: bool) -> type[Model]:
    """The tests' `Model`, with its methods under `eqx.filter_jit` and a `jax.jit`
    that returns a constant next to the layers' output, as Equinox code often
    has them; or (`jit=False`) the same model without any of them."""

    @_maybe(jax.jit, jit)
    def scale(x):
        return x, jnp.float32(1.0)  # a constant output of a jitted function

    class Jitted(Model):
        @_maybe(eqx.filter_jit, jit)
        def features(self, tokens):
            return self.blocks(jax.vmap(self.embed)(tokens))

        @_maybe(eqx.filter_jit, jit)
        def __call__(self, tokens):
            x, one = scale(self.features(tokens))
            return jax.vmap(self.head)(x) * one

    return Jitted


@pytest.fixture(scope="module")
def plain_run():
    model = _jitted_model_class(jit=False)(dim=8, depth=2, key=jax.random.key(3))
    return offload_run(model, cross_entropy, optax.sgd(0.1), eo.Policy.none(), 2)


@pytest.mark.parametrize("preset", ["none", "offload_all"])
def test_inner_jits_train_like_the_plain_model(preset, plain_run):
    """Under `none` (no checkpoint) and `offload_all` (checkpointed layers,
    offloaded residuals, host parameters: what `remat` and `offload_residuals` do,
    and more)."""
    model = _jitted_model_class(jit=True)(dim=8, depth=2, key=jax.random.key(3))
    policy = getattr(eo.Policy, preset)()
    ours, _, losses = offload_run(model, cross_entropy, optax.sgd(0.1), policy, 2)
    ref, _, ref_losses = plain_run
    assert_close(losses, ref_losses)
    start = _jitted_model_class(jit=False)(dim=8, depth=2, key=jax.random.key(3))
    assert_close(ours, ref, tol=TRAINED, origin=start, steps=2)


def test_the_step_inside_another_jit_runs_as_part_of_it(getkey):
    policy = eo.Policy.offload_all()
    optimizer = optax.sgd(0.1)
    model = eo.place(Model(dim=8, depth=2, key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    batch = next(batches())
    copy = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
    outer = eqx.filter_jit(step)(copy, opt_state, *batch)
    direct = step(model, opt_state, *batch)
    outer, direct = eqx.filter((outer, direct), eqx.is_array)
    for a, b in zip(jax.tree.leaves(outer), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert memory_kind(a) == memory_kind(b)
    assert memory_kind(outer[0].blocks.layers.mlp.layers[0].weight) == "pinned_host"


def test_what_the_loss_returns_is_checked(getkey):
    policy = eo.Policy.remat()
    optimizer = optax.sgd(0.1)
    model = eo.place(Model(dim=8, depth=2, key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    batch = next(batches())

    def with_aux(model, tokens, targets):
        return cross_entropy(model, tokens, targets), {"n": tokens.size}

    def per_example(model, tokens, targets):
        return jnp.mean(jax.vmap(model)(tokens), axis=(1, 2))

    mistakes = [
        (
            with_aux,
            False,
            r"returned \(float32\[\], \{'n': int\}\); for `\(loss, aux\)`, "
            r"pass `has_aux=True`",
        ),
        (
            per_example,
            False,
            r"returned float32\[2\]; the loss must be one "
            r"floating-point scalar \(e\.g\. `jnp\.mean`",
        ),
        (
            cross_entropy,
            True,
            r"returned float32\[\]; it returns the loss alone: drop "
            r"`has_aux=True`",
        ),
    ]
    for loss_fn, has_aux, message in mistakes:
        step = eo.train_step(loss_fn, optimizer, policy, has_aux=has_aux)
        with pytest.raises(ValueError, match=r"`train_step`: `loss_fn` " + message):
            step(model, opt_state, *batch)


def test_keyword_batch_arguments_are_refused(getkey):
    policy = eo.Policy.remat()
    optimizer = optax.sgd(0.1)
    model = eo.place(Model(dim=8, depth=2, key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens, targets = next(batches())
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(
        TypeError,
        match=r"got keyword batch argument\(s\) 'targets'\. Pass them by position: "
        r"`step\(model, opt_state, \*batch\)`",
    ):
        step(model, opt_state, tokens, targets=targets)


def test_the_step_is_a_public_train_step(getkey):
    """`train_step` returns an `eo.TrainStep` whose fields are what it was built
    from (an `optax.MultiSteps` as its transformation), and `step.trace` traces the
    program the step runs."""
    policy = eo.Policy.offload_all()
    optimizer = optax.MultiSteps(optax.sgd(0.1), 2)
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
    assert isinstance(step, eo.TrainStep)
    assert (step.loss_fn, step.policy) == (cross_entropy, policy)
    assert isinstance(step.optimizer, optax.GradientTransformation)
    assert (step.has_aux, step.microbatches, step.unsplit, step.metrics) == (
        False,
        2,
        (),
        False,
    )
    model = eo.place(Model(dim=8, depth=2, key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    traced = step.trace(model, opt_state, *next(batches()))
    assert "scan" in str(traced.jaxpr)
