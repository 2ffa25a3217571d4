"""What `verify` compares: each leaf against the reference, within a tolerance by
its dtype (`compare`), and the pairs of the update check."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from . import _paths
from ._memory_kinds import is_key, kind_of
from ._update._dispatch import is_trainable
from ._verify_report import Difference


# Default tolerances by the compared leaf's floating-point width (bytes), 32- and
# 64-bit floats' for wider ones: see `verify`'s docstring and docs/verify.md for
# why these values.
DEFAULT_TOLERANCES = {2: (5e-2, 1e-5), 1: (2e-1, 1e-3)}


def tolerance(
    dtype: Any, rtol: float | None, atol: float | None, computed: Any = None
) -> tuple:
    """`(rtol, atol)` for a leaf of `dtype`.

    That is its own default, or the default of the dtype it was `computed` in where that
    is narrower.
    """
    if jnp.issubdtype(dtype, jnp.inexact):
        width = np.dtype(dtype).itemsize
        if computed is not None:
            width = min(width, np.dtype(computed).itemsize)
        default = DEFAULT_TOLERANCES.get(width, (1e-4, 1e-8))
    else:
        default = (0.0, 0.0)  # integers, booleans, PRNG keys: exactly
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def rounding(x: Any) -> float:
    """One rounding of the largest entry of a floating-point array."""
    largest = float(np.nanmax(np.abs(as_float(x)), initial=0.0))
    return float(jnp.finfo(x.dtype).eps) * largest


def as_float(x: Any) -> np.ndarray:
    if is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # Laid out over several processes' devices: each process compares the
        # whole value.
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x).astype(np.float64)


def compare(
    pairs: list[tuple[str, Any, Any, Any, float]],
    rtol: float | None,
    atol: float | None,
    computed: Any = None,
) -> Difference:
    """The worst of `(leaf, ours, reference, scale_of, slack)` comparisons.

    The worst is the largest difference relative to its tolerance, `atol + rtol * scale
    + slack`. `scale` is the largest magnitude of the array `scale_of`. The tolerance is
    that of the reference's dtype. Where the values were `computed` in a narrower dtype,
    it is that dtype's. `computed` is one dtype for every leaf, or a dict of them by
    leaf.
    """

    def one(leaf: str, ours: Any, ref: Any, scale_of: Any, slack: float) -> Difference:
        dtype = computed.get(leaf) if isinstance(computed, dict) else computed
        r, a = tolerance(ref.dtype, rtol, atol, dtype)
        ours, ref = as_float(ours), as_float(ref)
        with np.errstate(invalid="ignore"):
            gap = np.where(ours == ref, 0.0, np.abs(ours - ref))
        # NaNs where the reference has them are equal; anywhere else they differ.
        gap = np.where(np.isnan(ours) & np.isnan(ref), 0.0, gap)
        gap = np.where(np.isnan(gap), np.inf, gap)
        difference = float(np.max(gap, initial=0.0))
        scale = float(np.nanmax(np.abs(as_float(scale_of)), initial=0.0))
        return Difference(leaf, difference, scale, a + r * scale + slack)

    return max((one(*pair) for pair in pairs), key=ratio)  # (the first of the worst)


def ratio(d: Difference) -> float:
    if d.tolerance == 0:
        return 0.0 if d.difference == 0 else float("inf")
    return d.difference / d.tolerance


def array_leaves(tree: Any) -> list[_paths.Leaf]:
    return [leaf for leaf in _paths.leaves(tree) if eqx.is_array(leaf.value)]


def update_pairs(old: PyTree, streamed: tuple, whole: tuple) -> list:
    """What the update check compares.

    Each leaf of the model and optimizer state after the streamed update, against the
    same after the whole update.
    """
    (streamed_model, streamed_state), (whole_model, whole_state) = streamed, whole
    pairs = []
    trees = (streamed_model, whole_model, old)
    for s, w, o in zip(*map(array_leaves, trees), strict=True):
        if is_trainable(o.value):
            # Relative to the change, which is what the update computes, give or
            # take one rounding of the new parameter (a change below it rounds
            # away, in bfloat16 often).
            change = as_float(w.value) - as_float(o.value)
            pairs.append((s.path, s.value, w.value, change, rounding(w.value)))
        else:
            pairs.append((s.path, s.value, w.value, w.value, 0.0))
    states = zip(array_leaves(streamed_state), array_leaves(whole_state), strict=True)
    return pairs + [
        (f"opt_state.{s.path}", s.value, w.value, w.value, 0.0) for s, w in states
    ]


def check_kinds(outputs: tuple, inputs: tuple) -> None:
    for out, into in zip(array_leaves(outputs), array_leaves(inputs), strict=True):
        if kind_of(out.value) != kind_of(into.value):
            raise ValueError(
                f"`verify`: the step returned leaf {out.path!r} in "
                f"{kind_of(out.value)!r}, not {kind_of(into.value)!r}: an "
                "eqx_offload bug, please report it."
            )
