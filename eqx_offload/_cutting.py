"""Cutting a model, its optimizer state and a batch to their first few layers and
examples, as `verify` runs them: the sizes of each leaf's cut, and the cut itself
(a jitted slice that moves only the kept part of a host-resident leaf)."""

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from . import _layout, _mesh, _paths, _tiling
from ._memory_kinds import is_host, kind_of, to_space
from ._policy import Policy
from ._state_dict import layer_axes


def take(x: Any, sizes: tuple[int, ...]) -> Any:
    """The first `sizes[k]` entries of `x` along each axis `k`, on the device. A
    host-resident leaf is cut on the host along axis 0 first where a TPU can slice
    it there (`_tiling.slices_by_layer`), so only the slice moves."""
    cut = [(axis, n) for axis, n in enumerate(sizes) if n < x.shape[axis]]
    if is_host(x) and cut and cut[0][0] == 0 and _tiling.slices_by_layer(x.shape):
        x = jax.lax.slice_in_dim(x, 0, cut[0][1], axis=0)
        cut = cut[1:]
    x = to_space(x, "device", "")
    for axis, n in cut:
        x = jax.lax.slice_in_dim(x, 0, n, axis=axis)
    return x


@functools.partial(jax.jit, static_argnums=1)
def take_all(xs: list[Any], sizes: tuple[tuple[int, ...], ...]) -> list[Any]:
    return [take(x, s) for x, s in zip(xs, sizes)]


def cut(tree: Any, sizes: list[tuple[int, ...] | None]) -> Any:
    """`tree` with each array leaf cut to `sizes` (one entry per leaf; `None` for
    leaves that are not arrays), every array on the device in a new buffer."""
    flat, treedef = jtu.tree_flatten(tree)
    positions = [i for i, x in enumerate(flat) if eqx.is_array(x)]
    cut = take_all(
        [flat[i] for i in positions], tuple(sizes[i] or () for i in positions)
    )
    for i, x in zip(positions, cut):
        flat[i] = x
    return jtu.tree_unflatten(treedef, flat)


def copy_into(tree: Any, like: Any) -> Any:
    """A copy of every array of `tree` (new buffers, which a step may donate), each
    in the memory kind of the matching leaf of `like`."""

    def copy(x: Any, y: Any) -> Any:
        if not eqx.is_array(x):
            return x
        sharding = x.sharding.with_memory_kind(kind_of(y))
        return jax.device_put(x, sharding, may_alias=False)

    return jtu.tree_map(copy, tree, like)


def model_sizes(model: PyTree, layers: int | None) -> list[tuple[int, ...] | None]:
    """The cut of each leaf: every `Stacked` (each of its leaves' leading layer
    axes) to its first `layers` layers."""
    out: list[tuple[int, ...] | None] = []
    for x, depth in zip(jtu.tree_leaves(model), layer_axes(model)):
        if not eqx.is_array(x):
            out.append(None)
        elif layers is None:
            out.append(tuple(x.shape))
        else:
            sizes = tuple(min(n, layers) for n in x.shape[:depth])
            out.append(sizes + tuple(x.shape[depth:]))
    return out


def state_sizes(
    optimizer: optax.GradientTransformation, opt_state: PyTree, small_params: PyTree
) -> list[tuple[int, ...] | None]:
    """The cut of each optimizer-state leaf: to the shape `optimizer.init` gives for
    the sliced parameters, keeping the first entries of each axis that shrinks
    (the layers kept). Parameter-shaped state is cut with its parameter; a factored
    moment (`optax.adafactor`) along its layer axis."""
    expected = jax.eval_shape(optimizer.init, small_params)
    flat, treedef = jtu.tree_flatten(opt_state)
    flat_expected, expected_def = jtu.tree_flatten(expected)
    if treedef != expected_def:
        raise ValueError(
            "`verify`: `opt_state` does not have the structure `optimizer.init` "
            "gives for the model; create it with "
            "`eqx_offload.init_opt_state(optimizer, model, policy)`."
        )
    out: list[tuple[int, ...] | None] = []
    for leaf, x, e in zip(_paths.leaves(opt_state), flat, flat_expected):
        if not eqx.is_array(x):
            out.append(None)
            continue
        shape = tuple(getattr(e, "shape", ()))
        if len(shape) != x.ndim or any(a > b for a, b in zip(shape, x.shape)):
            raise ValueError(
                f"`verify`: optimizer state leaf {leaf.path!r} has shape "
                f"{tuple(x.shape)}, which cannot be cut to the {shape} that "
                "`optimizer.init` gives for the sliced model; verify with "
                "`layers=None` (the whole model)."
            )
        out.append(shape)
    return out


def whole_parts(microbatch: int | None, policy: Policy, model: PyTree) -> int | None:
    """`microbatch` rounded up to a multiple of the parts `Policy(batch=...)` splits
    the leading dimension into, so that the cut batch can be laid out."""
    mesh = _mesh.tree_mesh(model)
    if microbatch is None or policy.batch is None or not len(policy.batch):
        return microbatch
    if mesh is None:
        return microbatch
    names = _layout.axis_names(policy.batch[0])
    parts = math.prod(dict(mesh.shape).get(n, 1) for n in names)
    return -(-microbatch // parts) * parts


def batch_sizes(batch: tuple, microbatch: int | None) -> list[tuple[int, ...] | None]:
    out: list[tuple[int, ...] | None] = []
    for x in jtu.tree_leaves(batch):
        if not eqx.is_array(x):
            out.append(None)
        elif microbatch is None or x.ndim == 0:
            out.append(tuple(x.shape))
        else:
            out.append((min(x.shape[0], microbatch),) + tuple(x.shape[1:]))
    return out


def examples(batch: tuple) -> int | None:
    """The leading axis of the batch's arrays (the largest, if they differ)."""
    sizes = [x.shape[0] for x in jtu.tree_leaves(batch) if eqx.is_array(x) and x.ndim]
    return max(sizes, default=None)
