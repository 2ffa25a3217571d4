"""Placement is proven on jaxprs and avals, not assumed."""

import contextlib
import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import eqx_offload as eo
from eqx_offload.internal import jaxpr_checkpoint_names, saved_residuals

from .helpers import (
    all_eqns,
    batches,
    cross_entropy,
    Model,
    primitive_names,
    TanhBlock,
)


def test_agrees_with_jax_print_saved_residuals():
    def f(x, w):
        h = checkpoint_name(jnp.sin(x @ w), "h")
        return jnp.sum(jnp.cos(h) * x)

    x, w = jnp.ones((3, 4)), jnp.ones((4, 4))
    policy = jax.checkpoint_policies.save_only_these_names("h")
    for fn in (f, jax.checkpoint(f, policy=policy)):
        ours = sorted(
            (r.aval.str_short(short_dtypes=True), describe(r))
            for r in saved_residuals(fn, x, w)
        )
        theirs = sorted(
            (
                aval,
                re.sub(r"( x| w|) from .*$|(argument) [xw]$", r"\2", description),
            )
            for aval, description in jax_saved_residuals(fn, x, w)
        )
        assert len(theirs) == (5 if fn is f else 3)  # the oracle printed them all
        assert ours == theirs


def jax_saved_residuals(fn, *args):
    """JAX's own account, the oracle: what its public `print_saved_residuals`
    prints, one `type description` line per residual."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return [line.split(" ", 1) for line in out.getvalue().splitlines()]


def describe(r):
    if r.source == "named":
        return f"named '{r.name}'"
    if r.source == "argument":
        return "from the argument"
    return f"output of {r.source}"


def test_checkpoint_names_finds_nested_names():
    def f(x):
        x = checkpoint_name(x, "a")
        return jax.lax.scan(
            lambda c, _: (checkpoint_name(c, "b") * 2, None), x, None, 3
        )[0]

    assert jaxpr_checkpoint_names(jax.make_jaxpr(f)(1.0)) == ["a", "b"]


def stacked_residuals(depth, policy):
    # Traced only: an abstract model, none to build.
    model = eqx.filter_eval_shape(Model, depth=depth, key=jax.random.key(0))
    fn = eo.filter_offload(cross_entropy, policy)
    residuals = saved_residuals(fn, model, *next(batches()))
    return [r for r in residuals if r.per_iteration]


def test_offload_residuals_moves_every_per_layer_residual_to_the_host():
    by_depth = {}
    for depth in (4, 16):
        residuals = stacked_residuals(depth, eo.Policy.offload_residuals())
        assert residuals and all(r.host for r in residuals)
        by_depth[depth] = (
            sum(r.nbytes for r in residuals if not r.host),
            sum(r.nbytes for r in residuals if r.host),
        )
    (device4, host4), (device16, host16) = by_depth[4], by_depth[16]
    assert device4 == device16
    assert host16 == 4 * host4 > 0


def test_without_offload_per_layer_residuals_stay_on_the_device():
    residuals = stacked_residuals(4, eo.Policy.remat(save=("blocks.input",)))
    assert residuals and not any(r.host for r in residuals)


def test_host_params_move_one_slice_at_a_time_and_gradients_return_to_host(getkey):
    policy = eo.Policy.offload_all()
    model = eo.place(Model(depth=4, key=getkey()), policy)
    fn = eqx.filter_value_and_grad(eo.filter_offload(cross_entropy, policy))
    batch = next(batches())
    jaxpr = eqx.filter_make_jaxpr(fn)(model, *batch)[0]

    leaves = jax.tree.leaves(eqx.filter(model.blocks, eqx.is_array))
    # Weights move a layer at a time; a bias or LayerNorm scale (one row per
    # layer, which a TPU cannot slice from the host: `_tiling.py`) moves whole.
    stacked_shapes = {x.shape for x in leaves if x.ndim >= 3}
    row_shapes = {x.shape for x in leaves if x.ndim < 3}
    assert stacked_shapes and row_shapes
    slice_shapes = {shape[1:] for shape in stacked_shapes}
    moved_in_scans = set()
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name == "device_put":
            for var, dst in zip(eqn.invars, eqn.params["devices"]):
                aval = var.aval
                # A whole stacked leaf never moves, in either direction...
                assert aval.shape not in stacked_shapes or aval.shape in slice_shapes
                if (
                    aval.memory_space == jax.memory.Space.Host
                    and dst == jax.memory.Space.Device
                ):
                    moved_in_scans.add(aval.shape)
    # ...but every layer slice is brought to the device (inside the scan).
    assert slice_shapes <= moved_in_scans
    assert row_shapes <= moved_in_scans  # whole, before the scan
    scans = [e for e in all_eqns(jaxpr) if e.primitive.name == "scan"]
    host_xs = {
        v.aval.shape
        for e in scans
        for v in e.invars
        if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
    }
    assert stacked_shapes <= host_xs

    _, grads = eqx.filter_jit(fn)(model, *batch)
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    }
    assert kinds == {"pinned_host"}


@pytest.mark.parametrize("with_grad", [False, True])
def test_policy_none_adds_no_transfers_and_no_remat(with_grad, getkey):
    model = Model(key=getkey())
    batch = next(batches())
    ours = eo.filter_offload(cross_entropy, eo.Policy.none())
    plain = cross_entropy
    if with_grad:
        ours, plain = eqx.filter_value_and_grad(ours), eqx.filter_value_and_grad(plain)
    ours_jaxpr = eqx.filter_make_jaxpr(ours)(model, *batch)[0]
    plain_jaxpr = eqx.filter_make_jaxpr(plain)(model, *batch)[0]
    names = primitive_names(ours_jaxpr)
    assert "device_put" not in names and "remat2" not in names and "name" not in names
    assert str(ours_jaxpr) == str(plain_jaxpr)


def test_the_line_saving_a_value_is_the_users_not_a_type_checkers():
    """`Residual.where`: the innermost frame of the user's code, skipping the
    wrappers beartype generates (named `<@beartype(...)>`, here one around a
    function that saves a value); code typed at a prompt (`<stdin>`) is the
    user's."""
    source = "def loss(x):\n    return jnp.sum(jnp.sin(x) * x)\n"
    typed: dict = {"jnp": jnp}
    exec(compile(source, "<stdin>", "exec"), typed)
    wrapped: dict = {"jnp": jnp}
    exec(compile(source, "<@beartype(loss) at 0x7f00>", "exec"), wrapped)

    def f(x):
        return wrapped["loss"](x)  # the user's line

    for fn, where in [
        (typed["loss"], "<stdin>:2 (loss)"),
        (f, f"test_residual_placement.py:{f.__code__.co_firstlineno + 1} (f)"),
    ]:
        (saved,) = [r for r in saved_residuals(fn, jnp.ones(3)) if r.source == "sin"]
        assert saved.where == where


class _Tokens(eqx.Module):
    """An embedding and stacked layers: the carry entering each layer has the
    embedding's dtype (bf16 under `compute_dtype`), whatever the batch's."""

    embed: jax.Array
    blocks: eo.Stacked[TanhBlock]

    def __call__(self, tokens):
        return jnp.tanh(self.blocks(self.embed[tokens])).astype(jnp.float32)


def test_a_train_step_counts_residuals_in_the_dtype_and_micro_batch_saved():
    """The saved-for-backward table of a train step is what its compiled program
    keeps: under `compute_dtype` the carry is saved (and offloaded) in bf16, and
    under micro-batches one micro-batch's carry is saved at a time. The table,
    the moves of the traced and the compiled program and the compiled program's
    host buffer agree."""
    layers, dim, batch, seq = 3, 128, 4, 16
    model = _Tokens(
        jnp.zeros((64, dim)), eo.Stacked(TanhBlock(jnp.zeros((layers, dim, dim))))
    )
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    optimizer = optax.sgd(0.1)

    def loss(model, tokens):
        return jnp.mean(model(tokens))

    policy = eo.Policy.offload_residuals(compute_dtype=jnp.bfloat16)
    for microbatches in (1, 2):
        step = eo.train_step(loss, optimizer, policy, microbatches=microbatches)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        report = eo.memory_report(step, model, opt_state, tokens, target="tpu-v5e")
        carry = layers * (batch // microbatches) * seq * dim * 2  # bf16
        assert report.residuals is not None
        saved = {(r.name, r.memory_kind): r.bytes for r in report.residuals}
        assert saved[("blocks.input", "pinned_host")] == carry
        # The layers' weights, cast to bf16 for the step, are kept for the
        # backward pass too (they are on the device: no compute copies).
        weights = layers * dim * dim * 2
        assert saved[("(other)", "device")] >= weights
        assert "device-resident parameters in the compute dtype" in str(report)
        # The same as `checkpoint_names`, which reads the step as it calls its loss.
        (row,) = [
            r
            for r in eo.checkpoint_names(step, model, opt_state, tokens)
            if r.name == "blocks.input"
        ]
        assert row.bytes == carry
        # What the compiled program keeps in host memory: the offloaded carry of
        # one micro-batch (the buffer every micro-batch reuses).
        assert report.host["temp"] == carry
        moved = report.transfer_bytes("device_to_host", what="residuals")
        assert moved == microbatches * carry
        assert report.transfer_bytes("device_to_host", compiled=True) == moved
