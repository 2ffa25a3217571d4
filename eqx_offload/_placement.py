"""Memory kinds on pytree leaves: `field`, resolving each leaf's kind, and `place`."""

from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import PyTree

from . import _mesh, _paths
from ._memory_kinds import (
    abstract_sharding,
    backend_kinds,
    check_kind,
    is_arraylike,
    kind_of,
    KindArg,
    ParamsSpec,
    to_space,
)
from ._policy import check_policy, PolicyArg


_T = TypeVar("_T")


def field(*, memory_kind: KindArg, **kwargs: Any) -> Any:
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
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata["memory_kind"] = memory_kind
    return eqx.field(metadata=metadata, **kwargs)


def match_params(
    params: ParamsSpec, leaves: list[_paths.Leaf], where: str
) -> list[str | None]:
    """The kind `params` gives each leaf (`None`: no opinion). Where several patterns
    match, the one with the most literal (non-`*`) characters wins. A pattern that
    matches no leaf, or two equally specific patterns that disagree, is a
    `ValueError`."""
    if params is None:
        return [None] * len(leaves)
    if isinstance(params, str):
        return [params] * len(leaves)
    used = {pattern: False for pattern, _ in params}
    out: list[str | None] = []
    for leaf in leaves:
        best, best_len = None, -1
        for pattern, kind in params:
            if _paths.prefix_match(pattern, leaf.path) is None:
                continue
            used[pattern] = True
            length = _paths.specificity(pattern)
            if length > best_len:
                best, best_len = (pattern, kind), length
            elif length == best_len and best is not None and kind != best[1]:
                raise ValueError(
                    f"{where}: patterns {best[0]!r} and {pattern!r} both match leaf "
                    f"{leaf.path!r} equally well but give {best[1]!r} and {kind!r}; "
                    "make one of them more specific."
                )
        out.append(None if best is None else best[1])
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        raise ValueError(
            f"{where}: pattern(s) {_paths.quoted(unused)} match no leaf; array leaves "
            f"are: {_paths.quoted([leaf.path for leaf in leaves])}."
        )
    return out


def resolve(
    tree: Any, params: ParamsSpec = None, where: str = "`eqx_offload.place`"
) -> list[tuple[_paths.Leaf, str]]:
    """Every array leaf of `tree` with the memory kind it should live in.

    Highest first: the policy's `params` spec, the innermost field annotation
    (`eqx_offload.field`), the leaf's current placement, else `"device"`.
    """
    leaves = [leaf for leaf in _paths.leaves(tree) if is_arraylike(leaf.value)]
    # PRNG key arrays stay on the device: inside `jax.jit`, JAX 0.10 does not track
    # their memory kind, so a host-resident key could not be kept there by a step.
    keys = [_is_key(leaf.value) for leaf in leaves]
    others = [leaf for leaf, key in zip(leaves, keys) if not key]
    from_policy = iter(match_params(params, others, where))
    available = backend_kinds()
    out = []
    for leaf, key in zip(leaves, keys):
        annotated = leaf.metadata.get("memory_kind")
        if key:
            if annotated not in (None, "device"):
                raise ValueError(
                    f"{where}: leaf {leaf.path!r} is a PRNG key array annotated "
                    f"{annotated!r}; keys stay on the device (JAX 0.10 does not track "
                    "their memory kind inside `jax.jit`). Drop the annotation."
                )
            out.append((leaf, "device"))
            continue
        kind = next(from_policy) or annotated or kind_of(leaf.value)
        check_kind(kind, f"{where}: the memory kind of leaf {leaf.path!r}")
        if kind not in available:
            raise ValueError(
                f"{where}: leaf {leaf.path!r} is to live in {kind!r}, which the "
                f"{jax.default_backend()!r} backend does not have; valid kinds here: "
                f"{_paths.quoted(available)}."
            )
        out.append((leaf, kind))
    return out


def _explicit(sharding: NamedSharding) -> bool:
    return AxisType.Explicit in getattr(sharding.mesh, "axis_types", ())


def _uncommitted(x: Any) -> bool:
    """A concrete array not committed to devices yet, or a NumPy array."""
    if isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct):
        return False
    return not isinstance(x, jax.Array) or not x.committed


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def move(x: Any, kind: str, path: str, sharding: Any = None) -> Any:
    """Puts one array leaf in `kind`, keeping its sharding (or taking `sharding`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = sharding or x.sharding or SingleDeviceSharding(jax.devices()[0])
        sharding = abstract_sharding(sharding.with_memory_kind(kind))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.core.Tracer):
        return to_space(x, kind, path)
    if sharding is None:
        sharding = x.sharding if isinstance(x, jax.Array) else None
        sharding = sharding or SingleDeviceSharding(jax.devices()[0])  # NumPy
    if getattr(x, "weak_type", False):
        x = x.astype(x.dtype)  # strongly typed, as a jitted step's outputs will be
    if isinstance(sharding, NamedSharding) and _explicit(sharding):
        # Spelled in full (`P(None, "x", None)`), as a step returns it under an
        # `Explicit` mesh, whose jit cache tells the spellings apart.
        spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    # Also commits the array to its sharding, as a step's outputs will be, so that
    # the first step is not compiled for a second signature.
    return jax.device_put(x, sharding.with_memory_kind(kind))


def move_leaves(tree: _T, kinds: list[tuple[_paths.Leaf, str]]) -> _T:
    """Puts each array leaf of `tree` in its kind from `resolve(tree, ...)`. On a
    tree laid out on a mesh, arrays not committed to devices yet (and NumPy arrays)
    are replicated over it, as a jitted function would place them."""
    by_position = iter(kinds)
    flat, treedef = jax.tree.flatten(tree)
    mesh = _mesh.tree_mesh(tree)
    out = []
    for value in flat:
        if is_arraylike(value):
            leaf, kind = next(by_position)
            sharding = None
            if mesh is not None and _uncommitted(value):
                sharding = NamedSharding(mesh, PartitionSpec())
            value = move(value, kind, leaf.path, sharding)
        out.append(value)
    return jax.tree.unflatten(treedef, out)


def place(tree: PyTree, policy: PolicyArg | None = None) -> PyTree:
    """Moves every array leaf of `tree` to the memory kind it should live in.

    The kind of each leaf comes from, highest first: `policy.params`; the innermost
    `eqx_offload.field(memory_kind=...)` annotation above it; its current placement;
    else `"device"`. Each leaf keeps its sharding; only the memory kind changes
    (`sharding.with_memory_kind`). `jax.ShapeDtypeStruct` leaves (e.g. from
    `eqx.filter_eval_shape`) get the new memory kind in their sharding, so a model
    can be placed, and planned, before it exists; nothing is allocated for them.

    **Arguments:**

    - `tree`: any pytree, usually an Equinox model. Arrays, `jax.ShapeDtypeStruct`s
        and tracers (inside `jax.jit`) are placed; other leaves are left alone.
    - `policy`: an `eqx_offload.Policy`, or `None` to follow the annotations only.

    **Returns:**

    A pytree of the same structure with every array leaf in its memory kind.

    **Raises:**

    `ValueError` if a kind is unknown or the backend lacks it (naming the leaf), or if
    a `Policy(params=...)` pattern matches no leaf.

    !!! Warning "Placing does not copy what is already in place"

        A leaf already in its memory kind comes back as the same buffer; only
        moved leaves are copies. `eqx_offload.train_step` donates the model and
        the optimizer state, so after the first step the placed model *and* the
        leaves of the original that did not move are deleted (a later use is an
        error naming the leaf). Keep using what the step returns; to keep the
        original, copy it first: `jax.tree.map(jnp.copy, model)`.

    !!! Example

        ```python
        model = eo.place(Model(key=jax.random.key(0)), eo.Policy.offload_all())
        model.blocks.layers.mlp.weight.sharding.memory_kind  # 'pinned_host'
        ```
    """
    if policy is not None:
        check_policy(policy, "`place(tree, policy)`")
    params = None if policy is None else policy.params
    return move_leaves(tree, resolve(tree, params))
