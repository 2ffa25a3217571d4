"""Gradient taps: where a parameter enters the computation.

A tap gives the value the loss sees, cast to the compute dtype. It sends the
gradient that leaves it to an accumulator, in the master dtype.

A step with micro-batches or a compute dtype differentiates its loss with respect
to one *accumulator* per trainable leaf, not the model. The loss sees each
parameter through `tap(value, acc)`, which returns `value` in the compute dtype.
Its gradient rule sends the parameter's gradient to `acc`, cast to the
accumulator's dtype. After the first micro-batch, it is added to the
accumulator's old value. The tap sits right after the parameter is moved to the
device. For a leaf of a `Stacked`, that is inside the scan body, one layer at a
time. So a host-resident accumulator is read and written one layer at a time, in
the backward pass, on the device: host memory cannot be computed on. And a bf16
copy is what moves to the device, not the fp32 master.

The taps of a call are a table from leaf path to `Tap`. `taps(...)` makes it
current while the loss is traced. `filter_offload` (`_transform.py`) applies the
taps to the model's leaves outside any `Stacked`. A configured `Stacked`
(`_stacked.py`) applies them to its layers' leaves, one layer slice at a time.
"""

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _tiling
from ._memory_kinds import is_host, to_space


class Tap(NamedTuple):
    """How the loss sees one trainable leaf, and where its gradient goes (a pytree:
    `acc` and a traced `read` are its array leaves)."""

    acc: Any  # receives the gradient (its cotangent); the leaf's shape
    dtype: Any  # what the loss computes with
    read: Any  # False, or a traced bool: add the gradient to `acc`'s value
    shards: int = 1  # in how many parts the mesh splits its rows (`_layout.row_parts`)


_CURRENT: contextvars.ContextVar[dict[str, Tap] | None] = contextvars.ContextVar(
    "eqx_offload_taps", default=None
)


@contextlib.contextmanager
def taps(table: dict[str, Tap] | None) -> Iterator[None]:
    """Makes `table` the current taps.

    None means no taps: inside a layer body, the enclosing `Stacked` has tapped
    the leaves already.
    """
    token = _CURRENT.set(table)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> dict[str, Tap] | None:
    return _CURRENT.get()


def lookup(path: str) -> Tap | None:
    """The tap of the leaf at `path`, or None.

    A leaf the loss never reaches through its tap gets a zero gradient, as it
    would without one.
    """
    table = _CURRENT.get()
    return None if table is None else table.get(path)


def tap(
    value: Any, acc: Any, dtype: Any, read: Any, shards: int = 1, *, layer: bool = False
) -> Any:
    """`value` cast to `dtype`, whose gradient goes to `acc`.

    The gradient is cast to `acc.dtype`, plus `acc` if `read`. It becomes the
    gradient of `acc`, and `value` gets none.

    `value` is on the device. `acc` has the same shape and sharding, in its memory
    kind; for a `Stacked`, it is one layer's slice. A host-resident `acc` is read
    onto the device in the backward pass, when its gradient is known. The new
    value goes back to the host. `read` is `False`: never read, in the first
    micro-batch or a step without micro-batches. Or it is a traced boolean, read
    when true, inside the loop over micro-batches. `shards`: `acc`'s rows are split
    in that many parts over the mesh; each chip adds into its own part.

    `layer`: `acc` is one layer's slice inside a `Stacked`'s scan. It is added
    whole, however large. The layer is the unit the scan moves: its weights are on
    the device whole already. And XLA's host-offload passes reject a loop over
    blocks of rows nested in the scan's backward pass, for a layer of 64 MiB or
    more. On `tpu-v5e` the message is "The async-start expects the shape of
    operand 3 to match"; on `gpu-h100`, "Expected instruction to have shape equal
    to". A large leaf outside every `Stacked` (an embedding) is added a block of
    rows at a time.
    """
    static = (read is not False, layer, jnp.dtype(dtype), jnp.dtype(acc.dtype), shards)
    return _tap(static, value, acc, jnp.asarray(read))


def _forward(static: tuple, value: Any, acc: Any, flag: Any) -> Any:
    del acc, flag
    return value.astype(static[2])


def _forward_rule(static: tuple, value: Any, acc: Any, flag: Any) -> tuple[Any, Any]:
    out = _forward(static, value, acc, flag)
    # A streamed table's gradient arrives on the host: it is cast (and added) into
    # `acc` block by block, so `acc` is kept as the buffer.
    keep = static[0] or is_host(value)  # (`static[0]`: `acc` is read)
    return out, (acc if keep else None, flag, is_host(acc))


def _backward_rule(static: tuple, residual: tuple, g: Any) -> tuple[None, Any, None]:
    reads, layer, _, acc_dtype, shards = static
    acc, flag, host = residual
    if is_host(g):
        blocks = _tiling.row_blocks(acc.shape, g.dtype, _tiling.PIECE_BYTES)
        return None, _add_by_blocks(g, acc, flag if reads else False, blocks), None
    g = g.astype(acc_dtype)
    if not reads:
        return None, to_space(g, "pinned_host" if host else "device", ""), None
    if not host:  # (no barrier: the cast and the sum fuse, in place in `acc`)
        return None, g + jnp.where(flag, acc, 0), None
    # Read when the gradient is known: without the barrier the compiler starts
    # the transfer with the forward pass and keeps it on the device throughout.
    g, acc = jax.lax.optimization_barrier((g, acc))
    blocks = _tiling.chip_blocks(acc.shape, acc.dtype, shards)
    if layer or blocks < 2:
        return None, _add_whole(g, acc, flag), None
    whole = {p: _add_whole for p in _tiling.WHOLE_ON}
    by_blocks = functools.partial(_add_by_blocks, blocks=blocks, shards=shards)
    total = jax.lax.platform_dependent(g, acc, flag, **whole, default=by_blocks)
    return None, total, None


def _add_whole(g: Any, acc: Any, flag: Any) -> Any:
    acc = jnp.where(flag, to_space(acc, "device", ""), 0)
    return to_space(g + acc, "pinned_host", "")


def _add_by_blocks(g: Any, acc: Any, flag: Any, blocks: int, shards: int = 1) -> Any:
    """`g` cast to `acc`'s dtype, plus `acc` where `flag`, written into the
    host-resident `acc` one block of rows on the device at a time.

    `g` is on the device (a large leaf outside any `Stacked`: an embedding), or on
    the host (a table streamed by `Policy(host_tables=...)`). Where `flag` is
    `False` (never read), `acc` may be the master itself, which the step still
    needs: written into, it would be copied on the host first (host compute). Its
    blocks are then scanned out into a buffer the compiler allocates in host memory.
    Rows split in `shards` parts over the mesh are cut by part (`_tiling.parts`):
    a block is a block of rows of each part, so each chip moves only its own.
    """
    rows, fresh = acc.shape[0] // blocks, flag is False

    def body(carry: Any, index: Any) -> tuple[Any, Any]:
        piece = _tiling.read(g, index, rows, shards)
        piece = to_space(piece, "device", "").astype(acc.dtype)
        if fresh:
            return None, to_space(piece, "pinned_host", "")
        old = to_space(_tiling.read(carry, index, rows, shards), "device", "")
        piece = to_space(piece + jnp.where(flag, old, 0), "pinned_host", "")
        return _tiling.write(carry, piece, index, rows, shards), None

    out, pieces = jax.lax.scan(body, None if fresh else acc, jnp.arange(blocks))
    return pieces.reshape(acc.shape) if fresh else out


_tap = jax.custom_vjp(_forward, nondiff_argnums=(0,))
_tap.defvjp(_forward_rule, _backward_rule)


def seed(value: Any, sums: list, reads: list) -> Any:
    """`value`, unchanged. In the backward pass, each of `sums` gets its own value
    as its cotangent where its `read` is true (zeros where it is `False`).

    `sums` are accumulators a scan carries, read one layer at a time through taps
    with `read=False` (`_scan_body._plain_scan`): their gradients then add into
    the value seeded here, in place, one layer's slice at a time."""
    flags = [jnp.asarray(r) for r in reads]
    return _seed(value, sums, flags)


@jax.custom_vjp
def _seed(value: Any, sums: list, flags: list) -> Any:
    del sums, flags
    return value


def _seed_forward(value: Any, sums: list, flags: list) -> tuple[Any, Any]:
    return value, (sums, flags)


def _seed_backward(residual: Any, g: Any) -> tuple[Any, list, list]:
    sums, flags = residual
    cts = [jnp.where(f, s, jnp.zeros_like(s)) for s, f in zip(sums, flags)]
    return g, cts, [None] * len(flags)


_seed.defvjp(_seed_forward, _seed_backward)
