"""The mistakes users make, each with the error (or warning) that names the argument
or leaf and the fix, or behaviour that now simply works."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float

import eqx_offload as eo

from .helpers import batches, cross_entropy, MLPBlock, Model, StackedNet, unchecked
from .numerics import assert_close, excess, TRAINED


# Two layers: the fewest that pass a carry from one layer to the next (one fewer
# model to build, at another depth, than mixing depths).
DEPTH = 2
# SGD in the comparisons with plain Equinox: its update is Lipschitz in the
# gradient, so the updates compare with `TRAINED` (`tests/numerics.py`).
LR = 0.1


def _model(key, depth: int = DEPTH) -> Model:
    """A `Model` of `depth` layers: the first of one of `DEPTH` (no model of
    another depth to build, op by op)."""
    model = Model(depth=DEPTH, key=key)
    return eqx.tree_at(lambda m: m.blocks, model, model.blocks[:depth])


def _setup(policy: eo.Policy, getkey, optimizer=None, depth: int = DEPTH):
    optimizer = optimizer or optax.adamw(1e-3)
    model = eo.place(_model(getkey(), depth), policy)
    return model, eo.init_opt_state(optimizer, model, policy), optimizer


def _embedded(model: Model, tokens):
    return jax.vmap(model.embed)(tokens[0])


def _loop_loss(model: Model, tokens):
    """Applies the layers one by one in a Python loop, bypassing the scan."""
    x = _embedded(model, tokens)
    for layer in model.blocks:
        x = layer(x)
    return jnp.mean(x**2)


def _slice_loss(model: Model, tokens):
    return jnp.mean(model.blocks[1:](_embedded(model, tokens)))


# --- Layers taken out of a `Stacked` inside a step ---------------------------------


@pytest.mark.parametrize(
    "apply, how",
    [
        (lambda blocks, x: blocks[0](x), r"`blocks\[0\]`"),
        (lambda blocks, x: [layer(x) for layer in blocks][-1], "`for layer in blocks`"),
    ],
)
def test_a_host_resident_layer_outside_its_scan_is_refused(getkey, apply, how):
    policy = eo.Policy.offload_all()
    model, opt_state, optimizer = _setup(policy, getkey)

    def loss(model, tokens):
        return jnp.mean(apply(model.blocks, _embedded(model, tokens)))

    step = eo.train_step(loss, optimizer, policy)
    tokens, _ = next(batches())
    with pytest.raises(
        ValueError,
        match=how + r": the layers of the `Stacked` at 'blocks' are host-resident "
        r"\('blocks\.norm1\.weight'.*`blocks\(x\)` or `blocks\.scan\(f, carry\)`.*"
        r"`Policy\(params=\{'blocks': 'device'\}\)`",
    ):
        step(model, opt_state, tokens)


def test_a_slice_of_host_resident_layers_inside_a_step_is_refused(getkey):
    policy = eo.Policy.offload_all()
    model, opt_state, optimizer = _setup(policy, getkey)

    step = eo.train_step(_slice_loss, optimizer, policy)
    tokens, _ = next(batches())
    with pytest.raises(
        ValueError,
        match=r"`blocks\[1:\]`: the layers of the `Stacked` at 'blocks' are "
        r"host-resident .* slicing them inside a step is a computation on the host"
        r".*slice the model before the step",
    ):
        step(model, opt_state, tokens)


def test_a_slice_of_device_resident_layers_scans_under_the_policy(getkey):
    """The step's slice `blocks[1:]` offloads its layer's input to the host."""
    policy = eo.Policy.offload_residuals()
    model, opt_state, optimizer = _setup(policy, getkey)

    tokens, _ = next(batches())
    step = eo.train_step(_slice_loss, optimizer, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a slice is a `Stacked`: no bypass
        report = eo.memory_report(step, model, opt_state, tokens)
    assert report.residuals is not None
    saved = {(r.name, r.memory_kind): r.bytes for r in report.residuals}
    assert saved[("blocks.input", "pinned_host")] == 8 * 16 * 4  # seq 8, dim 16


_NO_CHECKPOINT = r"`jax\.checkpoint`.*does not apply"


def _plain_step(model, optimizer, tokens):
    """`_loop_loss`'s first step in plain Equinox and Optax: the loss, the new
    model, and the model it started from (copies: the train step donates
    `model`'s buffers)."""

    @eqx.filter_jit
    def step(model, tokens):
        loss, grads = eqx.filter_value_and_grad(_loop_loss)(model, tokens)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        new = eqx.filter(eqx.apply_updates(model, updates), eqx.is_array)
        # The negative control of the loss: the loss of a step that skipped a layer.
        skipped = eqx.tree_at(lambda m: m.blocks, model, model.blocks[1:])
        return loss, new, _loop_loss(skipped, tokens)

    loss, new, skipped = step(model, tokens)
    assert excess(skipped, loss) > 10
    return np.asarray(loss), _copy(new), _copy(model)


def _copy(tree):
    return jax.tree.map(np.array, eqx.filter(tree, eqx.is_array))


def _without_layer_update(model, start, layer: int = 1):
    """`model` with one layer's update undone (each stacked leaf's slice `layer`
    back to `start`'s): the negative control of a step that skipped a layer."""

    def undo(x, x0):
        x = np.array(x)
        x[layer] = x0[layer]
        return x

    blocks = jax.tree.map(undo, eqx.filter(model.blocks, eqx.is_array), start.blocks)
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


def _assert_steps_like_plain_equinox(expected, stepped):
    """`stepped`, a train step's outputs, is `expected`, `_plain_step`'s: the same
    loss, and the same update, which a skipped layer or a learning rate 1% too
    large would not be."""
    loss, new, start = expected
    new_model, _, new_loss, _ = stepped
    new_model = eqx.filter(new_model, eqx.is_array)  # (`Dropout.p` is a float)
    assert_close(new_loss, loss)
    assert_close(new_model, new, tol=TRAINED, origin=start, steps=1)
    skipped = _without_layer_update(new_model, start)
    assert excess(skipped, new, tol=TRAINED, origin=start, steps=1) > 10


def test_a_python_loop_under_remat_warns_that_no_checkpoint_applies(getkey):
    """`Policy.remat()`: it warns, pointing at the loop, and trains as plain
    Equinox does."""
    policy = eo.Policy.remat()
    model, opt_state, optimizer = _setup(policy, getkey, optax.sgd(LR))

    tokens, _ = next(batches())
    expected = _plain_step(model, optimizer, tokens)
    step = eo.train_step(_loop_loss, optimizer, policy)
    with pytest.warns(UserWarning, match=_NO_CHECKPOINT) as got:
        stepped = step(model, opt_state, tokens)
    assert got[0].filename == __file__  # points at the loop, not the library
    _assert_steps_like_plain_equinox(expected, stepped)


def test_a_python_loop_under_offload_residuals_warns_then_names_no_residual(getkey):
    """`Policy.offload_residuals()`: the same warning, then the error that the name
    it offloads never occurred (no `Stacked` scan names it)."""
    policy = eo.Policy.offload_residuals()
    model, opt_state, optimizer = _setup(policy, getkey)

    tokens, _ = next(batches())
    step = eo.train_step(_loop_loss, optimizer, policy)
    with pytest.warns(UserWarning, match=_NO_CHECKPOINT) as got:
        with pytest.raises(ValueError, match="never occurred"):
            step(model, opt_state, tokens)
    assert got[0].filename == __file__


@pytest.fixture(scope="module")
def plain_loop_step():
    """`_loop_loss`'s step under `Policy.none()`, compiled once for the tests that
    run it."""
    return eo.train_step(_loop_loss, optax.sgd(LR), eo.Policy.none())


def test_a_python_loop_without_remat_is_fine(getkey, plain_loop_step):
    """No warning, and it trains as plain Equinox does."""
    step = plain_loop_step
    model, opt_state, optimizer = _setup(step.policy, getkey, step.optimizer)

    tokens, _ = next(batches())
    expected = _plain_step(model, optimizer, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped = step(model, opt_state, tokens)
    _assert_steps_like_plain_equinox(expected, stepped)


def test_layers_outside_a_step_index_and_iterate(getkey):
    blocks = _model(getkey()).blocks
    assert len(list(blocks)) == 2
    weights = blocks.layers.norm1.weight
    assert weights is not None
    np.testing.assert_array_equal(blocks[1].norm1.weight, weights[1])


# --- Empty stacks -------------------------------------------------------------------


def test_an_empty_slice_of_a_stack_is_refused(getkey):
    blocks = _model(getkey()).blocks
    with pytest.raises(IndexError, match=r"`stacked\[0:0\]` selects no layers of 2"):
        blocks[0:0]
    assert len(blocks[1:]) == 1 and len(blocks[-2:]) == 2


def test_a_stacked_with_leading_axis_zero_is_refused():
    layer = eqx.nn.Linear(3, 3, key=jax.random.key(0))
    empty = jax.tree.map(lambda x: x[None][:0] if eqx.is_array(x) else x, layer)
    with pytest.raises(ValueError, match=r"`Stacked\(layers\)` has no layers"):
        eo.Stacked(empty)


# --- Arguments of the wrong type ----------------------------------------------------


@pytest.mark.parametrize("policy", ["offload_all", eo.Policy.offload_all, None, 3])
def test_a_policy_that_is_not_a_policy(getkey, policy):
    model = _model(getkey())
    optimizer = optax.adam(1e-3)
    calls = {
        "train_step(policy=...)": lambda: eo.train_step(
            cross_entropy, optimizer, policy
        ),
        "init_opt_state(policy=...)": lambda: eo.init_opt_state(
            optimizer, model, policy
        ),
        "filter_offload(policy=...)": lambda: eo.filter_offload(cross_entropy, policy),
    }
    if policy is not None:  # `place(model)` alone follows the annotations
        calls["place(tree, policy)"] = lambda: eo.place(model, policy)
    for where, call in calls.items():
        if policy is None and where.startswith("filter_offload"):
            match = "needs a policy"
        else:
            match = re.escape(f"`{where}` must be an `eqx_offload.Policy`")
        with unchecked(), pytest.raises(TypeError, match=match) as info:
            call()
        if policy == "offload_all" or policy is eo.Policy.offload_all:
            assert "`eqx_offload.Policy.offload_all()`" in str(info.value)


def test_an_optimizer_factory_not_called(getkey):
    model = _model(getkey())
    policy = eo.Policy.none()
    fix = r"`optax\.adamw` builds an optimizer: call it, e\.g\. `optax\.adamw\("
    with unchecked():
        with pytest.raises(
            TypeError, match=r"`init_opt_state\(optimizer=\.\.\.\)`.*" + fix
        ):
            eo.init_opt_state(optax.adamw, model, policy)  # pyright: ignore
        with pytest.raises(
            TypeError, match=r"`train_step\(optimizer=\.\.\.\)`.*" + fix
        ):
            eo.train_step(cross_entropy, optax.adamw, policy)  # pyright: ignore
        end = r"got str 'adam'\. See docs/errors\.md#e39\.$"  # (no hint)
        with pytest.raises(TypeError, match=end):
            eo.train_step(cross_entropy, "adam", policy)  # pyright: ignore


def test_an_optimizer_state_for_another_depth(getkey):
    policy = eo.Policy.offload_all()
    model, _, optimizer = _setup(policy, getkey)
    _, other_state, _ = _setup(policy, getkey, depth=1)
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(
        ValueError,
        match=r"optimizer state leaf '\[0\]\.mu\.blocks\.norm1\.weight' has shape "
        r"\(1, 16\) where `optimizer\.init\(model\)` gives \(2, 16\).*init_opt_state",
    ):
        step(model, other_state, *next(batches()))


def test_an_optimizer_state_for_another_optimizer(getkey):
    policy = eo.Policy.none()
    model, sgd_state, _ = _setup(policy, getkey, optimizer=optax.sgd(0.1, 0.9))
    step = eo.train_step(cross_entropy, optax.adam(1e-3), policy)
    with pytest.raises(ValueError, match="does not have the structure"):
        step(model, sgd_state, *next(batches()))


# --- Optimizers whose `init` looks at the parameters ---------------------------------


def _labels(params):
    """Labels built with `eqx.tree_at`: what `tree_map_params`' placeholder fails."""
    labels = jax.tree.map(lambda _: "momentum", params)
    return eqx.tree_at(lambda p: p.head.weight, labels, "sgd")


def _scale_by_initial_head_norm() -> optax.GradientTransformation:
    def init(params):
        return {"norm": jnp.linalg.norm(params.head.weight)}

    def update(updates, state, params=None):
        return jax.tree.map(lambda u: u / state["norm"], updates), state

    return optax.GradientTransformation(init, update)


def _mlps(key) -> StackedNet:
    """Two residual MLPs and a head: a small model, quick to compile."""
    return StackedNet(lambda k: MLPBlock(8, 16, key=k), 2, (8, 4), key=key)


def _squared_error(model: StackedNet, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _regression(key) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(key, (4, 8))
    return x, jnp.tanh(x[:, :4])


def _momentum() -> optax.GradientTransformation:
    """SGD with momentum on a schedule: momenta shaped like the parameters, and a
    step count."""
    return optax.sgd(optax.constant_schedule(LR), momentum=0.9)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.multi_transform(
            {"momentum": _momentum(), "sgd": optax.sgd(LR)}, _labels
        ),
        lambda: optax.chain(_scale_by_initial_head_norm(), _momentum()),
    ],
    ids=["multi_transform-tree_at-labels", "init-computes-on-params"],
)
def test_optimizers_whose_init_looks_at_the_parameters(getkey, make):
    policy = eo.Policy.offload_all()
    key = getkey()
    model = eo.place(_mlps(key), policy)
    optimizer = make()
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(_squared_error, optimizer, policy)
    reference = _mlps(key)
    start = _copy(reference)
    ref_state = optimizer.init(eqx.filter(reference, eqx.is_inexact_array))

    @eqx.filter_jit
    def ref_step(reference, ref_state, *batch):
        loss, grads = eqx.filter_value_and_grad(_squared_error)(reference, *batch)
        params = eqx.filter(reference, eqx.is_inexact_array)
        updates, ref_state = optimizer.update(grads, ref_state, params)
        # The negative control of the loss: a step that skipped a layer.
        skipped = eqx.tree_at(lambda m: m.blocks, reference, reference.blocks[1:])
        skipped_loss = _squared_error(skipped, *batch)
        return eqx.apply_updates(reference, updates), ref_state, loss, skipped_loss

    losses, ref_losses, skipped_losses = [], [], []
    for batch in (_regression(getkey()), _regression(getkey())):
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        reference, ref_state, ref_loss, skipped = ref_step(reference, ref_state, *batch)
        losses.append(loss)
        ref_losses.append(ref_loss)
        skipped_losses.append(skipped)
    assert_close(losses, ref_losses)
    assert excess(skipped_losses, ref_losses) > 10
    ours, ref = _copy(model), _copy(reference)
    assert_close(ours, ref, tol=TRAINED, origin=start, steps=2)
    skipped = _without_layer_update(ours, start)
    assert excess(skipped, ref, tol=TRAINED, origin=start, steps=2) > 10
    # The momenta are on the host, the step count on the device.
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt_state)}
    assert kinds == {"device", "pinned_host"}
    # Under `none`, nothing moves and the state is made as optax makes it.
    none = eo.Policy.none()
    state = eo.init_opt_state(optimizer, eo.place(reference, none), none)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)


# --- Layers that return more than their carry ---------------------------------------


class _CacheLayer(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(
        self, x: Float[Array, "n 4"]
    ) -> tuple[Float[Array, "n 4"], Float[Array, "n 4"]]:
        y = jax.vmap(self.linear)(x)
        return y, y  # (output, cache), Hugging Face style


def test_a_layer_returning_a_cache_points_to_scan(getkey):
    stacked = eo.Stacked.from_fn(
        lambda k: _CacheLayer(eqx.nn.Linear(4, 4, key=k)), 3, key=getkey()
    )
    x = jnp.ones((2, 4))
    with pytest.raises(
        TypeError,
        match=r"it took \(shape=\(2, 4\), dtype=float32\) and returned "
        r"\(\(shape=\(2, 4\).*use `stacked\.scan`",
    ):
        stacked(x)
    out, caches = stacked.scan(lambda layer, x, _: layer(x), x)
    assert out.shape == (2, 4) and caches.shape == (3, 2, 4)


def test_a_layer_changing_the_carry_dtype_is_named(getkey):
    stacked = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(4, 4, key=k), 2, key=getkey())
    with pytest.raises(TypeError, match=r"took \(shape=\(4,\), dtype=int32\)"):
        stacked(jnp.ones(4, jnp.int32))


# --- Donation ---------------------------------------------------------------------


def test_using_a_donated_model_again_names_the_leaf(getkey, plain_loop_step):
    step = plain_loop_step
    original = _model(getkey())
    model = eo.place(original, step.policy)
    opt_state = eo.init_opt_state(step.optimizer, model, step.policy)
    tokens, _ = next(batches())
    _, _, _, _ = step(model, opt_state, tokens)
    # `place` moved nothing, so the original's buffers were donated too.
    with pytest.raises(
        ValueError, match=r"model leaf 'embed\.weight' has been deleted"
    ):
        step(original, opt_state, tokens)


# --- Layers in a Python list, and an optimizer state made by optax -----------------


class _ListModel(eqx.Module):
    """A small `Model` with its layers in a Python list, applied by a loop."""

    embed: eqx.nn.Embedding
    layers: list[eqx.nn.MLP]
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(32, 8, key=k1)
        self.layers = [eqx.nn.MLP(8, 8, 16, 1, key=k) for k in jax.random.split(k2, 3)]
        self.head = eqx.nn.Linear(8, 32, key=k3)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for layer in self.layers:
            x = jax.vmap(layer)(x)
        return jax.vmap(self.head)(x)


def test_layers_in_a_python_list_with_host_parameters_warn_to_use_stacked(getkey):
    """Every layer is moved to the device whole: tracing the step (here for its
    memory report, as for a call) warns so at the line that called the library,
    and the report's hint for what is saved outside a `Stacked` names
    `eo.Stacked`."""
    policy = eo.Policy.remat(params="pinned_host", opt_state="pinned_host")
    optimizer = optax.adamw(1e-3)
    plain = _ListModel(key=getkey())
    model = eo.place(plain, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    batch = next(batches())
    with pytest.warns(
        UserWarning,
        match=r"`filter_offload`: 'layers' is a Python list of 3 layers of one "
        r"structure with host-resident parameters "
        r"\('layers\[0\]\.layers\[0\]\.weight'.*"
        r"all 3 layers are moved to the device whole, each step, and nothing "
        r"streams\. Hold them in an `eo\.Stacked` \(`eo\.Stacked\.from_layers\("
        r"layers\)`.*`self\.layers\(x\)`",
    ) as got:
        report = eo.memory_report(step, model, opt_state, *batch)
    assert got[0].filename == __file__  # the line that called the library
    assert "hold repeated layers in an `eo.Stacked`" in str(report)

    # On the device, or under a policy that keeps the list there: nothing to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = eo.filter_offload(cross_entropy, eo.Policy.remat())
        eqx.filter_eval_shape(loss, plain, *batch)
        eqx.filter_eval_shape(loss, eo.place(model, eo.Policy(params="device")), *batch)


def test_an_optimizer_state_made_by_optax_names_the_leaf_and_init_opt_state(getkey):
    """`optimizer.init` on the placed parameters fails inside JAX (eagerly: `Memory
    kind mismatch`, `test_evaluate.py`); jitted, it makes the state on the device,
    which the step refuses, naming the leaf, both kinds and the fix."""
    policy = eo.Policy.offload_all()
    model = eo.place(_model(getkey(), depth=1), policy)
    optimizer = optax.adamw(1e-3)
    opt_state = eqx.filter_jit(optimizer.init)(eqx.filter(model, eqx.is_inexact_array))
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(
        ValueError,
        match=r"`train_step`: optimizer state leaf '\[0\]\.mu\.embed\.weight' is in "
        r"'device' but the policy puts it in 'pinned_host'.*"
        r"`eqx_offload\.init_opt_state\(optimizer, model, policy\)`",
    ):
        step(model, opt_state, *next(batches()))


def test_the_old_policy_stream_names_host_tables():
    """`Policy(stream=...)` is `Policy(host_tables=...)` now: the old keyword (in a
    preset too) and the old attribute name the new one."""
    with pytest.raises(TypeError, match=r"`Policy\(stream=\.\.\.\)` is now `Policy\("):
        eo.Policy(stream=("embed",))
    with pytest.raises(TypeError, match=r"is now `Policy\(host_tables=\.\.\.\)`"):
        eo.Policy.offload_all(stream=("embed",))
    with pytest.raises(AttributeError, match=r"`policy\.host_tables`"):
        _ = eo.Policy().stream
    with pytest.raises(TypeError, match="unexpected keyword argument 'strem'"):
        eo.Policy(strem=("embed",))


def test_memory_report_kind_is_now_compiled():
    """`MemoryReport.kind` (what was compiled) is `MemoryReport.compiled`: the old
    name says so."""
    report = eo.memory_report(lambda x: x * 2, jnp.ones(3))
    assert report.compiled == "function"
    with pytest.raises(
        AttributeError, match=r"`MemoryReport\.kind` is now `MemoryReport\.compiled`"
    ):
        getattr(report, "kind")


def test_verify_takes_the_step_and_examples(getkey):
    """`verify(loss_fn, optimizer, policy, ...)` and `verify(..., microbatches=)`
    name the new form, `verify(step, model, opt_state, *batch)`; `microbatch=` is
    `examples=`, and `VerifyReport.microbatch` is `.examples`."""
    policy = eo.Policy.remat()
    model, opt_state, optimizer = _setup(policy, getkey, optax.sgd(0.1))
    tokens, targets = next(batches())
    new_form = r"`verify` takes the step.*`verify\(step, model, opt_state, \*batch\)`"
    with pytest.raises(TypeError, match=new_form):
        eo.verify(cross_entropy, optimizer, policy, model, opt_state, tokens, targets)
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(TypeError, match=new_form):
        eo.verify(step, model, opt_state, tokens, targets, microbatches=2)
    with pytest.raises(
        TypeError, match=r"`verify\(microbatch=\.\.\.\)` is now `verify\(examples="
    ):
        eo.verify(step, model, opt_state, tokens, targets, microbatch=2)
    # (`test_verify.py` runs `examples=`; the report's old field needs no run.)
    same = eo.Difference("loss", 0.0, 1.0, 1e-5)
    report = eo.VerifyReport(same, same, None, None, 1, False, 1)
    with pytest.raises(
        AttributeError, match=r"`VerifyReport\.microbatch` is now `\.examples`"
    ):
        getattr(report, "microbatch")
