"""Which host-resident arrays a TPU compiler can move to the device a slice at a
time, and how to slice them.

These are the rules behind streaming a `Stacked` layer by layer, and a large leaf
block by block. They apply in the forward and backward passes, and in the
optimizer update.

XLA's TPU backend stores an array in tiles over its two minor dimensions. A tile
is 8 rows ("sublanes") by 128 columns ("lanes") for 32-bit types. Each sublane
packs 2 rows of a 16-bit type, or 4 of an 8-bit type. Its host-offload passes move
slices made of whole tiles along the major dimensions. Checked with libtpu 0.0.42
(`tpu-v5e`, `tpu-v6e`, `tpu-v5p`, `tpu-v4`) on hand-written scans, it rejects:

- one element per layer, a stacked leaf of shape `(layers,)` such as a per-layer
  scalar: "Lane slice updating is not supported in async dynamic update slice";
- one row per layer of a 16- or 8-bit type, such as a stacked bias in bfloat16:
  "Sublane slicing size must be multiple of element packing factor";
- on `tpu-v4`, one row per layer wider than 128 lanes in any type, such as a
  `(layers, 256)` float32 bias. Its transfer is strided, and libtpu aborts the
  process ("Strided host DMA (non iova) is not supported");
- blocks of rows of a 2-D leaf whose row count is not a multiple of the packed
  tile height, or whose last dimension is not a multiple of 128. The compiler may
  then lay the array out transposed, making a row block a lane slice.

The library never asks for these. A stacked leaf with fewer than two dimensions
per layer is small: a bias, a scale. It is moved to the device whole where a step
starts using it, and updated whole. A large leaf without such blocks is updated
whole. The rules hold on every backend, so what the CPU runs is what a TPU
compiles.
"""

import math
from typing import Any

import jax
import numpy as np


LANES = 128
SUBLANES = 8

# A host-resident leaf this large (or larger) is streamed, or added to, in blocks of
# rows of at most this size. Read at call time (`_tiling.PIECE_BYTES`), so that a
# test that patches it here reaches every user.
PIECE_BYTES = 32 * 2**20
# Backends whose memory kinds share one memory: there a large host-resident leaf is
# updated, or added to, whole. Streaming it saves nothing and costs time (XLA's CPU
# backend copies the whole array at every block; `docs/benchmarks/speed.md`).
WHOLE_ON = ("cpu",)


def packing(dtype: Any) -> int:
    """How many elements of `dtype` share one 32-bit sublane row."""
    return max(1, 4 // np.dtype(dtype).itemsize)


def slices_by_layer(shape: tuple[int, ...]) -> bool:
    """Whether a stacked leaf (layers first) can be moved one layer at a time."""
    # A layer of one element is a lane slice; a layer of one row is a sublane
    # slice, which splits a packed sublane (16- and 8-bit types) and, wider than
    # 128 lanes, is a strided transfer that `tpu-v4` cannot do.
    return len(shape) >= 3


def whole_tiles(shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether a leaf's two minor dimensions are whole tiles, or it has fewer.

    Otherwise the TPU compiler may lay it out transposed in host memory. It then
    cannot copy it to the device into the layout an addition there wants. Checked
    with libtpu 0.0.42: a `(vocab, 96)` head read back from the host, inside the
    loop over micro-batches, fails at a `copy-start`. The message is "Expected
    instruction to have shape equal to (f32[256,96]{0,1:...S(5)} ...)".
    """
    if len(shape) < 2:
        return True
    return shape[-1] % LANES == 0 and shape[-2] % (SUBLANES * packing(dtype)) == 0


def row_blocks(shape: tuple[int, ...], dtype: Any, max_bytes: int) -> int:
    """How many equal blocks of rows a large non-stacked leaf is streamed in.

    Each block is at most `max_bytes` if possible. 1 means it is updated whole.
    """
    if len(shape) < 2 or (len(shape) == 2 and shape[1] % LANES):
        return 1
    needed = math.ceil(math.prod(shape) * np.dtype(dtype).itemsize / max_bytes)
    rows = shape[0]
    tile = SUBLANES * packing(dtype) if len(shape) == 2 else 1
    fits = [d for d in range(2, rows + 1) if rows % d == 0 and (rows // d) % tile == 0]
    # The fewest blocks of at most `max_bytes`; failing that, the smallest blocks.
    return next((d for d in fits if d >= needed), fits[-1] if fits else 1)


def chip_blocks(shape: tuple[int, ...], dtype: Any, shards: int = 1) -> int:
    """How many blocks of rows of `PIECE_BYTES` at most a large non-stacked leaf is
    streamed in (or added to), each a block of each of the `shards` parts its rows
    are split in over the chips (`parts`). 1: whole, as a leaf under twice
    `PIECE_BYTES` on a chip is."""
    part = (shape[0] // shards, *shape[1:]) if shape else ()  # one chip's rows
    if math.prod(part) * np.dtype(dtype).itemsize < 2 * PIECE_BYTES:
        return 1
    return row_blocks(part, dtype, PIECE_BYTES)


def parts(x: Any, shards: int) -> Any:
    """`x` with its rows in `shards` equal parts along a new axis 0 (`x` for 1).

    A leaf whose rows are split over `shards` chips is read and written a block
    of rows of each part at a time, along axis 1, so that each chip moves only its
    own rows. (A block along a split axis 0 is gathered from every chip, on the
    host.) On each chip the reshape has a majormost axis of 1, which the TPU
    compiler streams."""
    return x if shards == 1 else x.reshape(shards, -1, *x.shape[1:])


def read(full: Any, index: Any, rows: int, shards: int = 1) -> Any:
    """Piece `index` of `full`, `rows` rows along axis 0, still in `full`'s memory.

    One row (a layer) is read without its axis, with `dynamic_index_in_dim`. Read
    as a `(1, ...)` slice from the host, the TPU compiler keeps more pieces on the
    device: two more layers per Adam update loop in `benchmarks/optimizer.py`. Add
    the axis back on the device with `lift`. Over `shards` (`parts`), a piece is
    `rows // shards` rows of each part, parts first.
    """
    if rows == 1:
        return jax.lax.dynamic_index_in_dim(full, index, keepdims=False)
    part, axis = rows // shards, int(shards > 1)
    return jax.lax.dynamic_slice_in_dim(parts(full, shards), index * part, part, axis)


def lift(piece: Any, rows: int, shards: int = 1) -> Any:
    """A piece from `read`, moved to the device, with its row axis."""
    return piece[None] if rows == 1 else jax.lax.collapse(piece, 0, 1 + (shards > 1))


def lower(piece: Any, rows: int, shards: int = 1) -> Any:
    """A piece with its row axis, as `write` takes it (still on the device)."""
    return piece[0] if rows == 1 else parts(piece, shards)


def write(full: Any, piece: Any, index: Any, rows: int, shards: int = 1) -> Any:
    """`full` with piece `index` replaced by `piece`, from `lower`, in its memory."""
    if rows == 1:
        return jax.lax.dynamic_update_index_in_dim(full, piece, index, 0)
    blocks, part, axis = parts(full, shards), rows // shards, int(shards > 1)
    new = jax.lax.dynamic_update_slice_in_dim(blocks, piece, index * part, axis)
    return new.reshape(full.shape)
