"""The device mesh a pytree is laid out on: found from its leaves' `NamedSharding`s,
entered as JAX's mesh context where a jitted computation needs it (meshes with
`Explicit` axes), and checked for leaves on other devices."""

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from . import _paths
from ._errors import see


def _named(x: Any) -> NamedSharding | None:
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def tree_mesh(tree: Any, abstract: bool = False) -> Any:
    """The concrete mesh of the `NamedSharding`s of `tree`'s array leaves (one-device
    meshes, which abstract placements use, do not count), or None; with `abstract`,
    an `AbstractMesh` counts too. Leaves on two different meshes are a `ValueError`
    naming them."""
    found: tuple[str, Any] | None = None
    kinds = (Mesh, AbstractMesh) if abstract else Mesh
    for leaf in _paths.leaves(tree):
        named = _named(leaf.value)
        if named is None or not isinstance(named.mesh, kinds) or named.mesh.size == 1:
            continue
        if found is None:
            found = (leaf.path, named.mesh)
        elif named.mesh != found[1]:
            raise ValueError(
                f"Leaves {found[0]!r} and {leaf.path!r} are laid out on two different "
                f"meshes ({dict(found[1].shape)} and {dict(named.mesh.shape)}). Use "
                "one mesh." + see(48)
            )
    return None if found is None else found[1]


@contextlib.contextmanager
def context(*trees: Any, explicit_only: bool = False) -> Iterator[None]:
    """`jax.set_mesh` of the mesh `trees` are laid out on, if any: JAX needs it to
    trace ops that make new arrays under `Explicit` axes, and a loss may name
    mesh axes (`with_sharding_constraint(x, PartitionSpec("data"))`) under either
    axis type; otherwise nothing. `explicit_only`: only a mesh with `Explicit`
    axes (under an `Auto` mesh in context, a jitted function returns arrays of a
    partly laid out tree on the mesh, which `init_opt_state` does not want)."""
    meshes = [
        named.mesh
        for named in map(_named, jax.tree.leaves(trees))
        if named is not None and isinstance(named.mesh, Mesh) and named.mesh.size > 1
    ]
    if explicit_only:
        meshes = [m for m in meshes if AxisType.Explicit in m.axis_types]
    with jax.set_mesh(meshes[0]) if meshes else contextlib.nullcontext():
        yield


def check_devices(named_trees: dict[str, Any], where: str) -> None:
    """Raises, naming the leaves, if the committed array leaves of the trees are not
    all on the same devices (JAX would say "incompatible devices", naming an
    argument position)."""
    first: tuple[str, frozenset] | None = None
    for name, tree in named_trees.items():
        for leaf in _paths.leaves(tree):
            x = leaf.value
            if not isinstance(x, jax.Array) or not x.committed:
                continue
            devices = frozenset(d.id for d in x.sharding.device_set)
            path = f"{name}.{leaf.path}" if leaf.path else name
            if first is None:
                first = (path, devices)
            elif devices != first[1]:
                raise ValueError(
                    f"{where}: leaf {path!r} is on devices {sorted(devices)} but "
                    f"{first[0]!r} is on devices {sorted(first[1])}. Lay them out on "
                    "one mesh." + see(47)
                )
