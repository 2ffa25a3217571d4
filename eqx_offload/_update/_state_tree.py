"""Optimizer state as a tree that mirrors the parameters: which state leaves are
parameter-shaped, and which parameter each of them belongs to."""

import re
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from .. import _paths
from .._errors import see
from .._memory_kinds import is_arraylike, is_masked


def _owners(
    optimizer: optax.GradientTransformation | None, opt_state: PyTree, params: PyTree
) -> list[int | None]:
    """For each array leaf of `opt_state` (in `jax.tree.leaves` order), the index of
    the parameter leaf (of `params`) whose parameter-shaped part of the state it is
    in, or None (skipping `optax.masked`'s holes).

    The parameter-shaped parts are found with `optax.tree_utils.tree_map_params`,
    which calls `optimizer.init` on a placeholder. An `init` that looks inside its
    argument (a `multi_transform` whose labels come from `eqx.tree_at`, an `init`
    that computes on the parameters) fails on the placeholder; the parts are then
    the subtrees of the state with the parameters' structure, as they are without
    an `optimizer`."""
    leaves, treedef = jtu.tree_flatten(params)
    indices = jtu.tree_unflatten(treedef, [_Index(i) for i in range(len(leaves))])

    def params_leaf(s: Any, i: _Index) -> Any:
        return i if is_arraylike(s) and not is_masked(s) else s

    def others(tree: Any) -> Any:
        return jtu.tree_map(lambda s: _Index(None) if is_arraylike(s) else s, tree)

    def mapped() -> PyTree:
        if optimizer is not None:
            try:
                return optax.tree_utils.tree_map_params(
                    optimizer,
                    params_leaf,
                    opt_state,
                    indices,
                    transform_non_params=others,
                    is_leaf=is_masked,
                )
            # Broad on purpose: the user's `init`, run on a placeholder, may raise
            # anything; the fallback below is the documented answer, not a guess.
            except Exception:
                pass
        single = jtu.treedef_is_leaf(treedef) and treedef.num_leaves == 1

        def like_params(x: Any) -> bool:
            if single:  # a lone array: only a state leaf of its shape mirrors it
                return is_arraylike(x) and x.shape == params.shape
            return jtu.tree_structure(x, is_leaf=is_masked) == treedef

        def visit(x: Any) -> Any:
            if like_params(x):
                return jtu.tree_map(params_leaf, x, indices, is_leaf=is_masked)
            return others(x)

        return jtu.tree_map(visit, opt_state, is_leaf=like_params)

    return [x.i for x in jtu.tree_leaves(mapped()) if isinstance(x, _Index)]


def check_matches(
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    params: PyTree,
    where: str,
) -> None:
    """Raises, naming the first leaf that differs, if `opt_state` does not have the
    structure and shapes `optimizer.init(params)` gives (a state built for a model
    of another depth or width, or for another optimizer)."""
    abstract = jtu.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    expected = jax.eval_shape(optimizer.init, abstract)
    fix = (
        "Build the state for this model with `eqx_offload.init_opt_state(optimizer, "
        "model, policy)`, or restore it from a checkpoint of this model."
    )
    got_leaves, want_leaves = _paths.leaves(opt_state), _paths.leaves(expected)
    if jtu.tree_structure(opt_state) != jtu.tree_structure(expected):
        got = {leaf.path for leaf in got_leaves}
        want = {leaf.path for leaf in want_leaves}
        detail = ""
        if got - want:
            detail = f" It has {sorted(got - want)[0]!r}, which the optimizer's lacks."
        elif want - got:
            detail = f" It lacks {sorted(want - got)[0]!r}."
        raise ValueError(
            f"{where}: the optimizer state does not have the structure "
            f"`optimizer.init(model)` gives.{detail} {fix}" + see(43)
        )
    for got, want in zip(got_leaves, want_leaves):
        if is_arraylike(got.value) and got.value.shape != want.value.shape:
            raise ValueError(
                f"{where}: optimizer state leaf {got.path!r} has shape "
                f"{tuple(got.value.shape)} where `optimizer.init(model)` gives "
                f"{tuple(want.value.shape)}. {fix}" + see(42)
            )


class StateLeaf(NamedTuple):
    """An array leaf of an optimizer state: its path, the index of the parameter
    whose parameter-shaped part of the state it is in (`None` for step counts and
    other state) and its path (`None` too), and that part's name (`"mu"` of
    `"[0].mu.blocks.w"`)."""

    leaf: _paths.Leaf
    owner: int | None
    owner_path: str | None
    part: str | None


class _Index:
    """A parameter's position standing in for it (a pytree leaf)."""

    def __init__(self, i: int | None):
        self.i = i


def state_leaves(
    optimizer: optax.GradientTransformation | None, opt_state: PyTree, params: PyTree
) -> list[StateLeaf]:
    """Every array leaf of `opt_state` (in `jax.tree.leaves` order) with the
    parameter it belongs to and the name of its part of the state."""
    param_leaves = _paths.leaves(params)
    owners = _owners(optimizer, opt_state, params)
    leaves = [leaf for leaf in _paths.leaves(opt_state) if is_arraylike(leaf.value)]
    paths = [None if owner is None else param_leaves[owner].path for owner in owners]
    return [
        StateLeaf(leaf, owner, path, _part(leaf.path, path))
        for leaf, owner, path in zip(leaves, owners, paths, strict=True)
    ]


_NAME = re.compile(r"(?:^|\.)([A-Za-z_]\w*)$")


def _part(state_path: str, param_path: str | None) -> str | None:
    """The field of the state holding this copy of the parameters: `"nu"` of
    `"[0].nu.blocks.w"` for parameter `"blocks.w"` (None without a parameter)."""
    if param_path is None or not state_path.endswith(param_path):
        return None
    prefix = state_path[: len(state_path) - len(param_path)].rstrip(".")
    found = _NAME.search(prefix)
    return None if found is None else found.group(1)


def state_owners(
    optimizer: optax.GradientTransformation, opt_state: PyTree, params: PyTree
) -> list[int | None]:
    """For each array leaf of `opt_state` (in `jax.tree.leaves` order), the index of
    the parameter leaf it mirrors (in a parameter-shaped part of the state, with the
    parameter's shape), or None (a count, a per-leaf scalar, a factored moment)."""
    shapes = [tuple(p.shape) for p in jtu.tree_leaves(params)]
    return [
        s.owner
        if s.owner is not None and tuple(s.leaf.value.shape) == shapes[s.owner]
        else None
        for s in state_leaves(optimizer, opt_state, params)
    ]
