"""`eo.Stacked`: a stack of identical layers run as one `jax.lax.scan`, equal to the
Python loop over them (keys, per-layer inputs and outputs, broadcast arguments,
indexing), and host-resident layers read one slice at a time."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo

from .helpers import Block
from .numerics import assert_close, excess, scaled


def loop(layers, x, **kwargs):
    for layer in layers:
        x = layer(x, **kwargs)
    return x


def assert_same_values(ours, reference):
    """`ours` is `reference` computed in another order (a scan rather than a Python
    loop), to float32 rounding; values 1% too large are caught."""
    assert_close(ours, reference)
    assert excess(scaled(ours, 1.01), reference) > 10


class Residual(eqx.Module):
    """Wraps a vector-to-vector layer as `x + layer(x)` with optional dropout."""

    layer: Callable
    dropout: eqx.nn.Dropout

    def __init__(self, layer, p=0.0):
        self.layer = layer
        self.dropout = eqx.nn.Dropout(p)

    def __call__(self, x, *, key=None):
        y = self.layer(x)
        return x + (self.dropout(y, key=key) if key is not None else y)


@pytest.mark.parametrize(
    "make",
    [
        lambda k: Residual(eqx.nn.MLP(8, 8, 16, depth=2, key=k)),  # of `Linear`s
        lambda k: Residual(eqx.nn.LayerNorm(8)),
    ],
    ids=["MLP", "LayerNorm"],
)
def test_call_matches_a_python_loop(make, getkey):
    stacked = eo.Stacked.from_fn(make, 3, key=getkey())
    layers = list(stacked)
    assert len(stacked) == len(layers) == 3
    assert all(type(layer) is Residual for layer in layers)
    x = jax.random.normal(getkey(), (8,))

    @eqx.filter_jit
    def values_and_grads(stacked, layers):
        def squares(f):
            return lambda model: jnp.sum(f(model) ** 2)

        return (
            (stacked(x), eqx.filter_grad(squares(lambda s: s(x)))(stacked)),
            (loop(layers, x), eqx.filter_grad(squares(lambda ls: loop(ls, x)))(layers)),
        )

    (out, grads), (ref_out, ref_grads) = values_and_grads(stacked, layers)
    assert_same_values(out, ref_out)
    assert_same_values(grads, eo.Stacked.from_layers(ref_grads))


def test_attention_blocks(getkey):
    stacked = eo.Stacked.from_fn(lambda k: Block(16, 2, key=k), 4, key=getkey())
    x = jax.random.normal(getkey(), (6, 16))
    ours, ref = eqx.filter_jit(lambda s: (s(x), loop(s, x)))(stacked)
    assert_same_values(ours, ref)


def test_dropout_gets_one_key_per_layer(getkey):
    stacked = eo.Stacked.from_fn(
        lambda k: Residual(eqx.nn.Linear(8, 8, key=k), p=0.5), 3, key=getkey()
    )
    x = jnp.ones(8)
    key = getkey()

    @eqx.filter_jit
    def run(stacked):
        expected = x
        for layer, k in zip(stacked, jax.random.split(key, 3)):
            expected = layer(expected, key=k)
        inference = eqx.nn.inference_mode(stacked)
        return stacked(x, key=key), expected, inference(x, key=key), stacked(x)

    dropped, expected, inference, plain = run(stacked)
    assert_same_values(dropped, expected)
    assert excess(plain, dropped) > 10  # dropout is active
    assert_same_values(inference, plain)


def test_scan_with_per_layer_inputs_and_outputs(getkey):
    stacked = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey())
    scales = jnp.array([1.0, 2.0, 3.0])

    def f(layer, carry, scale):
        out = scale * layer(carry)
        return out, jnp.sum(out)

    x = jnp.ones(4)

    @eqx.filter_jit
    def run(stacked):
        expected, sums = x, []
        for layer, s in zip(stacked, scales):
            expected = s * layer(expected)
            sums.append(jnp.sum(expected))
        return stacked.scan(f, x, scales), (expected, jnp.stack(sums))

    (carry, ys), (expected, sums) = run(stacked)
    assert_same_values(carry, expected)
    assert_same_values(ys, sums)


def test_extra_arguments_are_broadcast(getkey):
    class Scaled(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x, scale, *, shift):
            return scale * self.lin(x) + shift

    stacked = eo.Stacked.from_fn(
        lambda k: Scaled(eqx.nn.Linear(4, 4, key=k)), 2, key=getkey()
    )
    x = jnp.ones(4)

    @eqx.filter_jit
    def run(stacked):
        layers = [lambda y, layer=layer: layer(y, 0.5, shift=1.0) for layer in stacked]
        return stacked(x, 0.5, shift=1.0), loop(layers, x)

    assert_same_values(*run(stacked))


def test_indexing_and_slicing(getkey):
    layers = [eqx.nn.Linear(3, 3, key=getkey()) for _ in range(4)]
    stacked = eo.Stacked.from_layers(layers)
    np.testing.assert_array_equal(stacked[2].weight, layers[2].weight)
    np.testing.assert_array_equal(stacked[-1].weight, layers[3].weight)
    part = stacked[1:3]
    assert isinstance(part, eo.Stacked) and len(part) == 2
    np.testing.assert_array_equal(part[0].weight, layers[1].weight)
    with pytest.raises(IndexError):
        stacked[4]


def test_from_layers_names_the_first_difference(getkey):
    a = eqx.nn.Linear(3, 3, key=getkey())
    with pytest.raises(
        ValueError,
        match=r"leaf 'weight' is float32\[3, 3\] in layer 0 "
        r"but float32\[4, 3\] in layer 1",
    ):
        eo.Stacked.from_layers([a, eqx.nn.Linear(3, 4, key=getkey())])
    with pytest.raises(
        ValueError,
        match=r"leaf 'bias' is float32\[3\] in layer 0 but bfloat16\[3\] in layer 1",
    ):
        assert a.bias is not None
        b = eqx.tree_at(lambda m: m.bias, a, a.bias.astype(jnp.bfloat16))
        eo.Stacked.from_layers([a, b])
    with pytest.raises(
        ValueError,
        match=r"layer 1 differs in structure from layer 0 "
        r"at leaf 'bias', which only one",
    ):
        eo.Stacked.from_layers([a, eqx.nn.Linear(3, 3, use_bias=False, key=getkey())])
    with pytest.raises(
        ValueError, match=r"non-array leaf 'p' is 0.1 in layer 0 but 0.2"
    ):
        eo.Stacked.from_layers([eqx.nn.Dropout(0.1), eqx.nn.Dropout(0.2)])
    with pytest.raises(ValueError, match="at least one layer"):
        eo.Stacked.from_layers([])
    heads = [eqx.nn.MultiheadAttention(n, 4, key=getkey()) for n in (1, 2)]
    with pytest.raises(
        ValueError, match="layer 1 differs from layer 0 in a static field"
    ):
        eo.Stacked.from_layers(heads)


def test_constructor_checks_the_layer_axis(getkey):
    with pytest.raises(ValueError, match=r"leaf 'b' has leading axis 2 but 'a' has 3"):
        eo.Stacked({"a": jnp.zeros((3, 1)), "b": jnp.zeros((2, 1))})
    with pytest.raises(ValueError, match="at least one array leaf"):
        eo.Stacked({"a": 1.0})
    with pytest.raises(ValueError, match="positive int"):
        eo.Stacked.from_fn(lambda k: eqx.nn.Linear(2, 2, key=k), 0, key=getkey())


def test_abstract_layers(getkey):
    stacked = eqx.filter_eval_shape(
        eo.Stacked.from_fn, lambda k: eqx.nn.Linear(3, 5, key=k), 7, key=getkey()
    )
    assert len(stacked) == 7
    assert stacked[0].weight.shape == (5, 3)
    abstract = eo.Stacked.from_layers(
        [eqx.filter_eval_shape(eqx.nn.Linear, 3, 5, key=getkey())] * 2
    )
    assert abstract.layers.weight.shape == (2, 5, 3)


def test_host_resident_layers_are_moved_one_slice_at_a_time(getkey):
    stacked = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey())
    host = eo.place(stacked, eo.Policy(params="pinned_host"))
    x = jnp.ones(4)
    call = eqx.filter_jit(lambda s, x: s(x))
    with pytest.warns(UserWarning, match="outside `filter_offload`"):
        ours = call(host, x)
        grads = eqx.filter_jit(eqx.filter_grad(lambda s: jnp.sum(s(x))))(host)
    assert_same_values(ours, call(stacked, x))
    assert grads.layers.weight.sharding.memory_kind == "pinned_host"


def test_a_ported_loop_keeps_its_key_chain_through_scan(getkey):
    # `Stacked.__call__` splits the key one per layer; a loop that chains
    # `key, k = split(key)` is reproduced by carrying the key through `scan`, and
    # such a carry trains and is reported under the offloading presets.
    class Noisy(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x, *, key):
            return self.dropout(jax.nn.relu(self.linear(x)), key=key)

    layers = [
        Noisy(eqx.nn.Linear(8, 8, key=k), eqx.nn.Dropout(0.5))
        for k in jax.random.split(getkey(), 3)
    ]

    def chained(layer, carry, _):
        x, key = carry
        key, k = jax.random.split(key)
        return (layer(x, key=k), key), None

    def loss(stacked, x, key):
        return jnp.sum(stacked.scan(chained, (x, key))[0][0] ** 2)

    def reference(layers, x, key):
        for layer in layers:
            key, k = jax.random.split(key)
            x = layer(x, key=k)
        return jnp.sum(x**2)

    x, key = jnp.ones(8), getkey()
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(reference))(layers, x, key)
    policy = eo.Policy.offload_residuals()
    stacked = eo.Stacked.from_layers(layers)
    ours = eqx.filter_jit(eqx.filter_value_and_grad(eo.filter_offload(loss, policy)))
    value_and_grads = ours(stacked, x, key)
    assert_same_values(value_and_grads, (value, eo.Stacked.from_layers(grads)))
    optimizer = optax.sgd(0.1)
    opt_state = eo.init_opt_state(optimizer, stacked, policy)
    step = eo.train_step(loss, optimizer, policy)
    report = eo.memory_report(step, stacked, opt_state, x, key)
    assert report.residuals is not None
    saved = {(r.name, r.memory_kind): r.bytes for r in report.residuals}
    assert saved["input", "pinned_host"] == 3 * (8 * 4 + 8)  # the key is offloaded too
