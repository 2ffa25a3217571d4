"""`verify`: correct policies pass (compute dtypes, micro-batches and FSDP too), a
wrong loss, gradient or update is named, and the caller's arrays are left alone."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import eqx_offload as eo
import eqx_offload.internal as eoi
from eqx_offload.internal import is_host

from .helpers import batches, memory_kind
from .numerics import F32
from .test_state_dict import make_nested, Net


def cross_entropy(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def setup(policy, key, dtype=None, optimizer=None):
    model = Net(key=key)
    if dtype is not None:
        model = jax.tree.map(
            lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model
        )
    optimizer = optimizer or optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2)
    )
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens, targets = next(batches(batch=4))
    return optimizer, model, opt_state, tokens, targets


def snapshot(tree):
    """Values and memory kinds of every array leaf, kept apart from the buffers."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    return [(np.array(x), memory_kind(x)) for x in leaves]


def assert_intact(tree, before):
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    assert len(leaves) == len(before)
    for x, (value, kind) in zip(leaves, before):
        assert not x.is_deleted()  # not donated
        assert memory_kind(x) == kind
        np.testing.assert_array_equal(np.asarray(x), value)


CASES = {
    # policy, verify's keyword arguments, `has_aux`, the examples given, the slice
    # `loss_fn` sees, how the report says what was checked
    "offload_all": (
        eo.Policy.offload_all(),
        {},
        False,
        4,
        (2, (2, 8)),
        "the first 2 layers of each `Stacked`, the first 2 examples",
    ),
    "offload_residuals": (
        eo.Policy.offload_residuals(),
        {},
        False,
        4,
        (2, (2, 8)),
        "the first 2 layers of each `Stacked`, the first 2 examples",
    ),
    # The batch kept whole, of one example; the step inside `eqx.filter_jit`, as
    # `memory_report` takes it (the step inside is verified).
    "remat": (
        eo.Policy.remat(),
        dict(examples=None),
        True,
        1,
        (2, (1, 8)),
        "the first 2 layers of each `Stacked`, the whole batch (1 example)",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_correct_policies_pass_and_the_callers_arrays_are_intact(name, getkey):
    policy, kwargs, has_aux, given, expected, checked = CASES[name]
    optimizer, model, opt_state, tokens, targets = setup(policy, getkey())
    tokens, targets = tokens[:given], targets[:given]
    before = snapshot((model, opt_state))
    seen = []

    def loss_fn(model, tokens, targets):
        seen.append((len(model.blocks), tokens.shape))
        loss = cross_entropy(model, tokens, targets)
        return (loss, {"tokens": tokens}) if has_aux else loss

    step = eo.train_step(loss_fn, optimizer, policy, has_aux=has_aux)
    if name == "remat":
        step = eqx.filter_jit(step)
    report = eo.verify(step, model, opt_state, tokens, targets, **kwargs)
    assert isinstance(report, eo.VerifyReport) and report.passed
    assert set(seen) == {expected}  # the layers and examples kept
    assert (report.examples, report.whole_batch) == (expected[1][0], given == 1)
    # Parameters and optimizer state on the host: the update streams, and is
    # checked; otherwise there is nothing to compare it with.
    assert (report.update is not None) == (name == "offload_all")
    text = str(report)
    assert "gradients" in text and "FAILED" not in text and checked in text
    assert ("(not checked)" in text) == (name != "offload_all")
    assert_intact((model, opt_state), before)


def test_bfloat16_passes(getkey):
    policy = eo.Policy.offload_all()
    optimizer, model, opt_state, tokens, targets = setup(
        policy, getkey(), dtype=jnp.bfloat16, optimizer=optax.adam(1e-2)
    )
    step = eo.train_step(cross_entropy, optimizer, policy)
    report = eo.verify(step, model, opt_state, tokens, targets)
    assert report.passed and report.update is not None
    tolerance = report.gradients.tolerance
    assert tolerance == pytest.approx(1e-5 + 5e-2 * report.gradients.scale)


def test_optimizer_state_is_cut_with_its_parameters(getkey):
    # Adafactor's factored moments are not parameter-shaped; they are cut along
    # their layer axis all the same, to what `init` gives for the sliced model.
    model = Net(key=getkey())
    optimizer = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    small = eoi.cutting_cut(model, eoi.model_sizes(model, 2))
    assert len(small.blocks) == 2
    sizes = eoi.state_sizes(
        optimizer, opt_state, eqx.filter(small, eqx.is_inexact_array)
    )
    expected = jax.eval_shape(optimizer.init, eqx.filter(small, eqx.is_inexact_array))
    leaves = [x for x in jax.tree.leaves(opt_state) if eqx.is_array(x)]
    assert [s for s in sizes if s is not None] == [
        tuple(e.shape) for e in jax.tree.leaves(expected)
    ]
    assert any(len(x.shape) == 2 and x.shape[0] == 4 for x in leaves)  # factored


def test_nested_stacked_are_cut_too(getkey):
    model = make_nested(key=getkey())  # 2 blocks of 3 linears
    small = eoi.cutting_cut(model, eoi.model_sizes(model, 2))
    assert small.blocks.layers.linears.layers.weight.shape == (2, 2, 8, 8)
    assert small.blocks.layers.scale.shape == (2, 8)


def test_a_loss_that_differs_under_the_transform_is_named(getkey):
    # Under the offloaded transform only, the loss is shifted and the head gets no
    # gradient: the loss is reported first, and the report names the gradient too.
    def loss_fn(model, tokens, targets):
        if eoi.is_inside():
            head = jax.lax.stop_gradient(model.head.weight)
            model = eqx.tree_at(lambda m: m.head.weight, model, head)
            return cross_entropy(model, tokens, targets) + 1.0
        return cross_entropy(model, tokens, targets)

    policy = eo.Policy.offload_residuals()
    optimizer, model, opt_state, tokens, targets = setup(policy, getkey())
    with pytest.raises(
        eo.DoesNotMatch,
        match=r"`verify`: the loss differs between the offloaded step and "
        r"the reference \(every leaf on the device, no remat\) by 1, beyond the "
        r"tolerance (.|\n)*openxla/xla#46231",
    ) as info:
        step = eo.train_step(loss_fn, optimizer, policy)
        eo.verify(step, model, opt_state, tokens, targets)
    report = info.value.report
    assert not report.loss.passed and report.update is None
    assert not report.gradients.passed and report.gradients.leaf == "head.weight"
    assert "FAILED" in str(report)


def test_a_corrupted_transfer_in_the_backward_pass_is_named(monkeypatch, getkey):
    # The class of bug `verify` is for: the forward pass is right, but moving one
    # host-resident layer slice to the device corrupts its gradient.
    policy = eo.Policy.offload_all()
    optimizer, model, opt_state, tokens, targets = setup(policy, getkey())
    shape = model.blocks.layers.layers[1].weight.shape[1:]  # (32, 16): unique

    @jax.custom_vjp
    def corrupt(x):
        return x

    corrupt.defvjp(lambda x: (x, None), lambda _, g: (2.0 * g,))
    to_device = eoi.to_device

    def corrupted(layer_arrays):
        def one(x):
            return corrupt(x) if is_host(x) and x.shape == shape else x

        return to_device(jax.tree.map(one, layer_arrays))

    monkeypatch.setattr("eqx_offload._scan_body.to_device", corrupted)

    def loss_fn(*args):  # its own: no program traced before the patch is reused
        return cross_entropy(*args)

    with pytest.raises(
        eo.DoesNotMatch, match=r"the gradient of leaf 'blocks.layers\[1\].weight'"
    ) as info:
        step = eo.train_step(loss_fn, optimizer, policy)
        eo.verify(step, model, opt_state, tokens, targets)
    assert info.value.report.loss.passed


def test_a_corrupted_streamed_update_is_named(monkeypatch, getkey):
    policy = eo.Policy.offload_all()
    optimizer, model, opt_state, tokens, targets = setup(
        policy, getkey(), optimizer=optax.sgd(1e-2)
    )
    before = snapshot((model, opt_state))
    update = eoi.streaming_update

    def corrupted(*args, **kwargs):
        params, state, norms = update(*args, **kwargs)
        head = params.head.weight
        return eqx.tree_at(lambda p: p.head.weight, params, head + 1e-3), state, norms

    monkeypatch.setattr("eqx_offload._update._streaming.update", corrupted)
    with pytest.raises(
        eo.DoesNotMatch,
        match=r"leaf 'head.weight' after the streamed update differs between the "
        r"offloaded step and the whole update",
    ) as info:
        step = eo.train_step(cross_entropy, optimizer, policy)
        eo.verify(step, model, opt_state, tokens, targets)
    report = info.value.report
    assert report.loss.passed and report.gradients.passed
    assert report.update is not None and report.update.leaf == "head.weight"
    assert_intact((model, opt_state), before)


@pytest.mark.parametrize("argument", ["layers", "examples"])
def test_counts_must_be_positive(argument, getkey):
    policy = eo.Policy.remat()
    optimizer, model, opt_state, tokens, targets = setup(policy, getkey())
    kwargs: dict[str, Any] = {argument: 0}
    step = eo.train_step(cross_entropy, optimizer, policy)
    with pytest.raises(
        ValueError, match=rf"`verify\({argument}=...\)` must be a positive int"
    ):
        eo.verify(step, model, opt_state, tokens, targets, **kwargs)


def test_a_loss_sized_by_the_configured_depth_names_layers(getkey):
    policy = eo.Policy.remat()
    optimizer, model, opt_state, tokens, targets = setup(
        policy, getkey(), optimizer=optax.sgd(0.1)
    )
    n_layers = len(model.blocks)  # as a config would hold it

    def one_cache_per_layer(model, tokens, targets):
        caches = jnp.zeros((n_layers, tokens.shape[-1]))
        x = jax.vmap(model.embed)(tokens[0])

        def layer(block, x, cache):
            return jax.vmap(block)(x) + cache[:, None], None

        return jnp.mean(model.blocks.scan(layer, x, caches)[0] ** 2)

    step = eo.train_step(one_cache_per_layer, optimizer, policy)
    args = (model, opt_state, tokens, targets)
    with pytest.raises(
        ValueError,
        match=r"`verify\(layers=2\)`: `loss_fn` fails on the model cut to the first 2 "
        r"layer\(s\) of each `Stacked`, though it traces on the whole model.*"
        r"configured depth.*`verify\(\.\.\., layers=None\)`\. It raised ValueError: "
        r"scan got `length`",
    ):
        eo.verify(step, *args)
    report = eo.verify(step, *args, layers=None)
    assert (report.layers, report.whole_batch, report.examples) == (None, False, 2)
    assert "every layer of each `Stacked`, the first 2 examples" in str(report)


def beyond_float32(report) -> float:
    """How many times `F32` of the scale the step's loss or gradients are from the
    reference's (`tests/numerics.py`), at most."""
    checks = (report.loss, report.gradients)
    return max(c.difference / (F32 * c.scale) for c in checks)


def assert_computes_what_the_step_computes(report):
    """The reference computes what the step computes, in its dtype and its
    micro-batches: the same float32 values in another order (`F32`). A reference
    in another dtype or over other examples is off by far more: a float32 one
    against a bfloat16 step by some 5e-3 of the scale, another micro-batching by
    the loss itself (each test's negative control). (In bfloat16 the same values
    in another order are only within `BF16_COMPUTE`, too loose to tell a float32
    reference; on the CPU the step and the reference compute the very same bits,
    under AVX-512, AVX2 and SSE4.2 alike.)"""
    assert beyond_float32(report) <= 1


def test_compute_dtypes_are_verified(getkey):
    # bfloat16 compute copies, rewritten by the streamed update (checked against
    # the whole one), but for `head`: computed in float32 on both sides, with no
    # copy. (`test_fsdp_steps_are_verified` has a compute dtype without
    # `keep_dtype`.)
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16, keep_dtype=("head",))
    optimizer, model, opt_state, tokens, targets = setup(
        policy, getkey(), optimizer=optax.sgd(0.1)
    )
    assert isinstance(opt_state, eo.ComputeCopyState)
    assert isinstance(opt_state.copies.head.weight, optax.MaskedNode)
    assert opt_state.copies.embed.weight.dtype == jnp.bfloat16
    before = snapshot((model, opt_state))
    step = eo.train_step(cross_entropy, optimizer, policy)
    report = eo.verify(step, model, opt_state, tokens, targets)
    assert report.passed and report.update is not None
    assert_computes_what_the_step_computes(report)
    # Float32 gradients computed in bfloat16: bfloat16's tolerance.
    scale = report.gradients.scale
    assert report.gradients.tolerance == pytest.approx(1e-5 + 5e-2 * scale)
    # Both updates are float32 arithmetic on the masters: float32's tolerance
    # (bfloat16's `atol` alone is 1e-5).
    assert report.update.tolerance < 1e-5
    assert_intact((model, opt_state), before)

    # Negative controls: compute copies that are not the masters' (the state of
    # another model) are what the step computes with, and are caught; a reference
    # in float32, not in the compute dtype, is far from the step.
    other = eo.init_opt_state(optimizer, eo.place(Net(key=getkey()), policy), policy)
    with pytest.raises(eo.DoesNotMatch, match=r"`verify`: the gradient of leaf"):
        eo.verify(step, model, other, tokens, targets)
    reference = eoi.verify_reference

    def in_float32(step, dtypes, *args):
        return reference(step, None, *args)  # (no dtypes: no cast)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("eqx_offload._verify._reference", in_float32)
        with pytest.raises(eo.DoesNotMatch) as info:
            eo.verify(step, model, opt_state, tokens, targets)
    assert beyond_float32(info.value.report) > 10


def summed_cross_entropy(model, tokens, targets):
    # A sum over examples, not a mean (nor is a mean over non-padding tokens): the
    # step's loss is the mean over its micro-batches, not the whole batch's.
    return cross_entropy(model, tokens, targets) * tokens.shape[0]


def test_micro_batched_steps_are_verified(getkey):
    policy = eo.Policy.offload_all(update="whole")
    optimizer, model, opt_state, tokens, targets = setup(
        policy, getkey(), optimizer=optax.sgd(0.1)
    )
    args = (model, opt_state, tokens, targets)
    # `examples=2` kept (the default), split into two micro-batches.
    step = eo.train_step(summed_cross_entropy, optimizer, policy, microbatches=2)
    report = eo.verify(step, *args)
    assert report.passed and report.microbatches == 2
    assert (report.whole_batch, report.examples) == (False, 2)
    assert "the first 2 examples in 2 micro-batches" in str(report)
    assert_computes_what_the_step_computes(report)

    # Negative control: a step whose micro-batches all hold the first one's
    # examples.
    def repeated(batch, k, unsplit):
        parts = split(batch, k, unsplit)
        return jax.tree.map(lambda x: jnp.stack([x[0]] * k), parts)

    def loss_fn(*args):  # its own: no program traced before the patch is reused
        return summed_cross_entropy(*args)

    split = eoi.microbatch_split
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("eqx_offload._microbatch.split", repeated)
        with pytest.raises(eo.DoesNotMatch, match="the loss differs") as info:
            step = eo.train_step(loss_fn, optimizer, policy, microbatches=2)
            eo.verify(step, *args)
    assert beyond_float32(info.value.report) > 10


def test_a_batch_that_does_not_split_into_micro_batches_is_named(getkey):
    policy = eo.Policy.remat()
    optimizer, model, opt_state, tokens, targets = setup(policy, getkey())
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=4)
    with pytest.raises(
        ValueError,
        match=r"`verify` \(the whole batch, `train_step\(microbatches=4\)`\): batch "
        r"argument 0 has leading axis 3, which does not split into 4 micro-batches\. "
        r"Give a batch whose size is a multiple of 4",
    ):
        eo.verify(step, model, opt_state, tokens[:3], targets[:3])


def test_fsdp_steps_are_verified():
    """FSDP over 2 devices, in bfloat16 and two micro-batches. The two examples
    kept by default are rounded up to 4: two micro-batches of one example per
    device. (Summed over the devices in bfloat16, in another order than the
    reference's: not exactly the reference's gradients, but within bfloat16's
    tolerance.)"""
    policy = eo.Policy.offload_all(
        shard=eo.FSDP("fsdp", min_size=0),
        batch="fsdp",
        compute_dtype=jnp.bfloat16,
        update="whole",
    )
    mesh = jax.make_mesh(
        (2,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    optimizer = optax.sgd(0.1)
    model = eo.place(Net(key=jax.random.key(0)), policy, mesh=mesh)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    assert "fsdp" in model.blocks.layers.layers[0].weight.sharding.spec
    tokens, targets = next(batches(batch=8))
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
    report = eo.verify(step, model, opt_state, tokens, targets)
    assert report.passed and (report.whole_batch, report.examples) == (False, 4)


def test_unsplit_arguments_are_not_cut():
    # Passed whole to every micro-batch, so not batch-major: a shared mask.
    tokens, mask = jnp.zeros((8, 4), jnp.int32), jnp.ones((4, 4))
    assert eoi.batch_sizes((tokens, mask), 2, (1,)) == [(2, 4), (4, 4)]
    assert eoi.cutting_examples((tokens, mask), (1,)) == 8
