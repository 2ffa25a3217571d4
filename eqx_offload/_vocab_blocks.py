"""A large `[vocab, dim]` table that stays in host memory inside a step and is read
(and its gradient written) one block of rows at a time: how `embed` and
`chunked_cross_entropy` use a vocabulary table named in `Policy(host_tables=...)`.

Host memory cannot be computed on (a sum, a gather), so every operation on such a
table is a loop over its blocks: read block `i` onto the device, use it, and, in
the backward pass, write block `i` of the gradient back into a host buffer with
`dynamic_update_slice` (in place). Two loops that write gradients for the same table
(a tied embedding's lookup and output projection) cannot add host arrays either:
the lookup returns the table, the head uses the returned one, and the lookup's
backward pass adds its rows into the head's gradient block by block.
"""

from typing import Any

import jax
import jax.numpy as jnp

from . import _checkpoint_name_log, _tiling
from ._memory_kinds import is_host, to_space


# Name scope of every operation that reads a host-resident table by blocks; the
# transform allows a streamed leaf to be used only under it.
SCOPE = "eqx_offload_vocab_blocks"
# One block of the table is at most this large...
BLOCK_BYTES = 32 * 2**20
# ...and one block's `[tokens, rows]` float32 logits (or gradient) too, if possible.
LOGIT_BYTES = 32 * 2**20


def streams(table: Any) -> bool:
    """Whether `table` is read by blocks: it is in host memory (inside a step, only
    a leaf named in `Policy(host_tables=...)` is)."""
    return is_host(table)


def check(table: Any, where: str) -> None:
    """Raises unless `table` can be read by blocks here: inside a `filter_offload`
    function (a step), as a `[vocab, dim]` table of whole tiles."""
    if not _checkpoint_name_log.is_inside():
        # Outside a step no `Policy(host_tables=...)` asked for streaming, and the
        # rest of a host-resident model cannot be computed on there either.
        raise ValueError(
            f"`{where}` was given a host-resident table of shape "
            f"{tuple(table.shape)} outside `filter_offload` (and `train_step`). A "
            "host-resident model is run outside the step with "
            "`eqx.filter_jit(eo.filter_offload(fn, policy))`, which moves the table "
            "to the device where `fn` starts (or reads it by blocks, as the step "
            "does, if `Policy(host_tables=...)` names it); or, if it fits, put the "
            "model on the device with `eo.place(model, eo.Policy(params='device'))`."
        )
    if table.ndim != 2:
        raise ValueError(
            f"`{where}`: a host-resident table must be `[vocab, dim]`, got shape "
            f"{tuple(table.shape)}."
        )
    if rows_per_block(table, 1) == table.shape[0] and table.shape[0] > 1:
        raise ValueError(
            f"`{where}`: the host-resident table of shape {tuple(table.shape)} "
            "cannot be cut into blocks of rows a TPU can move (rows a multiple of "
            f"{_tiling.SUBLANES * _tiling.packing(table.dtype)}, `dim` a multiple "
            f"of {_tiling.LANES}); keep it on the device (remove it from "
            "`Policy(host_tables=...)`) or pad the vocabulary."
        )


def rows_per_block(table: Any, tokens: int) -> int:
    """Rows per block: a block of the table and its `[tokens, rows]` logits each
    about `BLOCK_BYTES`/`LOGIT_BYTES` at most."""
    vocab, dim = table.shape
    limit = min(BLOCK_BYTES, LOGIT_BYTES * dim * table.dtype.itemsize // (4 * tokens))
    blocks = _tiling.row_blocks(table.shape, table.dtype, max(limit, 1))
    return vocab // blocks


def read(table: Any, index: Any, rows: int) -> Any:
    """Block `index` of the host table, on the device."""
    return to_space(_tiling.read(table, index, rows), "device", "")


def write(table: Any, block: Any, index: Any, rows: int) -> Any:
    """The host table with block `index` replaced by the device `block`."""
    return _tiling.write(table, to_space(block, "pinned_host", ""), index, rows)


def loop(body: Any, carry: Any, table: Any, rows: int) -> Any:
    """`body(carry, index, start)` for every block of `table`, in order, under the
    scope the transform recognises."""
    starts = jnp.arange(table.shape[0] // rows) * rows

    def step(carry: Any, xs: tuple) -> tuple[Any, None]:
        index, start = xs
        return body(carry, index, start), None

    blocks = jnp.arange(table.shape[0] // rows)
    return jax.lax.scan(step, carry, (blocks, starts))[0]
