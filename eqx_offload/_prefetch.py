"""A scan over a `Stacked`'s layers that reads the next layer while one computes.

In the forward pass it reads layer `i + 1` while layer `i` computes. In the backward
pass it reads layer `i - 1`.

Inside a plain scan body, the read of a layer's host-resident parameters starts and
ends right before its matmuls. Nothing else is there to hide it behind. So the next
layer's parameters are carried in the scan's carry. The compiler can then start
their read at the top of the body, and end it after this layer's compute. Under
JAX's own autodiff, that carry would become a residual. Every layer's parameters
would be saved on the device. The transposed scan would also read each layer at the
top of its body. So the scan is a `jax.custom_vjp`, with both scans written here:

- forward: carry `(x, layer i)`. The body reads layer `i + 1`, and runs layer `i`
  under `jax.vjp`. Of its residuals, it keeps only those that are not one of its
  inputs: the saved and offloaded activations. A layer's parameters and per-layer
  inputs are read again in the backward pass, not saved.
- backward: a reverse scan with carry `(cotangent, layer i, layer i's offloaded
  residuals)`. The body reads layer `i - 1` and its offloaded residuals. It
  rebuilds layer `i`'s `jax.vjp` from its parameters and saved residuals, and
  applies it.

The last forward iteration reads layer `n - 1` again. That is the first layer the
backward pass needs: it is carried over, not read twice. The last backward iteration
reads layer 0 again. That is the one read more than a plain scan does. A
forward-only scan reads layer `n - 1` twice.

A `custom_vjp` has no forward-mode derivative. So under `jax.jvp`, the caller
(`_scan_body.py`) does not prefetch. It runs the plain scan there.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_derivatives import SymbolicZero

from . import _compat, _jaxpr
from ._errors import see
from ._memory_kinds import is_host, to_space


class Pending(NamedTuple):
    """An update each layer's parameters get before the layer computes
    (`Policy(update_timing=...)`, `_pending.py`), with the arrays `owed` to
    `scan`: `(aux, held)`.

    - `apply(piece, aux, held) -> aux`: a layer's slice of the stacked layers
        (in their memory) and of `aux`, to the new slice of `aux` on the device.
    - `merge(piece, aux) -> piece`: the slice the layer computes with, given the
        new slice of `aux` (on the device or the host).
    - `writes`: a tree of bools with the structure of `aux`: the leaves the
        update writes (the others are only read).
    - `backward()`: called when the backward scan is built (where it is not, the
        cotangent of `aux` is zero: the caller must not read it).

    The forward scan writes each layer's new slice into `aux` in place; the
    backward scan reads the layers through `merge` from it; and the new `aux` is
    the cotangent `aux` gets (how the step gets the new values back)."""

    apply: Callable[[Any, Any, Any], Any]
    merge: Callable[[Any, Any], Any]
    writes: Any
    backward: Callable[[], None]


def scan(
    layer_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    read: Callable[[Any], Any],
    carry: Any,
    stacked: Any,
    xs: Any,
    length: int,
    linear: bool = False,
    plain: Callable[[], tuple[Any, Any]] | None = None,
    pending: Pending | None = None,
    owed: Any = None,
) -> tuple[Any, Any]:
    """`jax.lax.scan` of `layer_fn(carry, read(stacked[i]), xs[i]) -> (carry, y)`
    over `i < length`, with each `read` issued one iteration ahead (forward and
    backward). `read` moves one layer's slice to the device (and may gather or
    cast it). Its transpose is taken in the backward pass: with
    `jax.linear_transpose` where `linear` (a move and a gather), else with
    `jax.vjp` (a gradient tap), whose forward part, unused, the compiler
    removes. `plain`: the plain scan, run instead where a value the layers close
    over is differentiated in forward mode. `pending`, with its arrays `owed`:
    an update applied to each layer's slice before it is read (`Pending`)."""
    # Abstractly: an operation on a host-resident stack outside the scan is a
    # computation on the host (`filter_offload` refuses it).
    layer0 = jax.eval_shape(lambda s: read(jtu.tree_map(lambda a: a[0], s)), stacked)
    x0 = jax.eval_shape(lambda s: jtu.tree_map(lambda a: a[0], s), xs)
    fn, consts = _jaxpr.closure_converted(layer_fn, carry, layer0, x0)
    if _compat.forward_mode(consts):
        if pending is not None:
            raise ValueError(
                "`Policy(update_timing=...)`: the layers close over a `jax.jvp` "
                "tangent. Use `update_timing='now'`."
            )
        if plain is not None:
            return plain()  # a tangent the layers close over: no `custom_vjp`
    meta = _Meta(fn, read, length, {}, linear, pending)
    return _run(meta, consts, carry, stacked, xs, owed)


def _run(
    meta: "_Meta", consts: list, carry: Any, stacked: Any, xs: Any, owed: Any
) -> tuple[Any, Any]:
    """The scans, with `meta.fn` taking its closed-over values as trailing
    arguments.

    Inside `jax.vmap` (a model applied per example), the batch is moved inside the
    layer, one `jax.vmap` at a time, so that the scans see one batch of layers.
    Under JAX's batching of a `custom_vjp`, each example's gradient of the
    (unbatched) parameters would be moved to the host before they are summed, and
    a gradient tap would add its accumulator once per example."""
    if not _compat.batched((consts, carry, stacked, xs, owed)):
        return _scan(meta, consts, carry, stacked, xs, owed)

    @jax.custom_batching.custom_vmap
    def whole(consts: list, carry: Any, stacked: Any, xs: Any, owed: Any) -> Any:
        return _run(meta, consts, carry, stacked, xs, owed)

    @whole.def_vmap
    def _(
        size: int,
        batched: Any,
        consts: list,
        carry: Any,
        stacked: Any,
        xs: Any,
        owed: Any,
    ):
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
        per_example = jax.vmap(meta.fn, in_axes=in_axes)
        inner = _Meta(
            per_example, meta.read, meta.length, {}, meta.linear, meta.pending
        )
        c, ys = _run(inner, consts, carry, stacked, xs, owed)
        ys = jtu.tree_map(lambda y: jnp.moveaxis(y, 1, 0), ys)
        out = (c, ys)
        return out, jtu.tree_map(lambda _: True, out)

    return whole(consts, carry, stacked, xs, owed)


class _Meta:
    """What the scans share and do not differentiate: the closure-converted layer
    function, `read`, the length, (filled in by the forward pass) how to rebuild
    a layer's `jax.vjp` from its inputs and saved residuals, and the update the
    layers get first (`Pending`, or None)."""

    def __init__(
        self,
        fn: Callable,
        read: Callable,
        length: int,
        rebuild: dict,
        linear: bool,
        pending: Pending | None = None,
    ):
        self.fn = fn
        self.read = read
        self.length = length
        self.rebuild = rebuild
        self.linear = linear
        self.pending = pending


def _updated(
    meta: _Meta, stacked: Any, owed: Any, index: Any, fresh: Any, last: Any = None
) -> tuple[Any, Any]:
    """Layer `index` on the device, read through its pending update where there is
    one, and that layer's new slice of `aux` (on the device; None without an
    update), which `_write` writes into `owed` one iteration later, while the
    next layer computes. Where not `fresh` (the last layer read a second time),
    its new slice is `last`, the one computed the first time."""
    piece = _at(stacked, index)
    if meta.pending is None:
        return meta.read(piece), None
    aux, held = owed
    new = meta.pending.apply(piece, _at(aux, index), held)
    if last is not None:
        new = jtu.tree_map(lambda n, o: jnp.where(fresh, n, o), new, last)
    return meta.read(meta.pending.merge(piece, new)), new


def _write(meta: _Meta, owed: Any, new: Any, index: Any) -> Any:
    """`owed` with layer `index`'s new slice of `aux` written in place (the
    slices `Pending.writes` marks)."""
    if meta.pending is None:
        return owed
    aux, held = owed

    def write(full: Any, value: Any, written: bool) -> Any:
        if not written:
            return full
        value = to_space(value, "pinned_host" if is_host(full) else "device", "")
        return jax.lax.dynamic_update_index_in_dim(full, value, index, 0)

    return jtu.tree_map(write, aux, new, meta.pending.writes), held


def _layer(meta: _Meta, stacked: Any, owed: Any, index: Any) -> tuple[Any, Any]:
    """Layer `index` on the device, as the forward pass computed with it (its new
    slice read back from `owed`), and the slice it was read from."""
    piece = _at(stacked, index)
    if meta.pending is not None:
        piece = meta.pending.merge(piece, _at(owed[0], index))
    return meta.read(piece), piece


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
        del size
        a_batched, index_batched = batched
        if index_batched:  # never from the scans here: JAX's own rule
            plain = functools.partial(
                jax.lax.dynamic_index_in_dim, axis=axis, keepdims=False
            )
            return jax.vmap(plain, in_axes=(0 if a_batched else None, 0))(
                a, index
            ), True
        if not a_batched:
            return jax.lax.dynamic_index_in_dim(a, index, axis, keepdims=False), False
        return _take_along(axis + 1)(a, index), True

    return take


def _primal(
    meta: _Meta, consts: list, carry: Any, stacked: Any, xs: Any, owed: Any
) -> Any:
    """The forward pass, undifferentiated (evaluation, sampling)."""
    n = meta.length

    def body(state: Any, inputs: Any) -> Any:
        c, layer, owed, new = state
        i, x = inputs
        owed = _write(meta, owed, new, i)
        j = jnp.minimum(i + 1, n - 1)
        following, upcoming = _updated(meta, stacked, owed, j, i + 1 < n, new)
        c, y = meta.fn(c, layer, x, *consts)
        return (c, following, owed, upcoming), y

    layer, new = _updated(meta, stacked, owed, 0, True)
    init = (carry, layer, owed, new)
    (c, _, _, _), ys = jax.lax.scan(body, init, (jnp.arange(n), xs), length=n)
    return c, ys


def _value(x: Any) -> Any:
    return x.value


def _forward(
    meta: _Meta, consts: list, carry: Any, stacked: Any, xs: Any, owed: Any
) -> Any:
    """The forward pass under differentiation: the outputs, and per layer the
    residuals that are not one of the layer's inputs."""
    everything = (consts, carry, stacked, xs, owed)
    perturbed = jtu.tree_map(lambda p: p.perturbed, everything)
    consts, carry, stacked, xs, owed = jtu.tree_map(_value, everything)
    n = meta.length

    def body(state: Any, inputs: Any) -> Any:
        c, layer, owed, new = state
        i, x = inputs
        # Layer `i`'s update (computed last iteration) written, and layer `i + 1`
        # read through its update, while this layer computes. The write comes
        # first: a read of the arrays before it would make the compiler copy
        # them whole at every iteration.
        owed = _write(meta, owed, new, i)
        j = jnp.minimum(i + 1, n - 1)
        following, upcoming = _updated(meta, stacked, owed, j, i + 1 < n, new)
        out, vjp = jax.vjp(meta.fn, c, layer, x, *consts)
        leaves, treedef = jtu.tree_flatten(vjp)
        inputs_again = jtu.tree_leaves((layer, x, consts))
        where: list[int | None] = []
        kept = []
        for leaf in leaves:
            found = next((k for k, a in enumerate(inputs_again) if a is leaf), None)
            where.append(found)
            if found is None:
                kept.append(leaf)
        meta.rebuild["treedef"] = treedef
        meta.rebuild["where"] = where
        return (out[0], following, owed, upcoming), (out[1], kept)

    layer, new = _updated(meta, stacked, owed, 0, True)
    (c, last, owed, _), (ys, kept) = jax.lax.scan(
        body, (carry, layer, owed, new), (jnp.arange(n), xs), length=n
    )
    return (c, ys), (kept, last, consts, stacked, xs, owed, perturbed)


def _backward(meta: _Meta, residuals: Any, cotangents: Any) -> Any:
    kept, last, consts, stacked, xs, owed, perturbed = residuals
    n = meta.length
    if meta.pending is not None:
        meta.pending.backward()
    treedef, where = meta.rebuild["treedef"], meta.rebuild["where"]
    p_consts, p_carry, p_stacked, p_xs, p_owed = perturbed
    ct_carry, ct_ys = _instantiate(cotangents)
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
        previous, _ = _layer(meta, stacked, owed, jnp.maximum(i - 1, 0))
        earlier = fetch(jnp.maximum(i - 1, 0))
        saved = iter([h if h is not None else s for s, h in zip(saved, here)])
        again = jtu.tree_leaves((layer, x, consts))
        leaves = [next(saved) if w is None else again[w] for w in where]
        vjp = jtu.tree_unflatten(treedef, leaves)
        ct_c, ct_layer, ct_x, *ct_consts = vjp((g, ct_y))
        ct_piece = None
        if any(jtu.tree_leaves(p_stacked)):
            # Under a pending update, the parameters the layer computed with
            # (the new ones, read back): their cotangent is the gradient.
            _, piece = _layer(meta, stacked, owed, i)
            ct_piece = _transpose_read(meta, piece, ct_layer)
            ct_piece = _keep_perturbed(ct_piece, p_stacked)
        ct_x = _keep_perturbed(ct_x, p_xs)
        g_consts = [
            a + b if p else a
            for a, b, p in zip(g_consts, ct_consts, p_consts, strict=True)
        ]
        return (ct_c, previous, earlier, g_consts), (ct_piece, ct_x)

    g_consts = [jnp.zeros_like(c) for c in consts]
    (ct_c, _, _, g_consts), (ct_stacked, ct_xs) = jax.lax.scan(
        body,
        (ct_carry, last, fetch(n - 1), g_consts),
        (jnp.arange(n), xs, on_device, ct_ys),
        length=n,
        reverse=True,
    )
    ct_consts = [g if p else None for g, p in zip(g_consts, p_consts)]
    # The new values of a pending update's `aux`, as its cotangent (`Pending`).
    ct_owed = None if owed is None else (owed[0], None)
    return (
        ct_consts,
        _keep_perturbed(ct_c, p_carry),
        _keep_perturbed(ct_stacked, p_stacked),
        _keep_perturbed(ct_xs, p_xs),
        _keep_perturbed(ct_owed, p_owed),
    )


def _transpose_read(meta: _Meta, piece: Any, ct_layer: Any) -> Any:
    """The cotangent of a layer's slice from that of the layer `read` made of it.
    A move and a gather are transposed as linear functions, leaving no read in
    the program; a read with a custom rule (a gradient tap) by `jax.vjp`, whose
    read the compiler removes (its result is unused)."""
    if meta.linear:
        shapes = jtu.tree_map(lambda a: jax.typeof(a), piece)
        try:
            return jax.linear_transpose(meta.read, shapes)(ct_layer)[0]
        except (NotImplementedError, KeyError, TypeError):
            pass  # a primitive with no transpose; an integer leaf
    return jax.vjp(meta.read, piece)[1](ct_layer)[0]


def _keep_perturbed(cts: Any, perturbed: Any) -> Any:
    """`cts` with None where the input was not differentiated (and where an input
    is not of a float type: its cotangent is `float0`)."""
    if cts is None:
        return jtu.tree_map(lambda _: None, perturbed)

    def keep(ct: Any, p: Any) -> Any:  # (a whole subtree of flags where ct is None)
        if not p or ct is None or not jnp.issubdtype(ct.dtype, jnp.inexact):
            return None
        return ct

    return jtu.tree_map(keep, cts, perturbed, is_leaf=lambda x: x is None)


def _instantiate(tree: Any) -> Any:
    def zero(x: Any) -> Any:
        if isinstance(x, SymbolicZero):
            return jnp.zeros(x.shape, jnp.dtype(x.dtype))  # pyright: ignore
        return x

    return jtu.tree_map(zero, tree, is_leaf=lambda x: isinstance(x, SymbolicZero))


_scan = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_scan.defvjp(_forward, _backward, symbolic_zeros=True)
