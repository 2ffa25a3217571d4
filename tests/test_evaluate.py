"""A host-resident model outside the train step (`docs/evaluate.md`): evaluated and
sampled through `filter_offload`, compiled once per shape, with the results of the
model on the device; and what JAX, optax and the library say when it is run
without it."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import TableLM, TanhBlock
from .numerics import assert_close, excess, scaled


POLICY = eo.Policy.offload_all()
# Both fixes, as every message names them.
FIX = r"`eqx\.filter_jit\(eo\.filter_offload\(fn, policy\)\)`.*"
FIX += r"Policy\(params='device'\)"


@functools.cache
def _models() -> tuple[TableLM, TableLM]:
    """The model on the device, and placed by `POLICY` (from NumPy: no compiles)."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) / shape[-1] ** 0.5)

    plain = TableLM(
        normal(16, 8), eo.Stacked(TanhBlock(normal(2, 8, 8))), normal(16, 8)
    )
    return plain, eo.place(plain, POLICY)


@eqx.filter_jit
def _logits(model, tokens):
    return jax.vmap(model)(tokens)


def assert_same_values(ours, reference):
    """`ours` is `reference` computed in another program, to float32 rounding;
    values 1% too large are caught."""
    assert_close(ours, reference)
    assert excess(scaled(ours, 1.01), reference) > 10


def test_calling_a_host_resident_model_fails_and_filter_offload_runs_it():
    plain, model = _models()
    tokens = np.random.default_rng(1).integers(0, 16, (3, 5)).astype(np.int32)
    with pytest.raises(ValueError, match=r"memory_space of all inputs passed to "):
        _logits(model, tokens)  # JAX's error: `gather` on the host-resident table

    traces = []

    def logits(model, tokens):
        traces.append(tokens.shape)
        return jax.vmap(model)(tokens)

    evaluate = eqx.filter_jit(eo.filter_offload(logits, POLICY))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside `filter_offload`: nothing to say
        for t in (tokens, tokens[::-1], tokens[:2]):
            assert_same_values(evaluate(model, t), _logits(plain, t))
    assert traces == [(3, 5), (2, 5)]  # once per shape
    assert model.head.sharding.memory_kind == "pinned_host"  # not donated

    on_device = eo.place(model, eo.Policy(params="device"))  # the other fix
    assert on_device.blocks.layers.weight.sharding.memory_kind == "device"
    assert_same_values(_logits(on_device, tokens), _logits(plain, tokens))


def _sample(model, window, start, key):
    def body(i, window):
        logits = model(window)[i - 1]
        token = jax.random.categorical(jax.random.fold_in(key, i), logits)
        return window.at[i].set(token)

    return jax.lax.fori_loop(start, window.shape[0], body, window)


def test_sampling_in_one_loop_compiles_once_and_matches_the_device_model():
    plain, model = _models()
    traces = []

    def sample(*args):
        traces.append(None)
        return _sample(*args)

    sample_fn = eqx.filter_jit(eo.filter_offload(sample, POLICY))
    window = jnp.array([3, 1, 4, 0, 0, 0, 0, 0])
    key = jax.random.key(3)
    out = [sample_fn(model, window, jnp.int32(start), key) for start in (1, 3)]
    assert len(traces) == 1  # not once per position, nor per prompt length
    np.testing.assert_array_equal(out[1][:3], window[:3])
    reference = eqx.filter_jit(_sample)(plain, window, jnp.int32(3), key)
    np.testing.assert_array_equal(out[1], reference)


def test_a_host_resident_stacked_outside_filter_offload_warns():
    plain, model = _models()
    x = np.ones((5, 8), np.float32)
    match = r"host-resident \(.*\) is applied outside `filter_offload`.*" + FIX
    with pytest.warns(UserWarning, match=match) as got:
        y = eqx.filter_jit(lambda blocks, x: blocks(x))(model.blocks, x)
    assert got[0].filename == __file__  # the line that applied it
    assert_same_values(y, plain.blocks(x))  # works
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.blocks(x)  # layers on the device
        eqx.filter_jit(eo.filter_offload(lambda m, x: m.blocks(x), POLICY))(model, x)


def test_a_host_resident_table_outside_filter_offload_is_an_error():
    table = np.random.default_rng(2).normal(size=(256, 128)).astype(np.float32)
    model = eo.place({"embed": table}, POLICY)
    ids = jnp.array([[1, 200], [3, 255]])
    match = r"`{}` was given a host-resident table of shape \(256, 128\) outside "
    match += r"`filter_offload`.*" + FIX
    with pytest.raises(ValueError, match=match.format("embed")):
        eo.embed(model["embed"], ids)
    with pytest.raises(ValueError, match=match.format("chunked_cross_entropy")):
        jax.jit(eo.chunked_cross_entropy)(jnp.ones((2, 2, 128)), model["embed"], ids)

    def lookup(model, ids):
        return eo.embed(model["embed"], ids)[0]

    # The fixes: moved to the device where the function starts, or read by blocks
    # when the policy streams it; or a device copy.
    for policy in (eo.Policy(), eo.Policy(host_tables=("embed",))):
        found = eqx.filter_jit(eo.filter_offload(lookup, policy))(model, ids)
        np.testing.assert_array_equal(found, table[ids])
    on_device = eo.place(model, eo.Policy(params="device"))
    np.testing.assert_array_equal(lookup(on_device, ids), table[ids])


def test_optax_init_on_a_placed_model_fails_and_init_opt_state_works():
    plain, model = _models()
    optimizer = optax.adamw(1e-3)
    with pytest.raises(ValueError, match="Memory kind mismatch with xla::PjRtBuffers"):
        optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    opt_state = eo.init_opt_state(optimizer, model, POLICY)
    expected = optimizer.init(eqx.filter(plain, eqx.is_inexact_array))
    assert jax.tree.structure(opt_state) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)
    mu = opt_state[0].mu.blocks.layers.weight
    assert mu.sharding.memory_kind == "pinned_host"  # where the policy puts it
