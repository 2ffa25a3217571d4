"""`memory_report`'s traffic: bytes moved host <-> device per step, by phase and
what moves, against figures computed by hand."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo

from .helpers import ProjectedStack, TanhBlock


B, SEQ_IN, LAYERS = 8, 16, 3
F32 = 4


def _model(dim, key) -> ProjectedStack:
    k1, k2 = jax.random.split(key)
    w_in = jax.random.normal(k1, (SEQ_IN, dim))
    return ProjectedStack(
        w_in, eo.Stacked(TanhBlock(jax.random.normal(k2, (LAYERS, dim, dim))))
    )


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _report(dim, policy, target, microbatches=1):
    optimizer = optax.sgd(0.1)
    model = eo.place(eqx.filter_eval_shape(_model, dim, jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(_loss, optimizer, policy, microbatches=microbatches)
    x = jax.ShapeDtypeStruct((B, SEQ_IN), jnp.float32)
    return eo.memory_report(step, model, opt_state, x, target=target)


@pytest.mark.parametrize("target", [None, "tpu-v5e"])
@pytest.mark.parametrize("dim", [128, 40])
def test_offload_all_by_hand(target, dim):
    stacked, w_in = LAYERS * dim * dim * F32, SEQ_IN * dim * F32
    carry = B * dim * F32  # the "blocks.input" residual of one layer
    r = _report(dim, eo.Policy.offload_all(), target)

    def moved(direction, phase, what):
        return r.transfer_bytes(direction, phase=phase, what=what)

    fb = "forward/backward"
    # Each layer is read in the forward pass and again to recompute it in the
    # backward pass; `w_in` (outside the stack) once, where the step starts.
    assert moved("host_to_device", fb, "params") == 2 * stacked + w_in
    assert moved("device_to_host", fb, "gradients") == stacked + w_in
    assert moved("device_to_host", fb, "residuals") == LAYERS * carry
    assert moved("host_to_device", fb, "residuals") == LAYERS * carry
    # SGD: the update reads every gradient and parameter and writes the parameter.
    assert moved("host_to_device", "update", "gradients") == stacked + w_in
    assert moved("host_to_device", "update", "params") == stacked + w_in
    assert moved("device_to_host", "update", "params") == stacked + w_in
    traced_h2d = 2 * stacked + w_in + LAYERS * carry + 2 * (stacked + w_in)
    assert r.transfer_bytes("host_to_device") == traced_h2d
    if target is not None:
        # The compiled program streams the layers as traced, and writes as much
        # back; it may read less (here it keeps `w_in`'s gradient on the device
        # for the update, where the traced program reads back what it wrote).
        def compiled(direction, phase=None, what=None):
            return r.transfer_bytes(direction, phase=phase, what=what, compiled=True)

        assert compiled("host_to_device", fb, "params") == 2 * stacked + w_in
        assert compiled("device_to_host") == r.transfer_bytes("device_to_host")
        assert traced_h2d - w_in <= r.host_to_device_bytes <= traced_h2d
        assert r.host_to_device_bytes == compiled("host_to_device")
        assert "moved per step (as compiled)" in str(r)
    names = {t.name for t in r.transfers or () if t.what == "residuals"}
    assert names == {"blocks.input"}
    text = str(r)
    assert "moved per step" in text and "params (fwd/bwd)" in text


def test_micro_batches_and_bf16_by_hand():
    dim = 128
    stacked, w_in = LAYERS * dim * dim * F32, SEQ_IN * dim * F32
    fb = "forward/backward"
    one = _report(dim, eo.Policy.offload_all(), "tpu-v5e")
    four = _report(dim, eo.Policy.offload_all(), "tpu-v5e", microbatches=4)
    # Every micro-batch streams the layers again, writes every gradient and reads
    # its accumulator back (the first reads the master in its place, and adds
    # nothing: one loop for all micro-batches).
    params = one.transfer_bytes("host_to_device", phase=fb, what="params")
    assert four.transfer_bytes("host_to_device", phase=fb, what="params") == 4 * params
    grads = four.transfer_bytes("device_to_host", phase=fb, what="gradients")
    assert grads == 4 * (stacked + w_in)
    reads = four.transfer_bytes("host_to_device", phase=fb, what="gradients")
    assert reads == 4 * (stacked + w_in)
    # The residuals of four quarter batches are those of the whole batch.
    residuals = one.transfer_bytes("device_to_host", what="residuals")
    assert four.transfer_bytes("device_to_host", what="residuals") == residuals

    bf16 = _report(dim, eo.Policy.offload_all(compute_dtype=jnp.bfloat16), "tpu-v5e")
    # The bf16 copies move: half the parameter bytes.
    assert bf16.transfer_bytes("host_to_device", phase=fb, what="params") == params // 2
    # The update writes the copies next to the masters, without reading them.
    written = bf16.transfer_bytes("device_to_host", phase="update", what="opt_state")
    assert written == (stacked + w_in) // 2


def test_nothing_moves_when_nothing_is_on_the_host():
    r = _report(40, eo.Policy.remat(), "tpu-v5e")
    assert r.transfers == ()
    assert r.host_to_device_bytes == r.device_to_host_bytes == 0
