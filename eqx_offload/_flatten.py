"""A pytree as its array leaves and a hashable rest: what a jitted function takes
as its traced and its static arguments."""

from typing import Any, TypeAlias

import jax.tree_util as jtu

from ._memory_kinds import is_arraylike


# The treedef (a `jax.tree_util.PyTreeDef`), and every leaf that is not an array
# (`None` where one is).
Static: TypeAlias = tuple[Any, tuple]


def flatten(tree: Any) -> tuple[list, Static]:
    """The array leaves of `tree` (`jax.ShapeDtypeStruct`s too), `None` for the
    others; and the hashable rest."""
    leaves, treedef = jtu.tree_flatten(tree)
    dynamic = [x if is_arraylike(x) else None for x in leaves]
    static = tuple(None if is_arraylike(x) else x for x in leaves)
    return dynamic, (treedef, static)


def unflatten(dynamic: list, static: Static) -> Any:
    """The tree `flatten` took apart, with the arrays `dynamic`."""
    treedef, static_leaves = static
    leaves = [s if d is None else d for d, s in zip(dynamic, static_leaves)]
    return jtu.tree_unflatten(treedef, leaves)
