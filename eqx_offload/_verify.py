"""`verify`: an offloaded train step checked against the plain one, on a slice of
the model small enough to run both."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import PyTree

from . import _cutting, _layout, _mesh, _microbatch, _mixed_precision, _paths
from ._memory_kinds import kind_of
from ._placement import place_batch
from ._policy import check_policy, Policy, replace
from ._train_step import train_step, value_and_grad
from ._transform import call_on_auto_axes
from ._update import (
    apply_pending,
    as_transformation,
    check_ready,
    is_trainable,
    own_state,
    stepping,
    trainable,
)
from ._verify_report import _raise_if_failed, Difference, VerifyReport


# Default tolerances by the compared leaf's floating-point width (bytes): see
# `verify`'s docstring and docs/verify.md for why these values.
_DEFAULT_TOLERANCES = {
    8: (1e-4, 1e-8),
    4: (1e-4, 1e-8),
    2: (5e-2, 1e-5),
    1: (2e-1, 1e-3),
}


def _check_count(value: Any, argument: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1
    ):
        raise ValueError(
            f"`verify({argument}=...)` must be a positive int, or None to keep all, "
            f"got {value!r}."
        )


def _tolerance(
    dtype: Any, rtol: float | None, atol: float | None, computed: Any = None
) -> tuple:
    """`(rtol, atol)` for a leaf of `dtype`: its own default, or the default of the
    dtype it was `computed` in where that is narrower."""
    if jnp.issubdtype(dtype, jnp.inexact):
        width = np.dtype(dtype).itemsize
        if computed is not None:
            width = min(width, np.dtype(computed).itemsize)
        default = _DEFAULT_TOLERANCES.get(width, (1e-4, 1e-8))
    else:
        default = (0.0, 0.0)  # integers, booleans, PRNG keys: exactly
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def _rounding(x: Any) -> float:
    """One rounding of the largest entry of a floating-point array."""
    largest = float(np.nanmax(np.abs(_as_float(x)), initial=0.0))
    return float(jnp.finfo(x.dtype).eps) * largest


def _as_float(x: Any) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # Laid out over several processes' devices: each process compares the
        # whole value.
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x).astype(np.float64)


def _compare(
    pairs: list[tuple[str, Any, Any, Any, float]],
    rtol: float | None,
    atol: float | None,
    computed: Any = None,
) -> Difference:
    """The worst of `(leaf, ours, reference, scale_of, slack)` comparisons: the
    largest difference relative to its tolerance, `atol + rtol * scale + slack`,
    where `scale` is the largest magnitude of the array `scale_of` (and the
    tolerance that of the reference's dtype, or of the dtype the values were
    `computed` in where that is narrower: one dtype for every leaf, or a dict of
    them by leaf)."""
    worst: Difference | None = None
    for leaf, ours, ref, scale_of, slack in pairs:
        dtype = computed.get(leaf) if isinstance(computed, dict) else computed
        r, a = _tolerance(ref.dtype, rtol, atol, dtype)
        ours, ref = _as_float(ours), _as_float(ref)
        with np.errstate(invalid="ignore"):
            gap = np.where(ours == ref, 0.0, np.abs(ours - ref))
        # NaNs where the reference has them are equal; anywhere else they differ.
        gap = np.where(np.isnan(ours) & np.isnan(ref), 0.0, gap)
        gap = np.where(np.isnan(gap), np.inf, gap)
        difference = float(np.max(gap, initial=0.0))
        scale = float(np.nanmax(np.abs(_as_float(scale_of)), initial=0.0))
        found = Difference(leaf, difference, scale, a + r * scale + slack)
        if worst is None or _ratio(found) > _ratio(worst):
            worst = found
    assert worst is not None
    return worst


def _ratio(d: Difference) -> float:
    if d.tolerance == 0:
        return 0.0 if d.difference == 0 else float("inf")
    return d.difference / d.tolerance


def _array_leaves(tree: Any) -> list[_paths.Leaf]:
    return [leaf for leaf in _paths.leaves(tree) if eqx.is_array(leaf.value)]


@eqx.filter_jit
def _reference(
    loss_fn: Callable,
    options: tuple[str, bool, tuple | None],
    split: tuple[int, tuple[int, ...]],
    model: Any,
    batch: tuple,
) -> Any:
    """Plain `value_and_grad`: no transform, so every `Stacked` is a plain scan. On
    the axis types the step runs the loss on: `Auto` ones over a mesh with
    `Explicit` axes under `Policy(loss_axes="auto")`.

    `options = (loss_axes, has_aux, dtypes)`: with `dtypes` (one per trainable
    leaf), the loss sees each trainable leaf cast to its dtype, and the gradient
    comes back in the leaf's own dtype (the cast's transpose). `split =
    (microbatches, unsplit)`: the mean of the loss and gradient over micro-batch
    `i` of `k` = examples `i, i + k, ...` (what `train_step` defines), in float32.
    """
    loss_axes, has_aux, dtypes = options
    k, unsplit = split

    def loss(model: Any, *batch: Any) -> Any:
        if dtypes is not None:
            params, rest = eqx.partition(model, is_trainable)
            flat, treedef = jtu.tree_flatten(params)
            cast = [x.astype(d) for x, d in zip(flat, dtypes, strict=True)]
            model = eqx.combine(jtu.tree_unflatten(treedef, cast), rest)
        if loss_axes == "auto" and _layout.explicit_axes():
            return call_on_auto_axes(loss_fn, (model, *batch), {})
        return loss_fn(model, *batch)

    grad = eqx.filter_value_and_grad(loss, has_aux=has_aux)
    if k == 1:
        return grad(model, *batch)

    def parts(x: Any) -> Any:
        return jnp.stack([x[i::k] for i in range(k)])

    def one(part: tuple) -> Any:
        whole = (b if p is None else p for b, p in zip(batch, part, strict=True))
        return grad(model, *whole)

    split_batch = tuple(
        None if position in unsplit else jtu.tree_map(parts, argument)
        for position, argument in enumerate(batch)
    )

    def mean(x: Any) -> Any:
        return jnp.sum(x.astype(jnp.float32), 0) / k

    value, grads = jax.lax.map(one, split_batch)
    grads = jtu.tree_map(lambda g: mean(g).astype(g.dtype), grads)
    return ((mean(value[0]), value[1]) if has_aux else mean(value)), grads


@eqx.filter_jit
def _offloaded(
    loss_fn: Callable,
    policy: Policy,
    has_aux: bool,
    split: tuple[int, tuple[int, ...]],
    arguments: tuple[Any, Any, tuple],
) -> Any:
    """The forward and backward pass as `train_step` computes them (its own code),
    on `arguments = (model, opt_state, batch)`, in `split = (microbatches,
    unsplit)`."""
    return value_and_grad(loss_fn, policy, has_aux, *split, arguments, "`verify`")


def _loss(value: Any, has_aux: bool) -> Any:
    return value[0] if has_aux else value


def _own_update(policy: Policy, model: PyTree, opt_state: PyTree) -> str | None:
    """The update of its own `train_step` runs here, to check against optax's on
    the device: `"streamed"` where it streams on some backend (`"auto"` streams
    on all but the CPU), `"host"` on the host's CPU; None for optax's own."""
    leaves = jtu.tree_leaves((trainable(model), opt_state))
    host = any(kind_of(x) != "device" for x in leaves if eqx.is_array(x))
    if policy.update == "host":
        return "host"
    return "streamed" if policy.update in ("streamed", "auto") and host else None


def verify(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    policy: Policy,
    model: PyTree,
    opt_state: PyTree,
    *batch: Any,
    has_aux: bool = False,
    microbatches: int = 1,
    unsplit: Sequence[int] = (),
    layers: int | None = 2,
    microbatch: int | None = 2,
    rtol: float | None = None,
    atol: float | None = None,
) -> VerifyReport:
    """Checks that `train_step(loss_fn, optimizer, policy, ...)` computes what plain
    training computes, on a slice of the model small enough to run both.

    Every `Stacked` is cut to its first `layers` layers (with the optimizer state
    that mirrors them, compute copies included) and every batch array to its first
    `microbatch` examples. On that slice, `verify` compares

    1. **the loss** and 2. **each leaf's gradient** as the step computes them
        (`filter_offload(loss_fn, policy)`, each leaf in the memory kind it has in
        `model`, in `microbatches`, from the compute copies) with the reference:
        every leaf on the device, no remat, plain `eqx.filter_value_and_grad` of
        the loss on the model cast to `Policy(compute_dtype=...)` (but for the
        `keep_dtype` leaves), averaged over the same micro-batches;
    3. **the update**: the model and optimizer state after one donating
        `train_step` with `Policy(update="streamed")` (or `"host"`, the policy's
        own) against one with `update="whole"` (plain optax on the device), when
        the step streams or updates on the host and the first two checks pass.
        Both steps' losses join the loss check. Any other step runs once, and
        its loss joins the loss check. Under `Policy(update_timing=...)` the
        step holds the stacked layers' update over: it runs, then
        `eqx_offload.apply_pending`, against the whole update with
        `update_timing="now"`; `opt_state` must have no update pending (a fresh
        one from `init_opt_state`, or after `apply_pending`).

    It never donates or changes the caller's arrays: only copies are given to the
    steps it runs.

    Each check passes if, for every leaf, `max |ours - reference| <= atol + rtol *
    scale`, where `scale` is the reference's largest magnitude over the leaf (the
    largest change, for parameters after the update): relative to the leaf as a
    whole, so that entries near zero (where cancellation leaves only rounding) do
    not fail a correct step. Default tolerances (`rtol`, `atol`), by the leaf's
    dtype, or for the loss and gradients the dtype they were computed in where
    that is narrower (the values carry its rounding, whatever dtype holds them):
    32- and 64-bit floats `1e-4, 1e-8`; 16-bit floats `5e-2, 1e-5`; 8-bit floats
    `0.2, 1e-3`; integers exact. A correct step differs from the reference by
    rounding in reassociated sums (on the CPU, under `3.6e-7` of a leaf's scale in
    float32); a wrong residual or transfer by the order of the values themselves.
    docs/verify.md says why these values.

    **Arguments:**

    - `loss_fn`, `optimizer`, `policy`, `has_aux`, `microbatches`, `unsplit`: the
        step, as for `train_step` (with `has_aux=True` the loss is compared, not
        `aux`). `microbatches=k` splits the examples kept into `k` micro-batches;
        the batch arguments in `unsplit` are passed whole, and not cut.
    - `model`, `opt_state`, `*batch`: as for the step, already placed
        (`eqx_offload.place`, `eqx_offload.init_opt_state`).
    - `layers`: how many layers of each `Stacked` to keep (nested ones too), or
        `None` for all. Two, by default: the fewest that still pass a carry (and
        its offloaded residual) from one layer to the next through a real loop.
    - `microbatch`: how many *examples* to keep (`microbatches` is how many parts
        the step splits them into): every batch array with at least one dimension
        is cut along its first axis. `None` keeps the batch whole (e.g. when its
        arrays are not batch-major). Two, by default, so that a bug mixing
        examples can show; rounded up to a multiple of `microbatches` times the
        parts a `Policy(batch=...)` splits the batch into.
    - `rtol`, `atol`: override the default tolerances for every check.

    **Returns:**

    A `VerifyReport` with each check's largest difference; `print` it for a table.

    **Raises:**

    - `eqx_offload.DoesNotMatch` (a `ValueError`) naming the first check that
        fails (loss, gradients, update), its leaf, the difference and the
        tolerance; `error.report` has all of them.
    - `ValueError` naming `layers=` (or `microbatch=`) when `loss_fn` fails on
        the slice but traces on the whole model and batch: a loss that sizes
        something by the configured depth (one KV cache per layer from a
        config) rather than by the `Stacked` it gets.
    - `ValueError` naming `microbatches=` when the examples kept do not split into
        that many micro-batches (of whole blocks of `Policy(batch=...)`).

    !!! Example

        ```python
        policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
        model = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        print(eo.verify(loss_fn, optimizer, policy, model, opt_state, tokens, targets,
                        microbatches=2))
        step = eo.train_step(loss_fn, optimizer, policy, microbatches=2)  # then train
        ```
    """
    if not callable(loss_fn):
        raise TypeError(f"`verify(loss_fn=...)` must be callable, got {loss_fn!r}.")
    _check_count(layers, "layers")
    _check_count(microbatch, "microbatch")
    unsplit = _microbatch.check_unsplit(unsplit, microbatches, "`verify`")
    transformation = as_transformation(optimizer, "`verify(optimizer=...)`")
    check_policy(policy, "`verify(policy=...)`")
    # A pending update (`Policy(update_timing=...)`) was computed for the whole
    # model: it cannot be cut, and the model is one update behind.
    check_ready(opt_state, "`verify`")
    # The optimizer the step runs: under a compute dtype, its state holds the
    # compute copies (`ComputeCopyState`), and under `update_timing` it is a
    # `PendingUpdate` holding the waiting gradients; both are cut with their
    # parameters.
    params = trainable(model)
    wrapped = _mixed_precision.for_policy(transformation, params, policy)
    _mixed_precision.check_state(
        wrapped is not transformation, own_state(opt_state), "`verify`"
    )
    runs = stepping(transformation, params, policy)
    dtypes = None
    if policy.compute_dtype is not None:
        _mixed_precision.check_keep_dtype(params, policy, "`verify`")
        dtypes = tuple(_mixed_precision.compute_dtypes(params, policy))

    model_sizes = _cutting.model_sizes(model, layers)
    small = _cutting.cut(model, model_sizes)  # on the device: the reference's input
    state_sizes = _cutting.state_sizes(runs, opt_state, trainable(small))
    small_state = _cutting.cut(opt_state, state_sizes)
    microbatch = _cutting.whole_parts(microbatch, policy, model, microbatches)
    small_batch = _cutting.cut(batch, _cutting.batch_sizes(batch, microbatch, unsplit))
    examples = _cutting.examples(small_batch, unsplit)
    if examples == _cutting.examples(batch, unsplit):
        microbatch = None  # the whole batch, whatever was asked
    if _cutting.model_sizes(model, None) == model_sizes:
        layers = None  # every layer
    # Laid out as `train_step` lays it out, so that its micro-batches are checked
    # against the blocks the step splits.
    mesh = _mesh.tree_mesh(model)
    small_batch = place_batch(small_batch, policy.batch, mesh, "`verify`", unsplit)
    if microbatches > 1:
        kept = "the whole batch" if microbatch is None else f"{examples} examples"
        where = f"`verify(microbatches={microbatches})` on {kept}"
        _microbatch.check(small_batch, microbatches, unsplit, where)
    split = (microbatches, unsplit)

    # In the model's mesh, as `train_step` traces the loss.
    with _mesh.context(small, small_batch):
        try:
            options = (policy.loss_axes, has_aux, dtypes)
            ref_value, ref_grads = _reference(
                loss_fn, options, split, small, small_batch
            )
        except Exception as e:  # the loss's own error, explained if the cut did it
            cut = _cutting.cut_error(
                loss_fn, model, batch, small, small_batch, layers, microbatch, e
            )
            if cut is None:
                raise
            raise cut from e
        arguments = (
            _cutting.copy_into(small, model),
            _cutting.copy_into(own_state(small_state), own_state(opt_state)),
            small_batch,
        )
        value, grads = _offloaded(loss_fn, policy, has_aux, split, arguments)
    ref_loss = _loss(ref_value, has_aux)
    losses = [("loss", _loss(value, has_aux), ref_loss, ref_loss, 0.0)]
    gradients = [
        (r.path, o.value, r.value, r.value, 0.0)
        for o, r in zip(_array_leaves(grads), _array_leaves(ref_grads), strict=True)
    ]

    # Computed in the compute dtype, whatever dtype they are kept in: its rounding
    # (each gradient in its leaf's: `keep_dtype` leaves are computed in their own).
    computed = policy.compute_dtype
    by_leaf = {}
    if dtypes is not None:
        arrays = [leaf.path for leaf in _array_leaves(params)]
        by_leaf = dict(zip(arrays, dtypes, strict=True))
    loss_check = _compare(losses, rtol, atol, computed)
    gradient_check = _compare(gradients, rtol, atol, by_leaf)
    update = None
    if loss_check.passed and gradient_check.passed:
        # The step itself, on a slice whose gradients are right: streamed (or on
        # the host) against whole when it is, else once, so that its own program
        # (placements, donation, outputs) is exercised.
        # Under `update_timing`, the step holds the stacked layers' update over,
        # and `apply_pending` applies it: together, against the whole update now.
        own = _own_update(policy, model, opt_state)
        timing = policy.update_timing != "now"
        streams = own is not None or timing
        outputs = []
        for mode in (own or policy.update, "whole") if streams else (policy.update,):
            mine = mode != "whole"
            timed = {} if mine else {"update_timing": "now"}
            chosen = replace(policy, update=mode, **timed)
            step = train_step(
                loss_fn,
                optimizer,
                chosen,
                has_aux=has_aux,
                microbatches=microbatches,
                unsplit=unsplit,
            )
            state = small_state if mine else own_state(small_state)
            new_model, new_state, value = step(
                _cutting.copy_into(small, model),
                _cutting.copy_into(state, opt_state if mine else own_state(opt_state)),
                *small_batch,
            )
            if mine and timing:
                new_model, new_state = apply_pending(
                    new_model, new_state, transformation, chosen
                )
            step_name = f"{mode}, {policy.update_timing}" if mine and timing else mode
            name = f"loss ({step_name} step)" if streams else "loss (step)"
            losses.append((name, _loss(value, has_aux), ref_loss, ref_loss, 0.0))
            outputs.append((new_model, own_state(new_state) if mine else new_state))
        _check_kinds(outputs[0], (model, own_state(opt_state)))
        loss_check = _compare(losses, rtol, atol, computed)
        if streams:
            # Both updates are the optimizer's on the masters, in their own dtype.
            update = _compare(_update_pairs(small, *outputs), rtol, atol)

    report = VerifyReport(
        loss=loss_check,
        gradients=gradient_check,
        update=update,
        layers=layers,
        microbatch=microbatch,
        examples=examples,
        microbatches=microbatches,
    )
    _raise_if_failed(report)
    return report


def _update_pairs(old: PyTree, streamed: tuple, whole: tuple) -> list:
    """What the update check compares: each leaf of the model and optimizer state
    after the streamed update against the same after the whole update."""
    (streamed_model, streamed_state), (whole_model, whole_state) = streamed, whole
    pairs = []
    for s, w, o in zip(
        _array_leaves(streamed_model),
        _array_leaves(whole_model),
        _array_leaves(old),
        strict=True,
    ):
        if is_trainable(o.value):
            # Relative to the change, which is what the update computes, give or
            # take one rounding of the new parameter (a change below it rounds
            # away, in bfloat16 often).
            change = _as_float(w.value) - _as_float(o.value)
            pairs.append((s.path, s.value, w.value, change, _rounding(w.value)))
        else:
            pairs.append((s.path, s.value, w.value, w.value, 0.0))
    for s, w in zip(
        _array_leaves(streamed_state), _array_leaves(whole_state), strict=True
    ):
        pairs.append((f"opt_state.{s.path}", s.value, w.value, w.value, 0.0))
    return pairs


def _check_kinds(outputs: tuple, inputs: tuple) -> None:
    for out, into in zip(_array_leaves(outputs), _array_leaves(inputs), strict=True):
        if kind_of(out.value) != kind_of(into.value):
            raise ValueError(
                f"`verify`: the train step returned leaf {out.path!r} in "
                f"{kind_of(out.value)!r}, but it lives in {kind_of(into.value)!r}. "
                "This is a bug in eqx_offload; please report it."
            )
