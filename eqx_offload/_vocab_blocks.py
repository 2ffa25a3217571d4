"""A large `[vocab, dim]` table that stays in host memory inside a step.

It is read, and its gradient written, one block of rows at a time. This is how
`embed` and `chunked_cross_entropy` use a table named in `Policy(host_tables=...)`.

Host memory cannot be computed on (a sum, a gather). So every operation on such a
table is a loop over its blocks. Block `i` is read onto the device and used. In the
backward pass, block `i` of the gradient goes back to the host: scanned out, into
a buffer the compiler allocates there (`loop`). Two loops that write gradients for
the same table cannot add host arrays either: a tied embedding's lookup and output
projection. So the lookup returns the table, and the head uses the returned one.
The lookup's backward pass then adds its rows into the head's gradient, block by
block, in place (`write`).
"""

from typing import Any

import jax
import jax.numpy as jnp

from . import _checkpoint_name_log, _tiling
from ._errors import see
from ._memory_kinds import is_host, to_space


# How a host-resident model runs outside the step.
_RUN_INSIDE = (
    "Run the model with `eqx.filter_jit(eo.filter_offload(fn, policy))`: it moves "
    "the table to the device where `fn` starts, or reads it by blocks if "
    "`Policy(host_tables=...)` names it. If it fits, put the model on the device "
    "with `eo.place(model, eo.Policy(params='device'))`."
)
# One block of the table is at most this large...
BLOCK_BYTES = 32 * 2**20
# ...and one block's `[tokens, rows]` float32 logits (or gradient) too, if possible.
LOGIT_BYTES = 32 * 2**20


def streams(table: Any, where: str) -> bool:
    """Whether `table` is read by blocks, being in host memory.

    Inside a step, only a leaf named in `Policy(host_tables=...)` is. Such a table
    must be read inside a `filter_offload` function (a step), as a table of whole
    tiles, else `where` raises. (Its callers check that it is `[vocab, dim]`.)
    """
    if not is_host(table):
        return False
    if not _checkpoint_name_log.is_inside():
        # Outside a step no `Policy(host_tables=...)` asked for streaming, and the
        # rest of a host-resident model cannot be computed on there either.
        raise ValueError(
            f"`{where}` was given a host-resident table of shape {tuple(table.shape)} "
            "outside `filter_offload` and `train_step`. " + _RUN_INSIDE + see(107)
        )
    if rows_per_block(table, 1) == table.shape[0] and table.shape[0] > 1:
        rows = _tiling.SUBLANES * _tiling.packing(table.dtype)
        raise ValueError(
            f"`{where}`: the host-resident table of shape {tuple(table.shape)} has "
            f"no row blocks a TPU can move ({rows}-row, {_tiling.LANES}-wide tiles). "
            "Drop it from `Policy(host_tables=...)`, or pad the vocabulary." + see(100)
        )
    return True


def rows_per_block(table: Any, tokens: int) -> int:
    """Rows per block: a block of at most `BLOCK_BYTES`, its logits `LOGIT_BYTES`.

    The logits of a block are `[tokens, rows]`.
    """
    vocab, dim = table.shape
    limit = min(BLOCK_BYTES, LOGIT_BYTES * dim * table.dtype.itemsize // (4 * tokens))
    return vocab // _tiling.row_blocks(table.shape, table.dtype, max(limit, 1))


def read(table: Any, index: Any, rows: int) -> Any:
    """Block `index` of the host table, on the device."""
    return to_space(_tiling.read(table, index, rows), "device", "")


def write(table: Any, block: Any, index: Any, rows: int) -> Any:
    """The host table with block `index` replaced by the device `block`."""
    return _tiling.write(table, to_space(block, "pinned_host", ""), index, rows)


def loop(body: Any, carry: Any, table: Any, rows: int) -> tuple[Any, Any]:
    """`body(carry, index, start)` for every block of `table`, in order.

    `body` gives `(carry, block)`. It runs under the scope the transform
    recognises. Returns the last carry and the blocks (a gradient) as one host
    table of `table`'s shape, or `None` where `block` is `None`. Scanned out, the
    blocks go into a buffer the compiler allocates in host memory. Written into a
    buffer made from `table` itself, which the step still needs, they would make
    the compiler copy `table` on the host first: host compute the policy did not
    ask for.
    """
    blocks = jnp.arange(table.shape[0] // rows)

    def step(carry: Any, xs: tuple) -> tuple[Any, Any]:
        carry, block = body(carry, *xs)
        return carry, None if block is None else to_space(block, "pinned_host", "")

    carry, out = jax.lax.scan(step, carry, (blocks, blocks * rows))
    return carry, None if out is None else out.reshape(table.shape)
