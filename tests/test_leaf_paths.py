"""Leaf paths and the patterns that select them (`_paths.py`): glob matching at segment
boundaries, the names `Stacked` layers get, and JAX's tree order."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi


@pytest.mark.parametrize(
    "pattern, name, expected",
    [
        ("blocks.input", "blocks.input", True),
        ("blocks.input", "blocks.inputs", False),
        ("blocks.*", "blocks.mlp", True),
        ("blocks.*", "blocks.mlp.layers[0]", False),
        ("blocks.**", "blocks.mlp.layers[0]", True),
        ("**.input", "blocks.input", True),
        ("**.input", "encoder.blocks.input", True),
        ("**.input", "input", True),
        ("**.input", "blocks.preinput", False),
        ("blocks.mlp.layers[0]", "blocks.mlp.layers[0]", True),
        ("blocks.mlp.layers[0]", "blocks.mlp.layers0", False),
        ("blocks.mlp.layers[*]", "blocks.mlp.layers[1]", True),
        ("blocks.mlp.layers[?]", "blocks.mlp.layers[1]", False),  # no fnmatch `?`
        ("*.input", "a.b.input", False),
    ],
)
def test_matches(pattern, name, expected):
    assert eoi.paths_matches(pattern, name) is expected


def test_prefix_match_is_at_segment_boundaries():
    assert eoi.prefix_match("blocks", "blocks.mlp.weight") == len("blocks")
    assert eoi.prefix_match("blocks.mlp", "blocks.mlp.layers[0].weight") == 10
    prefix = eoi.prefix_match("blocks.mlp.layers", "blocks.mlp.layers[0].weight")
    assert prefix == 17
    assert eoi.prefix_match("block", "blocks.mlp.weight") is None
    assert eoi.prefix_match("blocks.mlp.weight", "blocks.mlp.weight") == 17


def test_leaf_paths_skip_the_stacked_field_and_format_keys(getkey):
    class Layer(eqx.Module):
        mlp: eqx.nn.MLP

        def __init__(self, key):
            self.mlp = eqx.nn.MLP(2, 2, 4, depth=1, key=key)

    tree = {
        "blocks": eo.Stacked.from_fn(Layer, 3, key=getkey()),
        "not an identifier": jnp.zeros(1),
        "seq": [jnp.zeros(2)],
    }
    paths = [leaf.path for leaf in eoi.paths_leaves(tree) if eqx.is_array(leaf.value)]
    assert paths == [
        "blocks.mlp.layers[0].weight",
        "blocks.mlp.layers[0].bias",
        "blocks.mlp.layers[1].weight",
        "blocks.mlp.layers[1].bias",
        "['not an identifier']",
        "seq[0]",
    ]
    assert [leaf.path for leaf in eoi.paths_leaves({7: jnp.zeros(1)})] == ["[7]"]
    stacked = {leaf.path: leaf.stacked for leaf in eoi.paths_leaves(tree)}
    assert stacked["blocks.mlp.layers[0].weight"] == "blocks"
    assert stacked["seq[0]"] is None


def test_leaves_follow_jax_tree_order(getkey):
    model = {
        "a": jnp.zeros(1),
        "s": eo.Stacked(jnp.zeros((2, 3))),
        "b": (1, jnp.ones(2)),
    }
    ours = [leaf.value for leaf in eoi.paths_leaves(model)]
    theirs = jax.tree.leaves(model)
    assert len(ours) == len(theirs)
    assert all(a is b for a, b in zip(ours, theirs))
