"""Per-layer names for the leaves of `Stacked` layers.

State dicts are keyed as the per-layer model was (`blocks.3.mlp.weight`). So weights
saved before a port from `list[Block]` to `Stacked[Block]` still load.

A *state-dict key* is a leaf's path with every segment separated by dots. A
`torch.nn.Module.state_dict` (and so a Hugging Face checkpoint) spells it so. Its
segments are attribute names, string dictionary keys, and sequence indices as numbers. A
leaf inside a `Stacked` gets one key per layer. The layer index is a numeric segment
where the `Stacked` is. Take the stacked leaf `blocks.layers.mlp.weight` (in JAX's key
path) of an 8-layer `Stacked`. Its keys are `blocks.0.mlp.weight` ...
`blocks.7.mlp.weight`, the keys of `blocks: list[Block]`.

The library's own dotted paths (`_paths.py`) name the stacked leaf once. `Policy`
patterns and error messages use them. They leave out the `layers` field and write
indices in brackets: `blocks.mlp.layers[0].weight`. Its keys are
`blocks.<i>.mlp.layers.0.weight`.
"""

import functools
import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import Array, PyTree

from . import _layout, _paths, _tiling
from ._errors import see
from ._memory_kinds import is_arraylike, is_host, kind_of, to_space
from ._pending import check_ready


_LOAD = "`eqx_offload.load_state_dict`"


class LeafIndex(NamedTuple):
    """Where the array of one state-dict key lives in a model."""

    path: str
    """The leaf's dotted path, as the library writes it (`blocks.mlp.weight`)."""
    index: tuple[int, ...]
    """The layer along each enclosing `Stacked`, outermost first (its leading axes);
    `()` for a leaf outside any `Stacked`."""


def _indices(shape: tuple[int, ...], depth: int) -> list[tuple[int, ...]]:
    """Every index of the `depth` leading layer axes of a leaf of `shape`."""
    return list(itertools.product(*map(range, shape[:depth])))


def _key(entry: _paths.Leaf, index: tuple[int, ...]) -> str:
    """The state-dict key of layer `index` of an array leaf: its `segments` with the
    layer indices where the `None`s are."""
    layers = iter(index)
    return ".".join(str(next(layers)) if s is None else s for s in entry.segments)


def layer_axes(tree: Any) -> list[int]:
    """For every leaf of `tree` (in `jax.tree.leaves` order), how many `Stacked` enclose
    it.

    That is the number of its leading layer axes. Axis `k` is the layers of the `k`-th
    enclosing `Stacked`, outermost first.
    """
    return [leaf.layer_axes for leaf in _paths.leaves(tree)]


def _entries(model: Any, where: str) -> list[_paths.Leaf | None]:
    """One entry per leaf of `model` (`None` for a leaf that is not an array)."""
    out: list[_paths.Leaf | None] = []
    seen: dict[str, str] = {}
    for leaf in _paths.leaves(model):
        if not is_arraylike(leaf.value):
            out.append(None)
            continue
        key = _key(leaf, (0,) * leaf.layer_axes)
        if key in seen:
            raise ValueError(
                f"{where}: leaves {seen[key]!r} and {leaf.path!r} both have the "
                f"state-dict key {key!r}. Rename one."
            )
        seen[key] = leaf.path
        out.append(leaf)
    return out


def _per_layer_order(
    entries: list[_paths.Leaf | None],
) -> list[tuple[str, _paths.Leaf, tuple[int, ...]]]:
    """Every `(key, entry, index)`, in the order the per-layer model flattens.

    That is all of layer 0's leaves, then layer 1's, ... (a `Stacked` flattens leaf by
    leaf).
    """
    # A `Stacked`'s leaves are contiguous in flattening order; it sorts where its
    # first leaf is, then by layer, then (recursively) as inside one layer.
    starts: dict[tuple, int] = {}
    rows = []
    for k, entry in enumerate(entries):
        if entry is None:
            continue
        places = [j for j, s in enumerate(entry.segments) if s is None]
        for j in places:
            starts.setdefault(entry.segments[:j], k)
        for index in _indices(entry.value.shape, entry.layer_axes):
            order = []
            for j, i in zip(places, index):
                order += [starts[entry.segments[:j]], i]
            rows.append((tuple(order) + (k,), _key(entry, index), entry, index))
    rows.sort(key=lambda row: row[0])
    return [(key, entry, index) for _, key, entry, index in rows]


def state_dict_keys(model: PyTree) -> dict[str, LeafIndex]:
    """The per-layer state-dict keys of `model`, each with the leaf and layer index
    holding its array.

    **Arguments:**

    - `model`: any pytree, usually an Equinox model holding `Stacked` layers. Array
        leaves (and `jax.ShapeDtypeStruct`s) get keys.

    **Returns:**

    A dict from key (`blocks.3.mlp.weight`) to `LeafIndex(path, index)`. `path` is the
    leaf's dotted path, as `Policy` patterns write it (`blocks.mlp.weight`). `index`
    indexes its leading layer axes (`(3,)`; `()` outside any `Stacked`). The keys come
    in the order the per-layer model flattens in. That is every leaf of layer 0, then of
    layer 1, ... Its inverse, `{v: k for k, v in keys.items()}`, and `state_dict_key` go
    back.

    !!! Example

        ```python
        keys = eo.state_dict_keys(model)
        keys["blocks.3.mlp.layers.0.weight"]
        # LeafIndex(path='blocks.mlp.layers[0].weight', index=(3,))
        ```
    """
    entries = _entries(model, "`eqx_offload.state_dict_keys`")
    return {k: LeafIndex(e.path, i) for k, e, i in _per_layer_order(entries)}


def state_dict_key(model: PyTree, path: str, index: tuple[int, ...] = ()) -> str:
    """The per-layer state-dict key of layer `index` of the leaf at `path`.

    It is the way back from `state_dict_keys`.

    **Arguments:**

    - `model`: the model holding the leaf.
    - `path`: the leaf's dotted path, as the library writes it. E.g.
        `"blocks.mlp.layers[0].weight"`: no `layers` field of a `Stacked`.
    - `index`: one layer index per enclosing `Stacked`, outermost first. `()` for a leaf
        outside any `Stacked`.

    **Returns:**

    The key, e.g. `"blocks.3.mlp.layers.0.weight"`.

    **Raises:**

    `ValueError` if no array leaf has that path, or `index` does not fit its layers.
    """
    where = "`eqx_offload.state_dict_key`"
    entries = [e for e in _entries(model, where) if e is not None]
    for entry in entries:
        if entry.path == path:
            layers = tuple(entry.value.shape[: entry.layer_axes])
            if len(index) != len(layers) or not all(
                0 <= i < n for i, n in zip(index, layers)
            ):
                axes = "axis" if len(layers) == 1 else "axes"
                raise ValueError(
                    f"{where}: leaf {path!r} has {len(layers)} layer {axes} of sizes "
                    f"{layers}; index {index!r} does not fit. One index per `Stacked`."
                )
            return _key(entry, tuple(index))
    raise ValueError(
        f"{where}: no array leaf has path {path!r}. Array leaves are: "
        f"{_paths.quoted([e.path for e in entries])}."
    )


@functools.partial(jax.jit, static_argnums=1)
def _split_layers(x: Any, depth: int) -> list[Any]:
    """Every layer of a stacked leaf, in its memory.

    A TPU slices a host-resident leaf on the host only along one layer axis. The leaf
    needs at least 3 dimensions (`_tiling.slices_by_layer`). Other leaves are small, or
    sliced per layer of the outer axis first. They go to the device to be cut.
    """
    whole = is_host(x) and not (depth == 1 and _tiling.slices_by_layer(x.shape))
    y = to_space(x, "device", "") if whole else x
    return [
        to_space(y[index], "pinned_host", "") if whole else y[index]
        for index in _indices(x.shape, depth)
    ]


def state_dict(model: PyTree) -> dict[str, Array]:
    """The arrays of `model` keyed per layer, as the per-layer model would key them.

    A leaf of a `Stacked` gives one array per layer. Its key has the layer index where
    the `Stacked` is (`blocks.3.mlp.weight`). Other leaves keep their own key
    (`head.weight`). See `state_dict_keys` for the format. Each array stays in its
    leaf's memory kind. A host-resident stacked leaf gives host-resident layers.

    **Arguments:**

    - `model`: any pytree of arrays, usually an Equinox model holding `Stacked` layers.
        Leaves that are not arrays are left out. A model whose update a step left
        pending (`Policy(update_timing="next_forward")`) is refused: pass it through
        `eqx_offload.apply_pending` first.

    **Returns:**

    A dict from key to array, in the order the per-layer model flattens in. Arrays of
    leaves outside any `Stacked` are the model's own. A `train_step` donates them, so
    copy what you keep across a step.

    !!! Example

        ```python
        weights = eo.state_dict(model)  # {'blocks.0.mlp.weight': ..., ...}
        model = eo.load_state_dict(model, weights)
        ```
    """
    check_ready("`eqx_offload.state_dict`", model=model)
    entries = _entries(model, "`eqx_offload.state_dict`")
    arrays: dict[str, Any] = {}
    for entry in entries:
        if entry is None:
            continue
        if not eqx.is_array(entry.value):
            raise TypeError(
                f"`eqx_offload.state_dict`: leaf {entry.path!r} is abstract. Load "
                "weights into it with `load_state_dict`."
            )
        x, depth = entry.value, entry.layer_axes
        if not depth:
            arrays[_key(entry, ())] = x
            continue
        kind = kind_of(x)
        for index, piece in zip(_indices(x.shape, depth), _split_layers(x, depth)):
            if kind_of(piece) != kind:  # `unpinned_host`, which `jit` does not track
                piece = jax.device_put(piece, piece.sharding.with_memory_kind(kind))
            arrays[_key(entry, index)] = piece
    return {key: arrays[key] for key, _, _ in _per_layer_order(entries)}


class _Layout(NamedTuple):
    """What `_join_layers` builds (hashable: a static argument)."""

    shape: tuple[int, ...]
    dtype: Any
    depth: int
    kind: str
    spec: PartitionSpec  # over the mesh in context (none: ignored)


@functools.partial(jax.jit, static_argnums=0)
def _join_layers(layout: _Layout, old: Any, pieces: list[Any]) -> Any:
    """The stacked leaf with layer `i` replaced by `pieces[i]` (kept where `None`).

    The result is in the leaf's memory. Take a host-resident leaf with one layer axis
    and at least 3 dimensions. It is written on the host one layer at a time, as the
    streamed update writes it (`_tiling`). Any other leaf is assembled on the device.
    Over a mesh with `Explicit` axes (in context: `_join_mesh`) it is assembled on
    `Auto` axes. They lay out the writes of a layer into the stack. It is returned as
    `layout.spec`.
    """
    host = layout.kind != "device"
    on_host = host and layout.depth == 1 and _tiling.slices_by_layer(layout.shape)

    def join(old: Any, pieces: list[Any]) -> Any:
        if old is None:
            full = jnp.zeros(layout.shape, layout.dtype)
            full = to_space(full, "pinned_host", "") if on_host else full
        else:
            full = old if on_host else to_space(old, "device", "")
        for index, piece in zip(_indices(layout.shape, layout.depth), pieces):
            if piece is None:
                continue
            if on_host:
                piece = to_space(piece, "pinned_host", "")
                full = jax.lax.dynamic_update_index_in_dim(full, piece, index[0], 0)
            else:
                full = full.at[index].set(to_space(piece, "device", ""))
        return to_space(full, "pinned_host", "") if host else full

    return _layout.on_auto_axes(join, layout.spec)(old, pieces)


def _piece_sharding(sharding: Any, depth: int, kind: str) -> Any:
    """Where one layer's piece of a leaf with `sharding` goes, in memory `kind`."""
    if isinstance(sharding, NamedSharding):
        spec = PartitionSpec(*tuple(sharding.spec)[depth:])
        return NamedSharding(sharding.mesh, spec, memory_kind=kind)
    return SingleDeviceSharding(next(iter(sharding.device_set)), memory_kind=kind)


def _target_sharding(x: Any, path: str) -> Any:
    """Where the array of leaf `x` (at `path`) is created: its sharding.

    An `AbstractMesh` has no devices: it gets the mesh of `jax.set_mesh`. (An abstract
    model made under `jax.set_mesh` has one.)
    """
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    abstract = getattr(sharding, "mesh", None)  # (of a `NamedSharding`)
    if not isinstance(abstract, jax.sharding.AbstractMesh):
        return sharding
    mesh = jax.sharding.get_mesh()
    same = lambda m: (m.axis_names, m.axis_sizes, m.axis_types)  # noqa: E731
    if mesh.empty or same(mesh) != same(abstract):
        context = "none" if mesh.empty else dict(mesh.shape)
        raise ValueError(
            f"{_LOAD}: leaf {path!r} is laid out on an `AbstractMesh` "
            f"{dict(abstract.shape)}; `jax.set_mesh` is {context}. Call "
            "`load_state_dict` inside `with jax.set_mesh(mesh):`." + see(70)
        )
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _join_mesh(sharding: Any) -> Mesh | None:
    """The mesh `_join_layers` runs in for a leaf of `sharding`.

    It is the leaf's mesh if that has `Explicit` axes: JAX traces their sharding types
    under it. Otherwise none. Not the one a caller set: a leaf on one device is not on
    it.
    """
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    return mesh if isinstance(mesh, Mesh) and _layout.explicit_mesh(mesh) else None


def _check_value(key: str, value: Any, shape: tuple, dtype: Any) -> None:
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(
            f"{_LOAD}: state_dict[{key!r}] is a {type(value).__name__}, not an array. "
            "Give a JAX or NumPy array." + see(66)
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{_LOAD}: state_dict[{key!r}] has shape {tuple(value.shape)} but the "
            f"model expects {tuple(shape)}." + see(66)
        )
    if value.dtype != dtype:
        raise ValueError(
            f"{_LOAD}: state_dict[{key!r}] has dtype {value.dtype} but the model "
            f"expects {dtype}. Cast it first." + see(66)
        )


def load_state_dict(
    model: PyTree, state_dict: Mapping[str, Any], *, strict: bool = True
) -> PyTree:
    """`model` with its arrays replaced by those of `state_dict`, keyed per layer.

    It is the inverse of `state_dict`. A per-layer key (`blocks.3.mlp.weight`) writes
    layer 3 of the stacked leaf `blocks.mlp.weight`. So weights saved from the per-layer
    model (`blocks: list[Block]`) load into the ported one (`blocks: Stacked[Block]`).
    Every leaf keeps its memory kind and sharding. A host-resident stacked leaf is
    written on the host, layer by layer. The state dict's arrays are copied, never
    aliased. So a step that donates the model leaves them intact.

    **Arguments:**

    - `model`: the model to load into. Its leaves may be arrays, or
        `jax.ShapeDtypeStruct`s (e.g. `eo.place(eqx.filter_eval_shape(Model, ...),
        policy)`). Then nothing is initialised randomly. Every leaf is created from the
        state dict, in the memory kind of its sharding.
    - `state_dict`: a mapping from key to array (JAX or NumPy). Each array has the
        layer's exact shape and dtype.
    - `strict`: if `True` (the default), every key of the model must be present and no
        other. If `False`, missing keys keep the model's arrays, and unexpected keys are
        ignored.

    **Returns:**

    A model of the same structure, with array leaves.

    **Raises:**

    - `ValueError` naming missing or unexpected keys (with `strict=True`), or a key
        whose shape or dtype differs from the model's;
    - `TypeError` naming a key whose value is not an array.

    !!! Example

        ```python
        # Weights of the per-layer model: {'blocks.0.mlp.weight': ..., ...}
        weights = dict(safetensors.numpy.load_file("model.safetensors"))
        model = eo.place(eqx.filter_eval_shape(Model, key=key), policy)
        model = eo.load_state_dict(model, weights)  # arrays, in their memory kinds
        ```
    """
    flat, treedef = jtu.tree_flatten(model)
    entries = _entries(model, _LOAD)
    assert len(flat) == len(entries)
    expected = {key: entry for key, entry, _ in _per_layer_order(entries)}
    _check_keys(expected, state_dict, strict)
    out = [
        x if entry is None else _load_leaf(x, entry, state_dict)
        for x, entry in zip(flat, entries)
    ]
    return jtu.tree_unflatten(treedef, out)


def _check_keys(
    expected: dict[str, _paths.Leaf], state_dict: Mapping[str, Any], strict: bool
) -> None:
    """Raises naming the missing and unexpected keys (with `strict`; else only the
    missing keys of abstract leaves, which have no arrays to keep)."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected] if strict else []
    abstract = any(not eqx.is_array(expected[k].value) for k in missing)
    if not ((strict and missing) or unexpected or abstract):
        return
    parts = [
        f"{what} keys: {_paths.quoted(keys)}"
        for what, keys in (("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    fix = "Pass `strict=False` to keep the model's arrays for missing keys."
    if abstract:
        fix = "Abstract leaves have no values to keep: give every key, even with "
        fix += "`strict=False`."
    raise ValueError(
        f"{_LOAD}: {'; '.join(parts)}. Keys have layer indices as segments, e.g. "
        f"{next(iter(expected), 'blocks.0.weight')!r} (`state_dict_keys` lists "
        "them). " + fix + see(65 if unexpected else 64)
    )


def _load_leaf(x: Any, entry: _paths.Leaf, state_dict: Mapping[str, Any]) -> Any:
    """The leaf `x` (at `entry`) with the arrays `state_dict` has for its keys, in
    its memory kind and sharding (`x` itself if it has none)."""
    depth = entry.layer_axes
    keys = [_key(entry, index) for index in _indices(x.shape, depth)]
    for key in keys:
        if key in state_dict:
            _check_value(key, state_dict[key], x.shape[depth:], x.dtype)
    pieces = [state_dict.get(key) for key in keys]
    if all(p is None for p in pieces):
        return x
    sharding = _target_sharding(x, entry.path)
    if not depth:
        return jax.device_put(pieces[0], sharding, may_alias=False)
    kind = kind_of(x)
    if kind != "device":
        # Into host memory before the jitted join: its NumPy arguments would
        # otherwise all go to the device at once, the whole stacked leaf.
        target = _piece_sharding(sharding, depth, kind)
        pieces = [None if p is None else jax.device_put(p, target) for p in pieces]
    spec = getattr(sharding, "spec", PartitionSpec())
    layout = _Layout(tuple(x.shape), x.dtype, depth, kind, spec)
    with jax.set_mesh(_join_mesh(sharding)):
        new = _join_layers(layout, x if eqx.is_array(x) else None, pieces)
    return jax.device_put(new, sharding)
