"""Declared layouts, turned into each leaf's spec on a given mesh.

A partition rule maps a leaf-path pattern to a `PartitionSpec`, or to `FSDP` along a
mesh axis. The checks name the leaf when a spec cannot apply.
"""

import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AxisType, PartitionSpec

from . import _paths, _tiling
from ._custom_types import AnyMesh as AnyMesh
from ._errors import see
from ._warn import warn_at_caller


def axis_names(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a `PartitionSpec` (or `FSDP(axis=...)`) names.

    That is `None`, one name, or a tuple of names.
    """
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


class FSDP(eqx.Module):
    """Fully sharded data parallelism for the leaves a rule matches.

    Each leaf is split along `axis` of the mesh, over one of its dimensions. The
    dimension is one that `axis` divides, never a layer axis of a `Stacked`. Dimensions
    whose shard is whole TPU tiles of rows come first (a multiple of 8 for 32-bit
    types). Among them, the largest wins, and the first of equal ones. A leaf with fewer
    than `min_size` elements in one layer stays replicated. So does a leaf with no
    divisible dimension, with a warning naming it.

    **Arguments:**

    - `axis`: a mesh axis name, or a tuple of them (their sizes multiply).
    - `min_size`: the fewest elements (per layer of a `Stacked`) a leaf must have to be
        sharded. Smaller leaves (biases, norm scales) are replicated. That costs little
        and saves their gathers.

    In a `Policy`, the string `"fsdp"` stands for `FSDP("fsdp")`. So `shard="data"`
    shards every large leaf along the mesh axis `"data"`.
    """

    axis: str | tuple[str, ...] = eqx.field(static=True)
    min_size: int = eqx.field(static=True, default=2**12)

    def __check_init__(self):
        names = axis_names(self.axis)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"`FSDP(axis={self.axis!r})`: give a mesh axis name, or a tuple."
            )
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise ValueError(
                f"`FSDP(min_size={self.min_size!r})` must be a non-negative int."
            )


Rule = PartitionSpec | FSDP
Rules = tuple[tuple[str, Rule], ...]


def _rule(value: Any, where: str) -> Rule:
    if isinstance(value, PartitionSpec | FSDP):
        return value
    if isinstance(value, str) and value:
        return FSDP(value)
    if value is None:
        return PartitionSpec()
    raise TypeError(
        f"{where} must be a `jax.sharding.PartitionSpec`, an `FSDP` or a mesh axis "
        f"name, got {value!r}."
    )


def check_rules(value: Any) -> Rules | None:
    """`Policy(shard=...)` in canonical form: `None`, or (pattern, rule) pairs. One
    rule (a spec, an `FSDP`, an axis name) applies to every leaf (`"**"`)."""
    where = "`Policy(shard=...)`"
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = tuple(value.items())
    elif isinstance(value, tuple) and all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in value
    ):
        items = value
    else:
        return (("**", _rule(value, where)),)
    for pattern, _ in items:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"{where} has key {pattern!r}. Keys are non-empty leaf path patterns, "
                "such as 'blocks.**'."
            )
    return tuple((p, _rule(rule, f"{where}[{p!r}]")) for p, rule in items)


def check_batch(value: Any) -> PartitionSpec | None:
    if value is None or isinstance(value, PartitionSpec):
        return value
    if isinstance(value, str | tuple):
        return PartitionSpec(value)
    raise TypeError(
        "`Policy(batch=...)` must be a `PartitionSpec`, a mesh axis name or None, "
        f"got {value!r}."
    )


def current_mesh() -> AnyMesh | None:
    """The mesh of `jax.set_mesh`, concrete if there is one, or None."""
    meshes = (jax.sharding.get_mesh(), jax.sharding.get_abstract_mesh())
    return next((mesh for mesh in meshes if not mesh.empty), None)


def normalise(spec: PartitionSpec, ndim: int, full: bool = True) -> PartitionSpec:
    """`spec` in one spelling, so that equal layouts compare (and hit `jax.jit`'s cache)
    equal.

    The full spelling has one entry per dimension: `P('x')` of a 3-D leaf is `P('x',
    None, None)`. A jitted function returns it so over a mesh with `Explicit` axes. With
    `full=False`, trailing `None`s are left out, as it returns it over `Auto` axes.
    """
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    if not full:
        while entries and entries[-1] is None:
            entries = entries[:-1]
    return PartitionSpec(*entries)


def check_spec(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    mesh: AnyMesh,
    what: str,
    undivided_link: str = "",
) -> None:
    """Raises a `ValueError` naming `what` unless `spec` can lay out an array of `shape`
    on `mesh`.

    That needs known axes, each used once, each dividing its dimension. An axis that
    does not divide its dimension ends with `undivided_link` (a batch's). Otherwise it
    ends with the catalogue's link for a leaf.
    """
    sizes = dict(mesh.shape)
    if len(spec) > len(shape):
        raise ValueError(
            f"{what} has shape {shape} but is given {spec}, with {len(spec)} "
            "entries. Give one per dimension at most." + see(74)
        )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        names = axis_names(entry)
        for name in names:
            if name not in sizes:
                raise ValueError(
                    f"{what} is given {spec}, but the mesh has no axis {name!r}; its "
                    f"axes are {sizes}. Name one of them." + see(71)
                )
            if name in seen:
                raise ValueError(
                    f"{what} is given {spec}, which uses mesh axis {name!r} twice. "
                    "Each axis can split one dimension." + see(74)
                )
            seen.add(name)
        parts = math.prod(sizes[n] for n in names)
        if shape[dim] % parts:
            raise ValueError(
                f"{what} has shape {shape}; {spec} splits dimension {dim} into "
                f"{parts} parts, which does not divide it. Pad it."
                + (undivided_link or see(72))
            )


def _fsdp_spec(rule: FSDP, leaf: _paths.Leaf, mesh: AnyMesh) -> PartitionSpec | None:
    """The spec `rule` gives `leaf`, in full spelling.

    None if it stays replicated for lack of a divisible dimension.
    """
    sizes = dict(mesh.shape)
    missing = [a for a in axis_names(rule.axis) if a not in sizes]
    if missing:
        raise ValueError(
            f"`Policy(shard=...)`: `FSDP` along {rule.axis!r} for leaf {leaf.path!r}, "
            f"but the mesh has no axis {missing[0]!r}; its axes are {sizes}." + see(71)
        )
    shape, layer_axes = tuple(leaf.value.shape), leaf.layer_axes
    per_layer = shape[layer_axes:]
    if math.prod(per_layer) < rule.min_size or not per_layer:
        return normalise(PartitionSpec(), len(shape))
    parts = math.prod(sizes[a] for a in axis_names(rule.axis))
    divisible = [d for d in range(len(per_layer)) if per_layer[d] % parts == 0]
    if not divisible:
        return None
    # Prefer a dimension whose shard is whole tiles of rows (a TPU compiler stores
    # arrays in tiles of 8 rows of 32 bits, and moves host-resident layers of other
    # shapes only sometimes), then the largest, then the first.
    tile = _tiling.SUBLANES * _tiling.packing(leaf.value.dtype)
    best = max(
        divisible, key=lambda d: ((per_layer[d] // parts) % tile == 0, per_layer[d], -d)
    )
    entries: list[Any] = [None] * len(shape)
    entries[layer_axes + best] = rule.axis
    return PartitionSpec(*entries)


def rule_of(path: str, rules: Rules) -> tuple[str, Rule] | None:
    """The (pattern, rule) of `Policy(shard=...)` that applies to the leaf at
    `path` (`_paths.best_match`)."""
    return _paths.best_match(path, rules, "`Policy(shard=...)`", None, see(17))


def row_parts(leaf: _paths.Leaf, policy: Any) -> int:
    """In how many parts `policy.shard` splits `leaf`'s rows (axis 0) over the
    mesh it is traced on: 1 where it does not (never a `Stacked`'s layer axis).
    `policy`: a `Policy`, or None."""
    if policy is None or not policy.shard:
        return 1
    mesh = jax.typeof(leaf.value).sharding.mesh
    found = None if mesh.empty else rule_of(leaf.path, policy.shard)
    if found is None:
        return 1
    spec = specs([leaf], (found,), mesh, False, policy.host_tables)[0]
    return math.prod(dict(mesh.shape)[a] for a in axis_names(spec[0] if spec else None))


def explicit_mesh(mesh: AnyMesh) -> bool:
    """Whether `mesh` has `Explicit` axes."""
    return not mesh.empty and AxisType.Explicit in mesh.axis_types


def explicit_axes() -> bool:
    """Whether the current trace runs over a mesh with `Explicit` axes."""
    return explicit_mesh(jax.sharding.get_abstract_mesh())


def traced_spec(x: Any) -> PartitionSpec:
    """The spec of `x` inside a trace, in full spelling."""
    return normalise(jax.typeof(x).sharding.spec, x.ndim)


def on_auto_axes(fn: Any, out_sharding: Any) -> Any:
    """`fn`, to be called inside a trace, run on `Auto` axes where the mesh has
    `Explicit` ones.

    There the partitioner lays out its loops, which index and add with ids split over
    the batch axes. It returns `out_sharding` (one `PartitionSpec` per output). Anywhere
    else it is `fn` itself.
    """
    if not explicit_axes():
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=out_sharding)


def gather_fsdp(tree: Any, prefix: str, rules: Rules | None) -> Any:
    """The leaves an `FSDP` rule shards, gathered, inside a trace over a mesh with
    `Explicit` axes.

    These are the array leaves of `tree` at paths under `prefix`. They are resharded
    without the FSDP axes, as FSDP computes with whole weights. Their gradients come
    back sharded, by the transpose: a reduce-scatter. Under `Auto` axes the partitioner
    decides, and nothing changes.
    """
    if rules is None or not explicit_axes():
        return tree
    if not any(isinstance(rule, FSDP) for _, rule in rules):
        return tree

    def gather(path: str, x: Any) -> Any:
        found = rule_of(path, rules)
        if found is None or not isinstance(found[1], FSDP):
            return x
        axes = set(axis_names(found[1].axis))
        spec = jax.typeof(x).sharding.spec
        kept = (tuple(n for n in axis_names(e) if n not in axes) for e in spec)
        want = PartitionSpec(*(n[0] if len(n) == 1 else n or None for n in kept))
        if want == spec:
            return x
        # The barrier keeps the gather of this layer inside the scan: without it the
        # TPU compiler gathers every layer of a host-resident stack at once, in host
        # memory, before the loop.
        return jax.sharding.reshard(jax.lax.optimization_barrier(x), want)

    out = [gather(_paths.join(prefix, x.path), x.value) for x in _paths.leaves(tree)]
    return jtu.tree_unflatten(jtu.tree_structure(tree), out)


def specs(
    leaves: list[_paths.Leaf],
    rules: Rules | None,
    mesh: AnyMesh,
    warn: bool = True,
    host_tables: tuple[str, ...] = (),
) -> list[PartitionSpec | None]:
    """The spec the rules give each leaf, in full spelling.

    `None`: no rule matches it, so it keeps its layout. Where several patterns match,
    the one with the most literal characters wins. Problems are reported naming the
    leaf. They are a pattern that matches no leaf, and a spec that cannot apply. For
    `FSDP`, a large leaf with no divisible dimension gives a warning.

    `host_tables`: the `Policy(host_tables=...)` patterns. A table read by blocks of
    rows from the host stays whole on every device. `FSDP` leaves it replicated, and a
    spec that splits it is an error. (The TPU compiler cannot read row blocks of a host
    table split over chips.)
    """
    if rules is None:
        return [None] * len(leaves)
    where, paths = "`Policy(shard=...)`", [leaf.path for leaf in leaves]
    found = _paths.best_matches(paths, rules, where, (see(17), see(75)))
    out: list[PartitionSpec | None] = []
    undivided = []
    for leaf, best in zip(leaves, found):
        spec = None if best is None else _spec(leaf, best, mesh, host_tables)
        if best is not None and spec is None:
            undivided.append(f"{leaf.path} {tuple(leaf.value.shape)}")
            spec = normalise(PartitionSpec(), len(leaf.value.shape))
        out.append(spec)
    if undivided and warn:
        warn_at_caller(
            f"{where}: `FSDP` leaves {_paths.quoted(undivided)} "
            "replicated: no dimension is divisible by the mesh axis. Pad them, or "
            "give them a spec or `FSDP(min_size=...)` to say so." + see(80)
        )
    return out


def _spec(
    leaf: _paths.Leaf, best: tuple[str, Rule], mesh: AnyMesh, tables: tuple[str, ...]
) -> PartitionSpec | None:
    """The spec `best`, a (pattern, rule) pair, gives `leaf`, in full spelling
    (`specs`). `tables`: the `Policy(host_tables=...)` patterns.

    None for an `FSDP` leaf with no divisible dimension.
    """
    (pattern, rule), shape = best, tuple(leaf.value.shape)
    if not leaf.layer_axes and _paths.under(leaf.path, tables):
        if isinstance(rule, FSDP) or not any(axis_names(e) for e in rule):
            return normalise(PartitionSpec(), len(shape))
        raise ValueError(
            f"`Policy(shard=...)`: leaf {leaf.path!r} is streamed from the host, "
            f"but {pattern!r} splits it. Give it `PartitionSpec()`." + see(103)
        )
    if isinstance(rule, FSDP):
        return _fsdp_spec(rule, leaf, mesh)
    what = f"`Policy(shard=...)`: leaf {leaf.path!r}"
    per_layer = shape[leaf.layer_axes :]
    if leaf.layer_axes and len(rule) > len(per_layer):
        raise ValueError(
            f"{what} is in a `Stacked` and has shape {per_layer} per layer, but is "
            f"given {rule}: drop the entry for the layer axis." + see(73)
        )
    check_spec(rule, per_layer, mesh, what)
    return normalise(PartitionSpec(*(None,) * leaf.layer_axes, *rule), len(shape))
