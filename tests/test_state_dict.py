"""Per-layer state-dict keys: weights of a `list[Block]` model load into the
`Stacked[Block]` port, and back."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equinox.nn import MLP
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_offload as eo
from eqx_offload.internal import layer_axes

from .helpers import assert_trees_equal, batches, memory_kind
from .numerics import assert_close, excess


class Net(eqx.Module):
    """The ported model: 4 MLPs stacked."""

    embed: eqx.nn.Embedding
    blocks: eo.Stacked[eqx.nn.MLP]
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(32, 16, key=k1)
        keys = jax.random.split(k2, 4)  # (`from_layers`: quicker than eager vmaps)
        self.blocks = eo.Stacked.from_layers([MLP(16, 16, 32, 1, key=k) for k in keys])
        self.head = eqx.nn.Linear(16, 32, key=k3)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        return jax.vmap(self.head)(jax.vmap(self.blocks)(x))


class PerLayerNet(eqx.Module):
    """The same model before the port: a Python list of MLPs."""

    embed: eqx.nn.Embedding
    blocks: list[eqx.nn.MLP]
    head: eqx.nn.Linear

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = jax.vmap(block)(x)
        return jax.vmap(self.head)(x)


def as_per_layer(model: Net) -> PerLayerNet:
    return PerLayerNet(model.embed, list(model.blocks), model.head)


def per_layer_model(key: PRNGKeyArray) -> PerLayerNet:
    return as_per_layer(Net(key=key))


def test_keys_are_those_of_the_per_layer_model(getkey):
    model = Net(key=getkey())
    keys = eo.state_dict_keys(model)
    assert list(keys) == list(eo.state_dict(as_per_layer(model)))
    assert "blocks.2.layers.0.weight" in keys
    assert keys["blocks.2.layers.0.weight"] == eo.LeafIndex(
        "blocks.layers[0].weight", (2,)
    )
    assert keys["head.weight"] == eo.LeafIndex("head.weight", ())
    # And back.
    assert eo.state_dict_key(model, "blocks.layers[0].weight", (2,)) == (
        "blocks.2.layers.0.weight"
    )
    assert eo.state_dict_key(model, "embed.weight") == "embed.weight"


def test_per_layer_weights_load_into_the_stacked_port_and_back(getkey):
    old = per_layer_model(getkey())  # the model before the port, with its weights
    weights = eo.state_dict(old)
    ported = eo.load_state_dict(Net(key=getkey()), weights)
    tokens, _ = next(batches())
    # Equal weights; outputs equal up to rounding (a scan against a Python loop),
    # which a layer the port lost would not be.
    apply = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))
    outputs = apply(old, tokens)
    assert_close(apply(ported, tokens), outputs)
    lost = PerLayerNet(old.embed, old.blocks[:-1], old.head)
    assert excess(apply(lost, tokens), outputs) > 10
    assert_trees_equal(ported.blocks, eo.Stacked.from_layers(old.blocks))
    # Round trip: the port's state dict loads into the per-layer model.
    back = eo.load_state_dict(per_layer_model(getkey()), eo.state_dict(ported))
    assert_trees_equal(back, old)


def test_state_dict_slices_are_the_layers(getkey):
    model = Net(key=getkey())
    weights = eo.state_dict(model)
    for i, block in enumerate(model.blocks):
        np.testing.assert_array_equal(
            np.asarray(weights[f"blocks.{i}.layers.1.weight"]),
            np.asarray(block.layers[1].weight),
        )


class Inner(eqx.Module):
    linears: eo.Stacked[eqx.nn.Linear]
    scale: Float[Array, " dim"]

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        make = lambda k: eqx.nn.Linear(dim, dim, key=k)  # noqa: E731
        self.linears = eo.Stacked.from_fn(make, 3, key=key)
        self.scale = jnp.ones(dim)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.scale * self.linears(x)


class Nested(eqx.Module):
    blocks: eo.Stacked[Inner]

    def __init__(self, *, key: PRNGKeyArray):
        self.blocks = eo.Stacked.from_fn(lambda k: Inner(8, key=k), 2, key=key)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.blocks(x)


# Jitted: quicker than eager vmaps of vmaps (and shared with test_verify.py).
make_nested = eqx.filter_jit(Nested)


class NestedPerLayer(eqx.Module):
    blocks: list[dict[str, list[eqx.nn.Linear] | Array]]


def test_nested_stacked(getkey):
    model = make_nested(key=getkey())
    assert layer_axes(model) == [2, 2, 1]
    keys = eo.state_dict_keys(model)
    assert keys["blocks.1.linears.2.weight"] == eo.LeafIndex(
        "blocks.linears.weight", (1, 2)
    )
    assert eo.state_dict_key(model, "blocks.linears.bias", (0, 1)) == (
        "blocks.0.linears.1.bias"
    )
    weights = eo.state_dict(model)
    np.testing.assert_array_equal(
        np.asarray(weights["blocks.1.linears.2.weight"]),
        np.asarray(model.blocks[1].linears[2].weight),
    )
    # The same weights in a per-layer layout (lists, a dict) have the same keys.
    per_layer = NestedPerLayer(
        [{"linears": list(b.linears), "scale": b.scale} for b in model.blocks]
    )
    assert list(eo.state_dict(per_layer)) == list(keys)
    loaded = eo.load_state_dict(
        eqx.filter_eval_shape(Nested, key=getkey()), eo.state_dict(per_layer)
    )
    assert_trees_equal(loaded, model)
    # On the host: two layer axes are cut and assembled on the device, and the
    # results go back to the host.
    host = eo.place(make_nested(key=getkey()), eo.Policy(params="pinned_host"))
    host_weights = eo.state_dict(host)
    assert memory_kind(host_weights["blocks.1.linears.2.weight"]) == "pinned_host"
    loaded = eo.load_state_dict(host, weights)
    assert {memory_kind(x) for x in jax.tree.leaves(loaded)} == {"pinned_host"}
    assert_trees_equal(loaded, model)


def test_keys_that_coincide_are_an_error():
    tree = {"a.b": jnp.zeros(2), "a": {"b": jnp.ones(2)}}
    with pytest.raises(
        ValueError, match=r"leaves .* both have the state-dict key 'a.b'"
    ):
        eo.state_dict(tree)


def test_host_resident_leaves_stay_on_the_host(getkey):
    policy = eo.Policy.offload_all()
    model = eo.place(Net(key=getkey()), policy)
    weights = eo.state_dict(per_layer_model(getkey()))
    loaded = eo.load_state_dict(model, weights)
    for x in jax.tree.leaves(eqx.filter(loaded, eqx.is_array)):
        assert memory_kind(x) == "pinned_host"
    # Host-resident layers come out on the host, and load back unchanged.
    out = eo.state_dict(loaded)
    assert memory_kind(out["blocks.1.layers.0.weight"]) == "pinned_host"
    for key, value in weights.items():
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(value))


def test_abstract_model_is_created_from_the_state_dict(getkey):
    policy = eo.Policy(params={"blocks": "pinned_host"})
    abstract = eo.place(eqx.filter_eval_shape(Net, key=getkey()), policy)
    old = per_layer_model(getkey())
    loaded = eo.load_state_dict(
        abstract, {k: np.asarray(v) for k, v in eo.state_dict(old).items()}
    )
    assert memory_kind(loaded.blocks.layers.layers[0].weight) == "pinned_host"
    assert memory_kind(loaded.head.weight) == "device"
    assert_trees_equal(loaded.blocks, eo.Stacked.from_layers(old.blocks))


def _layouts(model) -> list:
    return [
        (getattr(x.sharding, "spec", None), x.sharding.memory_kind)
        for x in jax.tree.leaves(model)
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct)
    ]


def test_loads_into_an_fsdp_model_on_an_explicit_mesh(getkey):
    """Each layer written into its stack on the leaf's mesh: on `Explicit` axes the
    join runs on `Auto` ones (JAX's types refused writing a split layer into a
    stack made whole)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    policy = eo.Policy.offload_all(shard=eo.FSDP("fsdp", min_size=0))
    old = per_layer_model(getkey())
    weights = eo.state_dict(old)
    key = getkey()
    with jax.set_mesh(mesh):
        model = eo.place(eqx.filter_eval_shape(Net, key=key), policy)
    assert model.blocks.layers.layers[0].weight.sharding.spec == P(None, "fsdp", None)
    loaded = eo.load_state_dict(model, weights)
    assert _layouts(loaded) == _layouts(model)
    assert loaded.head.weight.sharding.mesh == mesh
    assert_trees_equal(loaded.blocks, eo.Stacked.from_layers(old.blocks))
    assert_trees_equal((loaded.embed, loaded.head), (old.embed, old.head))
    # And back, a host-resident layer at a time.
    for key, value in eo.state_dict(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(weights[key]))


def test_loads_into_a_model_made_under_an_explicit_mesh(getkey):
    """`eqx.filter_eval_shape` under `jax.set_mesh` lays leaves out on the
    `AbstractMesh`; their arrays are created on the mesh in context."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    old = per_layer_model(getkey())
    weights = eo.state_dict(old)
    key = getkey()
    with jax.set_mesh(mesh):
        abstract = eqx.filter_eval_shape(Net, key=key)
        hosted = eo.place(abstract, eo.Policy(params={"blocks": "pinned_host"}))
        assert isinstance(abstract.head.weight.sharding.mesh, AbstractMesh)
        for model, kind in ((abstract, "device"), (hosted, "pinned_host")):
            loaded = eo.load_state_dict(model, weights)
            weight = loaded.blocks.layers.layers[0].weight
            assert weight.sharding == NamedSharding(
                mesh, P(None, None, None), memory_kind=kind
            )
            assert loaded.head.weight.sharding.mesh == mesh
            assert_trees_equal(loaded.blocks, eo.Stacked.from_layers(old.blocks))
            assert_trees_equal(loaded.head, old.head)
    with pytest.raises(
        ValueError,
        match=r"leaf 'embed.weight' is laid out on an `AbstractMesh` \{'fsdp': 8\}.*"
        r"`jax.set_mesh` is none\. Call `load_state_dict` inside `with "
        r"jax.set_mesh\(mesh\):`",
    ):
        eo.load_state_dict(abstract, weights)


def test_loaded_arrays_are_copies(getkey):
    model = Net(key=getkey())
    weights = eo.state_dict(per_layer_model(getkey()))
    loaded = eo.load_state_dict(model, weights)
    assert loaded.head.weight is not weights["head.weight"]
    loaded.head.weight.delete()  # as a donating step would
    assert not weights["head.weight"].is_deleted()


def test_missing_and_unexpected_keys(getkey):
    model = Net(key=getkey())
    weights = eo.state_dict(as_per_layer(Net(key=getkey())))
    del weights["blocks.1.layers.1.bias"]
    weights["blocks.4.layers.1.bias"] = jnp.zeros(16)
    with pytest.raises(
        ValueError,
        match=r"`eqx_offload.load_state_dict`: missing keys: 'blocks.1.layers.1.bias'; "
        r"unexpected keys: 'blocks.4.layers.1.bias'.*strict=False",
    ):
        eo.load_state_dict(model, weights)
    # Not strict: the missing layer keeps the model's array, the rest loads.
    loaded = eo.load_state_dict(model, weights, strict=False)
    bias, old_bias = (
        loaded.blocks.layers.layers[1].bias,
        model.blocks.layers.layers[1].bias,
    )
    assert bias is not None and old_bias is not None
    np.testing.assert_array_equal(np.asarray(bias[1]), np.asarray(old_bias[1]))
    np.testing.assert_array_equal(
        np.asarray(bias[0]),
        np.asarray(weights["blocks.0.layers.1.bias"]),
    )
    # An abstract model has nothing to keep.
    abstract = eqx.filter_eval_shape(Net, key=getkey())
    with pytest.raises(
        ValueError, match=r"missing keys: 'blocks.1.layers.1.bias'.*even"
    ):
        eo.load_state_dict(abstract, weights, strict=False)


def test_stacked_key_format_is_explained(getkey):
    model = Net(key=getkey())
    # Keys written with the `Stacked`'s `layers` field (JAX's key path) are not
    # per-layer keys. (`blocks.<i>.layers` is the MLP's own `layers` list.)
    weights = {
        k.replace("blocks.", "blocks.layers."): v
        for k, v in eo.state_dict(model).items()
    }
    with pytest.raises(
        ValueError,
        match=r"unexpected keys: 'blocks.layers.0.layers.0.weight'.*"
        r"e\.g\. 'embed.weight'",
    ):
        eo.load_state_dict(model, weights)


def test_shape_dtype_and_type_mismatches_name_the_key(getkey):
    model = Net(key=getkey())
    weights = eo.state_dict(model)
    bad = dict(weights, **{"blocks.1.layers.0.weight": jnp.zeros((3, 3))})
    with pytest.raises(
        ValueError,
        match=r"state_dict\['blocks.1.layers.0.weight'\] has shape \(3, 3\) but "
        r"the model expects \(32, 16\)",
    ):
        eo.load_state_dict(model, bad)
    bad = dict(weights, **{"head.bias": weights["head.bias"].astype(jnp.bfloat16)})
    with pytest.raises(
        ValueError,
        match=r"state_dict\['head.bias'\] has dtype bfloat16 but the model expects "
        r"float32",
    ):
        eo.load_state_dict(model, bad)
    bad = dict(weights, **{"head.bias": [0.0] * 32})
    with pytest.raises(TypeError, match=r"state_dict\['head.bias'\] is a list"):
        eo.load_state_dict(model, bad)


def test_state_dict_key_errors(getkey):
    model = Net(key=getkey())
    with pytest.raises(ValueError, match=r"no array leaf has path 'blocks.mlp'"):
        eo.state_dict_key(model, "blocks.mlp", (0,))
    with pytest.raises(
        ValueError,
        match=r"'blocks.layers\[0\].bias' has 1 layer axis of sizes \(4,\); "
        r"index \(4,\)",
    ):
        eo.state_dict_key(model, "blocks.layers[0].bias", (4,))
