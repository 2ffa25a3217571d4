"""Memory kinds on pytree leaves: `field`, resolving each leaf's kind, and `place`."""

from typing import Any

import equinox as eqx
import jax
import jax.core
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import PyTree

from . import _layout, _mesh, _paths
from ._custom_types import AnyMesh
from ._errors import see
from ._memory_kinds import (
    abstract_sharding,
    backend_kinds,
    check_kind,
    is_arraylike,
    is_key,
    kind_of,
    MemoryKind,
    ParamsSpec,
    to_space,
)
from ._policy import check_policy, Policy


def field(*, memory_kind: MemoryKind, **kwargs: Any) -> Any:
    """An `equinox.field` whose array leaves live in `memory_kind` between steps.

    **Arguments:**

    - `memory_kind`: `"device"`, `"pinned_host"` or `"unpinned_host"`. It applies to
        every array leaf under the field (the innermost annotated field wins). A
        `Policy(params=...)` that matches the leaf overrides it.
    - `**kwargs`: passed to `equinox.field` (`converter`, `static`, `default`, ...);
        `metadata` is merged.

    **Returns:**

    A dataclass field, as from `equinox.field`.

    !!! Example

        ```python
        class Model(eqx.Module):
            embed: eqx.nn.Embedding = eo.field(memory_kind="pinned_host")
            head: eqx.nn.Linear
        ```
    """
    check_kind(memory_kind, "`eqx_offload.field(memory_kind=...)`")
    metadata = {**(kwargs.pop("metadata", None) or {}), "memory_kind": memory_kind}
    return eqx.field(metadata=metadata, **kwargs)


def resolve(
    tree: Any, params: ParamsSpec = None, where: str = "`eqx_offload.place`"
) -> list[tuple[_paths.Leaf, str]]:
    """Every array leaf of `tree` with the memory kind it should live in.

    Highest first: the policy's `params` spec, the innermost field annotation
    (`eqx_offload.field`), the leaf's current placement, else `"device"`. Where
    several `params` patterns match, the one with the most literal (non-`*`)
    characters wins. A pattern that matches no leaf is a `ValueError`. So are two
    equally specific patterns that disagree.
    """
    leaves = [leaf for leaf in _paths.leaves(tree) if is_arraylike(leaf.value)]
    # PRNG key arrays stay on the device: inside `jax.jit`, JAX 0.10 does not track
    # their memory kind, so a host-resident key could not be kept there by a step.
    others = [leaf.path for leaf in leaves if not is_key(leaf.value)]
    from_policy = iter([params] * len(others))
    if params is not None and not isinstance(params, str):
        found = _paths.best_matches(others, params, where, (see(17), see(16)))
        from_policy = iter(None if best is None else best[1] for best in found)
    available = backend_kinds()

    def kind_for(leaf: _paths.Leaf) -> str:
        annotated = leaf.metadata.get("memory_kind")
        if is_key(leaf.value):
            if annotated not in (None, "device"):
                raise ValueError(
                    f"{where}: leaf {leaf.path!r} is a PRNG key array annotated "
                    f"{annotated!r}. Drop the annotation." + see(11)
                )
            return "device"
        kind = next(from_policy) or annotated or kind_of(leaf.value)
        check_kind(kind, f"{where}: the memory kind of leaf {leaf.path!r}")
        if kind not in available:
            raise ValueError(
                f"{where}: leaf {leaf.path!r} is to live in {kind!r}, which the "
                f"{jax.default_backend()!r} backend lacks; valid kinds here: "
                f"{_paths.quoted(available)}." + see(10)
            )
        return kind

    return [(leaf, kind_for(leaf)) for leaf in leaves]


def _uncommitted(x: Any) -> bool:
    """A concrete array not committed to devices yet, or a NumPy array."""
    if isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct):
        return False
    return not isinstance(x, jax.Array) or not x.committed


def _spelled(sharding: Any, ndim: int) -> Any:
    """A `NamedSharding`'s spec spelled as a step returns it.

    `jax.jit`'s cache tells spellings apart. Over `Explicit` axes the spec is in full
    (`P(None, "x", None)`). Over `Auto` ones it has no trailing `None`s (`P(None,
    "x")`).
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = _layout.normalise(sharding.spec, ndim, _layout.explicit_mesh(sharding.mesh))
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def move(x: Any, kind: str, path: str, sharding: Any = None) -> Any:
    """Puts one array leaf in `kind`, keeping its sharding (or taking `sharding`)."""
    if isinstance(x, jax.core.Tracer):
        if isinstance(sharding, NamedSharding):
            plain = NamedSharding(sharding.mesh, sharding.spec)
            x = jax.lax.with_sharding_constraint(to_space(x, "device", path), plain)
        return to_space(x, kind, path)
    # A NumPy array, or a `jax.ShapeDtypeStruct` without one, has no sharding.
    sharding = sharding or getattr(x, "sharding", None)
    sharding = _spelled(sharding or SingleDeviceSharding(jax.devices()[0]), x.ndim)
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = abstract_sharding(sharding.with_memory_kind(kind))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if getattr(x, "weak_type", False):
        x = x.astype(x.dtype)  # strongly typed, as a jitted step's outputs will be
    if not sharding.is_fully_addressable and getattr(x, "is_fully_addressable", True):
        # A global layout from a value every process holds whole (several
        # processes): a NumPy array, or an array on this process's devices only.
        data = np.asarray(x)
        x = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
    # Also commits the array to its sharding, as a step's outputs will be, so that
    # the first step is not compiled for a second signature.
    return jax.device_put(x, sharding.with_memory_kind(kind))


def _lay_out(tree: Any, kinds: list, policy: Policy, mesh: Any) -> tuple[Any, Any]:
    """The spec `Policy(shard=...)` gives each leaf of `kinds` (or None, without
    one), and the mesh, for `place`.

    The mesh is `mesh`, else the one of `jax.set_mesh`, else the tree's.
    """
    where = "`eqx_offload.place`"
    if policy.shard is None:
        return None, mesh
    if mesh is None:  # (a mesh, concrete or abstract, is never falsy)
        mesh = _layout.current_mesh() or _mesh.tree_mesh(tree, abstract=True)
    if mesh is None:
        raise ValueError(
            f"{where}: `Policy(shard=...)` names mesh axes, but there is no mesh. "
            "Use `with jax.set_mesh(mesh):`, or pass `mesh=`." + see(76)
        )
    concrete = [
        leaf.path
        for leaf, _ in kinds
        if not isinstance(leaf.value, jax.ShapeDtypeStruct | jax.core.Tracer)
    ]
    if concrete and not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(
            f"{where}: leaf {concrete[0]!r} is an array, which needs a concrete "
            f"`jax.sharding.Mesh`, not {mesh}. Pass a mesh of devices." + see(77)
        )
    # PRNG keys stay replicated.
    leaves = [leaf for leaf, _ in kinds if not is_key(leaf.value)]
    found = _layout.specs(leaves, policy.shard, mesh, host_tables=policy.host_tables)
    by_leaf = iter(found)
    return [None if is_key(leaf.value) else next(by_leaf) for leaf, _ in kinds], mesh


def place_batch(
    batch: tuple,
    spec: PartitionSpec | None,
    mesh: Any,
    where: str,
    unsplit: tuple[int, ...] = (),
) -> tuple:
    """The leaves of the batch arguments `batch`, laid out as `spec` on `mesh`.

    It lays out the array leaves not yet on `mesh`: NumPy arrays, arrays on one device,
    and unsharded `jax.ShapeDtypeStruct`s. Their leading dimensions are split. A PRNG
    key array with a leading axis is split too (per-example keys). Scalars are
    replicated. So are the arguments at the positions in `unsplit`, passed whole to
    every micro-batch.
    """
    if spec is None:
        return batch
    mesh = _layout.current_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError(
            f"{where}: `Policy(batch={spec})` names mesh axes, but there is no mesh. "
            "Use `with jax.set_mesh(mesh):`."
        )

    def lay_out(leaf: _paths.Leaf, whole: bool) -> Any:
        x = leaf.value
        named = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or (
            isinstance(named, NamedSharding)
            and named.mesh.shape == mesh.shape
            and named.mesh.axis_names == mesh.axis_names
            and any(entry is not None for entry in named.spec)
        ):
            # Laid out by hand on the mesh: kept. (Replicated is what an array
            # made inside `jax.set_mesh` gets, not a layout: it is laid out.)
            return x
        shape = tuple(x.shape)
        leaf_spec = PartitionSpec()
        if not whole:
            leaf_spec = PartitionSpec(*tuple(spec)[: len(shape)])
            what = f"{where}: batch leaf {'batch' + leaf.path!r}"
            _layout.check_spec(leaf_spec, shape, mesh, what, see(78))
        return move(x, "device", leaf.path, NamedSharding(mesh, leaf_spec))

    positions = [i for i, arg in enumerate(batch) for _ in jax.tree.leaves(arg)]
    flat = [
        lay_out(leaf, i in unsplit) if is_arraylike(leaf.value) else leaf.value
        for leaf, i in zip(_paths.leaves(batch), positions, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(batch), flat)


def place(
    tree: PyTree, policy: Policy | None = None, *, mesh: AnyMesh | None = None
) -> PyTree:
    """Moves every array leaf of `tree` to the memory kind it should live in.

    The kind of each leaf comes from, highest first:

    1. `policy.params`;
    2. the innermost `eqx_offload.field(memory_kind=...)` annotation above it;
    3. its current placement;
    4. else `"device"`.

    Each leaf keeps its sharding; only the memory kind changes
    (`sharding.with_memory_kind`). `jax.ShapeDtypeStruct` leaves (e.g. from
    `eqx.filter_eval_shape`) get the new memory kind in their sharding. So a model can
    be placed, and planned, before it exists. Nothing is allocated for them.

    **Arguments:**

    - `tree`: any pytree, usually an Equinox model. Arrays, `jax.ShapeDtypeStruct`s and
        tracers (inside `jax.jit`) are placed. Other leaves are left alone.
    - `policy`: an `eqx_offload.Policy`, or `None` to follow the annotations only. With
        `Policy(shard=...)`, each leaf a pattern matches is also laid out. Its layout is
        `NamedSharding(mesh, spec, memory_kind)`.
    - `mesh`: the mesh `Policy(shard=...)` lays leaves out on. A `jax.sharding.Mesh`, or
        an `AbstractMesh` for an abstract model. By default, the mesh of `jax.set_mesh`,
        else the one the tree's leaves are laid out on.

    **Returns:**

    A pytree of the same structure with every array leaf in its memory kind (and its
    declared layout).

    **Raises:**

    `ValueError` naming the leaf in these cases:

    - a kind is unknown, or the backend lacks it;
    - a spec names an axis the mesh lacks, or one that does not divide the leaf;
    - a `Policy(params=...)` or `Policy(shard=...)` pattern matches no leaf.

    !!! Warning "Placing does not copy what is already in place"

        A leaf already in its memory kind comes back as the same buffer. Only moved
        leaves are copies. `eqx_offload.train_step` donates the model and the optimizer
        state. So after the first step, the placed model is deleted. So are the leaves
        of the original that did not move. A later use is an error naming the leaf. Keep
        using what the step returns. To keep the original, copy it first:
        `jax.tree.map(jnp.copy, model)`.

    !!! Warning "Host-resident leaves are computed on only inside the transform"

        `filter_offload` and `train_step` bring host-resident leaves to the device. JAX
        computes on nothing in host memory. Called outside them (`model(x)`, with or
        without `eqx.filter_jit`), a host-resident model fails inside JAX. The error
        says `` memory_space of all inputs passed to `gather` must be the same `` (or
        `dot_general`, `mul`, ...). Evaluate it with
        `eqx.filter_jit(eo.filter_offload(fn, policy))(model, ...)`. The optax idiom
        `optimizer.init(params)` fails with "Memory kind mismatch with
        xla::PjRtBuffers". Use `eo.init_opt_state(optimizer, model, policy)`.

    !!! Example

        ```python
        model = eo.place(Model(key=jax.random.key(0)), eo.Policy.offload_all())
        model.blocks.layers.mlp.weight.sharding.memory_kind  # 'pinned_host'
        ```
    """
    policy = Policy() if policy is None else policy
    check_policy(policy, "`place(tree, policy)`")
    kinds = resolve(tree, policy.params)
    specs, mesh = _lay_out(tree, kinds, policy, mesh)
    mesh = mesh if mesh is not None else _mesh.tree_mesh(tree)
    placed = iter(zip(kinds, specs or [None] * len(kinds), strict=True))

    def place_one(x: Any) -> Any:
        """Puts an array leaf in its kind from `resolve`, and where `specs` gives one,
        in `NamedSharding(mesh, spec)`. On a tree laid out on a mesh, other arrays are
        replicated over it: those not committed to devices yet, and NumPy arrays. A
        jitted function would place them so."""
        if not is_arraylike(x):
            return x
        (leaf, kind), spec = next(placed)
        if mesh is None or (spec is None and not _uncommitted(x)):
            return move(x, kind, leaf.path)
        return move(x, kind, leaf.path, NamedSharding(mesh, spec or PartitionSpec()))

    return jax.tree.map(place_one, tree)
