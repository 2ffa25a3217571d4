"""`train_step(..., microbatches=k)`: the batch split in `k`, gradients accumulated
inside the one compiled step, equal to the whole batch's step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import eqx_offload as eo

from .helpers import (
    batches,
    CountCompiles,
    cross_entropy,
    memory_kind,
    Model,
    table_lm,
)
from .numerics import assert_close, excess, scaled, TRAINED


def _reference(model, optimizer, steps, loss_fn=cross_entropy):
    """Plain Equinox + optax on the device, the whole batch at once."""
    params = eqx.filter(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    @eqx.filter_jit
    def step(model, state, *batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        updates, state = optimizer.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for batch in steps:
        model, state, loss = step(model, state, *batch)
        losses.append(float(loss))
    return model, losses, state


def _offloaded(model, optimizer, policy, steps, k):
    """`train_step` with `k` micro-batches over `steps`, from `model` placed by
    `policy`: the trained model, the losses, the step (its compiles counted) and
    the optimizer state."""
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = CountCompiles(
        eo.train_step(cross_entropy, optimizer, policy, microbatches=k)
    )
    losses = []
    for batch in steps:
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        losses.append(float(loss))
    return model, losses, step, opt_state


def _assert_losses_close(losses, ref_losses):
    """The losses to float32 rounding; losses 1% too large are caught."""
    assert_close(losses, ref_losses)
    assert excess(scaled(losses, 1.01), ref_losses) > 10


def _on_device(model):
    return eo.place(model, eo.Policy(params="device"))


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


KEY = jax.random.key(17)
STEPS = 3


def _from_numpy(abstract):
    """`abstract`'s arrays drawn from NumPy, uniform and scaled by their last
    dimension as Equinox's initialisers are: a model of new shapes without eager
    initialisers to compile for them."""
    rng = np.random.default_rng(0)

    def draw(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        values = rng.uniform(-1, 1, x.shape) / np.sqrt(x.shape[-1])
        return jnp.asarray(values.astype(x.dtype))

    return jax.tree.map(draw, abstract)


def _momentum():
    """SGD with momentum: an update Lipschitz in the gradient (`numerics.TRAINED`),
    and optimizer state (the trace) that must follow the whole batch's too, updated
    once a step with the mean of the micro-batches' gradients."""
    return optax.sgd(0.1, momentum=0.9)


@pytest.fixture(scope="module")
def whole_batch():
    """Three batches of 8, and plain Equinox's steps of `Model(key=KEY)` on them,
    each batch whole: the same for every preset, so run once."""
    steps = [b for _, b in zip(range(STEPS), batches(batch=8))]
    return steps, _reference(Model(key=KEY), _momentum(), steps)


@pytest.mark.parametrize(
    "preset, update", [("offload_residuals", "auto"), ("offload_all", "streamed")]
)
def test_equals_the_whole_batch_step(whole_batch, preset, update):
    """Micro-batching changes only the order in which the gradient is summed: the
    losses, the updates of the parameters and the momentum trace are the whole
    batch's to float32 rounding, under a preset whose parameters and state are on
    the device and one (streamed) whose are on the host."""
    steps, (ref_model, ref_losses, ref_state) = whole_batch
    policy = getattr(eo.Policy, preset)(update=update)
    model, losses, step, opt_state = _offloaded(
        Model(key=KEY), _momentum(), policy, steps, 4
    )
    _assert_losses_close(losses, ref_losses)
    start = Model(key=KEY)
    assert_close(_on_device(model), ref_model, tol=TRAINED, origin=start, steps=STEPS)
    # The trace is a sum of the steps' gradients, as the updates are.
    assert_close(opt_state, ref_state, tol=TRAINED)
    assert excess(scaled(opt_state, 1.01), ref_state, tol=TRAINED) > 10
    assert step.compiled_on == [0]
    kind = "pinned_host" if preset == "offload_all" else "device"
    assert {memory_kind(x) for x in _arrays(model)} == {kind}
    assert {memory_kind(x) for x in _arrays(opt_state)} == {kind}


def test_host_leaves_outside_the_layers_accumulate_where_they_can():
    """The embedding and head outside the `Stacked`, host-resident, at width 128
    (whole TPU tiles): their accumulators stay on the host and are added to in the
    backward pass (`_tiling.whole_tiles`), with the whole batch's step, and the
    parameters on the host. (At width 16 they are summed on the device:
    `test_equals_the_whole_batch_step[offload_all-streamed]`.)"""
    steps = [b for _, b in zip(range(2), batches(vocab=64, batch=4))]
    model = _from_numpy(eqx.filter_eval_shape(Model, 64, 128, 2, key=KEY))
    ref_model, ref_losses, _ = _reference(model, optax.sgd(0.1), steps)
    policy = eo.Policy.offload_all()
    ours, losses, _, _ = _offloaded(model, optax.sgd(0.1), policy, steps, 2)
    _assert_losses_close(losses, ref_losses)
    assert_close(_on_device(ours), ref_model, tol=TRAINED, origin=model, steps=2)
    assert memory_kind(ours.head.weight) == "pinned_host"


def test_aux_comes_back_per_micro_batch_and_unsplit_arguments_are_whole(getkey):
    key = getkey()
    tokens, targets = next(batches(batch=4))
    weights = jnp.linspace(0.5, 1.5, tokens.shape[1])

    def loss_fn(model, tokens, targets, weights):
        logits = jax.vmap(model)(tokens)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        loss = jnp.mean(per_token * weights)
        return loss, {"first": tokens[:, 0], "loss": loss}

    optimizer = optax.sgd(0.1)
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(
        loss_fn, optimizer, policy, has_aux=True, microbatches=2, unsplit=(2,)
    )
    _, _, (loss, aux), _ = step(model, opt_state, tokens, targets, weights)
    # Micro-batch i holds examples i, i + 2.
    np.testing.assert_array_equal(aux["first"], tokens[jnp.array([[0, 2], [1, 3]]), 0])
    assert aux["loss"].shape == (2,)
    assert_close(loss, aux["loss"].mean())
    ref = eqx.filter_jit(loss_fn)(Model(key=key), tokens, targets, weights)[0]
    assert_close(loss, ref)
    # One micro-batch's loss alone is caught.
    assert excess(aux["loss"][0], ref) > 10


def test_bad_arguments_name_the_fix(getkey):
    optimizer = optax.sgd(0.1)
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens, targets = next(batches(batch=6))
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=4)
    with pytest.raises(ValueError, match=r"leading axis 6.*multiple of 4"):
        step(model, opt_state, tokens, targets)

    def with_key(model, tokens, targets, key):
        del key
        return cross_entropy(model, tokens, targets)

    step = eo.train_step(with_key, optimizer, policy, microbatches=2)
    with pytest.raises(
        ValueError, match=r"batch argument 2 is a scalar.*unsplit=\(2,\)"
    ):
        step(model, opt_state, tokens, targets, jax.random.key(0))
    step = eo.train_step(with_key, optimizer, policy, microbatches=2, unsplit=(5,))
    with pytest.raises(ValueError, match="`unsplit` names batch argument 5"):
        step(model, opt_state, tokens, targets, jax.random.key(0))
    with pytest.raises(ValueError, match="no effect without `microbatches`"):
        eo.train_step(with_key, optimizer, policy, unsplit=(2,))
    with pytest.raises(ValueError, match="must be >= 1"):
        eo.train_step(with_key, optimizer, policy, microbatches=0)
    with pytest.raises(TypeError, match="microbatches"):
        eo.train_step(with_key, optimizer, policy, microbatches=2.0)  # pyright: ignore


def test_a_layer_taken_out_of_its_stack(getkey):
    """Host-resident layers get their gradients where the `Stacked` applies them:
    one taken out is an error; on the device it trains like the whole batch."""

    def by_hand(model, tokens, targets):
        first = model.blocks[0]
        x = jax.vmap(lambda t: first(jax.vmap(model.embed)(t)))(tokens)
        return jnp.mean(x**2)

    optimizer = optax.sgd(0.1)
    tokens, targets = next(batches(batch=2))
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(by_hand, optimizer, policy, microbatches=2)
    with pytest.raises(ValueError, match=r"Apply the layers with `blocks\(x\)`"):
        step(model, opt_state, tokens, targets)

    key = getkey()
    ref_model, _, _ = _reference(
        Model(key=key), optimizer, [(tokens, targets)], by_hand
    )
    policy = eo.Policy.remat()
    model = eo.place(Model(key=key), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(by_hand, optimizer, policy, microbatches=2)
    with pytest.warns(UserWarning, match="outside its scan"):
        model, _, _, _ = step(model, opt_state, tokens, targets)
    assert_close(model, ref_model, tol=TRAINED, origin=Model(key=key), steps=1)


def test_on_a_mesh_with_a_laid_out_batch(whole_batch):
    """FSDP over 4 devices, the batch over the same axis, 2 micro-batches: the
    same losses and parameters as one device and the whole batch."""
    steps, (ref_model, ref_losses, _) = whole_batch
    optimizer = _momentum()
    mesh = jax.make_mesh(
        (4,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4]
    )
    policy = eo.Policy.offload_all(shard=eo.FSDP("fsdp", min_size=64), batch="fsdp")
    with jax.set_mesh(mesh):
        model = eo.place(Model(key=KEY), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
        losses = []
        for batch in steps:
            model, opt_state, loss, _ = step(model, opt_state, *batch)
            losses.append(float(loss))
        with pytest.raises(ValueError, match=r"laid out in 4 blocks.*multiple of 8"):
            step(model, opt_state, *next(batches(batch=4)))
    _assert_losses_close(losses, ref_losses)
    assert_close(model, ref_model, tol=TRAINED, origin=Model(key=KEY), steps=STEPS)
    specs = {x.sharding.spec for x in _arrays(model)}
    assert any("fsdp" in str(s) for s in specs)


def test_compiles_for_tpu_at_small_and_odd_widths():
    """On `tpu-v5e`, at the small and odd width 72 (not whole TPU tiles), the
    micro-batched `offload_all` step compiles, its parameters and optimizer state
    on the host, the embedding and head tables outside the layers too. (Layers of
    one matmul, not attention: what is checked is where the leaves live, and this
    compiles in a quarter of the time. With a bf16 compute dtype, LayerNorm and
    biases: `test_tpu_compile.py`'s `SHARE`; how device memory falls with `k`:
    `benchmarks/microbatch.py`.)"""
    optimizer = _momentum()  # its state (the trace) is the parameters' size
    vocab, dim, depth = 64, 72, 2

    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), vocab, dim, depth)
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    policy = eo.Policy.offload_all()
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
    report = eo.memory_report(step, model, opt_state, tokens, tokens, target="tpu-v5e")
    params = sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves(abstract)
        if isinstance(x, jax.ShapeDtypeStruct)
    )
    assert params == 4 * (2 * vocab + depth * dim) * dim
    assert report.params == report.opt_state == {"pinned_host": params}
