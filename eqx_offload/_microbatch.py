"""The gradient of a step taken in micro-batches, or in a compute dtype.

The batch is split along its leading axis, and a `lax.scan` runs over the parts.
Each parameter's gradient is accumulated where the loss reads it from
(`_grad_taps.py`): a host-resident parameter's on the host, or on the device
beside its compute copy when the policy keeps the copy there.

Micro-batch `i` of `k` holds the examples `i, i + k, i + 2k, ...`. A batch laid
out over a mesh is in contiguous blocks. Each device then keeps its share of every
micro-batch, and nothing moves between devices to split it.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from . import _grad_taps, _paths, _tiling
from ._errors import see
from ._layout import axis_names, row_parts
from ._memory_kinds import is_arraylike, is_host, to_space


def check_unsplit(unsplit: Any, microbatches: Any, where: str) -> tuple[int, ...]:
    """Validates `train_step`'s `microbatches` and `unsplit` arguments."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int):
        raise TypeError(
            f"{where}: `microbatches` must be a positive int, got {microbatches!r}."
        )
    if microbatches < 1:
        raise ValueError(f"{where}: `microbatches` must be >= 1, got {microbatches}.")
    if isinstance(unsplit, int):
        unsplit = (unsplit,)
    if not isinstance(unsplit, Sequence) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in unsplit
    ):
        raise TypeError(
            f"{where}: `unsplit` must be batch argument positions, got {unsplit!r}. "
            "Position 0 is the argument after `opt_state`."
        )
    if unsplit and microbatches == 1:
        raise ValueError(
            f"{where}: `unsplit={tuple(unsplit)!r}` has no effect without "
            "`microbatches`. Drop it, or give `microbatches=k` with k > 1." + see(86)
        )
    return tuple(unsplit)


def _parts(x: Any) -> int:
    """How many blocks a leaf's leading axis is laid out in over its mesh."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.spec:
        return 1
    axes = axis_names(sharding.spec[0])
    return math.prod(sharding.mesh.shape[a] for a in axes)


def check(
    batch: tuple, k: int, unsplit: tuple[int, ...], where: str, undivided_link: str = ""
) -> None:
    """Raises unless every batch array splits into `k` micro-batches.

    The arguments in `unsplit` are not split. An array laid out over a mesh must
    split into micro-batches of whole blocks. The error names the argument and
    the fix. One that does not split ends with `undivided_link` (`verify`'s), or
    else with the catalogue's link for `train_step`.
    """
    for i in unsplit:
        if i >= len(batch):
            raise ValueError(
                f"{where}: `unsplit` names batch argument {i}, but the step was "
                f"given {len(batch)} batch argument(s)." + see(86)
            )
    for position, arg in enumerate(batch):
        if position in unsplit:
            continue
        for leaf in _paths.leaves(arg):
            x = leaf.value
            if not is_arraylike(x):
                continue
            name = f"batch argument {position}" + (
                f" ({leaf.path})" if leaf.path else ""
            )
            if x.ndim == 0:
                raise ValueError(
                    f"{where}: {name} is a scalar, which cannot be split into {k} "
                    f"micro-batches. Pass it whole: `unsplit=({position},)`." + see(85)
                )
            parts = _parts(x)
            if x.shape[0] % (k * parts):
                laid = f" (laid out in {parts} blocks)" if parts > 1 else ""
                raise ValueError(
                    f"{where}: {name} has leading axis {x.shape[0]}{laid}, which does "
                    f"not split into {k} micro-batches"
                    + (" of whole blocks" if parts > 1 else "")
                    + f". Give a batch whose size is a multiple of {k * parts}, "
                    "another `microbatches`, or pass it whole with "
                    f"`unsplit=({position},)`."
                    + (undivided_link or see(87 if parts > 1 else 84))
                )


def split(batch: tuple, k: int, unsplit: tuple[int, ...]) -> tuple:
    """The batch arguments with a leading axis of `k` micro-batches: scan inputs.

    The arguments in `unsplit` are None: they are passed whole to each.
    """

    def strided(x: Any) -> Any:
        if not is_arraylike(x):
            return x
        y = x.reshape((x.shape[0] // k, k) + x.shape[1:])
        return jnp.moveaxis(y, 1, 0)

    return tuple(
        None if position in unsplit else jtu.tree_map(strided, arg)
        for position, arg in enumerate(batch)
    )


def _by_place(
    leaves: list, dtypes: list, k: int, host_tables: tuple[str, ...], copies: dict
) -> tuple[list, list, set[str]]:
    """The trainable leaves, each with its dtype, by where the gradient adds up:
    `(tapped, plain, moved)`. `tapped` add up through a tap, where the loss reads
    them; `plain` on the device. `moved` are the host-resident paths of `plain`,
    sent to the host at the end.

    A host-resident leaf's gradient adds up on the device (`moved`) over several
    micro-batches if it is outside every `Stacked`, not a host table, read by the
    loss from the host (`copies`: its compute copy, else itself), and its minor
    dimensions are not whole TPU tiles."""

    def moved(leaf: _paths.Leaf, dtype: Any) -> bool:
        x, whole_tiles = leaf.value, _tiling.whole_tiles
        return (
            is_host(x)
            and is_host(copies[leaf.path])
            and k > 1
            and leaf.stacked is None
            and not _paths.under(leaf.path, host_tables)
            and not (whole_tiles(x.shape, x.dtype) and whole_tiles(x.shape, dtype))
        )

    to_device = {leaf.path for leaf, d in zip(leaves, dtypes) if moved(leaf, d)}
    host = [is_host(leaf.value) and leaf.path not in to_device for leaf in leaves]
    tapped = [(leaf, d) for leaf, d, h in zip(leaves, dtypes, host) if h]
    plain = [(leaf, d) for leaf, d, h in zip(leaves, dtypes, host) if not h]
    return tapped, plain, to_device


def _accumulator(leaf: _paths.Leaf, source: Any) -> Any:
    """The accumulator of a host-resident leaf's gradient over micro-batches.

    Where the loss reads the leaf from the device (its compute copy is kept
    there), its gradient adds up on the device too, in the master's dtype: zeros
    beside the copy. Nothing then crosses to the host per micro-batch. Else it
    adds up on the host, starting as the master: the first micro-batch does not
    read it.
    """
    return leaf.value if is_host(source) else jnp.zeros_like(source, leaf.value.dtype)


def _loop(
    grad: Callable, accs: tuple, batch: tuple, k: int, unsplit: tuple, on_host: bool
) -> tuple:
    """One loop over every micro-batch: `(value, aux), (host grads, device grads)`.

    `grad(accs, arguments, read)` is one micro-batch's, of `accs`: `(masters,
    device_params)`. The first micro-batch does not read the host accumulators.
    They start as the masters, any value of their shape and placement, so nothing
    is zero-initialised on the host. The device accumulators start at zero.
    """
    masters, device_params = accs
    parts = split(batch, k, unsplit)

    def arguments(part: tuple) -> tuple:
        return tuple(
            whole if p is None else p for whole, p in zip(batch, part, strict=True)
        )

    def body(carry: tuple, part: tuple, read: Any = None) -> tuple:
        (accs, device_grads), total, index = carry
        read = index > 0 if read is None else read
        (_, (value, aux)), (accs, new) = grad(accs, arguments(part), read)
        device_grads = [a + b for a, b in zip(device_grads, new, strict=True)]
        return ((accs, device_grads), total + value, index + 1), aux

    zeros = [jnp.zeros_like(x) for x in device_params]
    init = ((masters, zeros), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    if on_host:
        # The first micro-batch before the loop: its gradients start the host
        # accumulators. Started as the masters, the loop's accumulators and
        # the masters are both operands of the host update, and the TPU
        # compiler fails to alias them ("output index {0} is already aliased
        # with param 0"). (Peeled alike, accumulators on the host would be read
        # back k - 1 times, not k, but the step would hold a second copy of the
        # loss's buffers: 45% more device memory at k = 2 on the GPT of
        # `benchmarks/microbatch.py`.)
        init, aux_first = body(init, jtu.tree_map(lambda p: p[0], parts), False)
        parts = jtu.tree_map(lambda p: p[1:], parts)
    (grads, total, _), aux = jax.lax.scan(body, init, parts)
    if on_host:
        aux = jtu.tree_map(
            lambda a, b: jnp.concatenate([jnp.asarray(a)[None], b]), aux_first, aux
        )
    return (total / k, aux), grads


def value_and_grad(
    loss: Callable,
    sources: PyTree,
    params: PyTree,
    dtypes: list,
    batch: tuple,
    k: int,
    unsplit: tuple[int, ...],
    has_aux: bool,
    host_tables: tuple[str, ...] = (),
    on_host: bool = False,
    policy: Any = None,
) -> tuple[Any, PyTree]:
    """The loss and its gradient with respect to `params`, over `k` micro-batches.

    `params` is the trainable part of the model. The loss sees the model
    `sources`: the model, with compute copies in place of their parameters. Each
    trainable leaf is in its dtype from `dtypes`, one per array leaf of `params`.
    `host_tables` are the `Policy(host_tables=...)` patterns: tables the loss
    reads from the host. `on_host` says the update runs on the host
    (`Policy(update="host")`). `policy`: the step's, whose `shard` rules split
    the accumulators' rows over the mesh (`_layout.row_parts`).
    Without micro-batches, a host-resident parameter with a compute copy gets its
    gradient in the compute dtype; the update casts it.

    A host-resident parameter's gradient is accumulated where the loss uses it,
    through a tap (`_grad_taps.py`): one layer at a time. Where its compute copy
    is on the device, the accumulator is too, in the master's dtype, and nothing
    crosses the host link per micro-batch. Else it is read from and written back
    to the host. A parameter on the device is differentiated as usual, and
    its gradient added to a device accumulator. So is, over several
    micro-batches, a host-resident leaf outside every `Stacked`, read from the host
    (no compute copy on the device), whose minor dimensions are not whole TPU tiles
    (`_tiling.whole_tiles`), such as a `(vocab, 96)` head. The step moves it to the
    device whole anyway, and the TPU compiler cannot read such an accumulator back
    from the host in the loop. Its gradient goes to the host once, after the last
    micro-batch.

    The gradient of each leaf is in its dtype and memory kind. The loss (and its
    gradient) is the mean over micro-batches, each weighted `1 / k`. With
    `has_aux` and `k > 1`, the aux of every micro-batch comes back stacked
    (leading axis `k`).
    """
    leaves = [leaf for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    model_leaves = _paths.leaves(sources)
    copies = {leaf.path: leaf.value for leaf in model_leaves}
    tapped, plain, moved = _by_place(leaves, dtypes, k, host_tables, copies)
    device_params = [to_space(leaf.value, "device", "") for leaf, _ in plain]
    shards = [row_parts(leaf, policy) for leaf, _ in tapped]

    def run(wrt: tuple, arguments: tuple, read: Any) -> tuple[Any, Any]:
        """The loss of one micro-batch, of `wrt`: `(accs, device_params)`, the host
        accumulators of the tapped leaves and the device leaves. `read` says
        whether the taps add to the accumulators."""
        accs, device_params = wrt
        table = {
            leaf.path: _grad_taps.Tap(acc, dtype, read, parts)
            for (leaf, dtype), acc, parts in zip(tapped, accs, shards, strict=True)
        }
        cast = {
            leaf.path: x.astype(dtype)
            for (leaf, dtype), x in zip(plain, device_params, strict=True)
        }
        model = jtu.tree_unflatten(
            jtu.tree_structure(sources),
            [cast.get(leaf.path, leaf.value) for leaf in model_leaves],
        )
        with _grad_taps.taps(table):
            out = loss(model, *arguments)
        value, aux = out if has_aux else (out, None)
        return value / k, (value, aux)

    def grad(accs: list, arguments: tuple, read: Any) -> tuple:
        wrt = (accs, device_params)
        out, (sums, new) = jax.value_and_grad(run, has_aux=True)(wrt, arguments, read)
        # A leaf the loss never reaches gets a zero gradient from JAX, on the
        # device: put it where its accumulator lives.
        kinds = ["pinned_host" if is_host(a) else "device" for a in accs]
        return out, ([to_space(a, c, "") for a, c in zip(sums, kinds)], new)

    if k == 1:
        # Each host gradient is received by its compute copy, in the compute dtype
        # (exactly: it is computed in it), where the copy lives (a host copy's
        # crosses to the host once); the update casts it to its master's dtype where
        # it runs. A host table's is not: it is written into its receiver block by
        # block (`_grad_taps._add_by_blocks`).
        receivers = [
            leaf.value
            if _paths.under(leaf.path, host_tables)
            else copies.get(leaf.path, leaf.value)
            for leaf, _ in tapped
        ]
        (_, (value, aux)), grads = grad(receivers, batch, False)
    else:
        accs = (
            [_accumulator(leaf, copies[leaf.path]) for leaf, _ in tapped],
            device_params,
        )
        (value, aux), grads = _loop(grad, accs, batch, k, unsplit, on_host)
    paths = [leaf.path for leaf, _ in tapped + plain]
    by_path = dict(zip(paths, grads[0] + grads[1], strict=True))
    flat = [
        to_space(by_path[leaf.path], "pinned_host", "")
        if leaf.path in moved
        else by_path[leaf.path]
        for leaf in leaves
    ]
    tree = jtu.tree_unflatten(jtu.tree_structure(params), flat)
    return ((value, aux) if has_aux else value), tree
