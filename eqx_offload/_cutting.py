"""Cutting a model, its optimizer state and a batch to their first few layers and
examples, as `verify` runs them.

This module has the sizes of each leaf's cut, and the cut itself: a jitted slice
that moves only the kept part of a host-resident leaf. It also has the error for a
loss that the cut breaks.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from . import _layout, _mesh, _paths, _tiling
from ._errors import see
from ._memory_kinds import abstract, is_host, kind_of, to_space
from ._policy import Policy
from ._state_dict import layer_axes


# Why a loss fails on the cut `verify` makes, and the fix.
_DEPTH_HELP = (
    "It sizes something by the model's configured depth (e.g. one KV cache per "
    "layer from `config.n_layers`) rather than by the `Stacked` it gets. Size it "
    "by `len(model.blocks)`, or `stacked.scan` over per-layer inputs cut with it. "
    "Or verify every layer with `verify(..., layers=None)`."
)
_BATCH_HELP = (
    "It depends on the batch size (e.g. a shape from a config). Make it follow the "
    "batch's shape, or verify the whole batch with `verify(..., examples=None)`."
)


def take(x: Any, sizes: tuple[int, ...]) -> Any:
    """The first `sizes[k]` entries of `x` along each axis `k`, on the device.

    A host-resident leaf is first cut on the host along axis 0, where a TPU can
    slice it there (`_tiling.slices_by_layer`). Then only the slice moves.
    """
    cut = [(axis, n) for axis, n in enumerate(sizes) if n < x.shape[axis]]
    if is_host(x) and cut and cut[0][0] == 0 and _tiling.slices_by_layer(x.shape):
        x = jax.lax.slice_in_dim(x, 0, cut[0][1], axis=0)
        cut = cut[1:]
    x = to_space(x, "device", "")
    for axis, n in cut:
        x = jax.lax.slice_in_dim(x, 0, n, axis=axis)
    return x


@functools.partial(jax.jit, static_argnums=1)
def _take_all(xs: list[Any], sizes: tuple[tuple[int, ...], ...]) -> list[Any]:
    return [take(x, s) for x, s in zip(xs, sizes)]


def cut(tree: Any, sizes: list[tuple[int, ...] | None]) -> Any:
    """`tree` with each array leaf cut to `sizes`, on the device in a new buffer.

    `sizes` has one entry per leaf: `None` for the leaves that are not arrays.
    """
    arrays, rest = eqx.partition(tree, eqx.is_array)
    shapes = tuple(size for size in sizes if size is not None)
    flat, treedef = jtu.tree_flatten(arrays)
    return eqx.combine(jtu.tree_unflatten(treedef, _take_all(flat, shapes)), rest)


def copy_into(tree: Any, like: Any) -> Any:
    """A copy of every array of `tree`, in the memory kind of its leaf in `like`.

    The copies are new buffers, which a step may donate.
    """

    def copy(x: Any, y: Any) -> Any:
        if not eqx.is_array(x):
            return x
        sharding = x.sharding.with_memory_kind(kind_of(y))
        return jax.device_put(x, sharding, may_alias=False)

    return jtu.tree_map(copy, tree, like)


def model_sizes(model: PyTree, layers: int | None) -> list[tuple[int, ...] | None]:
    """The cut of each leaf: every `Stacked` to its first `layers` layers.

    A `Stacked` leaf is cut along each of its leading layer axes.
    """

    def size(x: Any, depth: int) -> tuple[int, ...] | None:
        if not eqx.is_array(x):
            return None
        if layers is None:
            return tuple(x.shape)
        return tuple(min(n, layers) for n in x.shape[:depth]) + tuple(x.shape[depth:])

    return [size(x, d) for x, d in zip(jtu.tree_leaves(model), layer_axes(model))]


def state_sizes(
    optimizer: optax.GradientTransformation, opt_state: PyTree, small_params: PyTree
) -> list[tuple[int, ...] | None]:
    """The cut of each optimizer-state leaf: the shape `optimizer.init` gives it.

    `optimizer.init` sees the sliced parameters. Each axis that shrinks keeps its
    first entries, the layers kept. Parameter-shaped state is cut with its
    parameter; a factored moment (`optax.adafactor`) along its layer axis.
    `optimizer` is the one the step runs (`_mixed_precision.for_policy`). Under a
    compute dtype, its state holds the compute copies too.
    """
    expected = jax.eval_shape(optimizer.init, small_params)
    if jtu.tree_structure(opt_state) != jtu.tree_structure(expected):
        raise ValueError(
            "`verify`: `opt_state` does not have the structure `optimizer.init` "
            "gives. Build it with `eqx_offload.init_opt_state`." + see(43)
        )

    def size(leaf: _paths.Leaf, e: Any) -> tuple[int, ...] | None:
        x = leaf.value
        if not eqx.is_array(x):
            return None
        shape = tuple(getattr(e, "shape", ()))
        if len(shape) != x.ndim or any(a > b for a, b in zip(shape, x.shape)):
            raise ValueError(
                f"`verify`: optimizer state leaf {leaf.path!r} of shape "
                f"{tuple(x.shape)} cannot be cut to {shape}, its `optimizer.init` "
                "shape. Verify with `layers=None`."
            )
        return shape

    return list(map(size, _paths.leaves(opt_state), jtu.tree_leaves(expected)))


def whole_parts(
    examples: int | None, policy: Policy, model: PyTree, microbatches: int = 1
) -> int | None:
    """`examples` rounded up to whole micro-batches of whole blocks.

    It becomes a multiple of `microbatches` times the parts `Policy(batch=...)`
    splits the leading dimension into. The cut batch can then be laid out, and
    split into the step's micro-batches.
    """
    if examples is None:
        return None
    parts = 1
    mesh = _mesh.tree_mesh(model)
    if mesh is not None and policy.batch is not None and len(policy.batch):
        names = _layout.axis_names(policy.batch[0])
        parts = math.prod(dict(mesh.shape).get(n, 1) for n in names)
    whole = parts * microbatches
    return -(-examples // whole) * whole


def batch_sizes(
    batch: tuple, examples: int | None, unsplit: tuple[int, ...] = ()
) -> list[tuple[int, ...] | None]:
    """The cut of each batch leaf: its first `examples` rows along axis 0.

    The arguments at positions `unsplit` are not cut. They are passed whole to
    every micro-batch, so they are not batch-major.
    """

    def size(x: Any, position: int) -> tuple[int, ...] | None:
        if not eqx.is_array(x):
            return None
        if examples is None or x.ndim == 0 or position in unsplit:
            return tuple(x.shape)
        return (min(x.shape[0], examples),) + tuple(x.shape[1:])

    return [size(x, i) for i, arg in enumerate(batch) for x in jtu.tree_leaves(arg)]


def examples(batch: tuple, unsplit: tuple[int, ...] = ()) -> int | None:
    """The largest leading axis of the batch's arrays, but those in `unsplit`."""
    sizes = [
        x.shape[0]
        for position, argument in enumerate(batch)
        if position not in unsplit
        for x in jtu.tree_leaves(argument)
        if eqx.is_array(x) and x.ndim
    ]
    return max(sizes, default=None)


def _traces(loss_fn: Callable, model: Any, batch: tuple) -> bool:
    """Whether `loss_fn` traces on (abstract, device-resident) `model` and `batch`."""
    try:
        eqx.filter_eval_shape(loss_fn, *abstract((model, *batch), keep_sharding=False))
    except Exception:  # whatever the loss raises: it does not trace
        return False
    return True


def cut_error(
    loss_fn: Callable,
    model: Any,
    batch: tuple,
    small: Any,
    small_batch: tuple,
    layers: int | None,
    examples: int | None,
    error: Exception,
) -> ValueError | None:
    """Why the loss fails on the slice `verify` cut, or `None`.

    The cut is to blame when the loss traces on the whole model and batch. The
    error then names `verify`'s argument and the fix.
    """
    if (layers is None and examples is None) or not _traces(loss_fn, model, batch):
        return None
    if _traces(loss_fn, small, small_batch):
        return None  # it traces on the slice too: the cut is not to blame
    if layers is not None and not _traces(loss_fn, small, batch):
        what = f"the model cut to the first {layers} layer(s) of each `Stacked`"
        argument, how, link = f"layers={layers}", _DEPTH_HELP, see(69)
    else:
        what = f"the batch cut to its first {examples} example(s)"
        argument, how, link = f"examples={examples}", _BATCH_HELP, ""
    return ValueError(
        f"`verify({argument})`: `loss_fn` fails on {what}, though it traces on the "
        f"whole model and batch. {how} It raised {type(error).__name__}: {error}" + link
    )
