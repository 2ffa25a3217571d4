"""`eo.field(memory_kind=...)` annotations and `eo.place`: which memory kind each leaf
gets (annotation, policy pattern, default, in that order), sharding and values kept,
abstract trees placed without allocating, inside `jit` too; and the mistakes, with
the leaf named."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload as eo
from eqx_offload.internal import is_arraylike

from .helpers import memory_kind, Model, same_place, unchecked


class Annotated(eqx.Module):
    free: jax.Array
    embed: eqx.nn.Embedding = eo.field(memory_kind="pinned_host")
    head: eqx.nn.Linear = eo.field(memory_kind="device")

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(8, 4, key=k1)
        self.head = eqx.nn.Linear(4, 8, key=k2)
        self.free = jnp.zeros(3)


def test_annotation_places_every_leaf_under_the_field(getkey):
    model = eo.place(Annotated(getkey()))
    assert memory_kind(model.embed.weight) == "pinned_host"
    assert memory_kind(model.head.weight) == "device"
    assert memory_kind(model.head.bias) == "device"
    assert memory_kind(model.free) == "device"


def test_resolution_order(getkey):
    model = Annotated(getkey())
    # The array's own placement counts when nothing else says.
    model = eqx.tree_at(
        lambda m: m.free,
        model,
        jax.device_put(model.free, model.free.sharding.with_memory_kind("pinned_host")),
    )
    placed = eo.place(model)
    assert memory_kind(placed.free) == "pinned_host"
    # The policy beats annotations and current placement.
    placed = eo.place(model, eo.Policy(params={"embed": "device", "free": "device"}))
    assert memory_kind(placed.embed.weight) == "device"
    assert memory_kind(placed.free) == "device"
    # One kind for everything.
    placed = eo.place(model, eo.Policy(params="pinned_host"))
    kinds = {memory_kind(x) for x in jax.tree.leaves(eqx.filter(placed, eqx.is_array))}
    assert kinds == {"pinned_host"}


def test_innermost_annotation_wins():
    class Inner(eqx.Module):
        w: jax.Array = eo.field(memory_kind="device")
        v: jax.Array = eqx.field(default_factory=lambda: jnp.ones(2))

    class Outer(eqx.Module):
        inner: Inner = eo.field(memory_kind="pinned_host")

    placed = eo.place(Outer(Inner(jnp.ones(2))))
    assert memory_kind(placed.inner.w) == "device"
    assert memory_kind(placed.inner.v) == "pinned_host"


def test_most_specific_pattern_wins_and_ties_must_agree(getkey):
    model = Model(key=getkey())
    policy = eo.Policy(params={"blocks": "pinned_host", "blocks.norm1": "device"})
    placed = eo.place(model, policy)
    assert memory_kind(placed.blocks.layers.norm1.weight) == "device"
    assert memory_kind(placed.blocks.layers.norm2.weight) == "pinned_host"
    # The most literal pattern wins, whatever the wildcards cover.
    for catch_all in ("**", "blocks.**", "blocks.*"):
        policy = eo.Policy(params={catch_all: "pinned_host", "blocks.norm1": "device"})
        placed = eo.place(model, policy)
        assert memory_kind(placed.blocks.layers.norm1.weight) == "device"
        assert memory_kind(placed.blocks.layers.norm2.weight) == "pinned_host"
    tie = eo.Policy(params={"*.norm1": "device", "blocks": "pinned_host"})
    with pytest.raises(ValueError, match="equally well"):
        eo.place(model, tie)


def test_sharding_is_kept_and_values_unchanged():
    mesh = jax.make_mesh(
        (2, 2),
        ("a", "b"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:4],
    )
    x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("a", "b")))
    placed = eo.place({"x": x}, eo.Policy(params="pinned_host"))["x"]
    assert placed.sharding == x.sharding.with_memory_kind("pinned_host")
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(x))


def test_abstract_trees_are_placed_without_allocating(getkey):
    abstract = eqx.filter_eval_shape(Model, key=getkey())
    placed = eo.place(abstract, eo.Policy.offload_all())
    leaves = jax.tree.leaves(eqx.filter(placed, is_arraylike))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}
    # Abstract and concrete placements agree.
    concrete = eo.place(Model(key=getkey()), eo.Policy.offload_all())
    for a, c in zip(leaves, jax.tree.leaves(eqx.filter(concrete, eqx.is_array))):
        assert same_place(a, c)


def test_unknown_kind_names_the_leaf():
    class Bad(eqx.Module):
        w: jax.Array = eqx.field(metadata={"memory_kind": "hbm"})

    with pytest.raises(ValueError, match=r"leaf 'w'.*'hbm'.*valid kinds"):
        eo.place(Bad(jnp.ones(2)))
    with (
        unchecked(),
        pytest.raises(ValueError, match=r"field\(memory_kind=\.\.\.\)`.*valid kinds"),
    ):
        eo.field(memory_kind="hbm")  # pyright: ignore[reportArgumentType]


def test_kind_missing_on_backend_names_the_leaf(monkeypatch, getkey):
    monkeypatch.setattr(
        "eqx_offload._placement.backend_kinds", lambda: ("device", "pinned_host")
    )
    policy = eo.Policy(params={"head": "unpinned_host"})
    with pytest.raises(
        ValueError,
        match=r"leaf 'head\.weight'.*'unpinned_host'.*"
        r"valid kinds here: 'device', 'pinned_host'",
    ):
        eo.place(Model(key=getkey()), policy)


def test_pattern_matching_no_leaf_is_an_error(getkey):
    with pytest.raises(ValueError, match=r"'blox' match no leaf"):
        eo.place(Model(key=getkey()), eo.Policy(params={"blox": "pinned_host"}))


def test_place_inside_jit_uses_memory_spaces(getkey):
    model = Model(key=getkey())
    placed = eqx.filter_jit(lambda m: eo.place(m, eo.Policy(params="pinned_host")))(
        model
    )
    assert memory_kind(placed.head.weight) == "pinned_host"


def test_field_keeps_other_metadata():
    class M(eqx.Module):
        w: jax.Array = eo.field(memory_kind="pinned_host", metadata={"note": "x"})

    (f,) = [f for f in M.__dataclass_fields__.values() if f.name == "w"]
    assert f.metadata == {"note": "x", "memory_kind": "pinned_host"}
