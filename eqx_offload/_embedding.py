"""`embed`: an embedding lookup that also works on a table in host memory.

It hands the table on to a tied output projection.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from . import _layout, _scopes, _vocab_blocks


def embed(
    table: Float[Array, "vocab dim"], tokens: Int[Array, "*tokens"]
) -> tuple[Float[Array, "*tokens dim"], Float[Array, "vocab dim"]]:
    """The rows of `table` at `tokens`, and `table` itself for a tied projection.

    On a device-resident table this is `(table[tokens], table)`. The step may keep
    the table in host memory, with `Policy(host_tables=("embed",))`. It is then
    read one block of rows at a time, so it never exists whole on the device. Its
    gradient is written back to the host block by block. Outside a step, a
    host-resident table is an error. Run the model with
    `eqx.filter_jit(eo.filter_offload(fn, policy))`, as the how-to "Evaluate and
    sample" shows.

    **Tied embeddings.** Pass the *returned* table to the output projection:
    `eo.chunked_cross_entropy(hidden, table, targets)`. The projection's gradient
    then flows into this lookup's backward pass. That pass adds its own rows to it,
    in place. Using `model.embed.weight` a second time would add two host-resident
    gradients. No backend can compute that sum. The step raises an error naming
    the leaf.

    Call it on the whole batch, not inside `jax.vmap`. `tokens` may have any shape.

    **Arguments:**

    - `table`: the embedding, `[vocab, dim]`.
    - `tokens`: integer token ids, any shape. Ids outside `[0, vocab)` give zeros
        on a table in host memory. No block holds them.

    **Returns:**

    `(embeddings, table)`: `[*tokens, dim]` in `table`'s dtype, and the table.

    !!! Example

        ```python
        def loss_fn(model, tokens, targets):
            h, table = eo.embed(model.embed.weight, tokens)  # [batch, seq, dim]
            hidden = jax.vmap(model.trunk)(h)
            return eo.chunked_cross_entropy(hidden, table, targets)
        ```
    """
    if table.ndim != 2:
        raise ValueError(
            f"`embed`: `table` must be `[vocab, dim]`, got shape {tuple(table.shape)}."
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"`embed`: `tokens` must be integer ids, got {tokens.dtype}.")
    found = PartitionSpec(*_layout.traced_spec(tokens), None)  # laid out as the ids are
    if not _vocab_blocks.streams(table, "embed"):
        return _layout.on_auto_axes(_take, found)(table, tokens), table
    with jax.named_scope(_scopes.VOCAB_BLOCKS):
        lookup = _layout.on_auto_axes(_streamed, (found, _layout.traced_spec(table)))
        return lookup(table, tokens)


def _take(table: Any, tokens: Any) -> Any:
    return table[tokens]


def _lookup(table: Any, tokens: Any) -> Any:
    flat = tokens.reshape(-1)
    rows = _vocab_blocks.rows_per_block(table, flat.size)

    def body(out: Any, index: Any, start: Any) -> Any:
        block = _vocab_blocks.read(table, index, rows)
        local = flat - start
        hit = (local >= 0) & (local < rows)
        found = jnp.take(block, jnp.clip(local, 0, rows - 1), axis=0)
        return jnp.where(hit[:, None], found, out), None

    zero = jnp.zeros((flat.size, table.shape[1]), table.dtype)
    out, _ = _vocab_blocks.loop(body, zero, table, rows)
    return out.reshape(*tokens.shape, table.shape[1])


@jax.custom_vjp
def _streamed(table: Any, tokens: Any) -> tuple[Any, Any]:
    return _lookup(table, tokens), table


def _forward(table: Any, tokens: Any) -> tuple[tuple[Any, Any], tuple]:
    table, tokens = table.value, tokens.value
    return (_lookup(table, tokens), table), (table, tokens)


def _backward(residuals: tuple, cotangents: tuple) -> tuple[Any, None]:
    table, tokens = residuals
    d_out, d_table = cotangents
    first = isinstance(d_table, SymbolicZero)  # no tied projection
    if isinstance(d_out, SymbolicZero):
        return (None if first else d_table), None
    flat = tokens.reshape(-1)
    rows = _vocab_blocks.rows_per_block(table, flat.size)
    d_flat = d_out.reshape(flat.size, -1).astype(table.dtype)
    zeros = jnp.zeros((rows, table.shape[1]), table.dtype)

    def body(buffer: Any, index: Any, start: Any) -> tuple[Any, Any]:
        local = flat - start
        local = jnp.where((local >= 0) & (local < rows), local, rows)  # dropped
        if first:  # a new gradient: its blocks are scanned out
            return None, zeros.at[local].add(d_flat, mode="drop")
        block = _vocab_blocks.read(buffer, index, rows)
        block = block.at[local].add(d_flat, mode="drop")
        return _vocab_blocks.write(buffer, block, index, rows), None

    start = None if first else d_table
    with jax.named_scope(_scopes.VOCAB_BLOCKS):  # (last carry, scanned-out blocks)
        return _vocab_blocks.loop(body, start, table, rows)[1 if first else 0], None


_streamed.defvjp(_forward, _backward, symbolic_zeros=True)
