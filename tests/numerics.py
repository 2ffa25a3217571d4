"""Comparisons with a plain JAX/Equinox reference whose tolerances hold by
construction, on any CPU: `assert_close` and the tolerances it takes.

**Why not element by element, after Adam.** Two correct programs that compute the
same values in another order (a `lax.scan` or a Python loop, piece by piece, over a
mesh, under another instruction set: AVX-512, AVX2 or SSE4.2 choose other kernels and
other fused multiply-adds) round differently. An element near zero is a sum whose
terms cancel, so its rounding error is large beside it; compared element by element
it fails any relative tolerance. Adam then divides each gradient element by the root
of its own second moment, so a gradient of 1e-9 against one of -1e-9 moves the
parameter by `+lr` against `-lr`: after a few steps two correct runs differ by up to
`2 * lr` per step in such an element, and no tolerance below that is safe, while
one above it cannot see a learning rate that is wrong by a percent. So:

- every leaf is compared relative to its **scale**, the largest magnitude of the
  reference leaf: `max |ours - reference| <= tol * max |reference|`, never element
  by element; a leaf whose reference is all zeros is compared relative to the
  largest scale of the tree (it must be zero at that scale);
- training is compared through its **updates** `p_n - p_0` (`origin=p_0`), whose
  scale is the update's, not the parameters': a parameter of size 1 moved by 1e-3
  has its update checked to 1e-4 of 1e-3, not of 1. Each step rounds the new
  parameter to its dtype, one unit in the last place (`eps |p|`, `eps = 2u`), in
  either run, so `steps` steps add `steps * eps * max |p_0|` to what is allowed;
- training steps use an optimizer whose update is Lipschitz in the gradient (SGD,
  with or without momentum), so a rounding difference in a gradient stays the same
  size in the update (see `TRAINED`);
- Adam's own arithmetic (the streamed, host and held-over updates) is compared one
  step at a time on the **same gradients**, where nothing is amplified (see `F32`).

**The tolerances.** float32 has a unit roundoff of `u = 2^-24 ≈ 6.0e-8`; bfloat16
one of `2^-8 ≈ 3.9e-3`.

- `F32 = 1e-4`: the same float32 values computed in another order (losses,
  outputs, gradients, one optimizer update on the same gradients, the optimizer
  state). Each value is built from sums of at most `n = 1024` terms in the suite's
  models (widths up to 256, at most 1024 tokens or examples). Reordering a sum
  changes it by at most `(n - 1) u Σ|terms|` in the worst case, and in practice, the
  roundings being independent, by a few `√n u Σ|terms|` (Higham & Mary, "A new
  approach to probabilistic rounding error analysis", 2019): `√1024 · u = 1.9e-6`. A
  gradient of a model of at most 8 layers passes through at most 50 such sums in a
  row (forward and backward: the norms, the attention's and the MLP's matmuls, the
  loss), each passing its input's error on at about its own size (the residual
  layers of the test models are near the identity at initialisation), so the errors
  add up to at most `50 × 1.9e-6 ≈ 1e-4` of the sums' magnitudes, which the leaf's
  scale bounds. An optimizer update on the same gradients is elementwise: about ten
  operations of relative error `u` each (`6e-7`), far inside.
- `TRAINED = 2e-4`: the updates `p_n - p_0` of up to 10 SGD steps (learning rate
  `lr`, momentum `β ≤ 0.9`). Each step adds `-lr g_k` (momentum: a sum of them with
  weights below `1 / (1 - β)`): `n` gradients each within `F32` of its reference,
  so their sum is within `F32` of the reference sum. Evaluated at parameters that
  already differ by `δ`, a gradient differs by at most `L δ` more (`L`: the loss's
  curvature); with `n lr L / (1 - β) ≤ 1/2`, true of the suite's small learning
  rates and few steps, those second-order terms add at most another `F32`. (Adam
  with `eps` far above every gradient would qualify too: its update is then within
  `(1 + √n) lr / eps` per unit of gradient error; the suite uses SGD.)
- `BF16 = 2^-8 + F32`: a float32 result rounded to bfloat16 once (a bf16 gradient
  or output against the float32 reference): the rounding is at most `2^-8` of each
  element, plus the float32 part.
- `BF16_COMPUTE = 2^-5`: a run in bfloat16 (`Policy(compute_dtype=jnp.bfloat16)`)
  against the same bf16 scheme written by hand. Both round the same float32 values
  to bf16, but where the float32 values differ by their own rounding (`F32`), a bf16
  rounding can land on the other neighbour, a difference of one unit in the last
  place (`2^-7`) in that element; such flips are rare (a fraction `F32 / 2^-8 ≈ 3%`
  of the roundings) and of random sign, so a sum of `n` terms sees about
  `√(0.03 n)` of them: a few units of `2^-7` relative to the sums' magnitudes along a
  chain of a few sums. Four units: `2^-5`.

**Negative controls.** Every comparison has one: the same run with a changed
learning rate, a dropped layer's update or a wrong gradient sign, which must land at
least ten times beyond its tolerance (`excess(...) > 10`): a tolerance that is too
loose to see a bug fails there.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree


F32 = 1e-4
TRAINED = 2e-4
BF16 = 2.0**-8 + F32
BF16_COMPUTE = 2.0**-5


def _is_value(x) -> bool:
    if isinstance(x, bool):
        return False
    return eqx.is_array(x) or isinstance(x, int | float | np.generic)


def _leaves(tree: PyTree) -> list[tuple[str, np.ndarray]]:
    leaves = jax.tree.leaves_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.Array | np.ndarray)
    )
    out = []
    for path, x in leaves:
        if not _is_value(x):
            continue
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append((f"leaf {jax.tree_util.keystr(path)}", np.asarray(x)))
    return out


def _pairs(ours: PyTree, reference: PyTree, origin: PyTree | None):
    mine, theirs = _leaves(ours), _leaves(reference)
    assert len(mine) == len(theirs), (
        f"not as many array leaves: {len(mine)} against {len(theirs)}"
    )
    starts = [None] * len(mine) if origin is None else [x for _, x in _leaves(origin)]
    assert len(starts) == len(mine), "`origin` has not as many array leaves"
    for (where, x), (_, y), o in zip(mine, theirs, starts):
        assert x.shape == y.shape, f"{where}: shape {x.shape} against {y.shape}"
        yield where, x, y, o


def _floats(x: np.ndarray) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def excesses(
    ours: PyTree,
    reference: PyTree,
    *,
    tol: float = F32,
    origin: PyTree | None = None,
    steps: int = 1,
) -> dict[str, float]:
    """By leaf, `max |ours - reference|` over what `tol` allows there (the module's
    docstring): at most 1 passes. With `origin`, the updates `ours - origin` against
    `reference - origin`, after `steps` steps. Leaves of other dtypes than floating
    ones must be equal (`inf` if not)."""
    errors, scales, floors = {}, {}, {}
    for where, x, y, o in _pairs(ours, reference, origin):
        if not _floats(y):
            errors[where] = 0.0 if np.array_equal(x, y) else math.inf
            continue
        eps = float(jnp.finfo(y.dtype).eps)
        x, y = x.astype(np.float64), y.astype(np.float64)
        floors[where] = 0.0
        if o is not None:
            o = np.asarray(o, np.float64)
            # Each step rounds the new parameter to its dtype: one unit in the last
            # place, `eps * |p|`, in either run.
            floors[where] = steps * eps * float(np.max(np.abs(o), initial=0.0))
            x, y = x - o, y - o
        errors[where] = float(np.max(np.abs(x - y), initial=0.0))
        scales[where] = float(np.max(np.abs(y), initial=0.0))
    largest = max(scales.values(), default=0.0)
    out = {}
    for where, error in errors.items():
        if where not in scales:
            out[where] = error
            continue
        allowed = tol * (scales[where] or largest) + floors[where]
        out[where] = error / allowed if allowed else (0.0 if error == 0 else math.inf)
    return out


def excess(
    ours: PyTree,
    reference: PyTree,
    *,
    tol: float = F32,
    origin: PyTree | None = None,
    steps: int = 1,
) -> float:
    """The largest of `excesses`: how many times what `tol` allows `ours` is from
    `reference`. A comparison passes at most 1; its negative control asserts
    `excess(...) > 10`."""
    return max(
        excesses(ours, reference, tol=tol, origin=origin, steps=steps).values(),
        default=0.0,
    )


def assert_close(
    ours: PyTree,
    reference: PyTree,
    *,
    tol: float = F32,
    origin: PyTree | None = None,
    steps: int = 1,
) -> None:
    """`ours` equals `reference` up to rounding, by construction (the module's
    docstring derives each tolerance).

    **Arguments:**

    - `ours`, `reference`: PyTrees with as many array (or Python number) leaves, in
        order and of the same shapes; other leaves are ignored. PRNG keys, integers
        and booleans must be equal.
    - `tol`: `F32` (the default: the same float32 values in another order),
        `TRAINED` (the updates of SGD steps), `BF16` (a result rounded to bfloat16
        once) or `BF16_COMPUTE` (a bf16 run against the same scheme by hand).
    - `origin`: the parameters both started from: compare the updates
        `ours - origin` and `reference - origin`, each leaf at its update's scale,
        plus the rounding of the parameters themselves over `steps` steps. The
        comparison must then also see an update `100 * tol` too large (1% at
        `F32`: `scaled_update(ours, origin, 1 + 100 * tol)`) at least ten times
        beyond the tolerance: an update too small beside the parameters' own
        rounding (too low a learning rate, too few steps, bfloat16 parameters)
        makes a comparison that cannot fail, and is refused.
    """
    failed = {
        where: e
        for where, e in excesses(
            ours, reference, tol=tol, origin=origin, steps=steps
        ).items()
        if not e <= 1
    }
    assert not failed, "beyond the tolerance ({:.3g} of the scale) by: {}".format(
        tol, ", ".join(f"{where}: {e:.3g}x" for where, e in failed.items())
    )
    if origin is not None:
        control = excess(
            scaled_update(ours, origin, 1 + 100 * tol),
            reference,
            tol=tol,
            origin=origin,
            steps=steps,
        )
        assert control > 10, (
            f"an update {100 * tol:.2%} too large is only {control:.3g}x the "
            "tolerance: the "
            "updates are too small beside the parameters' rounding to be compared "
            "(a larger learning rate, or more steps)"
        )


def scaled_update(ours: PyTree, origin: PyTree, factor: float) -> PyTree:
    """`origin + factor * (ours - origin)`, leaf by leaf, as NumPy arrays: a negative
    control without running anything again. `factor=1.01` is an update 1% too large
    (a learning rate 1% too large, for one SGD step), `factor=-1` one of the wrong
    sign, `factor=0` no update at all."""
    leaves, treedef = jax.tree.flatten(ours)
    starts = jax.tree.leaves(origin)
    assert len(starts) == len(leaves), "`origin` has not as many leaves"

    def scale(x, o):
        if not (eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        dtype = x.dtype
        x, o = np.asarray(x, np.float64), np.asarray(o, np.float64)
        return (o + factor * (x - o)).astype(dtype)

    return jax.tree.unflatten(treedef, [scale(x, o) for x, o in zip(leaves, starts)])


def scaled(tree: PyTree, factor: float) -> PyTree:
    """`tree` with every floating leaf (array or Python float) times `factor`, as
    NumPy arrays: the negative control of a comparison without an `origin` (losses,
    outputs, gradients, optimizer state). `1.01` is a value 1% too large, `-1` one
    of the wrong sign."""

    def scale(x):
        if isinstance(x, float) or (
            eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)
        ):
            x = np.asarray(x)
            return (np.float64(factor) * x).astype(x.dtype)
        return x

    return jax.tree.map(scale, tree)
