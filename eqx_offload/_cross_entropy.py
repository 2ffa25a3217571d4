"""`chunked_cross_entropy`: a language-model head and its cross-entropy.

They never hold the whole `[tokens, vocab]` logits. The tokens are cut into
chunks. A `lax.scan` computes one chunk's logits, log-sum-exp and loss at a time.
The backward pass (a `jax.custom_vjp`) computes each chunk's logits again, rather
than keeping them. The head then needs one chunk of logits (and its gradient) in
device memory, instead of all of them. For a 128k vocabulary and 8 x 1024 tokens
in fp32, 4 GiB become `chunk x 128256 x 4` B.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int, Real

from . import _layout, _scopes, _vocab_blocks
from ._errors import see


def chunked_cross_entropy(
    hidden: Float[Array, "*tokens dim"],
    weight: Float[Array, "vocab dim"],
    targets: Int[Array, "*tokens"],
    *,
    mask: Bool[Array, "*tokens"] | Real[Array, "*tokens"] | None = None,
    chunk: int = 1024,
) -> Float[Array, ""]:
    """The mean cross-entropy of the logits `hidden @ weight.T` against `targets`.

    It is computed `chunk` tokens at a time, so the whole logits never exist. It
    equals `optax.softmax_cross_entropy_with_integer_labels(hidden @ weight.T,
    targets)`, averaged over the unmasked tokens. The gradients for `hidden` and
    `weight` are the same too. The backward pass recomputes each chunk's logits.
    Logits are computed and reduced in float32, whatever the inputs' dtype.

    **Arguments:**

    - `hidden`: the last hidden states, any leading (token) axes, e.g.
        `[batch, seq, dim]`.
    - `weight`: the output projection, `[vocab, dim]`. It is a tied embedding's
        table, or a head's weight. `eqx.nn.Linear(dim, vocab).weight` has this
        layout.
    - `targets`: integer labels, with `hidden`'s token axes.
    - `mask`: which tokens count (booleans), or per-token weights. `None` counts
        all. The loss is the weighted mean `sum(mask * loss) / sum(mask)`.
    - `chunk`: tokens per chunk. A token count that is not a multiple is padded.
        The padding has no weight. Not used for a `weight` in host memory.

    **A weight in host memory.** The step may keep `weight` in host memory, with
    `Policy(host_tables=("embed",))`. It is then read one block of rows at a time.
    The forward pass computes each block's logits for all tokens, with a running
    log-sum-exp. The backward pass writes each block's gradient back to the host.
    For a tied embedding, pass the table that `eo.embed` returned.

    **Returns:**

    The scalar loss.

    !!! Example

        ```python
        def loss_fn(model, tokens, targets):
            hidden = jax.vmap(model.trunk)(tokens)           # [batch, seq, dim]
            return eo.chunked_cross_entropy(hidden, model.embed.weight, targets)
        ```
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(
            f"`chunked_cross_entropy(chunk={chunk!r})` must be a positive int, the "
            "tokens per chunk." + see(96)
        )
    if weight.ndim != 2 or hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"`chunked_cross_entropy`: `weight` {tuple(weight.shape)} is not "
            f"`[vocab, dim]` for `hidden` {tuple(hidden.shape)}. Transpose a "
            "`[dim, vocab]` matrix." + see(95)
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            "`chunked_cross_entropy`: `targets` must have the token axes of "
            f"`hidden` {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}."
            + see(95)
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            "`chunked_cross_entropy`: `targets` must be integer labels, got "
            f"{targets.dtype}." + see(96)
        )
    if mask is not None and tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(
            "`chunked_cross_entropy`: `mask` must have the shape of `targets` "
            f"{tuple(targets.shape)}, got {tuple(mask.shape)}."
        )
    dim = hidden.shape[-1]
    h = hidden.reshape(-1, dim)
    t = targets.reshape(-1)
    w = jnp.ones(t.shape, jnp.float32) if mask is None else mask.reshape(-1)
    w = w.astype(jnp.float32)
    if _vocab_blocks.streams(weight, "chunked_cross_entropy"):
        with jax.named_scope(_scopes.VOCAB_BLOCKS):
            total = _layout.on_auto_axes(_streamed_sum, PartitionSpec())
            return total(h, weight, t, w) / jnp.sum(w)
    size = min(chunk, h.shape[0])
    pad = -h.shape[0] % size

    if pad:  # to whole chunks, the padding of no weight
        h, t, w = (
            jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])
            for x in (h, t, w)
        )
    total = _layout.on_auto_axes(_weighted_sum, PartitionSpec())(
        h.reshape(-1, size, dim), weight, t.reshape(-1, size), w.reshape(-1, size)
    )
    return total / jnp.sum(w)


def _logits(h: Any, weight: Any) -> Any:
    return jnp.einsum("td,vd->tv", h, weight, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _weighted_sum(h: Any, weight: Any, t: Any, w: Any) -> Any:
    return _forward(h, weight, t, w)[0]


def _forward(h: Any, weight: Any, t: Any, w: Any) -> tuple[Any, Any]:
    def body(total: Any, chunk: tuple) -> tuple[Any, Any]:
        hc, tc, wc = chunk
        logits = _logits(hc, weight)
        lse = jax.nn.logsumexp(logits, axis=-1)
        correct = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return total + jnp.sum(wc * (lse - correct)), lse

    total, lse = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h, t, w))
    return total, (h, weight, t, w, lse)


def _backward(residuals: tuple, g: Any) -> tuple:
    h, weight, t, w, lse = residuals

    def body(dweight: Any, chunk: tuple) -> tuple[Any, Any]:
        hc, tc, wc, lsec = chunk
        probs = jnp.exp(_logits(hc, weight) - lsec[:, None])
        onehot = jax.nn.one_hot(tc, weight.shape[0], dtype=jnp.float32)
        dlogits = (probs - onehot) * (g * wc)[:, None]
        dh = jnp.einsum("tv,vd->td", dlogits, weight.astype(jnp.float32))
        dweight = dweight + jnp.einsum("tv,td->vd", dlogits, hc.astype(jnp.float32))
        return dweight, dh.astype(hc.dtype)

    zero = jnp.zeros(weight.shape, jnp.float32)
    dweight, dh = jax.lax.scan(body, zero, (h, t, w, lse))
    return dh, dweight.astype(weight.dtype), None, None


_weighted_sum.defvjp(_forward, _backward)


@jax.custom_vjp
def _streamed_sum(h: Any, table: Any, t: Any, w: Any) -> Any:
    return _streamed_forward(h, table, t, w)[0]


def _streamed_forward(h: Any, table: Any, t: Any, w: Any) -> tuple[Any, Any]:
    """The weighted sum of the losses, one block of the host `table` at a time.

    Per token, it keeps a running maximum and sum of exponentials. The target's
    logit comes from the block that holds it.
    """
    rows = _vocab_blocks.rows_per_block(table, h.shape[0])

    def body(carry: tuple, index: Any, start: Any) -> tuple:
        top, sums, correct = carry
        logits = _logits(h, _vocab_blocks.read(table, index, rows))
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        sums = sums * jnp.exp(top - new_top) + jnp.sum(
            jnp.exp(logits - new_top[:, None]), axis=-1
        )
        local = t - start
        hit = (local >= 0) & (local < rows)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, rows - 1)[:, None], 1)
        return (new_top, sums, jnp.where(hit, picked[:, 0], correct)), None

    n = h.shape[0]
    zeros = [jnp.zeros((n,), jnp.float32) for _ in range(2)]
    start = (jnp.full((n,), -jnp.inf, jnp.float32), *zeros)
    (top, sums, correct), _ = _vocab_blocks.loop(body, start, table, rows)
    lse = top + jnp.log(sums)
    return jnp.sum(w * (lse - correct)), (h, table, t, w, lse)


def _streamed_backward(residuals: tuple, g: Any) -> tuple:
    h, table, t, w, lse = residuals
    rows = _vocab_blocks.rows_per_block(table, h.shape[0])
    scale = (g * w)[:, None]
    h32 = h.astype(jnp.float32)

    def body(dh: Any, index: Any, start: Any) -> tuple:
        block = _vocab_blocks.read(table, index, rows)
        probs = jnp.exp(_logits(h, block) - lse[:, None])
        onehot = (t - start)[:, None] == jnp.arange(rows)[None, :]
        dlogits = (probs - onehot) * scale
        dh = dh + jnp.einsum("tv,vd->td", dlogits, block.astype(jnp.float32))
        return dh, jnp.einsum("tv,td->vd", dlogits, h32).astype(table.dtype)

    zero = jnp.zeros(h.shape, jnp.float32)
    with jax.named_scope(_scopes.VOCAB_BLOCKS):
        dh, dtable = _vocab_blocks.loop(body, zero, table, rows)
    return dh.astype(h.dtype), dtable, None, None


_streamed_sum.defvjp(_streamed_forward, _streamed_backward)
