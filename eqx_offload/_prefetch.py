"""A scan over a `Stacked`'s layers that reads the next layer while one computes.

In the forward pass it reads layer `i + 1` while layer `i` computes. In the backward
pass it reads layer `i - 1`.

Inside a plain scan body, the read of a layer's host-resident parameters starts and
ends right before its matmuls. Nothing else is there to hide it behind. So the next
layer's parameters are carried in the scan's carry. The compiler can then start
their read at the top of the body, and end it after this layer's compute. Under
JAX's own autodiff, that carry would become a residual. Every layer's parameters
would be saved on the device. The transposed scan would also read each layer at the
top of its body. So the scan is an `eqx.filter_custom_vjp`, with both scans written
here. Per iteration `i`:

```
forward   carry in:  (x_i, layer i, owed, new slice of layer i)
          body:      write layer i's new slice into owed; read layer i + 1 (through
                     its update); y_i, vjp_i = jax.vjp(layer i)(x_i)
          carry out: (x_{i+1}, layer i + 1, owed, new slice of layer i + 1)
          saved:     vjp_i's residuals that are not one of its inputs
backward  carry in:  (ct x_{i+1}, layer i, layer i's offloaded residuals)
          body:      read layer i - 1 and its offloaded residuals; rebuild vjp_i
                     from layer i, x's slice, the closed-over values and the saved
                     residuals; apply it
          carry out: (ct x_i, layer i - 1, its offloaded residuals)
```

The last forward iteration reads layer `n - 1` again. That is the first layer the
backward pass needs: it is carried over, not read twice. The last backward iteration
reads layer 0 again. That is the one read more than a plain scan does. A
forward-only scan reads layer `n - 1` twice.

A `jax.vjp`'s residuals include its inputs: the layer's parameters, its slice of
`xs` and the closed-over values. Those must not be saved (every layer's parameters
would be kept on the device), and nothing but their identity tells them apart from
the activations: `eqx.filter_closure_convert` of the `jax.vjp` hoists them all
alike. So the residuals are matched to the inputs by identity while the forward
body is traced, and that match is a static residual of the `filter_custom_vjp`.

A custom VJP has no forward-mode derivative. So under `jax.jvp`, `scan` returns
None: the caller (`_scan_body.py`) runs the plain scan there.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _compat, _jaxpr
from ._errors import see
from ._memory_kinds import is_host, to_space


class Pending(NamedTuple):
    """An update each layer's parameters get before the layer computes
    (`Policy(update_timing="next_forward")`, `_pending.py`), with the arrays
    `owed` to `scan`: `(aux, held)`, where `aux = (params, grads, state)`.

    - `apply(aux, held) -> aux`: a layer's slice of `aux` to its new slice, on the
        device.
    - `merge(piece, params) -> piece`: the slice of the stacked layers the layer
        computes with, given its new parameters (on the device or the host).
    - `backward()`: called when the backward scan is built (where it is not, the
        cotangent of `aux` is zero: the caller must not read it).

    The forward scan writes each layer's new parameters and optimizer state into
    `aux` in place (the gradients it only reads); the backward scan reads the
    layers through `merge` from it; and the new `aux` is the cotangent `aux` gets
    (how the step gets the new values back)."""

    apply: Callable[[Any, Any], Any]
    merge: Callable[[Any, Any], Any]
    backward: Callable[[], None]


class How(NamedTuple):
    """What the scans share and do not differentiate.

    - `fn(carry, layer, x) -> (carry, y)`: one layer. (`scan` passes it on
        closure-converted: the values it closes over as trailing arguments.)
    - `read(piece) -> layer`: one layer's slice moved to the device (and maybe
        gathered, or cast through a gradient tap).
    - `length`: the number of layers.
    - `linear`: whether `read` is linear (a move and a gather; not a tap).
    - `pending`: the update the layers get first, if any."""

    fn: Callable
    read: Callable
    length: int
    linear: bool
    pending: Pending | None = None


def scan(
    how: How, carry: Any, stacked: Any, xs: Any, owed: Any = None
) -> tuple[Any, Any] | None:
    """`jax.lax.scan` of `how.fn(carry, how.read(stacked[i]), xs[i]) -> (carry, y)`
    over `i < how.length`, with each `read` issued one iteration ahead (forward
    and backward). The transpose of `read` is taken in the backward pass: with
    `jax.linear_transpose` where `how.linear`, else with `jax.vjp`, whose forward
    part, unused, the compiler removes. `owed`: the arrays of `how.pending`, an
    update applied to each layer's slice before it is read (`Pending`).

    None where a value the scan reads or the layers close over is differentiated
    in forward mode (the caller runs the plain scan)."""
    # Abstractly: an operation on a host-resident stack outside the scan is a
    # computation on the host (`filter_offload` refuses it).
    first = functools.partial(jtu.tree_map, lambda a: a[0])
    layer0 = jax.eval_shape(lambda s: how.read(first(s)), stacked)
    x0 = jax.eval_shape(first, xs)
    fn, consts = _jaxpr.closure_converted(how.fn, carry, layer0, x0)
    if _compat.forward_mode((consts, carry, stacked, xs)):
        if how.pending is not None:
            raise ValueError(
                "`Policy(update_timing=...)`: the layers close over a `jax.jvp` "
                "tangent. Use `update_timing='now'`."
            )
        return None
    return _run(how._replace(fn=fn), consts, carry, stacked, xs, owed)


def _run(how: How, *args: Any) -> tuple[Any, Any]:
    """The scans of `args = (consts, carry, stacked, xs, owed)`.

    Inside `jax.vmap` (a model applied per example), the batch is moved inside the
    layer, one `jax.vmap` at a time, so that the scans see one batch of layers.
    Under JAX's batching of a custom VJP, each example's gradient of the
    (unbatched) parameters would be moved to the host before they are summed, and
    a gradient tap would add its accumulator once per example."""
    if not _compat.batched(args):
        return _scan(args, how)

    @jax.custom_batching.custom_vmap
    def whole(*args: Any) -> Any:
        return _run(how, *args)

    @whole.def_vmap
    def _(size: int, batched: Any, consts, carry, stacked, xs, owed):
        b_consts, b_carry, b_stacked, b_xs, b_owed = batched
        if any(jtu.tree_leaves((b_stacked, b_owed))):
            raise ValueError(
                "`Policy(prefetch=1)`: a `Stacked`'s layers are batched by "
                "`jax.vmap`. Use `prefetch=0`." + see(132)
            )

        def every(x: Any, b: bool) -> Any:  # the carry batched throughout
            return x if b else jnp.broadcast_to(x, (size,) + jnp.shape(x))

        carry = jtu.tree_map(every, carry, b_carry)
        xs = jtu.tree_map(lambda x, b: jnp.moveaxis(x, 0, 1) if b else x, xs, b_xs)
        in_axes = (
            jtu.tree_map(lambda _: 0, carry),
            None,
            jtu.tree_map(lambda b: 0 if b else None, b_xs),
            *[0 if b else None for b in b_consts],
        )
        inner = how._replace(fn=jax.vmap(how.fn, in_axes=in_axes))
        c, ys = _run(inner, consts, carry, stacked, xs, owed)
        out = (c, jtu.tree_map(lambda y: jnp.moveaxis(y, 1, 0), ys))
        return out, jtu.tree_map(lambda _: True, out)

    return whole(*args)


def _updated(
    how: How, stacked: Any, owed: Any, index: Any, fresh: Any, last: Any = None
) -> tuple[Any, Any]:
    """Layer `index` on the device, read through its pending update where there is
    one, and that layer's new slice of `aux` (on the device; None without an
    update), which `_write` writes into `owed` one iteration later, while the
    next layer computes. Where not `fresh` (the last layer read a second time),
    its new slice is `last`, the one computed the first time."""
    piece = _at(stacked, index)
    if how.pending is None:
        return how.read(piece), None
    aux, held = owed
    new = how.pending.apply(_at(aux, index), held)
    if last is not None:
        new = jtu.tree_map(lambda n, o: jnp.where(fresh, n, o), new, last)
    return how.read(how.pending.merge(piece, new[0])), new


def _write(owed: Any, new: Any, index: Any) -> Any:
    """`owed` with layer `index`'s new parameters and optimizer state (`new`, a
    slice of `aux`) written in place; the gradients the update only reads."""
    if new is None:
        return owed
    (params, grads, state), held = owed

    def write(full: Any, value: Any) -> Any:
        value = to_space(value, "pinned_host" if is_host(full) else "device", "")
        return jax.lax.dynamic_update_index_in_dim(full, value, index, 0)

    return (
        jtu.tree_map(write, params, new[0]),
        grads,
        jtu.tree_map(write, state, new[2]),
    ), held


def _layer(how: How, stacked: Any, owed: Any, index: Any) -> tuple[Any, Any]:
    """Layer `index` on the device, as the forward pass computed with it (its new
    parameters read back from `owed`), and the slice it was read from."""
    piece = _at(stacked, index)
    if how.pending is not None:
        piece = how.pending.merge(piece, _at(owed[0], index)[0])
    return how.read(piece), piece


def _at(tree: Any, index: Any) -> Any:
    """Layer `index` of each stacked leaf, in the leaf's memory."""
    index = jnp.asarray(index, jnp.int32)
    return jtu.tree_map(lambda a: _take_along(0)(a, index), tree)


@functools.cache
def _take_along(axis: int) -> Callable[[Any, Any], Any]:
    """`a[index]` along `axis`, as a `dynamic_slice` also under `jax.vmap`. JAX
    batches a `dynamic_slice` into a `gather`, which host memory cannot run (and
    a Python int index into one too: the index is traced); a batched operand is
    sliced here along the next axis instead."""

    @jax.custom_batching.custom_vmap
    def take(a: Any, index: Any) -> Any:
        return jax.lax.dynamic_index_in_dim(a, index, axis, keepdims=False)

    @take.def_vmap
    def _(size: int, batched: list[bool], a: Any, index: Any) -> tuple[Any, bool]:
        del size  # (`index`, a scan's counter, is never batched)
        if not batched[0]:
            return jax.lax.dynamic_index_in_dim(a, index, axis, keepdims=False), False
        return _take_along(axis + 1)(a, index), True

    return take


def _forward(how: How, args: Any, vjp: bool) -> Any:
    """The forward scan: the outputs; under differentiation (`vjp`), with per
    layer the residuals that are not one of the layer's inputs, and the final
    `owed`, the last layer read and how to rebuild a layer's `jax.vjp`."""
    consts, carry, stacked, xs, owed = args
    n = how.length
    rebuild = []  # the structure of a layer's `jax.vjp`, learnt as it is traced

    def body(state: Any, inputs: Any) -> Any:
        c, layer, owed, new = state
        i, x = inputs
        # Layer `i`'s update (computed last iteration) written, and layer `i + 1`
        # read through its update, while this layer computes. The write comes
        # first: a read of the arrays before it would make the compiler copy
        # them whole at every iteration.
        owed = _write(owed, new, i)
        j = jnp.minimum(i + 1, n - 1)
        following, upcoming = _updated(how, stacked, owed, j, i + 1 < n, new)
        if not vjp:
            c, y = how.fn(c, layer, x, *consts)
            return (c, following, owed, upcoming), y
        (c, y), back = jax.vjp(how.fn, c, layer, x, *consts)
        leaves, treedef = jtu.tree_flatten(back)
        again = jtu.tree_leaves((layer, x, consts))
        where = [next((k for k, a in enumerate(again) if a is r), None) for r in leaves]
        rebuild[:] = [treedef, where]
        kept = [r for r, w in zip(leaves, where) if w is None]
        return (c, following, owed, upcoming), (y, kept)

    layer, new = _updated(how, stacked, owed, 0, True)
    (c, last, owed, _), ys = jax.lax.scan(
        body, (carry, layer, owed, new), (jnp.arange(n), xs), length=n
    )
    return (c, ys), (last, owed, *rebuild)


def _primal(args: Any, how: How) -> Any:
    return _forward(how, args, False)[0]


_scan = eqx.filter_custom_vjp(_primal)


@_scan.def_fwd
def _fwd(perturbed: Any, args: Any, how: How) -> Any:
    del perturbed
    (c, (ys, kept)), (last, owed, treedef, where) = _forward(how, args, True)
    types = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (c, ys))
    return (c, ys), (kept, last, owed, treedef, where, types)


@_scan.def_bwd
def _bwd(residuals: Any, grads: Any, perturbed: Any, args: Any, how: How) -> Any:
    kept, last, owed, treedef, where, types = residuals
    consts, _, stacked, xs, _ = args
    p_consts, p_carry, p_stacked, p_xs, p_owed = perturbed
    n = how.length
    if how.pending is not None:
        how.pending.backward()
    ct_carry, ct_ys = jtu.tree_map(_zero, grads, types, is_leaf=lambda g: g is None)
    # A residual offloaded to the host is read one layer ahead, like the layer;
    # the scan slices the others (on the device) itself.
    on_host = [is_host(r) for r in kept]
    on_device = [None if h else r for r, h in zip(kept, on_host)]

    def fetch(index: Any) -> list:
        return [
            to_space(_at(r, index), "device", "") if h else None
            for r, h in zip(kept, on_host)
        ]

    def body(state: Any, inputs: Any) -> Any:
        g, layer, here, g_consts = state
        i, x, saved, ct_y = inputs
        previous, _ = _layer(how, stacked, owed, jnp.maximum(i - 1, 0))
        earlier = fetch(jnp.maximum(i - 1, 0))
        saved = iter([h if h is not None else s for s, h in zip(saved, here)])
        again = jtu.tree_leaves((layer, x, consts))
        leaves = [next(saved) if w is None else again[w] for w in where]
        back = jtu.tree_unflatten(treedef, leaves)
        ct_c, ct_layer, ct_x, *ct_consts = back((g, ct_y))
        ct_piece = None
        if any(jtu.tree_leaves(p_stacked)):
            # Under a pending update, the parameters the layer computed with
            # (the new ones, read back): their cotangent is the gradient.
            _, piece = _layer(how, stacked, owed, i)
            ct_piece = _only(_transpose_read(how, piece, ct_layer), p_stacked)
        g_consts = [
            a + b if p else a
            for a, b, p in zip(g_consts, ct_consts, p_consts, strict=True)
        ]
        return (ct_c, previous, earlier, g_consts), (ct_piece, _only(ct_x, p_xs))

    g_consts = [jnp.zeros_like(c) for c in consts]
    init = (ct_carry, last, fetch(n - 1), g_consts)
    per_layer = (jnp.arange(n), xs, on_device, ct_ys)
    (ct_c, _, _, g_consts), (ct_stacked, ct_xs) = jax.lax.scan(
        body, init, per_layer, length=n, reverse=True
    )
    # The new values of a pending update's `aux`, as its cotangent (`Pending`).
    new_aux = None if owed is None else (owed[0], None)
    return _only((g_consts, ct_c, ct_stacked, ct_xs, new_aux), perturbed)


def _transpose_read(how: How, piece: Any, ct_layer: Any) -> Any:
    """The cotangent of a layer's slice from that of the layer `read` made of it.
    A move and a gather of floating-point leaves are transposed as linear
    functions, leaving no read in the program. A read with a custom rule (a
    gradient tap), and one of a slice with an integer leaf (which
    `jax.linear_transpose` refuses), by `jax.vjp`, whose read the compiler
    removes (its result is unused)."""
    shapes = jtu.tree_map(jax.typeof, piece)
    if how.linear and all(
        jnp.issubdtype(s.dtype, jnp.inexact) for s in jtu.tree_leaves(shapes)
    ):
        return jax.linear_transpose(how.read, shapes)(ct_layer)[0]
    return jax.vjp(how.read, piece)[1](ct_layer)[0]


def _only(cts: Any, perturbed: Any) -> Any:
    """`cts` where `perturbed` (the input differentiated), else None. A None in
    `cts` (a zero) stands for a whole subtree: it becomes a subtree of Nones."""

    def keep(ct: Any, p: Any) -> Any:
        if ct is None:
            return jtu.tree_map(lambda _: None, p)
        return ct if p else None

    return jtu.tree_map(keep, cts, perturbed, is_leaf=lambda x: x is None)


def _zero(ct: Any, like: jax.ShapeDtypeStruct | None) -> Any:
    """`ct`, or where it is None (a symbolic zero), zeros of the output `like`'s
    tangent type."""
    if ct is not None or like is None:
        return ct
    if jnp.issubdtype(like.dtype, jnp.inexact):
        return jnp.zeros(like.shape, like.dtype)
    return np.zeros(like.shape, jax.dtypes.float0)
